"""Shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a test on one intra-op thread, restored afterwards.

    The tensors in most tests are tiny: extra threads only add synchronization, and on a busy
    2-core runner the thread pool's contention makes such tests 5-15x slower. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
