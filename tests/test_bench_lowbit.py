"""The lowbit pieces benchmark runs on the CPU (a smoke test: no timings there) and checks the scores it times."""

import json

import pytest

from sparsekv.bench.lowbit import main

pytest.importorskip("triton", reason="the variant mode sets the Triton kernels' TUNING")


def test_lowbit_bench_smoke(tmp_path):
    main(["--shape", "tiny", "--context", "256", "--page-size", "16", "--budget", "64", "--bits", "1", "2",
          "--reps", "1", "--device", "cpu", "--out", str(tmp_path), "--tag", "t",
          "--variants", '[{"coded_block": 64}]'])
    result = json.loads((tmp_path / "t.json").read_text())
    pieces = [r["piece"] for r in result["rows"]]
    assert {"quest_select", "coded_scores b1", "coded_scores b2", "lowbit_select b2", "select_pages"} <= set(pieces)
    assert all(c["rel_err"] < 1e-5 and c["inf_match"] and c["top_overlap"] == 1.0 for c in result["meta"]["checks"])
    assert (tmp_path / "t.md").read_text().startswith("# lowbit's selection pieces (tiny")
