"""The OpenAI chat-completions wire format: requests checked field by field, replies built, messages compared.

:func:`parse_request` turns a request body into a :class:`ChatRequest` or raises
:class:`RequestError` naming the field (``messages[2].role``) and what is wrong, which the
server returns as a 400 in OpenAI's error shape. Messages are kept in two forms:

- the **client's view** (:func:`message_key`): what a client echoes back, reduced to what
  matters (role, text, tool-call names and decoded arguments, tool-call ids of tool
  results), so that a history the client re-serialized (LangChain re-encodes arguments)
  still matches what the server returned;
- the **template's form** (:func:`template_messages`): what the chat template renders. An
  assistant turn the server produced is rendered from its raw sampled text, never from the
  client's copy, so the context is the tokens the model really wrote.

>>> request = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2})
>>> request.n, request.messages[0]["content"]
(2, 'hi')
>>> parse_request({"messages": [{"role": "robot", "content": "hi"}]})
Traceback (most recent call last):
...
treerl.serve.openai_format.RequestError: messages[0].role: 'robot' is not one of system, developer, user, ...
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from treerl.agents.chat import assistant_message
from treerl.envs.parsers import ParseResult
from treerl.envs.tools import Tool
from treerl.errors import ToolCallError

__all__ = ["RequestError", "ChatRequest", "parse_request", "message_key", "template_messages", "tool_reply", "call_opening",
           "call_end", "first_call_end", "completion_body", "completion_head", "chunk", "call_markers", "error_body"]

ROLES = ("system", "developer", "user", "assistant", "tool")
# Fields that change the sampling distribution in ways this server cannot apply: refused, not ignored.
_UNSUPPORTED_NONZERO = ("frequency_penalty", "presence_penalty")
_UNSUPPORTED_NONEMPTY = ("logit_bias",)
# The deprecated function-calling fields: ignored, the model would not see the functions at all.
_LEGACY_FUNCTIONS = ("functions", "function_call")
MAX_TOP_LOGPROBS = 20  # OpenAI's limit


class RequestError(ValueError):
    """A request the server refuses: ``param`` names the field, the message says what is wrong."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.status, self.code = param, status, code


def error_body(message: str, *, param: str | None = None, code: str | None = None,
               kind: str = "invalid_request_error") -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    """A checked ``POST /v1/chat/completions`` body."""

    messages: list[dict[str, Any]]
    model: str = ""
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    """False: at most one tool call per reply (the sample ends where the first call closes)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    """vLLM's extra sampling field: the penalty on every id of the conversation so far (see SamplingParams)."""
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    user: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools or []]


