"""Token fidelity over the real chat templates of 12 model families.

Each family's template (``tests/templates/real/<family>.jinja``, as the model ships it: the
header names the source and license, and :func:`test_real_templates_are_unmodified` checks
the text against its sha256) renders one tool-use episode through the engine's own turn steps
(:mod:`treerl.rollout.episode`): the prompt, then per turn a sampled completion in the
family's own format (reasoning, tool-call markup, stop token), the tool result or the user's
next turn, and the bridge or the branch. The tokenizer is a byte-level BPE trained here with
the family's special and added tokens as added tokens (what makes a bridge exact on a real
tokenizer is that added tokens are split out before BPE, which this one does the same way);
no model or tokenizer is downloaded.

Checked for every family, template variant and sampling (canonical ids, or every token split
into bytes): each sampled segment's root path in the tree is exactly the context the policy
was given (the trained path is what the model saw), and each such context decodes to the
template's rendering of the conversation so far (the model saw the conversation as its
template writes it). The branch counts are the table in the README ("Model families").
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from treerl.agents.chat import ChatRenderer
from treerl.agents.chat_templates import (TOOL_TEMPLATES, load_template, resolve_chat_template, template_family,
                                          template_gaps)
from treerl.agents.policy import Generation, SamplingParams
from treerl.agents.transformers_policy import end_of_turn_ids
from treerl.envs.core import Task, ToolEnv
from treerl.envs.parsers import HermesParser, PythonicParser, get_parser
from treerl.envs.tools import tool
from treerl.rollout.engine import RolloutEngine
from treerl.rollout import evaluate as evaluate_module
from treerl.rollout.evaluate import evaluate_with
from treerl.rollout.options import EpisodeOptions
from treerl.rollout.record import RolloutConfig, record, run_header
from treerl.rollout.summary import RolloutStats
from treerl.rollout.episode import EpisodeState, apply_bridge, finish_episode, observe, sample_turn
from treerl.rollout.trajectory import Group

from _scripted import ScriptedPolicy

REAL = Path(__file__).parent / "templates" / "real"

SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [
    "You are a helpful assistant. What is 17 times 23? Use the multiply tool, then answer.",
    '{"name": "multiply", "arguments": {"a": 17, "b": 23}} {"type": "function", "function": {}}',
    "The answer is 391. I should multiply. Thanks! And what is two plus two? Four.",
    "<function=multiply> <parameter=a> <arg_key>a</arg_key> <arg_value>17</arg_value> ```json",
]
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 17 times 23? Use the multiply tool, then answer."}]
FOLLOW_UP = {"role": "user", "content": "Thanks! And what is two plus two?"}
QWEN = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CODER_CALL = ("<tool_call>\n<function=multiply>\n<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n"
              "</function>\n</tool_call>")
HERMES_CALL = '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
HARMONY_CALL = ("<|channel|>analysis<|message|>{r}<|end|><|start|>assistant to=functions.multiply"
                '<|channel|>commentary json<|message|>{{"a": {a}, "b": {b}}}')
DEEPSEEK_CALL = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n"
                 '{{"a": {a}, "b": {b}}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
GLM_CALL = ("<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>{a}</arg_value>\n<arg_key>b</arg_key>\n"
            "<arg_value>{b}</arg_value>\n</tool_call>")


@dataclass
class Family:
    """One model family: its tokens, how its model writes the episode's turns, and its tool results' role."""

    special: list[str]
    added: list[str]
    bos: str | None
    eos: str
    call: str
    """A tool-call turn as the model writes it after the generation prompt ({r}: reasoning, {a}, {b}: arguments)."""
    answer: str
    """A final answer as the model writes it ({r}: reasoning)."""
    call_stop: str
    answer_stop: str
    tool_role: str = "tool"
    """Families whose template has no tool role get tool results as user turns."""
    parser: str | None = None
    template_kwargs: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "qwen2_5": Family(QWEN, ["<tool_call>", "</tool_call>"], None, "<|im_end|>",
                      HERMES_CALL, "The answer is {n}.", "<|im_end|>", "<|im_end|>"),
    "qwen3": Family(QWEN, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
                    None, "<|im_end|>", "<think>\n{r}\n</think>\n\n" + HERMES_CALL,
                    "<think>\n{r}\n</think>\n\nThe answer is {n}.", "<|im_end|>", "<|im_end|>"),
    # Qwen3 with enable_thinking=False: the generation prompt holds an empty <think></think>, which
    # its template leaves out of the earlier turns it renders again.
    "qwen3_no_thinking": Family(QWEN, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                       "</think>"], None, "<|im_end|>", HERMES_CALL, "The answer is {n}.",
                                "<|im_end|>", "<|im_end|>", template_kwargs={"enable_thinking": False}),
    # Qwen3.5 opens <think> in the generation prompt: the model starts inside its reasoning.
    "qwen3_5": Family(QWEN, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
                      None, "<|im_end|>", "{r}\n</think>\n\n" + CODER_CALL, "{r}\n</think>\n\nThe answer is {n}.",
                      "<|im_end|>", "<|im_end|>"),
    # Llama 3.x ends a turn that waits for a tool result with <|eom_id|>.
    "llama3_1": Family(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                        "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>",
                       '{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}', "The answer is {n}.",
                       "<|eom_id|>", "<|eot_id|>", tool_role="ipython"),
    "llama3_2": Family(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                        "<|python_tag|>"], [], "<|begin_of_text|>", "<|eot_id|>",
                       '{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}', "The answer is {n}.",
                       "<|eom_id|>", "<|eot_id|>", tool_role="ipython", template_kwargs={"date_string": "26 Jul 2024"}),
    # SentencePiece models write a leading space, which Mistral's template puts before plain content.
    "mistral": Family(["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                       "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [], "<s>", "</s>",
                      '[TOOL_CALLS] [{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}, "id": "call0000{i}"}}]',
                      " The answer is {n}.", "</s>", "</s>"),
    "gemma3": Family(["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], [], "<bos>", "<eos>",
                     "[multiply(a={a}, b={b})]", "The answer is {n}.", "<end_of_turn>", "<end_of_turn>",
                     tool_role="user", parser="pythonic"),
    "phi3_5": Family(["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], [], None, "<|endoftext|>",
                     '{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}', "The answer is {n}.",
                     "<|end|>", "<|end|>", tool_role="user"),
    "gpt_oss": Family(["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                       "<|endoftext|>"], [], None, "<|return|>", HARMONY_CALL,
                      "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>"
                      "The answer is {n}.", "<|call|>", "<|return|>"),
    # GLM ends a turn with the token that opens the next one: <|observation|> before a tool result.
    "glm4_moe": Family(["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
                        "<|endoftext|>"],
                       ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                        "</arg_value>", "<tool_response>", "</tool_response>"], None, "<|endoftext|>",
                       "\n<think>{r}</think>\n" + GLM_CALL, "\n<think>{r}</think>\nThe answer is {n}.",
                       "<|observation|>", "<|user|>"),
    # DeepSeek-R1 opens <think> in the generation prompt; after tool outputs it answers without one.
    "deepseek_r1": Family(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
                           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                           "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                           "<｜tool▁output▁end｜>", "<｜tool▁sep｜>"], ["<think>", "</think>"],
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "{r}\n</think>\n\n" + DEEPSEEK_CALL,
                          "{r}\n</think>\n\nThe answer is {n}.", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "nemotron3_nano": Family(QWEN, ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                                    "</think>"], None, "<|im_end|>", "{r}\n</think>\n" + CODER_CALL + "\n",
                             "{r}\n</think>\nThe answer is {n}.", "<|im_end|>", "<|im_end|>"),
}


def episode_script(family: Family) -> list[tuple[str, str, list[dict]]]:
    """The turns ``(text, stop token, what comes back)``: two tool calls, an answer, a follow-up, an answer."""
    def tool(content: str, i: int) -> dict:
        message = {"role": family.tool_role, "content": content}
        if family.tool_role == "tool":
            message.update(name="multiply", tool_call_id=f"call0000{i}")
        return message

    # After DeepSeek's tool outputs the model answers without reasoning (no <think> is opened there).
    after_tool = ("The answer is {n}." if family is FAMILIES["deepseek_r1"] else family.answer)
    return [
        (family.call.format(r="I should multiply.", a=1, b=1, i=1), family.call_stop, [tool("1", 1)]),
        (family.call.format(r="Now the real product.", a=17, b=23, i=2), family.call_stop, [tool("391", 2)]),
        (after_tool.format(r="The tool said 391.", n=391), family.answer_stop, [FOLLOW_UP]),
        (family.answer.format(r="Two plus two.", n=4), family.answer_stop, []),
    ]


TEMPLATE_OF = {"qwen3_no_thinking": "qwen3"}
"""Families that are another's template with other variables."""


