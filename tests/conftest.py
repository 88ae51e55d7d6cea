"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine are far faster without intra-op threads: a module that uses this
    (``pytestmark = pytest.mark.usefixtures("one_thread")``) runs on one, and the count is restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
