"""Task generators and readers of the evaluation harness: determinism, token lengths, formats, errors."""

import json
from pathlib import Path

import pytest

from sparsekv.eval import EvalError, TaskOptions, get_task
from sparsekv.eval.base import count_tokens, data_dir, insert_at
from sparsekv.eval.synthetic import COLOURS
from sparsekv.tiny import byte_tokenizer

GENERATED = ["passkey", "niah", "multikey", "vartrack", "2stage"]
HAYSTACK = data_dir() / "haystack" / "paul_graham_essays"


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _task(name, **kw):
    return get_task(name, TaskOptions(**kw))


@pytest.mark.parametrize("name", GENERATED)
@pytest.mark.parametrize("length", [1000, 2000, 4000])
def test_generated_length_within_one_percent(tok, name, length):
    task = _task(name)
    depth = 0.5 if task.depths else None
    for s in task.samples(tok, length, depth, seed=3, count=2):
        assert abs(count_tokens(tok, s) - length) <= 0.01 * length
        assert s.meta["prompt_tokens"] == count_tokens(tok, s)


@pytest.mark.parametrize("name", GENERATED)
def test_generated_deterministic_per_seed(tok, name):
    task = _task(name)
    depth = 0.25 if task.depths else None
    a = task.samples(tok, 1000, depth, seed=1, count=3)
    b = task.samples(tok, 1000, depth, seed=1, count=3)
    c = task.samples(tok, 1000, depth, seed=2, count=3)
    assert [(s.context, s.question, s.answer) for s in a] == [(s.context, s.question, s.answer) for s in b]
    assert [s.answer for s in a] != [s.answer for s in c]
    assert len({str(s.answer) for s in a}) > 1  # samples of one cell differ


def test_passkey_format_and_depth(tok):
    task = _task("passkey")
    early, = task.samples(tok, 2000, 0.0, seed=0, count=1)
    late, = task.samples(tok, 2000, 1.0, seed=0, count=1)
    def line(s):
        return f"The pass key is {s.answer}. Remember it. {s.answer} is the pass key."

    assert early.context.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." in (
        early.context)
    assert early.question.strip() == "What is the pass key? The pass key is"
    assert early.context.index(line(early)) < 200 and late.context.index(line(late)) > len(late.context) - 200
    assert task.score(early, f" {early.answer}. Remember") == 1.0 and task.score(early, " 1") == 0.0


def test_answers_are_in_context(tok):
    for name in ("niah", "multikey"):
        s, = _task(name).samples(tok, 1500, 0.5 if name == "niah" else None, seed=0, count=1)
        assert f"is: {s.answer[0]}." in s.context and s.meta["key"] in s.question
        assert _task(name).score(s, f" {s.answer[0]}.") == 1.0
    s, = _task("vartrack").samples(tok, 1500, None, seed=0, count=1)
    assert all(f"VAR {v} =" in s.context for v in s.answer)
    s, = _task("2stage").samples(tok, 1500, None, seed=0, count=1)
    x, y = s.meta["x"], s.meta["y"]
    assert f"The color of number {x + y} is {s.answer[0]}." in s.context
    assert f"The value of X is {x}." in s.context and f"The value of Y is {y}." in s.context
    task, colour = _task("2stage"), s.answer[0]
    assert s.meta["solution"].endswith(f"X + Y is {x} + {y} = {x + y}. The color of number {x + y} is {colour}.")
    assert task.score(s, s.meta["solution"]) == 1.0
    other = next(c for c in COLOURS if c != colour)
    assert task.score(s, f" {other}, {colour}.") == 0.0 and task.score(s, " The value of X is") == 0.0


def test_length_too_short_is_refused(tok):
    with pytest.raises(EvalError, match="too short"):
        _task("passkey").samples(tok, 50, 0.5, seed=0, count=1)


def test_missing_files_and_unknown_task(tmp_path):
    with pytest.raises(EvalError, match="unknown task 'nope'"):
        get_task("nope", TaskOptions())
    with pytest.raises(EvalError, match="no .txt files"):
        get_task("niah", TaskOptions(haystack_dir=str(tmp_path)))
    with pytest.raises(EvalError, match="gsm8k data not found"):
        get_task("gsm8k", TaskOptions(data=str(tmp_path / "missing.jsonl")))
    with pytest.raises(EvalError, match="longbench needs --data"):
        get_task("longbench", TaskOptions())


def test_reasoning_reader(tok, tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps({"question": "1+1?", "answer": "one and one\n#### 2"}) + "\n"
                    + json.dumps({"problem": "2+2?", "answer": "4"}) + "\n")
    task = get_task("gsm8k", TaskOptions(data=str(path)))
    a, b = task.samples(tok, None, None, seed=0, count=None)
    assert a.answer == "2" and b.answer == "4" and "\\boxed{}" in a.context and a.question == ""
    assert task.score(a, "so it is \\boxed{2}") == 1.0 and task.score(a, "#### 3") == 0.0


