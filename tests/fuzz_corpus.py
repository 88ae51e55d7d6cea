"""A seeded corpus of adversarial model replies, for the fuzz tests and ``benchmarks/bench_parsers.py``.

Each reply is built from pieces: a format's own markers and well-formed calls (so that the
parsers get past their first check), calls with arguments that strict JSON cannot hold
(``NaN``, ``Infinity``, integers of thousands of digits, nesting thousands deep), near
misses (a well-formed call with a stretch cut, doubled or replaced), the answer forms the
environments look for (``\\boxed{}``, fenced code), and plain noise. About one reply in
fifty repeats one piece hundreds to thousands of times, which is where super-linear
parsing shows. The same seed gives the same corpus.

>>> a, b = replies("hermes", 5, seed=3), replies("hermes", 5, seed=3)
>>> a == b and len(a) == 5
True
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

from treerl.envs.parsers import PARSERS, ToolCall

__all__ = ["replies", "iter_replies", "MARKERS", "REPEATED"]

MARKERS = {
    "glm4_moe": ["<tool_call>", "</tool_call>", "<tool_call>calculator\n", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "expression", "\n", "{", "1", "<"],
    "deepseek": ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                 "<｜tool▁sep｜>", "function", "calculator\n", "```json\n", "\n```", '{"expression": ', "{", "}", '"'],
    "harmony": ["<|start|>", "assistant", " to=functions.calculator", "<|channel|>", "analysis", "commentary",
                "final", " json", "<|constrain|>json", "<|message|>", "<|end|>", "<|call|>", "<|return|>",
                '{"expression": ', "{", "}", '"', " to=", "functions."],
    "hermes": ["<tool_call>", "</tool_call>", "<tool_call>\n{", '{"name": "calculator", "arguments": ',
               '"parameters": ', "{", "}", '"', "\n", '{"name":'],
    "llama3_json": ["<|python_tag|>", '{"name": "calculator", "parameters": ', "{", "}", ";", "\n", '"',
                    "<|eom_id|>", '\n{"name":', "; {"],
    "mistral": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", '[{"name": "calculator", "arguments": ', "calculator", "{",
                "}", "[", "]", "[TOOL_CALLS]calculator[ARGS]"],
    "pythonic": ["[calculator(", "expression=", ")", "]", "[", "(", '"', "'", '"""', "'''", "\n", ",", "#",
                 "<|python_start|>", "<|python_end|>", "\\", "-", "0x", "[f(\n"],
    "qwen3_coder": ["<tool_call>", "</tool_call>", "<function=calculator>", "<function=", "</function>",
                    "<parameter=expression>", "<parameter=", "</parameter>", "\n", ">", "<"],
}
"""Each format's own markup, in pieces."""

NOISE = [" ", "\n", "\t", "a", "The answer", "{", "}", "[", "]", "(", ")", '"', "'", "\\", ",", ":", ";", "=", "1",
         "-", ".", "e", "x", "\x00", "\u2028", "é", "\U0001f642", "```", "```python\n", "\\boxed{", "\\boxed{42}",
         "\\fbox{", "$", "\\frac{1}{2}", "<", ">", "/", "#", "True", "null", "NaN", "Infinity"]
"""Characters and words any reply may hold."""

REPEATED = ["\\boxed{", "{", "[", "(", '{"a":', "[f(\n", "[f(", "<tool_call>", "<function=", "<parameter=x>\n",
            "[TOOL_CALLS]", "[TOOL_CALLS][", '\n{"name":', ";{", '\n{"a":', "```\n", "1", "-", "\\", "'", '"',
            "9" * 50, "<|python_tag|>{", "<|message|>", "<|channel|>", " to=functions.f<|channel|>commentary<|message|>{",
            "<arg_key>", "<tool_call>f\n<arg_key>a</arg_key><arg_value>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>"]
"""Pieces that, repeated, made some parser or extractor super-linear once."""

_STRANGE_VALUES = ["NaN", "Infinity", "-Infinity", "9" * 4400, "-" + "9" * 4400, "1e999", "1" * 300 + ".5",
                   "[" * 1100 + "]" * 1100, '{"a":' * 1100 + "1" + "}" * 1100, "[" * 1100, "0x" + "f" * 3700,
                   '"' + "\\u00e9" * 50 + '"', '"\\ud800"', "-" * 1100 + "1", "1" + "+1" * 1100, "[" * 70 + "]" * 70]
