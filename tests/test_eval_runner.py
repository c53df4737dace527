"""The evaluation runner end to end on tiny random models: grid, records, resume, report, recall, errors."""

import importlib.util
import json

import pytest

from sparsekv.eval import EvalError, EvalSpec, TaskOptions, run_eval
from sparsekv.eval.cli import main
from sparsekv.errors import ConfigError
from sparsekv.eval.engine import Engine
from sparsekv.models import LoadedModel
from sparsekv.eval.runner import RESULTS, method_runs, read_results
from sparsekv.methods import METHODS
from sparsekv.tiny import byte_tokenizer, tiny_model

BUDGETS = [32, 64]


def _accepts(cls, budget: int) -> bool:
    try:
        cls(token_budget=budget)
    except ValueError:
        return False
    return True


def _methods() -> list[str]:
    """dense, quest, and a third method: the first other registered one that takes the test budgets, else quest
    with per-query-head selection."""
    others = [n for n, cls in METHODS.items() if n not in ("dense", "quest")
              and "token_budget" in cls.__dataclass_fields__ and all(_accepts(cls, b) for b in BUDGETS)]
    return ["dense", "quest:dense_layers=1", others[0] if others else "quest:per_query_head=true,dense_layers=1"]


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(tiny_model("llama", layers=3, heads=4, kv_heads=2, head_dim=16, max_positions=512),
                       byte_tokenizer(), "tiny-test")


def _spec(tmp_path, task, **kw):
    base = dict(task=task, methods=_methods(), budgets=BUDGETS, limit=1, out=str(tmp_path),
                options=TaskOptions(max_new_tokens=3, prefill_tokens=160))
    base.update(kw)
    return EvalSpec(**base)


def _runs_per_sample() -> int:
    return len(method_runs(_methods(), BUDGETS))


def test_passkey_grid_resumes_after_interruption(tmp_path, loaded, monkeypatch):
    spec = _spec(tmp_path, "passkey", lengths=[300], depths=[0.0, 1.0])
    total = 2 * _runs_per_sample()
    real = Engine.generate
    calls = {"n": 0}

    def crashing(self, sample):
        calls["n"] += 1
        if calls["n"] > _runs_per_sample() + 3:  # one warm-up per method, then three runs
            raise KeyboardInterrupt  # the process dies mid-grid
        return real(self, sample)

    monkeypatch.setattr(Engine, "generate", crashing)
    with pytest.raises(KeyboardInterrupt):
        run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    first = read_results(tmp_path / RESULTS)
    assert len(first) == 3
    with open(tmp_path / RESULTS, "a") as f:
        f.write('{"key": "half a rec')  # the crash cut a record short

    monkeypatch.setattr(Engine, "generate", real)
    messages = []
    run_eval(spec, log=messages.append, progress=False, loaded=loaded)
    # The torn line is moved aside once, said once, and the file holds whole records only.
    assert sum(f"{RESULTS}:4 is a record cut short" in m for m in messages) == 1
    assert (tmp_path / f"{RESULTS}.torn-1").read_text() == '{"key": "half a rec'
    lines = (tmp_path / RESULTS).read_text().splitlines()
    assert all(json.loads(line) for line in lines) and len(lines) == total
    records = read_results(tmp_path / RESULTS)
    assert len(records) == total and len({r["key"] for r in records}) == total
    assert records[:3] == first  # finished runs kept, not redone
    assert any("resuming: 3 runs" in m for m in messages)
    for r in records:
        assert r["seed"] == 0 and r["prompt_tokens"] == pytest.approx(300, rel=0.01)
        assert r["new_tokens"] <= 3 and r["kv"]["decode_steps"] > 0 and 0 < r["kv_held_bytes"] < r["kv_resident_bytes"]
        assert r["decode_tokens_per_s"] > 0 and r["score"] in (0.0, 1.0)
    dense = [r for r in records if r["method"] == "dense"]
    assert all(r["budget"] is None and r["kv"]["fraction"] == 1.0 for r in dense)
    sparse = [r for r in records if r["budget"] == 32]
    assert all(r["kv"]["fraction"] < 1.0 for r in sparse)
    # A third run has nothing left to do, and nothing to repair.
    messages.clear()
    run_eval(spec, log=messages.append, progress=False, loaded=loaded)
    assert not any("cut short" in m for m in messages)
    assert len(read_results(tmp_path / RESULTS)) == total
    table = (tmp_path / "passkey.md").read_text()
    assert "| dense |" in table and "quest:dense_layers=1 @32" in table
    plots = importlib.util.find_spec("matplotlib") is not None
    for png in ("passkey_vs_budget.png", "passkey_depth_length.png"):
        assert (tmp_path / png).exists() == plots