def real_template(name: str) -> str:
    """A family's template as the model ships it: the file without its header comment."""
    text = (REAL / f"{TEMPLATE_OF.get(name, name)}.jinja").read_text(encoding="utf-8")
    return text[text.index("-#}\n") + len("-#}\n"):]


def test_real_templates_are_unmodified():
    for path in sorted(REAL.glob("*.jinja")):
        header = path.read_text(encoding="utf-8").split("-#}", 1)[0]
        # The header names the source model, its license and where the text was taken from.
        assert re.search(r"The chat template of \S.* \(.+\), as stored in \S+", header), path.name
        digest = re.search(r"sha256 ([0-9a-f]{64})", header).group(1)
        assert hashlib.sha256(real_template(path.stem).encode()).hexdigest() == digest, path.name
        assert template_family(real_template(path.stem)) == path.stem  # treerl recognizes it
    assert len(list(REAL.glob("*.jinja"))) >= 10


# -- a tokenizer per family ----------------------------------------------------------------


@pytest.fixture(scope="module")
def base_bpe() -> str:
    return train_bpe()


def train_bpe() -> str:
    """A byte-level BPE trained on a few sentences, serialized (each family loads a copy)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok.to_str()


def make_tokenizer(base_bpe: str, family: Family) -> PreTrainedTokenizerFast:
    extra = [t for t in family.special if t not in (family.bos, family.eos)]
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(base_bpe), bos_token=family.bos,
                                  eos_token=family.eos, extra_special_tokens=extra)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return tok


# -- the scripted policy: the model writes the script, canonically or byte by byte ---------------


class ScriptPolicy:
    """Samples the next scripted turn; records every context it was given.

    With ``stop_ids`` the turn ends at the first of them, as a sampler given those stop ids
    would end it (without, the whole scripted turn is sampled whatever it holds)."""

    def __init__(self, tok, turns, *, canonical: bool, stop_ids: frozenset[int] | None = None):
        self.tok, self.turns, self.canonical, self.stop_ids = tok, turns, canonical, stop_ids
        self.contexts: list[list[int]] = []

    async def agenerate(self, request) -> Generation:
        text, stop, _ = self.turns[len(self.contexts)]
        self.contexts.append(list(request.prompt_ids))
        ids = self._ids(request.prompt_ids, text) + [self.tok.convert_tokens_to_ids(stop)]
        if self.stop_ids is not None:
            ids = ids[:next(k for k, i in enumerate(ids) if i in self.stop_ids) + 1]
        return Generation(token_ids=ids, logprobs=[-1.0] * len(ids), candidates=None, finish_reason="stop",
                          policy_version=0, num_prompt_tokens_processed=len(request.prompt_ids))

    def _ids(self, context: list[int], text: str) -> list[int]:
        if self.canonical:  # the ids the tokenizer gives the text right after the context
            whole = self.tok.encode(self.tok.decode(context) + text, add_special_tokens=False)
            if whole[:len(context)] == context:
                return whole[len(context):]
        added = set(self.tok.added_tokens_decoder)
        out: list[int] = []
        for i in self.tok.encode(text, add_special_tokens=False):
            piece = self.tok.convert_ids_to_tokens(i)
            out.extend([i] if i in added else self.tok.convert_tokens_to_ids(list(piece)))
        return out


@dataclass
class Played:
    group: Group
    policy: ScriptPolicy
    renderer: ChatRenderer
    conversations: list[list[dict]]
    """The conversation each context was rendered from."""
    branches: list[str | None]
    """Per bridge: None, or the branch reason."""


def play(base_bpe: str, name: str, variant: str, *, canonical: bool, family: Family | None = None) -> Played:
    """One scripted episode of family ``name`` (its tokens, script and template; ``family`` replaces its
    tokens and script) rendered with ``variant``."""
    family = family or FAMILIES[name]
    tok = make_tokenizer(base_bpe, family)
    tok.chat_template = real_template(name)  # as the model ships it
    template = resolve_chat_template(variant, tok)
    parser = get_parser(family.parser, chat_template=template or tok.chat_template)
    renderer = ChatRenderer(tok, tools=[MULTIPLY], chat_template=template, parser=parser,
                            template_kwargs=family.template_kwargs)
    turns = episode_script(family)
    policy = ScriptPolicy(tok, turns, canonical=canonical)
    group = Group(task_key="t", env_id="families")
    prompt = renderer.prompt_ids(QUESTION)
    state = EpisodeState(env=None, messages=[dict(m) for m in QUESTION], context_ids=list(prompt),
                         parent=group.add_segment("prompt", prompt), path=(0,))
    conversations, branches = [], []

    async def run() -> None:
        for _, _, obs in turns:
            conversations.append([dict(m) for m in state.messages])
            turn = await sample_turn(policy, state, group, renderer, SamplingParams(max_new_tokens=512),
                                     seed=0, shared=None, session=None)
            if not obs:
                finish_episode(state, group, turn.leaf, "terminated")
                return
            bridge = observe(state, renderer, turn, obs)
            branches.append(bridge.reason if bridge.branch else None)
            apply_bridge(state, group, turn, bridge)

    asyncio.run(run())
    return Played(group, policy, renderer, conversations, branches)


VARIANTS = [(name, variant) for name in FAMILIES for variant in ("model", "training")]


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "byte_split"])
@pytest.mark.parametrize("name, variant", VARIANTS)
def test_trained_path_is_what_the_model_saw(base_bpe, name, variant, canonical):
    played = play(base_bpe, name, variant, canonical=canonical)
    (episode,) = played.group.episodes
    tok = played.renderer.tokenizer
    sampled = [i for leaf in [*episode.extra_leaves, episode.leaf]
               for i in played.group.path_indices(leaf) if played.group.segments[i].kind == "sampled"]
    assert len(sampled) == len(played.policy.contexts) == 4
    for k, (segment, context) in enumerate(zip(sampled, played.policy.contexts)):
        path = [t for s in played.group.path_indices(segment)[:-1] for t in played.group.segments[s].token_ids]
        assert path == context, f"{name}/{variant} turn {k}: the trained path is not what the model saw"
        # ... and what the model saw is its template's rendering of the conversation so far
        # (a Llama turn that ended with <|eom_id|> keeps that token where the template writes <|eot_id|>).
        seen = tok.decode(context, skip_special_tokens=False).replace("<|eom_id|>", "<|eot_id|>")
        assert seen == played.renderer.render(played.conversations[k]), f"{name}/{variant} turn {k}"


def branch_table(base_bpe: str) -> dict[tuple[str, str], list[str | None]]:
    return {(name, variant): play(base_bpe, name, variant, canonical=True).branches for name, variant in VARIANTS}


# Bridges that branched, of the 3 in the episode (two tool results, one new user turn), with
# the model's own template and with treerl's training variant. The README's "Model families"
# table is this one.
EXPECTED_BRANCHES = {
    "qwen2_5": ([], []),
    "qwen3": (["not_append_only"], []),
    "qwen3_no_thinking": (["not_append_only"] * 3, []),  # every bridge: the empty <think></think> goes
    "qwen3_5": (["not_append_only"], []),
    "llama3_1": ([], []),
    "llama3_2": ([], []),
    "mistral": (["not_append_only", "not_append_only"], []),
    "gemma3": ([], []),
    "phi3_5": ([], []),
    "gpt_oss": (["not_append_only"], ["stop_token_mismatch"]),
    "glm4_moe": (["not_append_only"], []),
    "deepseek_r1": (["not_append_only"], []),
    "nemotron3_nano": (["not_append_only"], []),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_branches_per_family(base_bpe, name):
    got = tuple([r for r in play(base_bpe, name, variant, canonical=True).branches if r is not None]
                for variant in ("model", "training"))
    assert got == EXPECTED_BRANCHES[name]


# -- through the engine: gpt-oss's structured tool calls, a call inside reasoning ---------------


class _Multiply(ToolEnv):
    system_prompt = "You are a helpful assistant."

    def sample_task(self, rng):
        return Task(prompt="What is 17 times 23? Use the multiply tool, then answer.", answer="391")

    def score(self, task, completion):
        return float(task.answer in completion)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class _EnginePolicy(ScriptPolicy):
    def end_session(self, session) -> None:
        pass


@pytest.mark.parametrize("name, turns, executed, variant", [
    # gpt-oss: its template renders the tool result only after a structured call; the
    # analysis channel mentions a Hermes call, which is reasoning, not a call.
    ("gpt_oss", [(HARMONY_CALL.format(r='Maybe <tool_call>{"name": "multiply"}</tool_call>?', a=17, b=23), "<|call|>"),
                 (FAMILIES["gpt_oss"].answer.format(r="It said 391.", n=391), "<|return|>")], 1, "model"),
    # Qwen3: a call written inside <think> is not executed; the one after it is.
    ("qwen3", [("<think>\nFirst " + HERMES_CALL.format(a=1, b=1) + "\n</think>\n\n" + HERMES_CALL.format(a=17, b=23),
                "<|im_end|>"), ("<think>\nDone.\n</think>\n\nThe answer is 391.", "<|im_end|>")], 1, "model"),
    # GLM and DeepSeek: their own call formats, read by their parsers (picked from the template).
    ("glm4_moe", [(FAMILIES["glm4_moe"].call.format(r="Multiply.", a=17, b=23), "<|observation|>"),
                  ("\n<think>Done.</think>\nThe answer is 391.", "<|user|>")], 1, "model"),
    ("deepseek_r1", [(FAMILIES["deepseek_r1"].call.format(r="Multiply.", a=17, b=23), "<｜end▁of▁sentence｜>"),
                     ("The answer is 391.", "<｜end▁of▁sentence｜>")], 1, "training"),  # its own cuts the reasoning
])
def test_engine_plays_a_family_faithfully(base_bpe, name, turns, executed, variant):
    tok = make_tokenizer(base_bpe, FAMILIES[name])
    tok.chat_template = real_template(name)
    policy = _EnginePolicy(tok, [(text, stop, None) for text, stop in turns], canonical=True)
    engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=512), max_concurrency=1,
                           chat_template=resolve_chat_template(variant, tok))
    group = asyncio.run(engine.run_group(_Multiply(tools=[multiply]), "multiply", 0, 1))
    (episode,) = group.episodes
    assert episode.reward == 1.0 and episode.termination == "final_answer" and episode.extra_leaves == []
    assert "template/branch_reason" not in episode.metrics
    assert [(c["name"], c.get("arguments")) for c in episode.tool_calls] == [("multiply", {"a": 17, "b": 23})] * executed
    sampled = [i for i in group.path_indices(episode.leaf) if group.segments[i].kind == "sampled"]
    for segment, context in zip(sampled, policy.contexts, strict=True):
        assert [t for s in group.path_indices(segment)[:-1] for t in group.segments[s].token_ids] == context
    if name == "gpt_oss":  # the conversation holds the structured turn the template needed
        assert episode.messages[2]["tool_calls"][0]["function"] == {"name": "multiply", "arguments": {"a": 17, "b": 23}}


# -- Mistral's call ids, and a template that refuses what came back ----------------------------


def play_engine(base_bpe, name: str, turns: list[tuple[str, str]], *, template: str | None = None):
    """One episode of ``turns`` (text, stop token) through the engine with the family's real template."""
    tok = make_tokenizer(base_bpe, FAMILIES[name])
    tok.chat_template = template or real_template(name)
    policy = _EnginePolicy(tok, [(text, stop, None) for text, stop in turns], canonical=True)
    engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=512), max_concurrency=1)
    (episode,) = asyncio.run(engine.run_group(_Multiply(tools=[multiply]), "multiply", 0, 1)).episodes
    return episode