"""Argument values (as source text) that strict JSON, ``int()`` or the recursion limit cannot take."""


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.random()
    if kind < 0.25:
        return rng.choice([0, 1, -7, 10**12, 2.5, -0.0, True, False, None, float("nan"), float("inf")])
    if kind < 0.55 or depth > 2:
        return rng.choice(["", "2 + 3", "(12 + 7) * 3", "x", "é", "<tool_call>", "'", '"', "\\", "\n", "1/0",
                           "9" * 40, "2 ** 200", "print(1)", "```"])
    if kind < 0.8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(["a", "b", "expression", "code", ""]): _value(rng, depth + 1) for _ in range(rng.randrange(3))}


def _call_text(parser_name: str, rng: random.Random, tool_names: list[str], keys: list[str]) -> str:
    """A rendered call; sometimes with a value strict JSON cannot hold spliced in as text."""
    name = rng.choice(tool_names + ["unknown_tool", "calculator"])
    key = rng.choice(keys)
    arguments = {key: _value(rng)}
    try:
        text = PARSERS[parser_name]().render([ToolCall(name, arguments)])
    except (ValueError, TypeError):
        text = PARSERS[parser_name]().render([ToolCall("calculator", {"expression": "1 + 1"})])
    if rng.random() < 0.15:
        # Splice a strange value over the first value-like stretch (after "=", ":" or ">").
        strange = rng.choice(_STRANGE_VALUES)
        for sep in (": ", "=", ">\n"):
            at = text.find(sep, text.find(key))
            if at >= 0:
                cut = at + len(sep)
                text = text[:cut] + strange + text[cut + rng.randrange(1, 8):]
                break
    return text


def _mutate(text: str, rng: random.Random, noise: list[str]) -> str:
    if not text:
        return text
    i, j = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    op = rng.random()
    if op < 0.4:
        return text[:i] + text[j:]  # cut a stretch
    if op < 0.7:
        return text[:j] + text[i:j] + text[j:]  # double it
    return text[:i] + rng.choice(noise) + text[j:]  # replace it


def iter_replies(parser_name: str, count: int, *, seed: int, tool_names: list[str] | None = None,
                 keys: list[str] | None = None, final_rate: float = 0.1, repeat_rate: float = 0.02,
                 max_repeat: int = 3000, fences: bool = True) -> Iterator[str]:
    """``count`` adversarial replies for ``parser_name``'s format, the same for the same seed.

    Calls name one of ``tool_names`` (or an unknown tool) with one argument named from
    ``keys``. ``final_rate`` is the share of replies that look like final answers (no
    markup, a ``\\boxed{}`` or a fenced code block), which environments send to their scorers;
    ``fences=False`` leaves code fences out altogether (they make CodeSandbox run code).
    """
    rng = random.Random(f"{parser_name}/{seed}")
    names = list(tool_names or ["calculator"])
    arg_keys = list(keys or ["expression", "code", "a", "x"])
    markers = MARKERS[parser_name]
    noise = NOISE if fences else [n for n in NOISE if "```" not in n]
    repeated = REPEATED if fences else [r for r in REPEATED if "```" not in r]
    for _ in range(count):
        roll = rng.random()
        if roll < repeat_rate:
            piece = rng.choice(repeated + markers)
            yield rng.choice(["", "ok "]) + piece * rng.randrange(100, max_repeat) + rng.choice(["", "}", ")]", "\n"])
            continue
        if roll < repeat_rate + final_rate:
            answer = rng.choice(["\\boxed{" + rng.choice(["42", "1/2", "x^2", "9" * 5000, "\\frac{1}{0}", "{{}"]) + "}",
                                 "```python\ndef f(x):\n    return x\n```", "The answer is 7.", "\\boxed{" * 50])
            yield "".join(rng.choice(noise) for _ in range(rng.randrange(4))) + answer
            continue
        parts: list[str] = []
        for _ in range(rng.randrange(1, 8)):
            pick = rng.random()
            if pick < 0.35:
                parts.append(_call_text(parser_name, rng, names, arg_keys))
            elif pick < 0.55:
                parts.append(_mutate(_call_text(parser_name, rng, names, arg_keys), rng, noise))
            elif pick < 0.8:
                parts.append(rng.choice(markers))
            else:
                parts.append("".join(rng.choice(noise) for _ in range(rng.randrange(1, 6))))
        yield "".join(parts)


def replies(parser_name: str, count: int, *, seed: int, **kwargs: object) -> list[str]:
    """:func:`iter_replies` as a list."""
    return list(iter_replies(parser_name, count, seed=seed, **kwargs))
