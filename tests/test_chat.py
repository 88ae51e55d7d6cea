"""Chat rendering with token fidelity: bridges keep every recorded path equal to the rendering.

Each template family (``tests/templates/*.jinja``) gets a real byte-level BPE trained here
with ``tokenizers`` (with the Qwen2/Llama-3 pre-tokenizer regex), wrapped in
``PreTrainedTokenizerFast`` with the family's added tokens. A scripted "model" samples
texts as token ids: canonically (the ids the tokenizer gives in context) or not (the same
text split into single bytes). Episodes are played the way the engine plays them: prompt
once, then completion + bridge per turn, and the path is checked against the tokenization
of the whole rendered conversation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from treerl.agents.chat import Bridge, BranchReason, ChatRenderer, assistant_message
from treerl.agents.chat_templates import SHIPPED_TEMPLATES, load_template

TEMPLATES = Path(__file__).parent / "templates"
TINY = Path(__file__).resolve().parents[1] / "treerl" / "models" / "tiny"

# The Qwen2 / Llama-3 pre-tokenizer split: newlines group greedily, so a prompt ending with
# "\n" or "\n\n" tokenizes the same alone as with text after it.
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CORPUS = [
    "You are a helpful assistant. You may call one or more functions to assist with the user query.",
    "What is 17 times 23? Use the multiply tool, then answer.",
    '{"name": "multiply", "arguments": {"a": 17, "b": 23}}',
    '{"type": "function", "function": {"name": "multiply", "description": "Multiply two integers."}}',
    "The answer is 391. Let me check with another call to the tool.",
    "system user assistant tool ipython tool_call tool_response think Tools Environment",
    "Cutting Knowledge Date: December 2023. Today Date: 26 Jul 2024.",
    "Thanks! And what is two plus two? The weather in Paris is sunny today.",
    "I should call the tool first, then report the result in a box.",
]

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}

FAMILIES = {
    "hermes": dict(
        special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        bos=None, eos="<|im_end|>",
    ),
    "qwen3": dict(
        special=["<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>",
    ),
    "llama3": dict(
        special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                 "<|eom_id|>", "<|python_tag|>"],
        added=[],
        bos="<|begin_of_text|>", eos="<|eot_id|>",
    ),
    "mistral": dict(
        special=["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                 "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]",
                 "[/SYSTEM_PROMPT]"],
        added=[],
        bos="<s>", eos="</s>",
    ),
    # treerl's tool-use variants of the templates without a tool role (treerl/agents/templates).
    "gemma3_tools": dict(special=["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"], added=[],
                         bos="<bos>", eos="<end_of_turn>"),
    "phi3_5_tools": dict(special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], added=[],
                         bos=None, eos="<|end|>"),
}


@pytest.fixture(scope="module")
def base_bpe() -> str:
    """A byte-level BPE trained on a few sentences, serialized (each family loads a copy)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok.to_str()


def make_tokenizer(base_bpe: str, family: str) -> PreTrainedTokenizerFast:
    spec = FAMILIES[family]
    special = [t for t in spec["special"] if t not in (spec["bos"], spec["eos"])]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(base_bpe),
        bos_token=spec["bos"], eos_token=spec["eos"], extra_special_tokens=special,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    return tok


def make_renderer(base_bpe: str, family: str, **kwargs) -> tuple[ChatRenderer, PreTrainedTokenizerFast]:
    tok = make_tokenizer(base_bpe, family)
    template = load_template(family) if family in SHIPPED_TEMPLATES else (TEMPLATES / f"{family}.jinja").read_text()
    return ChatRenderer(tok, chat_template=template, **kwargs), tok


# -- the scripted model -----------------------------------------------------------------


def decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def canonical_ids(tok, context_ids: list[int], text: str) -> list[int]:
    """The ids the tokenizer gives ``text`` right after ``context_ids``: what a model trained
    on tokenized conversations samples. Asserts the boundary is stable (it is for the
    scripted texts: the pre-tokenizer never merges across it)."""
    ids = tok.encode(decode(tok, context_ids) + text, add_special_tokens=False)
    assert ids[: len(context_ids)] == context_ids, "unstable boundary in a scripted text"
    return ids[len(context_ids):]


