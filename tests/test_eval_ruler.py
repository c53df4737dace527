"""RULER's synthetic tasks: lengths, determinism, what each variant puts in the context, scoring."""

import json
import re
from collections import Counter

import pytest

from sparsekv.eval import EvalSpec, TaskOptions, get_task, run_eval
from sparsekv.eval.base import count_tokens, data_dir
from sparsekv.models import LoadedModel
from sparsekv.eval.metrics import string_match_part
from sparsekv.eval.ruler import RULER, NiahSpec
from sparsekv.tiny import byte_tokenizer, tiny_model

NAMES = [cls.name for cls in RULER]

if not (data_dir() / "haystack" / "paul_graham_essays").is_dir():
    pytest.skip("shared haystack essays not present", allow_module_level=True)


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _one(tok, name, length=2500, seed=0):
    sample, = get_task(name, TaskOptions()).samples(tok, length, None, seed=seed, count=1)
    return sample


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", [2500, 4000])  # bytes: CWE needs ~1800 without filler
def test_lengths_fit_and_samples_are_reproducible(tok, name, length):
    task = get_task(name, TaskOptions())
    a = task.samples(tok, length, None, seed=1, count=2)
    # A haystack of needles moves by a whole needle (~55 byte tokens) and FWE's Zipf counts (rounded down) by
    # several words at once; the rest by a token.
    assert all(abs(count_tokens(tok, s) - length) <= 0.05 * length for s in a)
    assert [(s.context, s.answer) for s in a] == [(s.context, s.answer) for s in
                                                  task.samples(tok, length, None, seed=1, count=2)]
    assert a[0].answer != a[1].answer


@pytest.mark.parametrize("name, values, asked", [
    ("ruler_niah_single_1", 1, 1), ("ruler_niah_single_2", 1, 1), ("ruler_niah_single_3", 1, 1),
    ("ruler_niah_multikey_1", 1, 1), ("ruler_niah_multivalue", 4, 1), ("ruler_niah_multiquery", 4, 4)])
def test_needles_are_in_the_context_and_asked(tok, name, values, asked):
    s = _one(tok, name)
    kind = "uuids" if name.endswith("_3") else "numbers"
    assert s.context.startswith(f"Some special magic {kind} are hidden within the following text.")
    assert len(s.answer) == values and len(s.meta["keys"]) == asked
    for key in s.meta["keys"]:
        assert key in s.question
    for value in s.answer:
        assert re.search(rf"One of the special magic {kind} for [\w-]+ is: {value}\.", s.context)
    query = s.meta["keys"][0] if asked == 1 else ", ".join(s.meta["keys"][:-1]) + f", and {s.meta['keys'][-1]}"
    assert s.question.endswith(f"The special magic {kind} for {query} mentioned in the provided text are")


@pytest.mark.parametrize("name", ["ruler_niah_multikey_2", "ruler_niah_multikey_3"])
def test_needle_haystack_has_one_needle_of_the_asked_key(tok, name):
    s = _one(tok, name)
    needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", s.context)
    assert len(needles) > 10 and len({k for k, _ in needles}) == len(needles)
    assert [v for k, v in needles if k == s.meta["keys"][0]] == s.answer


def test_common_words(tok):
    s = _one(tok, "ruler_cwe")
    shot, _, listed = s.context.rpartition("Below is a numbered list of words.")
    assert "The top 10 words that appear most often in the list are: 1. " in shot  # the worked example
    counts = Counter(re.findall(r"\d+\. (\w+)", listed))
    assert len(s.answer) == 10 and all(counts[w] == 6 for w in s.answer)
    assert max(c for w, c in counts.items() if w not in s.answer) == 1
    assert s.question.endswith("The top 10 words that appear most often in the list are:")


def test_frequent_words(tok):
    s = _one(tok, "ruler_fwe")
    counts = Counter(s.context.split("coded words. ", 1)[1].split())
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and ranked[1:4] == s.answer
    assert counts[s.answer[2]] > counts[ranked[4]]


def test_scores_all_and_part_match(tok):
    task = get_task("ruler_niah_multivalue", TaskOptions())
    s = _one(tok, "ruler_niah_multivalue")
    assert task.score(s, ", ".join(s.answer)) == 1.0
    assert task.score(s, f"{s.answer[0]} and {s.answer[1]}") == 0.5
    assert string_match_part(f" {s.answer[2]}", s.answer) == 1.0 and string_match_part("none", s.answer) == 0.0


@pytest.mark.parametrize("field, value, message", [
    ("haystack", "lake", "NiahSpec.haystack must be one of noise, essay, needles"),
    ("values", "word", "NiahSpec.values must be one of number, uuid"),
    ("num_keys", 0, "NiahSpec.num_keys must be >= 1"),
])
def test_niah_spec_validation(field, value, message):
    with pytest.raises(ValueError, match=message):
        NiahSpec(**{"haystack": "essay", field: value})
    with pytest.raises(ValueError, match=r"num_queries \(4\) must be <= num_keys \(1\)"):
        NiahSpec("essay", num_queries=4)


def test_runs_record_part_match(tmp_path):
    loaded = LoadedModel(tiny_model("llama", layers=2, heads=4, kv_heads=2, head_dim=16, max_positions=1024),
                         byte_tokenizer(), "tiny-test")
    out = run_eval(EvalSpec(task="ruler_niah_multiquery", methods=["dense"], lengths=[700], limit=1,
                            out=str(tmp_path), plots=False, options=TaskOptions(max_new_tokens=3)),
                   log=lambda *_: None, progress=False, loaded=loaded)
    record, = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert record["part_match"] in (0.0, 1.0) and record["score"] <= record["part_match"]