MISTRAL_CALL = '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 17, "b": 23}'


@pytest.mark.parametrize("call, num_calls", [
    (MISTRAL_CALL + "}]", 1),  # what Mistral-7B-v0.3 writes: no id
    (MISTRAL_CALL + ', "id": "call_1"}]', 1),  # an id the template refuses
    ('[TOOL_CALLS] [{"name": "multiply", "argu', 0),  # cut off: its error message is a tool result too
], ids=["no_id", "bad_id", "cut_off"])
def test_mistral_calls_get_the_ids_its_template_needs(base_bpe, call, num_calls):
    turns = [(call, "</s>"), (" The answer is 391.", "</s>")]
    episode = play_engine(base_bpe, "mistral", turns)
    assert episode.termination == "final_answer" and episode.reward == 1.0
    results = [m for m in episode.messages if m["role"] == "tool"]
    calls = [c for m in episode.messages for c in m.get("tool_calls", [])]
    assert len(results) == 1 and re.fullmatch(r"[A-Za-z0-9]{9}", results[0]["tool_call_id"])
    # The call and its result carry the same id, and a rerun gives the same one.
    assert [c["id"] for c in calls] == [results[0]["tool_call_id"]] * num_calls
    assert play_engine(base_bpe, "mistral", turns).messages == episode.messages


