"""Run by tests/test_tiny_model.py in a fresh interpreter: print the shipped model's load time, class and tokenizer kind.

Imported before the clock: the test times the load, not torch's and transformers' imports
(seconds of their own on a busy machine, and paid once per process by any user).
"""

import time

from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3ForCausalLM  # noqa: F401

from treerl.models import load_default_model

if __name__ == "__main__":
    start = time.perf_counter()
    model, tokenizer = load_default_model()
    print(time.perf_counter() - start, type(model).__name__, tokenizer.is_fast)