def test_longbench_templates_truncation_and_scores(tok, tmp_path):
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "dataset2prompt.json").write_text(json.dumps({
        "hotpotqa": "Passages:\n{context}\n\nQuestion: {input}\nAnswer:", "trec": "Examples:\n{context}\n{input}"}))
    (templates / "dataset2maxlen.json").write_text(json.dumps({"hotpotqa": 32, "trec": 64}))
    data = tmp_path / "data"
    data.mkdir()
    long_context = "word " * 2000
    (data / "hotpotqa.jsonl").write_text(json.dumps({"context": long_context + "END", "input": "Who?",
                                                     "answers": ["Ada Lovelace"], "all_classes": None}) + "\n")
    (data / "trec.jsonl").write_text(json.dumps({"context": "q: a\ntype: Number", "input": "How many?",
                                                 "answers": ["Number"], "all_classes": ["Number", "Location"]}) + "\n")
    task = get_task("longbench", TaskOptions(data=str(data), longbench_dir=str(templates)))
    assert task.datasets == ("hotpotqa", "trec")
    hot, trec = task.samples(tok, 500, None, seed=0, count=None)
    assert hot.question == "\n\nQuestion: Who?\nAnswer:" and hot.max_new_tokens == 32
    assert count_tokens(tok, hot) <= 500 and hot.context.startswith("Passages:\n") and hot.context.endswith("END")
    assert task.score(hot, "Ada Lovelace.") == 1.0
    assert task.score(trec, "Number\nLocation") == 1.0  # first line only, as LongBench scores trec
    with pytest.raises(EvalError, match="not supported"):
        get_task("longbench", TaskOptions(data=str(data), longbench_dir=str(templates), datasets=("dureader",)))
    (data / "trec.jsonl").write_text(json.dumps({"input": "How many?", "answers": ["Number"]}) + "\n")
    with pytest.raises(EvalError, match="trec.jsonl: row 1 has no field context"):
        task.samples(tok, 500, None, seed=0, count=None)


def test_perplexity_defaults_to_the_essays_the_model_did_not_train_on():
    from sparsekv.models import DEFAULT_MODEL

    held = json.loads((Path(DEFAULT_MODEL) / "training_args.json").read_text())["held_out"]
    if not (data_dir() / "haystack" / "paul_graham_essays").exists():
        pytest.skip("shared data not present")
    task = get_task("perplexity", TaskOptions())
    assert [f.name for f in task.files] == held and len(held) == 4


def test_perplexity_runs_on_the_essays_the_package_ships_without_the_shared_data(tmp_path, monkeypatch):
    """A fresh install has no shared data folder: the package ships the model's held-out essays, with enough tokens
    for a window of the longest default length."""
    from transformers import AutoTokenizer

    from sparsekv.eval.base import DATA_ENV
    from sparsekv.eval.datasets import Perplexity
    from sparsekv.models import DEFAULT_MODEL

    monkeypatch.setenv(DATA_ENV, str(tmp_path))  # empty
    held = json.loads((Path(DEFAULT_MODEL) / "training_args.json").read_text())["held_out"]
    task = get_task("perplexity", TaskOptions())
    assert [f.name for f in task.files] == held and all("sparsekv" in f.parts for f in task.files)
    windows = task.samples(AutoTokenizer.from_pretrained(DEFAULT_MODEL), max(Perplexity.lengths), None, seed=0,
                           count=2)
    assert len(windows) == 2


@pytest.mark.parametrize("content, message", [
    ("caf\u00e9 au lait".encode("latin-1"), r"is not UTF-8 text \(byte 0xe9 at offset 3\); --data takes UTF-8 text"),
    (b"PK\x03\x04\x00\x00binary", r"is a binary file \(a NUL byte at offset 4\), not text; --data takes UTF-8"),
])
def test_perplexity_refuses_a_file_that_is_not_utf8_text(tmp_path, capsys, content, message):
    """Read leniently, a binary or Latin-1 file would be scored as the U+FFFD characters it decodes to."""
    from sparsekv.eval.cli import main

    bad = tmp_path / "essay.txt"
    bad.write_bytes(content)
    for data in (bad, tmp_path):  # the file, or a folder holding it
        with pytest.raises(EvalError, match=rf"perplexity: {bad} {message}"):
            get_task("perplexity", TaskOptions(data=str(data)))
    assert main(["--task", "perplexity", "--data", str(bad), "--model", "tiny:llama", "--out",
                 str(tmp_path / "out"), "--no-progress", "--no-plots"]) == 2
    assert f"sparsekv eval: error: perplexity: {bad} " in capsys.readouterr().err
    (tmp_path / "essay.txt").write_text("caf\u00e9 " * 10, encoding="utf-8")
    assert get_task("perplexity", TaskOptions(data=str(bad))).text == "caf\u00e9 " * 10


