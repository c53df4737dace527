"""The end-to-end benchmark script runs and writes its tables (timings themselves are not tested)."""

import json

from sparsekv.bench.e2e import main


def test_e2e_bench_smoke(tmp_path):
    assert main(["--model", "tiny:llama", "--contexts", "96", "--methods", "dense", "quest", "--budget", "32",
                 "--new-tokens", "4", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense", "quest"]
    assert rows[1]["attended_per_head"] < rows[0]["attended_per_head"]
    assert "| quest | 32 | 96 |" in (tmp_path / "e2e.md").read_text()


def test_e2e_bench_rejects_unknown_methods(tmp_path, capsys):
    assert main(["--model", "tiny:llama", "--methods", "magic", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "unknown method 'magic'" in capsys.readouterr().err
