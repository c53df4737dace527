"""The attention benchmark's variant mode runs and writes its rows (timings themselves are not tested; on the CPU
they are not taken)."""

import json

import pytest

from sparsekv.bench.attention import main

pytest.importorskip("triton", reason="the variant mode sets the Triton kernels' TUNING")


def test_attention_bench_variants_smoke(tmp_path, capsys):
    main(["--shapes", "tiny", "--contexts", "256", "--batches", "1", "--device", "cpu", "--out", str(tmp_path),
          "--tag", "t", "--variants", '[{}, {"select_digit_bits": 4}]'])
    rows = json.loads((tmp_path / "t_variants.json").read_text())["rows"]
    assert [(r["shape"], r["context"], r["variant"]) for r in rows] == [("tiny", 256, 0), ("tiny", 256, 1)]
    assert rows[1]["select_digit_bits"] == 4 and all(r["same_as_baseline"] for r in rows)
    assert "variant 1 tiny B=1 ctx=256 {'select_digit_bits': 4}" in capsys.readouterr().out


def test_attention_bench_cpu_table_says_host_clock_and_no_floor(tmp_path, capsys):
    main(["--shapes", "tiny", "--contexts", "256", "--batches", "1", "--budgets", "64", "--reps", "2",
          "--device", "cpu", "--out", str(tmp_path), "--tag", "t"])
    table = (tmp_path / "t.md").read_text()
    assert "host clock" in table and "CUDA events" not in table and "floor" not in table.lower()
    row, = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert row["quest_floor_ratio"] is None and row["quest_eager_us"] > 0
    assert "floor" not in capsys.readouterr().out.lower()


def test_kv_dtype_bench_rows_checks_and_tuning_restored(tmp_path):
    from sparsekv.bench import kv_dtype
    from sparsekv.kernels.triton import TUNING

    before = dict(TUNING)
    kv_dtype.main(["--shape", "tiny", "--contexts", "256", "--check-tokens", "256", "--budget", "32", "--reps", "1",
                   "--device", "cpu", "--out", str(tmp_path), "--tag", "t", "--variants",
                   '[{"name": "current", "ops": ["dense", "sparse", "scores"], "tuning": {}},'
                   ' {"name": "pages 32", "ops": ["scores"], "tuning": {"fp8_page_block": 32}}]'])
    assert TUNING == before
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    checks = [r for r in rows if r["op"] == "check"]
    assert [(r["kv"], r["variant"]) for r in checks] == [("bf16", "current"), ("fp8", "current"), ("fp8", "pages 32")]
    assert all(r[f"err_{op}"] < 1e-2 for r in checks for op in ("dense", "sparse", "scores"))
    timed = [(r["kv"], r["op"], r["variant"]) for r in rows if r["op"] != "check"]
    assert timed == [("bf16", op, "current") for op in ("dense", "sparse", "scores")] + \
        [("fp8", op, "current") for op in ("dense", "sparse", "scores")] + [("fp8", "scores", "pages 32")]
    assert "| 256 | dense |" in (tmp_path / "t.md").read_text()
