"""LoRA on a Mixture-of-Experts model: transformers 5 keeps the experts as fused parameters (``gate_up_proj``,
``down_proj`` of one experts module), which peft adapts as parameters, nesting its wrappers; what is trained must
reach the sampler, output_dir/model and the adapter alike."""

from __future__ import annotations

import json

import pytest
import torch
from test_router_aux_loss import tiny_moe

pytestmark = pytest.mark.usefixtures("one_thread")


def test_lora_on_a_moe_trains_the_experts_and_the_sampler_gets_the_merged_weights(tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from treerl import GRPOConfig, GRPOTrainer
    from treerl.models import load_default_model

    _, tok = load_default_model()
    base = {k: v.detach().clone() for k, v in tiny_moe(vocab_size=len(tok)).state_dict().items()}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=2, num_generations=2,
                      per_device_train_batch_size=2, max_completion_length=8, learning_rate=1e-2, use_cpu=True,
                      report_to="none", disable_tqdm=True, sample_groups=0, optim="adamw_torch", num_threads=1)
    trainer = GRPOTrainer(model=tiny_moe(vocab_size=len(tok)), processing_class=tok, args=args,
                          peft_config=LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"),
                          reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                          train_dataset=[{"prompt": "1 + 1?"}, {"prompt": "2 + 2?"}])
    trainer.train()

    out = tmp_path / "out"
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["policy/version"] for m in lines] == [1, 2]
    # Step 2 sampled with step 1's weights: the sampler and the trainer compute the same distribution.
    assert lines[1]["is/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    # output_dir/model is the sampler's copy: the experts and the routers moved, as peft's all-linear adapts them.
    saved = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    assert set(saved) == set(base)
    moved = {k for k in base if not torch.allclose(saved[k], base[k], rtol=0, atol=1e-6)}
    assert {k for k in base if k.endswith(("experts.gate_up_proj", "experts.down_proj", "mlp.gate.weight"))} <= moved
    # The adapter merged into the starting weights is what the sampler holds.
    merged = PeftModel.from_pretrained(tiny_moe(vocab_size=len(tok)), out / "adapter").merge_and_unload().state_dict()
    assert set(merged) == set(saved)
    for key, value in merged.items():
        assert torch.equal(saved[key], value), key  # the same arithmetic as peft's merge: bit for bit


def test_all_linear_on_a_moe_adapts_the_fused_experts_and_the_router_as_peft_does(tmp_path):
    """peft converts all-linear for transformers 5's fused experts: attention, experts (gate_up_proj at rank and
    alpha 2x, gate_proj and up_proj fused) and router, as the unfused layers were linear; named modules adapt only
    those. The setup warns of nothing (peft's warning that its own rank pattern matched nothing is false)."""
    import warnings

    from treerl.learners.core import _apply_lora
    from treerl.learners.grpo import GRPOConfig

    def adapted(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            lora = _apply_lora(tiny_moe(), GRPOConfig(output_dir=str(tmp_path), lora_r=4, **kwargs))
        ranks = {}
        for name, module in lora.named_modules():
            if hasattr(module, "r") and "default" in module.r:
                ranks[getattr(module, "parameter_name", None) or name.rsplit(".", 1)[-1]] = module.r["default"]
        return ranks

    expected = {"q_proj": 4, "k_proj": 4, "v_proj": 4, "o_proj": 4, "gate_up_proj": 8, "down_proj": 4, "weight": 4}
    assert adapted() == adapted(lora_target_modules=["all-linear"]) == expected  # weight: the router's
    assert adapted(lora_target_modules=["q_proj", "v_proj"]) == {"q_proj": 4, "v_proj": 4}