def test_a_template_that_refuses_the_results_ends_the_episode_as_data(base_bpe, caplog):
    # A template without a tool role that raises on one: the episode ends there, the run goes on.
    template = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role here') }}"
                "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    turns = [(HERMES_CALL.format(a=17, b=23), "<|im_end|>")]
    with caplog.at_level("WARNING", logger="treerl.rollout.engine"):
        episode = play_engine(base_bpe, "qwen2_5", turns, template=template)
    assert episode.termination == "render_error" and episode.reward == 0.0
    assert "no tool role here" in episode.metrics["render_error"]
    assert "no tool role here" in caplog.text
    assert [c["name"] for c in episode.tool_calls] == ["multiply"]  # what happened before is kept


# -- where a turn stops: each family's own stop ids ---------------------------------------------

# The eos tokens of each model's generation_config.json (what a sampler stops on before treerl
# adds the template's end-of-turn tokens); tokens a test tokenizer lacks are left out.
GENERATION_EOS = {
    "qwen2_5": ["<|im_end|>", "<|endoftext|>"], "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "qwen3_no_thinking": ["<|im_end|>", "<|endoftext|>"],
    "qwen3_5": ["<|im_end|>", "<|endoftext|>"], "nemotron3_nano": ["<|im_end|>"],
    "llama3_1": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "llama3_2": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    "mistral": ["</s>"], "gemma3": ["<eos>", "<end_of_turn>"], "phi3_5": ["<|endoftext|>", "<|end|>"],
    "gpt_oss": ["<|return|>", "<|endoftext|>", "<|call|>"],
    "glm4_moe": ["<|endoftext|>", "<|user|>", "<|observation|>"], "deepseek_r1": ["<｜end▁of▁sentence｜>"],
}


