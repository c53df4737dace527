"""The cross-task summary: rows per (task, length, method, budget), the markdown table and the files."""

import json

from sparsekv.eval.summary import main, markdown, summarize
from sparsekv.models import model_shape, saved_config
from worktree import ROOT


def _record(task, method, budget, score, fraction, recall=None, part=None):
    return {"key": f"{task} {method} {budget} {score}", "task": task, "model": "m", "length": 1024, "depth": None,
            "sample": 0, "seed": 0, "settings": {}, "method": method, "budget": budget, "metric": "accuracy",
            "score": score, "kv": {"attended_per_head": 1024 * fraction, "fraction": fraction},
            "kv_resident_bytes": 0, "recall": recall, "part_match": part}


RECORDS = [_record("niah", "dense", None, 1.0, 1.0), _record("niah", "quest", 128, 0.0, 0.2),
           _record("niah", "quest", 32, 1.0, 0.1, recall=[0.5, 0.7]), _record("niah", "quest", 32, 0.0, 0.1),
           _record("ruler_fwe", "dense", None, 0.5, 1.0, part=1.0)]


def test_rows_average_runs_and_sort_budgets():
    rows = summarize(RECORDS)
    assert [(r["task"], r["method"], r["budget"], r["runs"]) for r in rows] == [
        ("niah", "dense", None, 1), ("niah", "quest", 32, 2), ("niah", "quest", 128, 1),
        ("ruler_fwe", "dense", None, 1)]
    assert rows[1]["score"] == 0.5 and rows[1]["fraction"] == 0.1 and rows[1]["recall"] == 0.6
    assert rows[3]["part_match"] == 1.0 and rows[0]["part_match"] is None


def test_markdown_and_files(tmp_path):
    text = markdown(summarize(RECORDS))
    assert "| quest |  | 0.5 (0.1) | 0 (0.2) |" in text and "| quest | 32 | 0.6 |" in text
    for task in ("niah", "ruler_fwe"):
        (tmp_path / task).mkdir()
        (tmp_path / task / "results.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in RECORDS if r["task"] == task))
    assert main([str(tmp_path)]) == 0
    assert len(json.loads((tmp_path / "summary.json").read_text())) == 4
    assert (tmp_path / "summary.md").read_text() == text
    assert main([str(tmp_path / "niah")]) == 2


def test_bytes_read_per_step():
    """With the model's config found (tiny:llama: 4 layers, 2 KV heads of 16), each row gives the MiB a step reads
    from a 16-bit cache: the KV attended (per layer and KV head, as measured) and the page metadata of the method
    (Quest's bounds in the layers past its two dense ones, every key for the oracle); a model not found here gives
    none and no table."""
    records = [{**r, "model": "tiny:llama"} for r in RECORDS[:3]]
    records.append({**_record("niah", "oracle", 32, 1.0, 0.1), "model": "tiny:llama"})
    rows = {(r["method"], r["budget"]): r["read_mib"] for r in summarize(records)}
    kv_per_token = 4 * 2 * 2 * 16 * 2  # layers, KV heads, key and value, head dim, bytes
    assert rows[("dense", None)] * 2**20 == 1024 * kv_per_token
    bounds = (4 - 2) * 2 * (1024 // 16) * 2 * 16 * 2  # scored layers, KV heads, pages, min and max
    assert rows[("quest", 32)] * 2**20 == int(102.4 * kv_per_token) + bounds
    every_key = (4 - 2) * 2 * (1024 // 16) * 16 * 16 * 2
    assert rows[("oracle", 32)] * 2**20 == int(102.4 * kv_per_token) + every_key
    assert "MiB a decode step reads" in markdown(summarize(records))
    assert "MiB a decode step reads" not in markdown(summarize(RECORDS))
    assert all(r["read_mib"] is None for r in summarize(RECORDS))


def test_saved_config_reads_a_model_folder_without_its_weights():
    assert model_shape(saved_config(str(ROOT / "models" / "sparsekv-llama-16m"))) == (8, 2, 64)
    assert model_shape(saved_config("tiny:qwen3")) == (4, 2, 16)
    assert saved_config(str(ROOT / "models" / "no-such-model")) is None
