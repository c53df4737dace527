"""Shared pytest setup."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models run fastest on one thread: their ops are dominated by thread hand-off, and on a shared 2-core
    machine the default thread count is up to ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