def byte_split_ids(tok, text: str) -> list[int]:
    """A non-canonical tokenization of ``text``: every merged token split into its bytes."""
    added = set(tok.added_tokens_decoder)
    out: list[int] = []
    for i in tok.encode(text, add_special_tokens=False):
        piece = tok.convert_ids_to_tokens(i)
        out.extend([i] if i in added else tok.convert_tokens_to_ids(list(piece)))
    return out


def play(renderer, tok, messages, turns, *, canonical=True, stop=None):
    """Play scripted turns ``[(completion_text, new_messages), ...]`` like the engine.

    Returns the recorded path and the full conversation. Every bridge must extend the path.
    """
    stop_id = tok.convert_tokens_to_ids(stop or tok.eos_token)
    path = renderer.prompt_ids(messages)
    for text, new_messages in turns:
        body = canonical_ids(tok, path, text) if canonical else byte_split_ids(tok, text)
        completion = body + [stop_id]
        assert renderer.completion_text(completion) == text
        bridge = renderer.bridge(messages, completion, text, new_messages)
        assert not bridge.branch, bridge.detail
        path = path + completion + bridge.ids
        messages = [*messages, assistant_message(text), *new_messages]
    return path, messages


def tool_msg(content: str, role: str = "tool") -> dict:
    return {"role": role, "content": content}


HERMES_CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 17, "b": 23}}\n</tool_call>'
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is 17 times 23? Use the multiply tool, then answer."}]

EPISODES = {
    "hermes": (QUESTION, [
        (HERMES_CALL, [tool_msg("391")]),
        ("Let me check with another call.\n" + HERMES_CALL + "\n" + HERMES_CALL,
         [tool_msg("391"), tool_msg('{"error": "rate limited"}')]),
        ("The answer is \\boxed{391}.", [{"role": "user", "content": "Thanks! And what is two plus two?"}]),
        ("Four.", [{"role": "user", "content": "Thanks!"}]),
    ]),
    "qwen3": (QUESTION, [
        ("<think>\nI should call the tool first.\n</think>\n\n" + HERMES_CALL, [tool_msg("391")]),
        ("<think>\nThe tool said 391.\n</think>\n\n" + HERMES_CALL, [tool_msg("391"), tool_msg("391")]),
    ]),
    "llama3": (QUESTION, [
        ('{"name": "multiply", "parameters": {"a": 17, "b": 23}}', [tool_msg("391", role="ipython")]),
        ('{"name": "multiply", "parameters": {"a": 23, "b": 17}}', [tool_msg("391")]),
        ("The answer is 391.", [{"role": "user", "content": "Thanks! And what is two plus two?"}]),
        ("Four.", [{"role": "user", "content": "Thanks!"}]),
    ]),
    "mistral": (QUESTION[1:], [
        ('[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 17, "b": 23}}]', [tool_msg("391")]),
        ('[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 23, "b": 17}}]', [tool_msg("391"), tool_msg("391")]),
        ("The answer is 391.", []),
    ]),
}
EPISODES["phi3_5_tools"] = EPISODES["hermes"]
EPISODES["gemma3_tools"] = (QUESTION, [
    ("[multiply(a=17, b=23)]", [tool_msg("391")]),
    ("Let me check with another call.\n[multiply(a=17, b=23), multiply(a=23, b=17)]",
     [tool_msg("391"), tool_msg('{"error": "rate limited"}')]),
    ("The answer is 391.", [{"role": "user", "content": "Thanks! And what is two plus two?"}]),
    ("Four.", [{"role": "user", "content": "Thanks!"}]),
])
APPEND_ONLY = ["hermes", "qwen3", "llama3", "mistral", "gemma3_tools", "phi3_5_tools"]


# -- append-only templates: the path is the rendering ---------------------------------


@pytest.mark.parametrize("family", APPEND_ONLY)
def test_path_equals_tokenized_rendering(base_bpe, family):
    renderer, tok = make_renderer(base_bpe, family, tools=[MULTIPLY])
    messages, turns = EPISODES[family]
    path, full = play(renderer, tok, messages, turns)
    # Canonical samples: the recorded path is exactly the tokenization of the whole
    # conversation, as the learner and any later re-rendering would see it.
    assert path == renderer.prompt_ids(full)
    assert path == tok.apply_chat_template(full, tools=[MULTIPLY], chat_template=renderer.chat_template,
                                           add_generation_prompt=True, return_dict=False)