def family_stop_ids(tok, name: str) -> frozenset[int]:
    """The stop ids a policy of this family samples with (:func:`end_of_turn_ids`, as the policies call it)."""
    vocab = tok.get_vocab()
    model = SimpleNamespace(generation_config=SimpleNamespace(
        eos_token_id=[vocab[t] for t in GENERATION_EOS[name] if t in vocab]))
    return end_of_turn_ids(model, tok)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_turn_stops_only_where_the_family_ends_it(base_bpe, name):
    # gpt-oss writes <|end|> after its analysis, inside the turn: stopping there would end every
    # turn before its call or its answer.
    family = FAMILIES[name]
    tok = make_tokenizer(base_bpe, family)
    stops = family_stop_ids(tok, name)
    for text, stop, _ in episode_script(family):
        inside = [tok.convert_ids_to_tokens(i) for i in tok.encode(text, add_special_tokens=False) if i in stops]
        assert inside == [], f"{name}: the turn would stop inside at {inside}: {text!r}"
        assert tok.convert_tokens_to_ids(stop) in stops, f"{name}: {stop} does not stop the turn"


def test_gpt_oss_plays_call_and_answer_with_its_own_stop_ids(base_bpe):
    tok = make_tokenizer(base_bpe, FAMILIES["gpt_oss"])
    tok.chat_template = real_template("gpt_oss")
    turns = [(HARMONY_CALL.format(r="Multiply.", a=17, b=23), "<|call|>", None),
             (FAMILIES["gpt_oss"].answer.format(r="It said 391.", n=391), "<|return|>", None)]
    policy = _EnginePolicy(tok, turns, canonical=True, stop_ids=family_stop_ids(tok, "gpt_oss"))
    engine = RolloutEngine(policy, tok, params=SamplingParams(max_new_tokens=512), max_concurrency=1)
    group = asyncio.run(engine.run_group(_Multiply(tools=[multiply]), "multiply", 0, 1))
    (episode,) = group.episodes
    assert [(c["name"], c.get("arguments")) for c in episode.tool_calls] == [("multiply", {"a": 17, "b": 23})]
    assert episode.reward == 1.0 and episode.termination == "final_answer"


