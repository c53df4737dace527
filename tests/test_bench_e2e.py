"""The end-to-end benchmark script runs and writes its tables (timings themselves are not tested)."""

import json

from sparsekv.bench.e2e import main


def test_e2e_bench_smoke(tmp_path):
    assert main(["--model", "tiny:llama", "--contexts", "96", "--methods", "dense", "quest", "lowbit", "--budget",
                 "32", "--new-tokens", "4", "--device", "cpu", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense", "quest", "lowbit"]
    assert rows[1]["attended_per_head"] < rows[0]["attended_per_head"]
    # Page metadata read per step: none for dense; the 2-bit codes add to Quest's min/max.
    assert rows[0]["metadata_mib"] == 0 and 0 < rows[1]["metadata_mib"] < rows[2]["metadata_mib"]
    assert "| quest | 32 | 96 |" in (tmp_path / "e2e.md").read_text()


def test_e2e_bench_rejects_unknown_methods(tmp_path, capsys):
    assert main(["--model", "tiny:llama", "--methods", "magic", "--device", "cpu", "--out", str(tmp_path)]) == 2
    assert "method must be one of dense, quest" in capsys.readouterr().err


def test_e2e_bench_reads_specs_as_eval_does(tmp_path):
    """The same spec parser: 'false' is False, a fractional budget is a fraction (OmniKV)."""
    assert main(["--model", "shape:tiny", "--contexts", "64", "--methods", "quest:per_query_head=false",
                 "omnikv:filter_layers=[0]", "--budget", "0.5", "--new-tokens", "3", "--device", "cpu",
                 "--out", str(tmp_path)]) == 2
    assert main(["--model", "shape:tiny", "--contexts", "64", "--methods", "quest:per_query_head=false,token_budget=32",
                 "omnikv:filter_layers=[0]", "--budget", "0.5", "--new-tokens", "3", "--device", "cpu",
                 "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "e2e.json").read_text())["rows"]
    assert [(r["spec"], r["budget"]) for r in rows] == [("quest:per_query_head=false,token_budget=32", 32),
                                                        ("omnikv:filter_layers=[0]", 0.5)]


def test_capacity_bench_smoke(tmp_path):
    """The ladder stops a method at its first failure; the long decode reports RaaS's held KV at its budget."""
    from sparsekv.bench.capacity import main as capacity

    omnikv = "omnikv:offload=true,filter_layers=[1],wait_layers=0"
    assert capacity(["ladder", "--model", "tiny:llama", "--device", "cpu", "--contexts", "96", "160", "--methods",
                     "dense", omnikv, "--budget", "16", "--new-tokens", "4", "--prefill", "96",
                     "--out", str(tmp_path), "--tag", "ladder"]) == 0
    rows = json.loads((tmp_path / "ladder.json").read_text())["rows"]
    assert [(r["spec"], r["context"], r["status"], r["fill"]) for r in rows] == [
        ("dense", 96, "ok", "prefill"), ("dense", 160, "ok", "random"),
        (omnikv, 96, "ok", "prefill"), (omnikv, 160, "ok", "random")]
    assert rows[3]["kv_host_gib"] > 0
    assert capacity(["long-decode", "--model", "tiny:llama", "--device", "cpu", "--prompt", "16", "--decode", "48",
                     "--window", "16", "--methods", "quest", "raas", "--budget", "32", "--out", str(tmp_path),
                     "--tag", "long"]) == 0
    quest, raas = json.loads((tmp_path / "long.json").read_text())["rows"]
    assert raas["held_gib_measured_end"] < quest["held_gib_measured_end"]
    assert "| raas |" in (tmp_path / "long.md").read_text()