def _text(value: Any, where: str) -> str:
    """Message content as text: a string, None, or a list of text parts."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise RequestError(f"{where}[{j}]", f"only text parts are supported, got {kind!r}.")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(where, f"must be a string, null or a list of text parts, got {type(value).__name__}.")


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        return None
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or (not integer and not math.isfinite(value)):
        raise RequestError(name, f"must be {'an integer' if integer else 'a number'}, got {value!r}.")
    if not lo <= value <= hi:
        raise RequestError(name, f"{value!r} is out of range [{lo}, {hi}].")
    return value


def _flag(body: Mapping[str, Any], name: str, where: str | None = None) -> bool:
    """A boolean field: true, false or absent. A string such as "false" is refused, never read as true."""
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(where or name, f"must be a boolean (true or false), got {value!r}.")
    return bool(value)


def _check_message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping):
        raise RequestError(where, f"must be an object, got {type(m).__name__}.")
    role = m.get("role")
    if role not in ROLES:
        raise RequestError(f"{where}.role", f"{role!r} is not one of {', '.join(ROLES)}.")
    out: dict[str, Any] = {"role": role, "content": _text(m.get("content"), f"{where}.content")}
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise RequestError(f"{where}.tool_call_id", "a tool message needs the id of the call it answers.")
        out["tool_call_id"] = m["tool_call_id"]
    if role == "assistant" and m.get("tool_calls"):
        calls = m["tool_calls"]
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls", "must be a list.")
        out["tool_calls"] = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, Mapping) else None
            if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
                raise RequestError(f"{where}.tool_calls[{j}].function.name", "is required (a string).")
            arguments = fn.get("arguments", "{}")
            if not isinstance(arguments, (str, Mapping)):
                raise RequestError(f"{where}.tool_calls[{j}].function.arguments", "must be a JSON string.")
            if c.get("id") is not None and not isinstance(c["id"], str):
                raise RequestError(f"{where}.tool_calls[{j}].id", f"must be a string, got {c['id']!r}.")
            out["tool_calls"].append({"id": c.get("id"), "name": fn["name"], "arguments": arguments})
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _check_tool_results(messages: Sequence[Mapping[str, Any]]) -> None:
    """Each tool message answers a call of the assistant message before it (other tool messages between),
    as OpenAI requires: a result with no call would be rendered as an answer to nothing."""
    calls: set[str] | None = None  # the ids of the calls the tool messages here may answer
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = {c["id"] for c in m.get("tool_calls") or [] if c.get("id") is not None}
        elif m["role"] != "tool":
            calls = None
        elif not calls:
            raise RequestError(f"messages[{i}]", "a tool message must follow an assistant message with "
                                                 "tool_calls: it answers one of those calls.")
        elif m["tool_call_id"] not in calls:
            raise RequestError(f"messages[{i}].tool_call_id", f"{m['tool_call_id']!r} is not the id of a call in "
                                                              "the tool_calls of the assistant message before it.")


def _check_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError("tools", "must be a list of {'type': 'function', 'function': {...}} objects.")
    out, names = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, Mapping) else None
        if not isinstance(t, Mapping) or t.get("type", "function") != "function" or not isinstance(fn, Mapping):
            raise RequestError(f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ..., ...}}.")
        if not isinstance(fn.get("name"), str):
            raise RequestError(f"tools[{i}].function.name", f"must be a string, got {fn.get('name')!r}.")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise RequestError(f"tools[{i}].function.parameters",
                               f"must be a JSON Schema object, got {fn['parameters']!r}.")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"tools[{i}].function.description", "must be a string.")
        try:
            Tool.from_schema(fn["name"], fn.get("parameters"))
        except ValueError as exc:
            raise RequestError(f"tools[{i}].function", str(exc)) from None
        except RecursionError:
            raise RequestError(f"tools[{i}].function.parameters", "the schema is nested too deeply.") from None
        if fn["name"] in names:
            raise RequestError(f"tools[{i}].function.name", f"{fn['name']!r} is given twice.")
        names.add(fn["name"])
        # As the client wrote it: the template renders the tools, and the model must see what was sent.
        out.append({"type": "function", "function": json.loads(json.dumps(fn))})
    return out or None


def _check_response_format(body: Mapping[str, Any]) -> None:
    """Plain text only: JSON modes need constrained decoding, which would change the sampling distribution the
    trajectory records, and served unconstrained they would hand the client text it cannot parse as promised."""
    fmt = body.get("response_format")
    if fmt is None or (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return
    kind = fmt.get("type") if isinstance(fmt, Mapping) else fmt
    raise RequestError("response_format", f"{kind!r} is not supported: only {{'type': 'text'}}; structured output "
                                          "would need constrained decoding, which would change the sampling "
                                          "distribution the trajectory records. Ask for JSON in the prompt, or "
                                          "call a tool whose parameters are the schema.")


def parse_request(body: Any) -> ChatRequest:
    """A :class:`ChatRequest` from a decoded JSON body; :class:`RequestError` names the first bad field."""
    if not isinstance(body, Mapping):
        raise RequestError(None, "the body must be a JSON object.")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of chat messages.")
    request = ChatRequest(messages=[_check_message(i, m) for i, m in enumerate(messages)])
    _check_tool_results(request.messages)
    if not isinstance(body.get("model", ""), str):
        raise RequestError("model", "must be a string.")
    request.model = body.get("model") or ""
    request.tools = _check_tools(body)
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, Mapping):
        if choice.get("type", "function") != "function" or not isinstance(choice.get("function"), Mapping):
            raise RequestError("tool_choice", "a named tool is {'type': 'function', 'function': {'name': ...}}, "
                                              f"got {dict(choice)!r}.")
        name = choice["function"].get("name")
        if not request.tools:
            raise RequestError("tool_choice", "names a function, but the request has no tools.")
        if name not in request.tool_names:
            raise RequestError("tool_choice.function.name", f"{name!r} is not one of the request's tools.")
    elif not isinstance(choice, str) or choice not in ("auto", "none", "required"):
        raise RequestError("tool_choice", f"{choice!r} must be auto, none, required or a function object.")
    elif choice == "required" and not request.tools:
        raise RequestError("tool_choice", "'required' needs tools: the request has none.")
    request.tool_choice = choice
    parallel = body.get("parallel_tool_calls")
    request.parallel_tool_calls = True if parallel is None else _flag(body, "parallel_tool_calls")
    request.temperature = _number(body, "temperature", 0.0, 2.0)
    request.top_p = _number(body, "top_p", 1e-9, 1.0)
    request.top_k = _number(body, "top_k", 1, 1 << 30, integer=True)
    request.min_p = _number(body, "min_p", 0.0, 0.999999)
    request.repetition_penalty = _number(body, "repetition_penalty", 1e-9, math.inf)
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 30, integer=True)
    request.max_tokens = max_tokens if max_tokens is not None else _number(body, "max_tokens", 1, 1 << 30,
                                                                           integer=True)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)):
        raise RequestError("stop", "must be a non-empty string or a list of them.")
    request.stop = list(stop or [])
    request.seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)
    request.n = _number(body, "n", 1, 1 << 20, integer=True) or 1
    request.stream = _flag(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, Mapping):
        raise RequestError("stream_options", f"must be an object such as {{'include_usage': true}}, "
                                             f"got {stream_options!r}.")
    request.include_usage = _flag(stream_options or {}, "include_usage", "stream_options.include_usage")
    request.logprobs = _flag(body, "logprobs")
    top_logprobs = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if top_logprobs is not None and not request.logprobs:
        raise RequestError("top_logprobs", "needs logprobs set to true.")
    request.top_logprobs = top_logprobs or 0
    for name in _UNSUPPORTED_NONZERO:
        if body.get(name) not in (None, 0, 0.0):
            raise RequestError(name, "is not supported: it would change the sampling distribution the trajectory "
                                     "records; leave it unset or 0.")
    for name in _UNSUPPORTED_NONEMPTY:
        if body.get(name) not in (None, {}):
            raise RequestError(name, "is not supported: it would change the sampling distribution the trajectory "
                                     "records; leave it unset or empty.")
    _check_response_format(body)
    for name in _LEGACY_FUNCTIONS:
        if body.get(name) is not None:
            raise RequestError(name, "is the deprecated form of tools; send the functions as tools "
                                     "([{'type': 'function', 'function': {...}}]) and tool_choice instead.")
    user = body.get("user")
    request.user = user if isinstance(user, str) and user else None
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise RequestError("metadata", "must be an object of strings.")
    request.metadata = dict(metadata)
    return request


# -- the two forms of a message ------------------------------------------------------------------


def _decoded(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def message_key(m: Mapping[str, Any]) -> str:
    """The client's view of a (checked) message, as a canonical string: what must match for a history to extend.

    >>> a = {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "name": "f", "arguments": '{"x": 1}'}]}
    >>> b = {"role": "assistant", "content": None, "tool_calls": [{"id": "2", "name": "f", "arguments": '{"x":1}'}]}
    >>> message_key(a) == message_key(b)
    True
    """
    role = "system" if m["role"] == "developer" else m["role"]
    key: dict[str, Any] = {"role": role, "content": m.get("content") or ""}
    if m.get("tool_calls"):
        key["tool_calls"] = [[c["name"], _decoded(c["arguments"])] for c in m["tool_calls"]]
    if m["role"] == "tool":
        key["tool_call_id"] = m.get("tool_call_id")
    return json.dumps(key, sort_keys=True, ensure_ascii=False)


def template_messages(messages: Sequence[Mapping[str, Any]], raw_texts: Mapping[str, str],
                      earlier: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The template's form of checked client messages.

    An assistant message whose :func:`message_key` is in ``raw_texts`` (a turn this server
    sampled) becomes its raw sampled text; tool results get the name of the call they answer
    (looked up in ``earlier`` messages too).
    """
    names = {c["id"]: c["name"] for m in [*earlier, *messages] for c in m.get("tool_calls") or [] if c.get("id")}
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        if role == "assistant" and message_key(m) in raw_texts:
            out.append(assistant_message(raw_texts[message_key(m)]))
        elif role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": m.get("content") or ""}
            if m.get("tool_calls"):
                msg["tool_calls"] = [{"type": "function", "function": {"name": c["name"],
                                                                       "arguments": _decoded(c["arguments"])}}
                                     for c in m["tool_calls"]]
            out.append(msg)
        elif role == "tool":
            msg = {"role": "tool", "content": m.get("content") or ""}
            name = m.get("name") or names.get(m.get("tool_call_id"))
            if name:
                msg["name"] = name
            out.append(msg)
        else:
            out.append({"role": role, "content": m.get("content") or ""})
    return out


