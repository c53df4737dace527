"""Shared pytest setup."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests run in Triton's CPU interpreter. Triton reads this when it is imported, which
    # importing sparsekv already does (through torch._dynamo), so it is set before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Files whose tests start processes or run the project's model (a minute or two each), run first: under `-n auto`
# the workers then take them together and end on the short tests, not one worker on a long one while the other waits.
LONG_FIRST = ["test_readme.py", "test_tensor_parallel.py", "test_training.py", "test_bench_peer.py",
              "test_eval_recall.py"]


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: LONG_FIRST.index(item.path.name) if item.path.name in LONG_FIRST else len(LONG_FIRST))


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """Tiny models run fastest on one thread: their ops are dominated by thread hand-off, and on a shared 2-core
    machine the default thread count is up to ~100x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def int4_model():
    """The tiny Llama with its linear layers' weights quantized to int4 (sparsekv is imported here, after the
    interpreter's switch above)."""
    from sparsekv.quant import quantize_model
    from sparsekv.tiny import tiny_model

    m = tiny_model("llama", seed=1)
    m.generation_config.eos_token_id = None
    assert quantize_model(m, "int4") == 4 * 7  # q, k, v, o, gate, up, down of 4 layers
    return m