def test_perplexity_grid_with_recall(tmp_path, loaded):
    text = tmp_path / "text.txt"
    text.write_text("It was a bright cold day in April, and the clocks were striking thirteen. " * 20)
    methods = ["dense", "quest:dense_layers=1"]  # methods that select (recall observes select)
    spec = _spec(tmp_path / "out", "perplexity", methods=methods, lengths=[200], recall=True,
                 options=TaskOptions(data=str(text), prefill_tokens=160))
    run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    records = read_results(tmp_path / "out" / RESULTS)
    assert len(records) == 1 + len(BUDGETS)
    by = {(r["method"], r["budget"]): r for r in records}
    dense = by[("dense", None)]
    assert dense["score"] > 1.0 and dense["kv"]["decode_steps"] == 200 - 160 - 1
    assert dense["recall"] == [1.0, 1.0, 1.0]
    quest = by[("quest:dense_layers=1", 32)]
    assert quest["recall"][0] == 1.0 and all(0.0 < x < 1.0 for x in quest["recall"][1:])
    assert quest["score"] != dense["score"]
    assert "recall" in (tmp_path / "out" / "perplexity.md").read_text()


def test_recall_probe_leaves_outputs_unchanged(loaded):
    from sparsekv.eval.base import Sample

    sample = Sample("The grass is green. " * 12, " The pass key is", None, 4)
    config = METHODS["quest"](token_budget=32, dense_layers=1)
    plain = Engine(loaded, config).generate(sample)
    probed = Engine(loaded, config, recall=True).generate(sample)
    assert probed["prediction"] == plain["prediction"] and probed["kv"] == plain["kv"]
    # At a budget covering the whole context the method is dense, so is its recall.
    full = Engine(loaded, METHODS["quest"](token_budget=512, dense_layers=1), recall=True).generate(sample)
    assert full["recall"] == pytest.approx([1.0, 1.0, 1.0])


def test_errors_are_clear_and_keep_results(tmp_path, loaded):
    with pytest.raises(ConfigError, match="method must be one of dense, quest.*, got 'nope'"):
        run_eval(_spec(tmp_path, "passkey", methods=["nope"]), loaded=loaded)
    with pytest.raises(EvalError, match="needs --budgets"):
        run_eval(_spec(tmp_path, "passkey", budgets=None), loaded=loaded)
    with pytest.raises(ConfigError, match="token_budget must be a positive multiple"):
        run_eval(_spec(tmp_path, "passkey", budgets=[20]), loaded=loaded)
    with pytest.raises(ConfigError, match="method field must be FIELD=VALUE with a field of quest"):
        run_eval(_spec(tmp_path, "passkey", methods=["quest:bogus=1"]), loaded=loaded)
    with pytest.raises(ValueError, match="exceeds the model's maximum of 512 positions"):
        run_eval(_spec(tmp_path, "passkey", lengths=[600]), loaded=loaded)
    with pytest.raises(EvalError, match="has no depth axis"):
        run_eval(_spec(tmp_path, "vartrack", depths=[0.5]), loaded=loaded)
    # Settings differ from the finished runs in the same folder: refused, the file untouched.
    spec = _spec(tmp_path, "passkey", methods=["dense"], lengths=[300], depths=[0.5])
    run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    before = (tmp_path / RESULTS).read_text()
    spec.question_mode = "prefill"
    with pytest.raises(EvalError, match="use another --out"):
        run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    assert (tmp_path / RESULTS).read_text() == before


