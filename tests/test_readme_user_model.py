"""The README's "Your own model, data and rewards" command, run as written on a tiny
Llama-architecture model placed in a Hugging Face cache under the README's Hub id (only the
sizes are made small)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import torch

from treerl.cli import main

README = Path(__file__).resolve().parent.parent / "README.md"

REWARDS = '''
async def mentions_answer(prompts, completions, answer, **kwargs):
    return [1.0 if a in c[-1]["content"] else None for c, a in zip(completions, answer)]
'''


def _readme_command() -> list[str]:
    text = README.read_text()
    section = text.split("## Your own model, data and rewards", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return shlex.split(block.replace("\\\n", " "))


def _tiny_llama_in_cache(cache: Path, repo_id: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from treerl.models import load_default_model

    _, tok = load_default_model()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    org, name = repo_id.split("/")
    snapshot = cache / f"models--{org}--{name}" / "snapshots" / ("1" * 40)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(snapshot)  # a bfloat16 checkpoint, as on the Hub
    tok.save_pretrained(snapshot)
    (cache / f"models--{org}--{name}" / "refs").mkdir()
    (cache / f"models--{org}--{name}" / "refs" / "main").write_text("1" * 40)


def test_readme_command_runs(tmp_path, monkeypatch, capsys):
    import huggingface_hub.constants

    argv = _readme_command()
    assert argv[:2] == ["treerl", "learn"]
    repo_id = argv[argv.index("--model") + 1]
    _tiny_llama_in_cache(tmp_path / "hub", repo_id)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": [{"role": "user", "content": f"{i} + {i}?"}], "answer": str(2 * i), "level": i % 3}
            for i in range(6)]
    Path("train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    Path("test.jsonl").write_text(json.dumps({"prompt": "9 + 9?", "answer": "18"}) + "\n")
    Path("my_rewards.py").write_text(REWARDS)
    from treerl.models import load_default_model

    Path("template.jinja").write_text(load_default_model()[1].chat_template)
    small = ["--steps", "2", "--tasks-per-step", "2", "--group-size", "2", "--max-new-tokens", "8",
             "--eval-episodes", "1", "--progress", "false"]
    assert main(argv[1:] + small) == 0
    err = capsys.readouterr().err
    assert "precision: weights float32 (checkpoint bfloat16, upcast)" in err
    run = tmp_path / "runs" / "mine"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all("reward_fn/mentions_answer_mean" in m for m in metrics)
    assert (run / "model" / "config.json").is_file()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(next((tmp_path / "hub").glob("models--*/snapshots/*"))))
    assert isinstance(PeftModel.from_pretrained(base, str(run / "adapter")), PeftModel)