def test_learning_gpt_oss_packs_padded_with_a_note(base_bpe, tmp_path, capsys):
    # Tree attention does not implement gpt-oss's attention sinks: the learner packs padded
    # (exact for a model's own attention) and says so at the start, instead of crashing at
    # the first training forward.
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    from treerl.learners.grpo import GRPOConfig, train

    tok = make_tokenizer(base_bpe, FAMILIES["gpt_oss"])
    tok.chat_template = real_template("gpt_oss")
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=16,
        eos_token_id=tok.convert_tokens_to_ids("<|return|>"), pad_token_id=tok.convert_tokens_to_ids("<|return|>")))
    cfg = GRPOConfig(output_dir=str(tmp_path), steps=1, tasks_per_step=1, group_size=2, max_new_tokens=6,
                     eval_episodes=0, progress=False, num_threads=1)
    train(cfg, model=model, tokenizer=tok, env_factory=lambda: _Multiply(tools=[multiply]))
    assert "packing padded (--pack-mode padded)" in capsys.readouterr().err
    assert json.loads((tmp_path / "config.json").read_text())["pack_mode"] == "padded"
    assert all(math.isfinite(v) for v in json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0]).values()
               if isinstance(v, float))


# -- what a template keeps from the model: warned before a run plays -----------------------------

TEMPLATE_GAPS = {  # which of the warnings each family's own template gets (none for the others)
    "phi3_5": ["ignores `tools`", "drops `tool` messages"],  # renders system, user, assistant only
    "gemma3": ["ignores `tools`", "cannot render a tool result"],  # its roles must alternate user/model
    "deepseek_r1": ["ignores `tools`"],
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_template_gaps_name_what_the_model_would_never_see(base_bpe, name):
    tok = make_tokenizer(base_bpe, FAMILIES[name])
    tok.chat_template = real_template(name)
    gaps = template_gaps(tok, [MULTIPLY])
    expected = TEMPLATE_GAPS.get(name, [])
    assert len(gaps) == len(expected) and all(e in g for e, g in zip(expected, gaps)), gaps
    assert template_gaps(tok, []) == []  # no tools, no tool results
    variant = f"{TEMPLATE_OF.get(name, name)}_tools"
    if variant in TOOL_TEMPLATES:  # the fix the warnings name leaves nothing out
        assert all(f"pass --chat-template {variant}" in g for g in gaps), gaps
        assert template_gaps(tok, [MULTIPLY], load_template(variant)) == []


def test_rollout_warns_when_the_template_drops_tool_results(base_bpe, tmp_path, capsys):
    tok = make_tokenizer(base_bpe, FAMILIES["phi3_5"])
    tok.chat_template = real_template("phi3_5")
    policy = _EnginePolicy(tok, [("The answer is 4.", "<|end|>", None)] * 16, canonical=True)
    record(RolloutConfig(out=str(tmp_path / "r.jsonl"), env="treerl/Calculator-v0", num_tasks=1, group_size=1,
                         progress=False), policy, tok)
    err = capsys.readouterr().err
    assert "warning: the chat template ignores `tools`" in err
    assert "warning: the chat template drops `tool` messages" in err and "--chat-template" in err


# -- choosing the template: --chat-template -----------------------------------------------------


def test_chat_template_flag_picks_the_training_variant(base_bpe, tmp_path):
    tok = make_tokenizer(base_bpe, FAMILIES["qwen3"])
    tok.chat_template = real_template("qwen3")
    assert resolve_chat_template("model", tok) is None
    assert resolve_chat_template("training", tok) == load_template("qwen3_training")
    tok.chat_template = real_template("qwen2_5")  # already prefix-preserving: kept
    assert resolve_chat_template("training", tok) is None
    assert "treerl's prefix-preserving training variant" in load_template("deepseek_r1_training")
    path = tmp_path / "mine.jinja"
    path.write_text("{{ messages[0].content }}")
    assert resolve_chat_template(str(path), tok) == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="unknown chat template 'qwen9_training'.*'training'"):
        resolve_chat_template("qwen9_training", tok)

    opts = EpisodeOptions(chat_template="training")
    tok.chat_template = real_template("glm4_moe")
    assert opts.engine(_EnginePolicy(tok, [], canonical=True), tok, seed=0).chat_template == load_template(
        "glm4_moe_training")
    with pytest.raises(ValueError, match=r"chat_template='bogus' is not a template choice.*--chat-template training"):
        EpisodeOptions(chat_template="bogus")


