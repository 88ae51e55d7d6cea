"""The shipped tiny model: files, offline loading, tokenizer, chat template, training pieces."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from treerl.envs.builtin.calculator_tasks import SYSTEM_PROMPT, CalculatorTask, calculator, sample_task
from treerl.models import DEFAULT_MODEL_PATH, default_model_path, load_default_model
from treerl.models import train_tiny
from treerl.models.train_tiny import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TOOL_TOKENS,
    TrainTinyConfig,
    calculator_schema,
    encode_conversations,
    make_episode,
)

TOOLS = [calculator_schema()]


@pytest.fixture(scope="module")
def shipped():
    return load_default_model()


def _call(expression: str) -> dict:
    return {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}


def _conversation() -> list[dict]:
    """A Calculator episode with two tool calls, a retry after a tool error, and an answer."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": "Ana has 12 apples and buys 7 more. Then she triples them. How many?"},
        {"role": "assistant", "content": "", "tool_calls": [_call("12 + 7")]},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": "Now triple it.", "tool_calls": [_call("19 x 3")]},
        {"role": "tool", "content": "Error: not a valid arithmetic expression"},
        {"role": "assistant", "content": "", "tool_calls": [_call("19 * 3")]},
        {"role": "tool", "content": "57"},
        {"role": "assistant", "content": "The answer is \\boxed{57}."},
    ]


# --- files and loading --------------------------------------------------------------------


def test_shipped_files_exist_and_fit_in_20_mb():
    path = default_model_path()
    assert path == DEFAULT_MODEL_PATH
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names), "weights must be safetensors only"
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    assert size <= 20 * 1024 * 1024, f"{size / 2**20:.1f} MiB on disk"


def test_loads_offline_in_under_five_seconds():
    # A fresh interpreter, so the offline switch is read at import as in real use; a dead proxy
    # makes any accidental network access fail instead of quietly succeeding.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}  # fmt: skip
    program = Path(__file__).parent / "programs" / "time_tiny_model_load.py"
    result = subprocess.run([sys.executable, str(program)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    seconds, class_name, is_fast = result.stdout.split()[-3:]
    assert float(seconds) < 5.0
    assert class_name == "Qwen3ForCausalLM" and is_fast == "True"


def test_model_is_a_small_tied_qwen3_in_eval_mode(shipped):
    model, tokenizer = shipped
    config = model.config
    assert config.model_type == "qwen3" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention
    num_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= num_params <= 10_000_000
    assert not model.training and next(model.parameters()).dtype == torch.float32
    assert config.vocab_size == len(tokenizer)


def test_generation_config_stops_at_im_end_and_endoftext(shipped):
    model, tokenizer = shipped
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in eos
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") in eos
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    saved = json.loads((DEFAULT_MODEL_PATH / "generation_config.json").read_text())
    assert set(eos) <= set(saved["eos_token_id"])


# --- tokenizer ----------------------------------------------------------------------------


def test_special_and_tool_tokens_are_single_tokens(shipped):
    _, tokenizer = shipped
    for token in SPECIAL_TOKENS + TOOL_TOKENS:
        ids = tokenizer.encode(token, add_special_tokens=False)
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids[0]) == token, token
    # Tool tags survive skip_special_tokens, so parsers see them; control tokens do not.
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True)
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_tokenizer_round_trips_and_splits_digits(shipped):
    _, tokenizer = shipped
    text = 'Mia has 1234 coins. {"expression": "(12 + 7) * 3"} \\boxed{-57}'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert [tokenizer.decode([i]) for i in tokenizer.encode("1234", add_special_tokens=False)] == ["1", "2", "3", "4"]
    assert 500 <= len(tokenizer) <= 2048


# --- chat template ------------------------------------------------------------------------