@pytest.mark.parametrize("task", ["niah", "ruler_niah_multivalue"])
def test_a_haystack_that_is_not_utf8_text_is_refused_when_the_task_is_built(tmp_path, task):
    """Read leniently, its bytes would become U+FFFD characters in every haystack."""
    (tmp_path / "a.txt").write_text("An essay. " * 20, encoding="utf-8")
    (tmp_path / "b.txt").write_bytes(b"caf\xe9 " * 10)
    with pytest.raises(EvalError, match=rf"{task}: {tmp_path / 'b.txt'} is not UTF-8 text .*--haystack-dir"):
        get_task(task, TaskOptions(haystack_dir=str(tmp_path)))


def test_perplexity_table_keeps_its_digits():
    from sparsekv.eval.report import markdown

    records = [{"metric": "perplexity", "method": m, "budget": None, "length": 2048, "model": "m", "seed": 0,
                "score": s, "kv": {"attended_per_head": 1.0, "fraction": 1.0}, "kv_resident_bytes": 2**20}
               for m, s in (("dense", 1.004), ("quest", 4770.3))]
    table = markdown(records, "perplexity")
    assert "| dense | 1.00 |" in table and "| quest | 4770.30 |" in table


def test_shared_reasoning_data_reads(tok):
    path = data_dir() / "math500" / "test.jsonl"
    if not path.exists():
        pytest.skip("shared data not present")
    samples = get_task("math500", TaskOptions()).samples(tok, None, None, seed=0, count=3)
    assert len(samples) == 3 and all(isinstance(s.answer, str) and s.answer for s in samples)


def test_arith_chain_is_a_long_decode_task_with_a_correct_reference():
    import re

    task = get_task("arith", TaskOptions())
    tok = byte_tokenizer()
    first = task.samples(tok, 40, None, 3, 3)
    assert [s.meta for s in first] == [s.meta for s in task.samples(tok, 40, None, 3, 3)]
    for sample in first:
        ops = re.findall(r"^(\d+): ([-+r]+)(\d+)$", sample.context, re.M)
        x = int(re.search(r"x = (\d+)\.", sample.context).group(1))
        results = []
        for k, (step, op, arg) in enumerate(ops, 1):
            assert int(step) == k
            prev = results[-1] if results else x
            if op == "+r":
                assert k - 8 <= int(arg) < k  # refers back to a recent result
                results.append((prev + results[int(arg) - 1]) % 100)
            else:
                results.append((prev + int(arg) if op == "+" else prev - int(arg)) % 100)
        assert len(results) == 40 and sample.answer == results[-1]
        solution = sample.meta["solution"]
        assert len(tok(solution).input_ids) > len(tok(sample.context).input_ids)  # the chain outgrows the prompt
        assert sample.max_new_tokens > len(tok(solution).input_ids)
        assert task.score(sample, solution) == 1.0
        assert task.score(sample, solution.replace(f"Answer: {sample.answer}", "Answer: 100")) == 0.0
        assert task.score(sample, "no answer here") == 0.0


def test_needles_go_to_sentence_ends_never_inside_a_word():
    text = "Alpha beta gamma. Delta epsilon. Zeta eta."
    assert insert_at(text, [(0.05, "N.")]) == " N. " + text  # no sentence ends before the depth: the start
    assert insert_at(text, [(0.6, "N.")]) == "Alpha beta gamma. N.  Delta epsilon. Zeta eta."
    assert insert_at(text, [(1.0, "N.")]) == text + " N. "


def test_niah_runs_without_the_shared_data_on_the_essays_the_package_ships(tok, tmp_path, monkeypatch):
    from importlib.resources import files

    monkeypatch.setenv("SPARSEKV_DATA_DIR", str(tmp_path / "no-shared-data"))
    monkeypatch.delenv("SPARSEKV_HAYSTACK_DIR", raising=False)
    task = get_task("niah", TaskOptions())
    shipped = files("sparsekv.eval") / "data" / "haystack"
    assert task.files and all(str(f).startswith(str(shipped)) for f in task.files)
    assert "MIT License" in (shipped / "LICENSE").read_text()  # the essays' licence goes with them
    # Enough text for an 8K-token haystack without repeating itself (SmolLM2's tokenizer: about 4 bytes a token).
    assert sum(f.stat().st_size for f in task.files) > 4 * 8192 * 2
    sample = task.samples(tok, 4000, 0.5, 0, 1)[0]
    assert sample.answer[0] in sample.context and abs(count_tokens(tok, sample) - 4000) <= 40
    # The shipped essays are the first of the shared folder's, so short haystacks are the same text either way.
    if HAYSTACK.is_dir():
        assert [f.name for f in task.files] == sorted(f.name for f in HAYSTACK.glob("*.txt"))[:len(task.files)]
        assert all(f.read_bytes() == (HAYSTACK / f.name).read_bytes() for f in task.files)
