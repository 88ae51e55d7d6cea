"""LoRA's weight sync: the sampler gets the adapter merged into the base weights, in new tensors, so that the frozen
base weights the adapter trains on stay bit for bit what they were, however many times the weights are published
(merging in place and unmerging after moves them by a rounding error each time, in bfloat16 by up to its
resolution)."""

from __future__ import annotations

import copy

import pytest
import torch
from test_router_aux_loss import tiny_moe

from treerl.learners.core import _apply_lora
from treerl.learners.grpo import GRPOConfig
from treerl.learners.weight_sync import plain_name, policy_state_dict

pytestmark = pytest.mark.usefixtures("one_thread")


def _tiny():
    from treerl.models import load_default_model

    return load_default_model()[0]


def _trained_lora(model, tmp_path, dtype, **lora):
    """``model`` in ``dtype`` with treerl's LoRA, its adapters moved off their start (B = 0 merges to nothing), as
    training moves them."""
    lora_model = _apply_lora(model.to(dtype), GRPOConfig(output_dir=str(tmp_path), lora_r=4, **lora))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in lora_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    return lora_model


CASES = {
    "linear": (_tiny, {}),
    "embedding": (_tiny, {"lora_target_modules": ["embed_tokens", "q_proj"]}),  # tied to the LM head
    "moe": (tiny_moe, {}),
}


# peft warns that an adapted embedding is tied to the LM head; merging changes both, as the sampler gets them.
@pytest.mark.filterwarnings("ignore:Model (has|with) `tie_word_embeddings=True`")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_syncs_leave_the_base_weights_bit_identical_and_send_a_fresh_merge(tmp_path, case, dtype):
    from peft import PeftModel

    build, lora = CASES[case]
    model = _trained_lora(build(), tmp_path, dtype, **lora)
    base = model.get_base_model()
    start = {k: v.detach().clone() for k, v in base.state_dict().items()}
    fresh = copy.deepcopy(model).merge_and_unload().state_dict()
    unmerged = {plain_name(k): v for k, v in start.items() if "lora_" not in k}
    assert any(not torch.equal(fresh[k], unmerged[k]) for k in fresh), "the adapters must move some weights"

    for _ in range(3):
        sent = policy_state_dict(model)
        # What the sampler gets is what PeftModel.merge_and_unload() of a fresh copy gives, bit for bit: the same
        # arithmetic (base + get_delta_weight, in the base's dtype as peft's merge rounds it).
        assert set(sent) == set(fresh)
        for key, value in fresh.items():
            assert sent[key].dtype == value.dtype and torch.equal(sent[key], value), key
    for key, value in base.state_dict().items():
        assert torch.equal(value, start[key]), f"{key} moved: the sync wrote into the frozen base weights"
    assert isinstance(model, PeftModel) and not any(getattr(m, "merged", False) for m in model.modules())