def test_cli_reports_errors(tmp_path, capsys):
    assert main(["--task", "nope", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "finished runs" not in err  # nothing ran


def test_cli_runs_default_model(tmp_path, capsys):
    status = main(["--task", "passkey", "--methods", "dense", "--lengths", "600", "--depths", "0.5", "--limit", "1",
                   "--out", str(tmp_path), "--no-progress", "--no-plots"])
    assert status == 0
    out = capsys.readouterr().out
    assert "the project's trained model" in out
    rec, = [json.loads(line) for line in (tmp_path / RESULTS).read_text().splitlines()]
    assert rec["model"].endswith("models/sparsekv-llama-16m") and rec["task"] == "passkey"
    assert rec["score"] == 1.0  # the trained model retrieves the pass key


def test_chat_template_keeps_the_question_for_the_decode_path():
    from sparsekv.eval.base import Sample

    tok = byte_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|user|>{{ m['content'] | trim }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    engine = Engine(LoadedModel(tiny_model(layers=2), tok, "t"), METHODS["dense"](), chat=True)
    ctx, q = engine._ids(Sample("Hello there. ", "\nWhat is it? It is", None, 2))
    assert tok.decode(ctx) == "<|user|>Hello there. \n" and tok.decode(q) == "What is it? It is<|end|><|assistant|>"
    tok.chat_template = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(EvalError, match="chat template changed the question"):
        engine._ids(Sample("Hello. ", "\nWhat is it?", None, 2))


EVAL_ARGS = ["--task", "passkey", "--methods", "dense", "--lengths", "300", "--depths", "0.5", "--limit", "1",
             "--model", "tiny:llama", "--no-progress", "--no-plots"]


@pytest.mark.parametrize("argv, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1 (or unset: the task's own), got 0"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be an integer >= 1"),
    (["--limit", "0"], "--limit must be an integer >= 1"),
    (["--methods", "omnikv:window=x"], "window must be an integer, got 'x'"),
])
def test_cli_refuses_counts_that_would_run_nothing(tmp_path, capsys, argv, message):
    assert main([*EVAL_ARGS, "--out", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / RESULTS).exists()


def test_cli_checks_out_before_loading_the_model(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    args = [*EVAL_ARGS[:-4], "--model", "/nonexistent/model"]
    assert main([*args, "--out", str(afile)]) == 2
    assert f"--out {afile}: is a file, not a folder" in capsys.readouterr().err
    assert main([*args, "--out", str(afile / "sub")]) == 2
    assert f"--out {afile / 'sub'}: cannot create the folder" in capsys.readouterr().err


def test_cli_runs_omnikv_at_a_fraction_of_the_prompt(tmp_path, capsys):
    assert main([*EVAL_ARGS, "--out", str(tmp_path), "--max-new-tokens", "2", "--methods",
                 "omnikv:filter_layers=[0],token_budget=0.1", "omnikv:filter_layers=[0]", "--budgets", "0.25"]) == 0
    records = read_results(tmp_path / RESULTS)
    assert [(r["method"], r["budget"]) for r in records] == [("omnikv:filter_layers=[0],token_budget=0.1", 0.1),
                                                             ("omnikv:filter_layers=[0]", 0.25)]
    assert records[0]["kv"]["attended_per_head"] < records[1]["kv"]["attended_per_head"]


def test_eval_help_names_the_methods(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "NAME one of: dense, quest, streamingllm, h2o, tova, snapkv, omnikv, raas" in out


def _one_run(tmp_path, loaded, **kw):
    """A grid of one dense run into ``tmp_path``; returns its spec."""
    spec = _spec(tmp_path, "passkey", methods=["dense"], lengths=[300], depths=[0.5], plots=False, **kw)
    run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    return spec


@pytest.mark.parametrize("bad, problem", [
    ('{"key": "hand-edited', "not a JSON record"),
    ("[1, 2]", "not a JSON object (a list)"),
    ('"text"', "not a JSON object (a str)"),
    ("{}", "has no 'key' field"),
    ("drop key", "has no 'key' field"),
    ("score=text", "'score' is 'high', not a number"),
    ("score=none", "'score' is None, not a number"),
    ("kv=list", "'kv' is [], not an object"),
    ("no fraction", "'kv' has no 'fraction' field"),
    ("length=text", "'length' is '300', not an integer or null"),
    (b'\xff\xfe{"key": 1}', "not UTF-8 text"),
    ("same key", "repeats the key of line 1 (a grid point written twice)"),
])
def test_a_bad_row_is_refused_with_its_line_and_never_deleted(tmp_path, loaded, capsys, bad, problem):
    spec = _one_run(tmp_path, loaded)
    good = (tmp_path / RESULTS).read_text()
    rec = json.loads(good)
    edits = {"drop key": {k: v for k, v in rec.items() if k != "key"}, "score=text": {**rec, "score": "high"},
             "score=none": {**rec, "score": None}, "kv=list": {**rec, "kv": []},
             "no fraction": {**rec, "kv": {"attended_per_head": 3.0}}, "length=text": {**rec, "length": "300"},
             "same key": rec}
    line = bad if isinstance(bad, bytes) else (json.dumps(edits[bad]) if bad in edits else bad).encode()
    for last in (False, True):  # in the middle, or a whole last line (with its newline)
        content = good.encode() + line + b"\n" + (b"" if last else good.replace('"sample": 0', '"sample": 1').encode())
        (tmp_path / RESULTS).write_bytes(content)
        with pytest.raises(EvalError) as err:
            run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
        assert f"{tmp_path / RESULTS}:2: " in str(err.value) and problem in str(err.value)
        assert (tmp_path / RESULTS).read_bytes() == content  # nothing deleted or rewritten
        with pytest.raises(EvalError, match=f"{RESULTS}:2: "):
            read_results(tmp_path / RESULTS)
        # The command line says the same without a traceback, and keeps the file.
        assert main([*EVAL_ARGS, "--out", str(tmp_path)]) == 2
        assert f"{RESULTS}:2: " in capsys.readouterr().err
        assert (tmp_path / RESULTS).read_bytes() == content


def test_summary_refuses_a_bad_row_without_a_traceback(tmp_path, loaded, capsys):
    from sparsekv.eval.summary import main as summary_main

    _one_run(tmp_path / "passkey", loaded)
    path = tmp_path / "passkey" / RESULTS
    path.write_text(path.read_text() + '{"task": "passkey"}\n')
    assert summary_main([str(tmp_path)]) == 2
    assert f"{path}:2: has no 'key' field" in capsys.readouterr().err


def test_a_torn_last_line_is_kept_aside_not_deleted(tmp_path, loaded):
    spec = _one_run(tmp_path, loaded, limit=2)
    path = tmp_path / RESULTS
    whole = path.read_text().splitlines(keepends=True)
    path.write_text(whole[0] + whole[1][:40])  # the crash cut the second record short
    assert read_results(path) == [json.loads(whole[0])]  # reading alone changes nothing
    assert path.read_text() == whole[0] + whole[1][:40]
    messages = []
    run_eval(spec, log=messages.append, progress=False, loaded=loaded)
    aside = tmp_path / f"{RESULTS}.torn-1"
    assert aside.read_text() == whole[1][:40]
    assert any(f"{path}:2" in m and str(aside) in m for m in messages)
    assert [r["sample"] for r in read_results(path)] == [0, 1]  # the torn run was redone
    # A whole last record without its newline is kept, and the next one starts on a line of its own.
    path.write_text(path.read_text().rstrip("\n"))
    spec.limit = 3
    run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    assert [r["sample"] for r in read_results(path)] == [0, 1, 2]
    assert not (tmp_path / f"{RESULTS}.torn-2").exists()


def test_a_second_run_on_the_same_out_fails_at_once(tmp_path, loaded):
    import fcntl
    import subprocess
    import sys

    # Another process holds the folder (as a running `sparsekv eval` does).
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"f = open({str(tmp_path / '.sparsekv-eval.lock')!r}, 'a+')\n"
        "fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB); f.truncate(0); f.write(str(os.getpid())); f.flush()\n"
        "print('held', flush=True); time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(EvalError, match=f"--out {tmp_path} is in use by another run \\(pid {holder.pid}\\)"):
            _one_run(tmp_path, loaded)
        assert not (tmp_path / RESULTS).exists()
    finally:
        holder.kill()
        holder.wait()
    _one_run(tmp_path, loaded)  # the lock went with its process
    assert len(read_results(tmp_path / RESULTS)) == 1
    with open(tmp_path / ".sparsekv-eval.lock") as f:  # and this run released it
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_another_model_into_the_same_out_is_refused(tmp_path, loaded):
    spec = _one_run(tmp_path, loaded)
    before = (tmp_path / RESULTS).read_text()
    other = LoadedModel(loaded.model, loaded.tokenizer, "other-model")
    with pytest.raises(EvalError, match="holds passkey runs of model tiny-test, not other-model; use another --out"):
        run_eval(spec, log=lambda *a: None, progress=False, loaded=other)
    assert (tmp_path / RESULTS).read_text() == before


@pytest.mark.parametrize("kw, message", [
    (dict(budgets=[32, 32]), "--budgets lists 32 twice"),
    (dict(lengths=[300, 300]), "--lengths lists 300 twice"),
    (dict(depths=[0.5, 0.5]), "--depths lists 0.5 twice"),
    (dict(methods=["dense", "dense"]), "--methods lists dense twice"),
    (dict(methods=["quest", "quest:token_budget=32"], budgets=[32]),
     "--methods quest @32 and quest:token_budget=32 are the same run"),
])
def test_a_grid_point_given_twice_is_refused(tmp_path, loaded, kw, message):
    spec = _spec(tmp_path, "passkey", **{"methods": ["dense", "quest"], "lengths": [300], "depths": [0.5], **kw})
    with pytest.raises(EvalError, match=message):
        run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
    assert not (tmp_path / RESULTS).exists()


def test_a_results_path_that_is_not_a_file_is_refused_before_work(tmp_path, loaded):
    (tmp_path / RESULTS).mkdir()
    with pytest.raises(EvalError, match=f"--out {tmp_path}: {RESULTS} is not a file"):
        _one_run(tmp_path, loaded)


def test_longbench_datasets_given_twice_are_refused(tmp_path, loaded):
    spec = _spec(tmp_path, "longbench", methods=["dense"], options=TaskOptions(data=str(tmp_path),
                                                                              datasets=("qasper", "qasper")))
    with pytest.raises(EvalError, match="--datasets lists qasper twice"):
        run_eval(spec, log=lambda *a: None, progress=False, loaded=loaded)
