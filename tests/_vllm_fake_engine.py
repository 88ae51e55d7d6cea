"""A fake ``vllm`` module for CPU tests: ``vllm.LLM``'s interface as treerl uses it (generate,
collective_rpc, reset_prefix_cache, get_tokenizer, the engine's logprobs mode). Tests subclass
:class:`FakeLLM` to choose the tokenizer and the completion it answers with."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace


def lp(x: float) -> SimpleNamespace:
    """One entry of vLLM's per-token log-prob dict."""
    return SimpleNamespace(logprob=x)


class FakeLLM:
    """Records what it is asked (``calls``, ``loaded`` weights, ``resets``) and every instance built."""

    instances: list = []

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls: list = []
        self.loaded: list = []
        self.resets = 0
        self.llm_engine = SimpleNamespace(model_config=SimpleNamespace(logprobs_mode=kwargs.get("logprobs_mode")))
        FakeLLM.instances.append(self)

    def get_tokenizer(self):
        raise NotImplementedError("a test's FakeLLM says which tokenizer it has")

    def complete(self, prompt_ids: list[int], sp) -> tuple[SimpleNamespace, int]:
        """One completion for one prompt, and how many prompt tokens the engine had cached."""
        raise NotImplementedError("a test's FakeLLM says what it answers")

    def generate(self, prompts, sampling_params, use_tqdm=True):
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, sp in zip(prompts, sampling_params):
            completion, cached = self.complete(prompt["prompt_token_ids"], sp)
            outputs.append(SimpleNamespace(outputs=[completion], num_cached_tokens=cached))
        return outputs

    def collective_rpc(self, method, args=()):
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=SimpleNamespace(
            load_weights=lambda weights: self.loaded.append(dict(weights)))))
        method(worker, *args)

    def reset_prefix_cache(self):
        self.resets += 1


def install_fake_vllm(monkeypatch, llm_class: type[FakeLLM]) -> ModuleType:
    """Put a ``vllm`` module whose ``LLM`` is ``llm_class`` in ``sys.modules`` for one test."""
    module = ModuleType("vllm")
    module.LLM = llm_class
    module.SamplingParams = lambda **kwargs: SimpleNamespace(**kwargs)
    monkeypatch.setitem(sys.modules, "vllm", module)
    FakeLLM.instances.clear()
    return module