def test_template_renders_tools_and_tool_calls_hermes_style(shipped):
    _, tokenizer = shipped
    text = tokenizer.apply_chat_template(_conversation()[:4], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    tool_json = json.dumps(TOOLS[0])
    expected = (
        f"<|im_start|>system\n{SYSTEM_PROMPT}\n\n<tools>\n{tool_json}\n</tools><|im_end|>\n"
        "<|im_start|>user\nAna has 12 apples and buys 7 more. Then she triples them. How many?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n19\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert text == expected


def test_template_content_before_calls_string_arguments_and_parallel_calls(shipped):
    _, tokenizer = shipped
    messages = [
        {"role": "user", "content": "Two sums?"},
        {
            "role": "assistant",
            "content": "Both at once.",
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "1 + 2"}'}},
                _call("3 + 4"),
            ],
        },
        {"role": "tool", "content": "3"},
        {"role": "tool", "content": "7"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nTwo sums?<|im_end|>\n"
        "<|im_start|>assistant\nBoth at once.\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1 + 2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 + 4"}}\n</tool_call><|im_end|>\n'
        # Consecutive tool results share one user turn, as in Qwen2.5.
        "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response><|im_end|>\n"
    )


def test_template_accepts_python_functions_as_tools(shipped):
    _, tokenizer = shipped
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tools=[calculator], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n<tools>\n{") and '"name": "calculator"' in text
    assert '"required": ["expression"]' in text and text.endswith("<|im_start|>assistant\n")


def test_template_without_tools_or_system(shipped):
    _, tokenizer = shipped
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>user\nhi<|im_end|>\n"
    )
    with pytest.raises(Exception, match="Unknown role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_template_is_append_only_in_text_and_tokens(shipped):
    _, tokenizer = shipped
    messages = _conversation()

    def render(upto: int, generation_prompt: bool) -> tuple[str, list[int]]:
        kwargs = dict(tools=TOOLS, add_generation_prompt=generation_prompt)
        text = tokenizer.apply_chat_template(messages[:upto], tokenize=False, **kwargs)
        return text, tokenizer.encode(text, add_special_tokens=False)

    for upto in range(2, len(messages)):
        longer_text, longer_ids = render(upto + 1, False)
        for generation_prompt in (False, True):
            if generation_prompt and messages[upto]["role"] != "assistant":
                continue  # a generation prompt is only ever followed by an assistant turn
            text, ids = render(upto, generation_prompt)
            assert longer_text.startswith(text), (upto, generation_prompt)
            assert longer_ids[: len(ids)] == ids, (upto, generation_prompt)


def test_shipped_template_is_the_training_template(shipped):
    _, tokenizer = shipped
    assert tokenizer.chat_template == CHAT_TEMPLATE


def test_training_schema_matches_the_tool_decorator_when_present():
    tools = pytest.importorskip("treerl.envs.tools")
    assert tools.tool(calculator).schema == calculator_schema()


# --- the model's behaviour ----------------------------------------------------------------


def test_greedy_episode_makes_a_well_formed_calculator_call(shipped):
    model, tokenizer = shipped
    task = CalculatorTask("Ana has 12 apples and buys 7 more. How many apples does Ana have now?", "12 + 7", "19")
    [(conversation, _)] = train_tiny.run_episodes(model, tokenizer, [task], TOOLS, temperature=1e-4)
    first_turn = conversation[2]["content"]
    call = json.loads(first_turn.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "calculator" and calculator(call["arguments"]["expression"])
    assert conversation[3]["role"] == "tool" and "\\boxed{" in conversation[4]["content"]


# --- the training script's pieces ---------------------------------------------------------


def test_make_episode_marks_exactly_the_correct_answers():
    config = TrainTinyConfig()
    rng = np.random.default_rng(0)
    num_correct = 0
    for _ in range(300):
        task = sample_task(rng)
        messages, correct = make_episode(task, rng, config)
        expression = messages[2]["tool_calls"][0]["function"]["arguments"]["expression"]
        assert messages[3]["content"] == calculator(expression)
        boxed = messages[4]["content"].removeprefix("The answer is \\boxed{").removesuffix("}.")
        assert correct == (boxed == task.answer)
        num_correct += correct
    # Independent mistakes at the configured odds leave roughly a third of episodes correct.
    assert 0.25 < num_correct / 300 < 0.5


def test_perfect_config_gives_only_correct_episodes():
    config = TrainTinyConfig(p_wrong_operator=0.0, p_distractor=0.0, p_wrong_answer=0.0)
    rng = np.random.default_rng(1)
    assert all(make_episode(sample_task(rng), rng, config)[1] for _ in range(200))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("p_wrong_answer", 1.5, "p_wrong_answer=1.5 is not a probability"),
        ("steps", 0, "steps=0 must be positive"),
        ("num_attention_heads", 5, "not divisible by num_attention_heads=5"),
        ("num_key_value_heads", 4, "num_key_value_heads=4 must divide"),
        ("lr", -1.0, "lr=-1.0 must be positive"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainTinyConfig(**{field: value})


def test_loss_mask_covers_exactly_the_assistant_turns(shipped):
    _, tokenizer = shipped
    [(ids, mask)] = encode_conversations(tokenizer, [_conversation()], TOOLS)
    trained = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    expected = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 + 7"}}\n</tool_call><|im_end|>'
        'Now triple it.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "19 x 3"}}\n</tool_call><|im_end|>'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "19 * 3"}}\n</tool_call><|im_end|>'
        "The answer is \\boxed{57}.<|im_end|>"
    )
    assert trained == expected