def test_chosen_template_and_its_variables_become_the_tokenizers_own(base_bpe):
    # --chat-template and --chat-template-kwargs together: the training variant with the fixed
    # variables is the tokenizer's own, and the engine renders with it (not the bare variant).
    tok = make_tokenizer(base_bpe, FAMILIES["qwen3"])
    tok.chat_template = real_template("qwen3")
    opts = EpisodeOptions(chat_template="training", chat_template_kwargs={"enable_thinking": False})
    opts.apply_chat_template(tok)
    assert tok.chat_template == "{%- set enable_thinking = false %}" + load_template("qwen3_training")
    assert opts.engine(_EnginePolicy(tok, [], canonical=True), tok, seed=0).chat_template is None
    assert resolve_chat_template("training", tok) is None
    assert resolve_chat_template("qwen3_training", tok) == load_template("qwen3_training")  # another spec: resolved


def test_eval_and_the_trajectory_header_use_the_chosen_template(base_bpe, tmp_path):
    tok = make_tokenizer(base_bpe, FAMILIES["qwen3"])
    tok.chat_template = real_template("qwen3")
    rendered: list[str | None] = []

    class Spy(RolloutEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            rendered.append(self.chat_template)

        async def run(self, *args, **kwargs):
            return [], RolloutStats()

    cfg = RolloutConfig(out=str(tmp_path / "r.jsonl"), chat_template="training")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evaluate_module, "RolloutEngine", Spy)
        evaluate_with(cfg, _EnginePolicy(tok, [], canonical=True), tok, num_episodes=1, seed=0)
    assert rendered == [load_template("qwen3_training")]
    header = run_header(cfg, tok)
    assert header["run"]["tokenizer"]["chat_template_sha256"] == hashlib.sha256(
        load_template("qwen3_training").encode()).hexdigest()


def test_gpt_oss_call_the_template_writes_differently_branches(base_bpe):
    """The structured turn renders its arguments with tojson's spacing: a call written compactly
    cannot be given back, so the episode goes on from the rendering, on a new branch."""
    tok = make_tokenizer(base_bpe, FAMILIES["gpt_oss"])
    tok.chat_template = real_template("gpt_oss")
    renderer = ChatRenderer(tok, tools=[MULTIPLY], parser=get_parser(tokenizer=tok))
    text = HARMONY_CALL.format(r="Multiply.", a=17, b=23).replace('{"a": 17, "b": 23}', '{"a":17,"b":23}')
    completion = tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|call|>")]
    result = [{"role": "tool", "name": "multiply", "content": "391"}]
    bridge = renderer.bridge(QUESTION, completion, text, result)
    assert bridge.branch and bridge.reason == "not_append_only" and "assistant turn just sampled" in bridge.detail
    assert bridge.message["tool_calls"][0]["function"]["arguments"] == {"a": 17, "b": 23}
    assert bridge.context_ids == renderer.prompt_ids([*QUESTION, bridge.message, *result])
    # Without the parser the template cannot render the turn at all: it refuses raw channel markup.
    with pytest.raises(Exception, match="<\\|channel\\|> tags in the content field"):
        ChatRenderer(tok, tools=[MULTIPLY]).bridge(QUESTION, completion, text, result)


# -- families without a tool role: their tool-use variants -----------------------------------------

TOOLS_VARIANT_FAMILIES = {
    # The episode as the model plays it with the variant: calls in the format the variant asks
    # for, results as `tool` messages; the parser is the one picked from the variant.
    "gemma3": replace(FAMILIES["gemma3"], tool_role="tool", parser=None),
    "phi3_5": replace(FAMILIES["phi3_5"], call=HERMES_CALL, tool_role="tool"),
}


@pytest.mark.parametrize("canonical", [True, False], ids=["canonical", "byte_split"])
@pytest.mark.parametrize("name", sorted(TOOLS_VARIANT_FAMILIES))
def test_tools_variant_plays_tool_results_append_only(base_bpe, name, canonical):
    played = play(base_bpe, name, "training", canonical=canonical, family=TOOLS_VARIANT_FAMILIES[name])
    assert played.renderer.chat_template == load_template(f"{name}_tools")  # what `training` picks for them
    assert played.branches == [None, None, None]  # every bridge extends the context
    tok = played.renderer.tokenizer
    contexts = [tok.decode(c, skip_special_tokens=False) for c in played.policy.contexts]
    assert "Multiply two integers." in contexts[0]  # the schemas reach the prompt
    assert "<tool_response>\n1\n</tool_response>" in contexts[1]  # each result reaches the next turn
    assert "<tool_response>\n391\n</tool_response>" in contexts[2]
    (episode,) = played.group.episodes
    for leaf_context, segment in zip(played.policy.contexts, [i for i in played.group.path_indices(episode.leaf)
                                                              if played.group.segments[i].kind == "sampled"]):
        assert [t for s in played.group.path_indices(segment)[:-1]
                for t in played.group.segments[s].token_ids] == leaf_context