# -- replies -------------------------------------------------------------------------------------


def completion_head() -> dict[str, Any]:
    """A new completion's id and creation time."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time())}


# Every call of these formats contains one of these strings; prose without them is content, whole.
_CALL_MARKERS: dict[str, tuple[str, ...]] = {
    "HermesParser": ("<tool_call>", "</tool_call>"),
    "Qwen3CoderParser": ("<tool_call>", "</tool_call>", "<function=", "</function>"),
    "MistralParser": ("[TOOL_CALLS]",),
}


def call_markers(parser: Any, request: ChatRequest) -> tuple[str, ...] | None:
    """What a streamed reply must hold back as a possible tool call: None when the reply is not read
    for calls (no tools, or ``tool_choice`` none); the format's call markers; or ``()`` when any text
    may turn out to be (or hide) a call (formats without fixed markers, and replies with reasoning,
    whose calls and content are read after it), so the content comes whole at the end.

    >>> from treerl.envs.parsers import get_parser
    >>> request = ChatRequest(messages=[], tools=[{"type": "function", "function": {"name": "add"}}])
    >>> call_markers(get_parser("hermes"), request), call_markers(get_parser("pythonic"), request)
    (('<tool_call>', '</tool_call>'), ())
    """
    if not request.tools or request.tool_choice == "none":
        return None
    if getattr(parser, "reasoning", None) is not None:
        return ()
    return _CALL_MARKERS.get(type(parser).__name__, ())


def call_opening(parser: Any, request: ChatRequest) -> str | None:
    """The text a reply must open with for ``request.tool_choice``: None for ``auto`` and ``none``.

    ``required`` opens a call in the template's format (the model picks the tool and writes the
    arguments); a named function also writes the name, so the model writes only the arguments.
    The server puts these tokens at the start of the turn unsampled (recorded as such, never
    trained on), then samples the rest: the reply opens a call whatever the model would have done.

    The opening ends where the model's own tokens of a call end: a BPE tokenizer writes
    ``"arguments": {"`` as ``'":'`` then ``' {"'``, so an opening ending in the space would leave
    the model after a lone ``' '`` token it never wrote there, and it writes garbage.

    >>> from treerl.envs.parsers import get_parser
    >>> request = ChatRequest(messages=[], tools=[{"type": "function", "function": {"name": "add"}}])
    >>> request.tool_choice = {"type": "function", "function": {"name": "add"}}
    >>> call_opening(get_parser("hermes"), request)
    '<tool_call>\\n{"name": "add", "arguments":'
    >>> request.tool_choice = "required"
    >>> call_opening(get_parser("qwen3_coder"), request)
    '<tool_call>\\n<function='
    """
    choice = request.tool_choice
    if not request.tools or choice in ("auto", "none"):
        return None
    name = choice["function"]["name"] if isinstance(choice, Mapping) else None
    kind = type(parser).__name__
    if kind == "HermesParser":
        return "<tool_call>\n" if name is None else '<tool_call>\n{"name": ' + json.dumps(name) + ', "arguments":'
    if kind == "Qwen3CoderParser":
        return "<tool_call>\n<function=" if name is None else f"<tool_call>\n<function={name}>\n"
    raise RequestError("tool_choice", f"{choice!r} is enforced for hermes and Qwen3-Coder call formats; this "
                                      f"model's template calls tools in another ({kind}). Send tool_choice 'auto'.")


# Where one call of these formats ends, with nothing of the call's markup left open after it.
_CALL_ENDS: dict[str, str] = {
    "HermesParser": "</tool_call>",
    "Qwen3CoderParser": "</tool_call>",
    "GlmParser": "</tool_call>",
    "HarmonyParser": "<|call|>",  # an end of turn as well: a harmony reply holds one call at most anyway
}


def call_end(parser: Any, request: ChatRequest) -> str | None:
    """The marker a reply ends at for ``parallel_tool_calls: false``: the format's end of one call.

    None when the request allows parallel calls or its reply is not read for calls (no tools,
    or ``tool_choice`` none). The server ends the sample where the first call closes (see
    :func:`first_call_end`), so the model's recorded turn is exactly the one call the client gets.
    Formats whose calls share one block (a JSON or Python list) have no such place: refused.

    >>> from treerl.envs.parsers import get_parser
    >>> request = ChatRequest(messages=[], tools=[{"type": "function", "function": {"name": "add"}}],
    ...                       parallel_tool_calls=False)
    >>> call_end(get_parser("hermes"), request)
    '</tool_call>'
    >>> call_end(get_parser("pythonic"), request)
    Traceback (most recent call last):
    ...
    treerl.serve.openai_format.RequestError: parallel_tool_calls: false is enforced for the hermes, ...
    """
    if request.parallel_tool_calls or not request.tools or request.tool_choice == "none":
        return None
    kind = type(parser).__name__
    if kind not in _CALL_ENDS:
        raise RequestError("parallel_tool_calls", "false is enforced for the hermes, Qwen3-Coder, GLM-4 and harmony "
                                                  f"call formats; this model's template calls tools in another "
                                                  f"({kind}), whose calls share one block the sample cannot end "
                                                  "inside. Leave parallel_tool_calls unset (true).")
    return _CALL_ENDS[kind]


def first_call_end(text: str, marker: str, reasoning: tuple[str, str] | None) -> int | None:
    """Where ``text``'s first call ends (just after ``marker``), or None while no call has closed.

    A call inside the reasoning is not a call (the parser skips it), so the search starts after
    the reasoning, which is read as :func:`~treerl.envs.parser_base.split_reasoning` reads it.

    >>> first_call_end('a<tool_call>{}</tool_call><tool_call>{}</tool_call>', "</tool_call>", None)
    26
    >>> think = ("<think>", "</think>")
    >>> first_call_end("<think>x</tool_call></think><tool_call>{}</tool_call>", "</tool_call>", think)
    53
    >>> first_call_end("<think>x</tool_call>", "</tool_call>", think) is None
    True
    """
    start = 0
    if reasoning is not None:
        opening, closing = reasoning
        at = text.find(closing)
        if at >= 0:
            start = at + len(closing)
        elif text.lstrip().startswith(opening):  # still thinking
            return None
    at = text.find(marker, start)
    return None if at < 0 else at + len(marker)


def tool_reply(text: str, parsed: ParseResult | None, tools: Sequence[Mapping[str, Any]] | None
               ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The assistant message for sampled ``text`` and the episode's tool-call records.

    ``parsed`` is the template parser's reading of ``text`` (None when tools are off). Calls
    come back as OpenAI ``tool_calls`` only when every one is well formed, names a tool of the
    request and has arguments valid for its schema; otherwise the whole text comes back as
    plain content, and the records say what was wrong (a metric, never an error).
    """
    if parsed is None or (not parsed.calls and not parsed.errors):
        return {"role": "assistant", "content": text}, []
    schemas = {t["function"]["name"]: t["function"].get("parameters") for t in tools or []}
    records = [{"name": e.tool_name, "arguments": None, "error": e.kind.value, "message": e.message}
               for e in parsed.errors]
    calls = []
    for call in parsed.calls:
        record = {"name": call.name, "arguments": call.arguments, "error": None, "message": None}
        if call.name not in schemas:
            record.update(error="unknown_tool", message=f"Unknown tool {call.name!r}.")
        else:
            try:
                Tool.from_schema(call.name, schemas[call.name]).validate(call.arguments)
            except ToolCallError as exc:
                record.update(error=exc.kind.value, message=exc.message)
        records.append(record)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}})
    if any(r["error"] for r in records):
        return {"role": "assistant", "content": text}, records
    return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, records


def completion_body(choices: Sequence[dict[str, Any]], *, model: str, prompt_tokens: int, policy_version: int,
                    episode_id: str | None, head: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion`` object; ``choices`` hold index, message, finish_reason, logprobs, episode_id.

    ``head`` gives the id and creation time a stream announced already (see :func:`completion_head`)."""
    completion_tokens = sum(c.pop("_completion_tokens", 0) for c in choices)
    head = head or completion_head()
    body = {
        "id": head["id"], "object": "chat.completion", "created": head["created"],
        "model": model, "choices": list(choices), "system_fingerprint": f"treerl-v{policy_version}",
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
        "policy_version": policy_version,
    }
    if episode_id is not None:
        body["episode_id"] = episode_id
    return body


def chunk(head: Mapping[str, Any], index: int, delta: dict[str, Any], finish: str | None = None,
          extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk`` of choice ``index``; ``head`` holds id, created, model, system_fingerprint."""
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, **(extra or {})}]}
