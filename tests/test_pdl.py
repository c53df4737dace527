"""Programmatic dependent launch (``kernels.set_programmatic_launch``): the setting, every kernel of ours taking part
(each waits for the kernel before it where it begins to touch memory, and is launched with the attribute), and on a
Hopper GPU the same outputs and tokens with it as without."""

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest
import torch

from sparsekv import DenseConfig, LowBitConfig, QuestConfig, kernels
from sparsekv.engine import Engine, GraphCapture
from sparsekv.tiny import tiny_model

TRITON = Path(kernels.__file__).with_name("triton")
CUDA = Path(kernels.__file__).with_name("cuda")
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture
def pdl_off():
    """Leaves the process's setting (ours and inductor's) as it found it."""
    import torch._inductor.config as inductor

    was = kernels.programmatic_launch(), inductor.triton.enable_pdl
    yield
    kernels.set_programmatic_launch(was[0])
    inductor.triton.enable_pdl = was[1]


def _triton_kernels():
    """(module, kernel def) of every Triton kernel of ours: the ``@triton.jit`` functions named ``*_kernel``."""
    for path in sorted(TRITON.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel"):
                yield path.name, tree, node


def test_every_triton_kernel_waits_first_and_every_launch_asks_for_the_setting():
    found = 0
    for module, tree, node in _triton_kernels():
        found += 1
        assert node.args.args[-1].arg == "PDL", (module, node.name)
        body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value,
                                                                                   ast.Constant) else node.body
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value) == "dependent_launch(PDL)"), (module, node.name)
        launches = [call for call in ast.walk(tree) if isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Subscript) and ast.unparse(call.func.value) == node.name]
        assert launches, (module, node.name)
        for call in launches:
            assert any(k.arg is None and ast.unparse(k.value) == "pdl_launch()" for k in call.keywords), \
                (module, node.name)
    assert found >= 28


def test_every_cuda_kernel_waits_and_launches_through_the_helper():
    for path in CUDA.glob("*.cu"):
        source = path.read_text()
        assert "<<<" not in source, path.name  # launch_kernel sets the attribute
        assert source.count("__global__") == len(re.findall(r"sparsekv::dependent_launch\(\);", source)), path.name
        assert "sparsekv::launch_kernel(" in source, path.name


def test_the_setting_reaches_inductor_and_the_launches(pdl_off, monkeypatch):
    import torch._inductor.config as inductor
    from triton import knobs

    from sparsekv.kernels.triton.common import pdl_launch

    kernels.set_programmatic_launch(True)
    assert kernels.programmatic_launch() and inductor.triton.enable_pdl
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert pdl_launch() == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(knobs.runtime, "interpret", True)  # the interpreter has no grid dependencies
    assert pdl_launch() == {"PDL": False, "launch_pdl": False}
    kernels.set_programmatic_launch(False)
    assert not kernels.programmatic_launch() and not inductor.triton.enable_pdl
    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert pdl_launch() == {"PDL": False, "launch_pdl": False}


@pytest.mark.parametrize("bench, argv", [
    ("e2e", ["--model", "shape:tiny", "--contexts", "64", "--methods", "dense"]),
    ("serve", ["--model", "tiny:llama", "--methods", "dense", "--requests", "1", "--prompt-len", "8", "8",
               "--output-len", "2", "2"]),
])
def test_the_benchmarks_refuse_pdl_off_cuda(bench, argv, tmp_path, capsys):
    module = importlib.import_module(f"sparsekv.bench.{bench}")
    with pytest.raises(SystemExit) as exit_code:
        module.main(["--pdl", "--device", "cpu", *argv, "--out", str(tmp_path)])
    assert exit_code.value.code == 2 and "--pdl launches CUDA kernels, the device is cpu" in capsys.readouterr().err
    assert not kernels.programmatic_launch() and not list(tmp_path.iterdir())


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
def test_int4_products_in_a_graph_read_what_the_kernel_before_wrote(pdl_off):
    """The 4-bit products copy their weights before the wait and read x after it: in a CUDA graph where the kernel
    before them writes x, with PDL and without, the outputs equal an eager launch on x, bit for bit."""
    from sparsekv.kernels import cuda
    from sparsekv.kernels.cuda import quant as cuda_int4
    from sparsekv.kernels.reference import to_tiles
    from sparsekv.quant import quantize_int4

    if not cuda.available(torch.device("cuda"), "quant"):
        pytest.skip("the CUDA kernels are not built here")
    torch.manual_seed(0)
    weight = torch.randn(4096, 4096, device="cuda")
    tiles = to_tiles(*quantize_int4(weight), 4096)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    source = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(source)

    def step():
        torch.mul(source, 2, out=x)  # the kernel before writes x
        return cuda_int4.int4_products(x, *tiles, None, sms)

    for on in (False, True):
        kernels.set_programmatic_launch(on)
        graph = torch.cuda.CUDAGraph()
        step()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):
            source.normal_()
            graph.replay()
            want = cuda_int4.int4_products(source * 2, *tiles, None, sms)
            assert torch.equal(out, want)


@pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU")
@pytest.mark.parametrize("config", [DenseConfig(), QuestConfig(token_budget=64, page_size=16, dense_layers=1),
                                    LowBitConfig(token_budget=64, page_size=16, dense_layers=1)],
                         ids=["dense", "quest", "lowbit"])
def test_compiled_captured_engine_gives_the_same_tokens_with_pdl(pdl_off, config):
    model = tiny_model("llama", seed=1, dtype=torch.bfloat16, head_dim=64).cuda()
    model.generation_config.eos_token_id = None
    rows = [torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 211)]
    tokens = []
    for on in (False, True):
        kernels.set_programmatic_launch(on)
        torch._dynamo.reset()  # inductor's setting applies to what it compiles next
        engine = Engine(model, dataclasses.replace(config), max_batch=2, max_context=512, prefill_chunk=64,
                        compile=True)
        engine.capture = GraphCapture()
        result = engine.generate(rows, 40, stop_tokens=())
        assert result.captured
        tokens.append(result.tokens)
    assert tokens[0] == tokens[1]