@pytest.mark.parametrize("family", APPEND_ONLY)
def test_non_canonical_samples_are_kept_and_decode_to_the_rendering(base_bpe, family):
    renderer, tok = make_renderer(base_bpe, family, tools=[MULTIPLY])
    messages, turns = EPISODES[family]
    path, full = play(renderer, tok, messages, turns, canonical=False)
    # The model saw its own (byte-split) ids: the path keeps them, so it differs from the
    # canonical tokenization while decoding to exactly the same conversation.
    assert path != renderer.prompt_ids(full)
    assert decode(tok, path) == renderer.render(full)
    assert len(path) > len(renderer.prompt_ids(full))


def test_bridge_is_the_glue_and_the_new_messages(base_bpe):
    renderer, tok = make_renderer(base_bpe, "hermes", tools=[MULTIPLY])
    completion = canonical_ids(tok, renderer.prompt_ids(QUESTION), HERMES_CALL) + [tok.eos_token_id]
    bridge = renderer.bridge(QUESTION, completion, HERMES_CALL, [tool_msg("391"), tool_msg("7")])
    assert decode(tok, bridge.ids) == (
        "\n<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n7\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert bridge == Bridge(ids=bridge.ids)


def test_template_without_generation_prompt_glue(base_bpe):
    renderer, tok = make_renderer(base_bpe, "mistral", tools=[MULTIPLY])
    messages = QUESTION[1:]
    assert renderer.render(messages, add_generation_prompt=True) == renderer.render(messages, add_generation_prompt=False)
    text = '[TOOL_CALLS][{"name": "multiply", "arguments": {"a": 17, "b": 23}}]'
    completion = canonical_ids(tok, renderer.prompt_ids(messages), text) + [tok.eos_token_id]
    bridge = renderer.bridge(messages, completion, text, [tool_msg("391")])
    # Nothing between </s> and the tool results, nothing after them: the model writes next.
    assert decode(tok, bridge.ids) == '[TOOL_RESULTS]{"content": "391"}[/TOOL_RESULTS]'


# -- truncated and odd completions ----------------------------------------------------


@pytest.mark.parametrize("family", APPEND_ONLY)
def test_length_stop_is_closed_by_a_forced_end_of_turn(base_bpe, family):
    renderer, tok = make_renderer(base_bpe, family, tools=[MULTIPLY])
    messages, turns = EPISODES[family]
    prompt = renderer.prompt_ids(messages)
    text = turns[0][0][:25]  # cut mid tool call, no stop token sampled
    completion = canonical_ids(tok, prompt, text)
    assert completion[-1] not in tok.all_special_ids
    assert renderer.completion_text(completion) == text
    bridge = renderer.bridge(messages, completion, text, [tool_msg("truncated")])
    assert not bridge.branch
    # The environment closes the turn: the bridge starts with the end-of-turn token.
    assert bridge.ids[0] == tok.eos_token_id
    full = [*messages, assistant_message(text), tool_msg("truncated")]
    assert prompt + completion + bridge.ids == renderer.prompt_ids(full)


def test_non_special_stop_id_keeps_its_text_and_closes_the_turn(base_bpe):
    # An engine that stops generation on </tool_call> (an added, non-special token).
    renderer, tok = make_renderer(base_bpe, "hermes", tools=[MULTIPLY])
    prompt = renderer.prompt_ids(QUESTION)
    completion = canonical_ids(tok, prompt, HERMES_CALL)
    assert completion[-1] == tok.convert_tokens_to_ids("</tool_call>")
    text = renderer.completion_text(completion)
    assert text == HERMES_CALL
    bridge = renderer.bridge(QUESTION, completion, text, [tool_msg("391")])
    assert bridge.ids[0] == tok.eos_token_id
    full = [*QUESTION, assistant_message(text), tool_msg("391")]
    assert prompt + completion + bridge.ids == renderer.prompt_ids(full)


def test_other_stop_token_branches(base_bpe):
    renderer, tok = make_renderer(base_bpe, "hermes", tools=[MULTIPLY])
    messages, turns = EPISODES["hermes"]
    text = turns[0][0]
    completion = canonical_ids(tok, renderer.prompt_ids(messages), text) + [tok.convert_tokens_to_ids("<|endoftext|>")]
    assert renderer.completion_text(completion) == text
    new = [tool_msg("391")]
    bridge = renderer.bridge(messages, completion, text, new)
    assert bridge.branch and bridge.reason == BranchReason.STOP_TOKEN_MISMATCH == "stop_token_mismatch"
    assert "<|endoftext|>" in bridge.detail and "<|im_end|>" in bridge.detail
    assert bridge.context_ids == renderer.prompt_ids([*messages, assistant_message(text), *new])


def test_llama_end_of_message_token_ends_the_turn_without_a_branch(base_bpe):
    """Llama 3.x ends a turn that waits for a tool with <|eom_id|>; the template writes <|eot_id|>
    there. The sampled <|eom_id|> stays in the path (Meta's format keeps it in history) and the
    bridge goes on with the template's tokens; without the alias it is a stop-token mismatch."""
    renderer, tok = make_renderer(base_bpe, "llama3", tools=[MULTIPLY])
    messages, turns = EPISODES["llama3"]
    text = turns[0][0]
    eom, eot = tok.convert_tokens_to_ids("<|eom_id|>"), tok.convert_tokens_to_ids("<|eot_id|>")
    prompt = renderer.prompt_ids(messages)
    completion = canonical_ids(tok, prompt, text) + [eom]
    new = [tool_msg("391", role="ipython")]
    bridge = renderer.bridge(messages, completion, text, new)
    assert not bridge.branch, bridge.detail
    full = renderer.prompt_ids([*messages, assistant_message(text), *new])
    path = prompt + completion + bridge.ids
    # The path is the rendering with the one sampled token in the place of the template's.
    assert path == [*prompt, *completion[:-1], eom, *bridge.ids]
    assert full == [*prompt, *completion[:-1], eot, *bridge.ids]

    strict = ChatRenderer(tok, chat_template=renderer.chat_template, tools=[MULTIPLY], turn_end_aliases={})
    bridge = strict.bridge(messages, completion, text, new)
    assert bridge.branch and bridge.reason == "stop_token_mismatch"
    assert "<|eom_id|>" in bridge.detail and "<|eot_id|>" in bridge.detail


def test_completion_text_with_the_stop_token_is_a_caller_bug(base_bpe):
    renderer, tok = make_renderer(base_bpe, "hermes")
    completion = canonical_ids(tok, renderer.prompt_ids(QUESTION), "Four.") + [tok.eos_token_id]
    with pytest.raises(ValueError, match=r"ends with the stop token '<\|im_end\|>'.*completion_text\(completion_ids\)"):
        renderer.bridge(QUESTION, completion, "Four.<|im_end|>", [tool_msg("x")])


# -- templates that are not append-only: a branch, never a mismatch -------------------


def test_qwen3_new_user_turn_drops_reasoning_and_branches(base_bpe):
    renderer, tok = make_renderer(base_bpe, "qwen3", tools=[MULTIPLY])
    messages, turns = EPISODES["qwen3"]
    path, conv = play(renderer, tok, messages, turns)  # tool results only: append-only
    assert path == renderer.prompt_ids(conv)

    answer = "<think>\nBoth calls said 391.\n</think>\n\nThe answer is 391."
    completion = canonical_ids(tok, path, answer) + [tok.eos_token_id]
    new = [{"role": "user", "content": "Thanks! And what is two plus two?"}]
    bridge = renderer.bridge(conv, completion, answer, new)
    assert bridge.branch and bridge.ids == []
    assert bridge.reason == BranchReason.NOT_APPEND_ONLY
    assert "earlier turn" in bridge.detail and "think" in bridge.detail
    full = [*conv, assistant_message(answer), *new]
    assert bridge.context_ids == renderer.prompt_ids(full)
    # Splicing the bridge tokens onto the old context would train on a context the model
    # never sees again: the re-rendered conversation lost the reasoning.
    assert "I should call the tool first" in decode(tok, path)
    assert "I should call the tool first" not in decode(tok, bridge.context_ids)

    # From the new branch, play continues append-only.
    completion = canonical_ids(tok, bridge.context_ids, "Four.") + [tok.eos_token_id]
    nxt = renderer.bridge(full, completion, "Four.", [tool_msg("4")])
    assert not nxt.branch
    assert bridge.context_ids + completion + nxt.ids == renderer.prompt_ids(
        [*full, assistant_message("Four."), tool_msg("4")])


def test_qwen3_without_thinking_branches_on_the_empty_think_block(base_bpe):
    # The generation prompt carries "<think>\n\n</think>\n\n"; the re-rendered turn does not.
    renderer, tok = make_renderer(base_bpe, "qwen3", tools=[MULTIPLY], template_kwargs={"enable_thinking": False})
    prompt = renderer.prompt_ids(QUESTION)
    assert decode(tok, prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    completion = canonical_ids(tok, prompt, HERMES_CALL) + [tok.eos_token_id]
    bridge = renderer.bridge(QUESTION, completion, HERMES_CALL, [tool_msg("391")])
    assert bridge.branch and bridge.reason == BranchReason.NOT_APPEND_ONLY
    assert "earlier turn" in bridge.detail


def test_llama3_trim_of_sampled_whitespace_branches(base_bpe):
    renderer, tok = make_renderer(base_bpe, "llama3")
    text = "The answer is 391.  "
    completion = canonical_ids(tok, renderer.prompt_ids(QUESTION), text) + [tok.eos_token_id]
    bridge = renderer.bridge(QUESTION, completion, text, [{"role": "user", "content": "Thanks!"}])
    assert bridge.branch and bridge.reason == BranchReason.NOT_APPEND_ONLY
    assert "assistant turn just sampled" in bridge.detail


def test_mistral_new_user_turn_moves_the_tools_block_and_branches(base_bpe):
    renderer, tok = make_renderer(base_bpe, "mistral", tools=[MULTIPLY])
    messages = QUESTION[1:]
    completion = canonical_ids(tok, renderer.prompt_ids(messages), "391.") + [tok.eos_token_id]
    bridge = renderer.bridge(messages, completion, "391.", [{"role": "user", "content": "Thanks!"}])
    assert bridge.branch and bridge.reason == BranchReason.NOT_APPEND_ONLY
    assert "[AVAILABLE_TOOLS]" in bridge.detail
    # Without tools the same template is append-only across user turns.
    renderer, tok = make_renderer(base_bpe, "mistral")
    path, full = play(renderer, tok, messages, [("391.", [{"role": "user", "content": "Thanks!"}]),
                                                ("You are welcome.", [{"role": "user", "content": "Bye."}])])
    assert path == renderer.prompt_ids(full)


def test_turn_end_without_special_token_branches(base_bpe):
    tok = make_tokenizer(base_bpe, "hermes")
    plain = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n\n{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    renderer = ChatRenderer(tok, chat_template=plain)
    messages = QUESTION[1:]
    completion = tok.encode("Four.", add_special_tokens=False)  # stopped on a stop string
    bridge = renderer.bridge(messages, completion, "Four.", [{"role": "user", "content": "Thanks!"}])
    assert bridge.branch and bridge.reason == BranchReason.TURN_END_NOT_SPECIAL
    assert "'\\n\\nuser: Thanks!" in bridge.detail
    assert bridge.context_ids == renderer.prompt_ids([*messages, assistant_message("Four."),
                                                      {"role": "user", "content": "Thanks!"}])


# -- property: any texts, the path decodes to the rendering -----------------------------

TEXT = st.text(alphabet=st.sampled_from(list("abc xyz 0129{}\":,.\n\t\u00e9\u65e5")), max_size=30)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(st.tuples(TEXT, st.lists(TEXT, min_size=1, max_size=2), st.booleans()),
                      min_size=1, max_size=3),
       canonical=st.booleans())
def test_any_episode_decodes_to_its_rendering(base_bpe, turns, canonical):
    renderer, tok = make_renderer(base_bpe, "hermes", tools=[MULTIPLY])
    messages = list(QUESTION)
    path = renderer.prompt_ids(messages)
    stable = True
    for text, results, as_user in turns:
        if canonical:
            ids = tok.encode(decode(tok, path) + text, add_special_tokens=False)
            # A text starting with whitespace may merge with the prompt's "\n": the model
            # then samples what it can from the context it has; fall back to a plain split.
            body = ids[len(path):] if ids[: len(path)] == path else tok.encode(text, add_special_tokens=False)
            stable &= ids[: len(path)] == path
        else:
            body = byte_split_ids(tok, text)
        completion = body + [tok.eos_token_id]
        new = [{"role": "user", "content": r} for r in results] if as_user else [tool_msg(r) for r in results]
        bridge = renderer.bridge(messages, completion, text, new)
        assert not bridge.branch, bridge.detail
        path = path + completion + bridge.ids
        messages = [*messages, assistant_message(text), *new]
    assert decode(tok, path) == renderer.render(messages)
    if canonical and stable:
        assert path == renderer.prompt_ids(messages)


# -- construction and the Bridge contract ------------------------------------------------


def test_renderer_config_errors_name_the_fix(base_bpe):
    tok = make_tokenizer(base_bpe, "hermes")
    with pytest.raises(ValueError, match="no chat_template.*Pass chat_template="):
        ChatRenderer(tok)
    template = (TEMPLATES / "hermes.jinja").read_text()
    with pytest.raises(ValueError, match=r"template_kwargs has \['add_generation_prompt', 'tools'\]"):
        ChatRenderer(tok, chat_template=template, template_kwargs={"tools": [], "add_generation_prompt": True})
    with pytest.raises(ValueError, match="tools must be a list of JSON-schema dicts"):
        ChatRenderer(tok, chat_template=template, tools=MULTIPLY)
    tok.chat_template = template
    assert ChatRenderer(tok).render(QUESTION).endswith("<|im_start|>assistant\n")


def test_bridge_fields_are_consistent():
    with pytest.raises(ValueError, match="branch=True.*context_ids"):
        Bridge(ids=[], branch=True)
    with pytest.raises(ValueError, match="branch=True.*no ids"):
        Bridge(ids=[1], branch=True, context_ids=[1], reason="not_append_only")
    with pytest.raises(ValueError, match="branch=False.*must be None"):
        Bridge(ids=[1], context_ids=[1])


def test_assistant_message_carries_raw_text_only(base_bpe):
    message = assistant_message(HERMES_CALL)
    assert message == {"role": "assistant", "content": HERMES_CALL}
    # Why no parsed tool_calls: the template renders them itself, so the call would appear
    # twice and the rendering would no longer be the text the model wrote.
    renderer, _ = make_renderer(base_bpe, "hermes")
    call = json.loads(HERMES_CALL.split("\n")[1])
    doubled = renderer.render([*QUESTION, {**message, "tool_calls": [{"type": "function", "function": call}]}])
    assert doubled.count('"name": "multiply"') == 2
    assert renderer.render([*QUESTION, message]).count('"name": "multiply"') == 1


# -- the shipped tiny model's tokenizer ----------------------------------------------------

TINY_EPISODE = (
    [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 17 times 23?"}],
    [(HERMES_CALL, [tool_msg("391")]),
     ("The answer is \\boxed{391}.", [{"role": "user", "content": "Thanks!"}]),
     ("You are welcome.", [tool_msg("1"), tool_msg("2")])],
)


def _check_append_only(tok):
    renderer = ChatRenderer(tok, tools=[MULTIPLY])
    messages, turns = TINY_EPISODE
    path, full = play(renderer, tok, messages, turns, stop="<|im_end|>")
    assert path == renderer.prompt_ids(full)
    path, full = play(renderer, tok, messages, turns, canonical=False, stop="<|im_end|>")
    assert path != renderer.prompt_ids(full) and decode(tok, path) == renderer.render(full)


def test_tiny_model_template_and_tokenizer_recipe_are_append_only():
    # The recipe the shipped tokenizer is built with, on a few sentences (no artifacts needed).
    train_tiny = pytest.importorskip("treerl.models.train_tiny")
    _check_append_only(train_tiny.train_tokenizer(CORPUS * 3, 500))


@pytest.mark.skipif(not (TINY / "tokenizer.json").exists(), reason="the tiny model is not built yet")
def test_shipped_tiny_tokenizer_is_append_only():
    from transformers import AutoTokenizer

    _check_append_only(AutoTokenizer.from_pretrained(TINY))