def _micro_config(**overrides) -> TrainTinyConfig:
    values = dict(vocab_size=400, tokenizer_episodes=200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, steps=3, batch_size=4, warmup_steps=1,
                  eval_episodes=0, threads=1)  # fmt: skip
    values.update(overrides)
    return TrainTinyConfig(**values)


def test_shared_prefix_loss_equals_the_plain_loss(shipped):
    _, tokenizer = shipped
    torch.manual_seed(0)
    model = train_tiny.build_model(tokenizer, _micro_config())
    rng = np.random.default_rng(0)
    examples = encode_conversations(
        tokenizer, [make_episode(sample_task(rng), rng, TrainTinyConfig())[0] for _ in range(5)], TOOLS
    )
    prefix_len = train_tiny.shared_prefix_length(examples)
    assert prefix_len > 50  # the system turn with the tool schema
    batch = train_tiny._batch(examples, tokenizer.pad_token_id, prefix_len)
    split_loss = train_tiny._loss(model, batch)

    # The same loss without the split: every row in full, right-padded.
    length = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), length), tokenizer.pad_token_id)
    labels = torch.full((len(examples), length), -100)
    attention_mask = torch.zeros_like(input_ids)
    for row, (ids, mask) in enumerate(examples):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        attention_mask[row, : len(ids)] = 1
        labels[row, : len(ids)] = torch.where(torch.tensor(mask), torch.tensor(ids), -100)
    plain_loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
    torch.testing.assert_close(split_loss, plain_loss, rtol=1e-5, atol=1e-5)


def test_training_script_is_deterministic_and_writes_a_loadable_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for run in ("a", "b"):
        train_tiny.main(["--out", str(tmp_path / run), "--seed", "3", *_cli(_micro_config())])
    assert "elapsed" in capsys.readouterr().out
    weights = [AutoModelForCausalLM.from_pretrained(tmp_path / run).state_dict() for run in ("a", "b")]
    for name, tensor in weights[0].items():
        torch.testing.assert_close(tensor, weights[1][name], rtol=0, atol=0, msg=name)
    tokenizers = [AutoTokenizer.from_pretrained(tmp_path / run) for run in ("a", "b")]
    assert tokenizers[0].get_vocab() == tokenizers[1].get_vocab()
    assert tokenizers[0].chat_template == CHAT_TEMPLATE


def _cli(config: TrainTinyConfig) -> list[str]:
    defaults = TrainTinyConfig()
    args = []
    for name, value in vars(config).items():
        if value != getattr(defaults, name):
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args