@pytest.mark.parametrize("name, parser", [("gemma3", PythonicParser), ("phi3_5", HermesParser)])
def test_tools_variant_renders_structured_calls_as_its_parser_reads_them(base_bpe, name, parser):
    tok = make_tokenizer(base_bpe, FAMILIES[name])
    template = load_template(f"{name}_tools")
    # The format the variant asks for is the one its family's parser is picked for.
    assert type(get_parser(chat_template=template)) is parser is type(get_parser(chat_template=real_template(name)))
    arguments = {"a": 17, "b": 23, "note": 'say "hi"\n', "flag": True, "none": None}
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "multiply", "arguments": arguments}}]}
    text = tok.apply_chat_template([QUESTION[1], call], tools=[MULTIPLY], chat_template=template, tokenize=False)
    turn = text.split("<start_of_turn>model\n" if name == "gemma3" else "<|assistant|>\n")[1]
    assert [(c.name, c.arguments) for c in parser().parse(turn).calls] == [("multiply", arguments)]
    # Without tools and tool messages, the variant is the model's own template.
    plain = [*QUESTION, {"role": "assistant", "content": "Hi."}, FOLLOW_UP]
    assert tok.apply_chat_template(plain, chat_template=template, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(plain, chat_template=real_template(name), tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("name, call, stop", [
    ("gemma3", "[multiply(a=17, b=23)]", "<end_of_turn>"),
    ("phi3_5", HERMES_CALL.format(a=17, b=23), "<|end|>"),
])
def test_training_template_plays_a_tool_env_for_families_without_a_tool_role(base_bpe, name, call, stop):
    # The way the commands do it: --chat-template training becomes the tokenizer's own, and the
    # environment reads calls with the parser that template implies.
    tok = make_tokenizer(base_bpe, FAMILIES[name])
    tok.chat_template = real_template(name)
    opts = EpisodeOptions(chat_template="training")
    opts.apply_chat_template(tok)
    assert tok.chat_template == load_template(f"{name}_tools")
    assert EpisodeOptions(chat_template=f"{name}_tools").chat_template == f"{name}_tools"  # a shipped name
    policy = _EnginePolicy(tok, [(call, stop, None), ("The answer is 391.", stop, None)], canonical=True)
    engine = opts.engine(policy, tok, seed=0, max_new_tokens=512)
    group = asyncio.run(engine.run_group(_Multiply(tools=[multiply]), "multiply", 0, 1))
    (episode,) = group.episodes
    assert episode.termination == "final_answer" and episode.reward == 1.0
    assert [(c["name"], c.get("arguments")) for c in episode.tool_calls] == [("multiply", {"a": 17, "b": 23})]
    assert "template/branch_reason" not in episode.metrics
    prompt, after_call = (tok.decode(c, skip_special_tokens=False) for c in policy.contexts)
    assert "Multiply two integers." in prompt and "<tool_response>\n391\n</tool_response>" in after_call


@pytest.mark.slow  # a whole run or many kernel shapes: CI's slow tier keeps the default under 10 min
def test_learning_gemma3_tool_use_with_a_tiny_model(base_bpe, tmp_path):
    # A tiny Gemma 3 learns from tool-use episodes played with its real template and
    # --chat-template training: the call is run, its result reaches the next turn.
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from treerl.learners.grpo import GRPOConfig, train

    tok = make_tokenizer(base_bpe, FAMILIES["gemma3"])
    tok.chat_template = real_template("gemma3")
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, sliding_window=16, max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id, eos_token_id=end, pad_token_id=tok.eos_token_id))
    before = {k: v.clone() for k, v in model.named_parameters()}
    answers = ["The answer is 391.", "The answer is 390."]  # one right, one wrong: the group has an advantage

    class Recording(ScriptedPolicy):
        contexts: list[str] = []

        def generate(self, requests):
            self.contexts += [tok.decode(r.prompt_ids, skip_special_tokens=False) for r in requests]
            return super().generate(requests)

    policy = Recording(tok, lambda task, gen, turn: "[multiply(a=17, b=23)]" if turn == 0 else answers[gen], end)
    cfg = GRPOConfig(output_dir=str(tmp_path), steps=1, tasks_per_step=1, group_size=2, max_new_tokens=32,
                     eval_episodes=0, progress=False, num_threads=1, chat_template="training")
    train(cfg, model=model, tokenizer=tok, policy=policy, env_factory=lambda: _Multiply(tools=[multiply]))
    metrics = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["reward/mean"] == 0.5
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
    assert all("Multiply two integers." in c for c in policy.contexts)  # the schemas, in every turn's prompt
    assert sum("<tool_response>\n391\n</tool_response>" in c for c in policy.contexts) == 2  # each second turn
