"""The selection diagnosis: the oracle's own scores agree with the true mass exactly, a method's rows cover its
sparse layers and rows, and the command runs end to end on a tiny model."""

import json

import pytest
import torch

import sparsekv
from sparsekv.errors import ConfigError
from sparsekv.eval.selection import SelectionConfig, format_table, main
from sparsekv.methods import LowBitConfig, OracleConfig, QuestConfig
from sparsekv.tiny import tiny_model


def test_rows_per_method_and_the_oracle_agrees_with_itself():
    model = tiny_model("llama", layers=3, heads=4, kv_heads=2, seed=0)
    estimates = (OracleConfig(token_budget=16, page_size=4, dense_layers=0),
                 QuestConfig(token_budget=16, page_size=4, dense_layers=1, per_query_head=True),
                 LowBitConfig(token_budget=16, page_size=4, dense_layers=1))
    ids = torch.randint(3, 259, (1, 70), generator=torch.Generator().manual_seed(0))
    with sparsekv.apply(model, SelectionConfig(estimates=estimates, steps=2)) as session, torch.no_grad():
        dense_out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                                   pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(dense_out, model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                                     do_sample=False, pad_token_id=0))  # the probe decodes densely
    oracle, quest, low = session.method.table()
    assert {(r["layer"], r["row"]) for r in oracle["rows"]} == {(i, j) for i in range(3) for j in range(2)}
    assert all(r["spearman"] == pytest.approx(1.0) and r["top_rank"] == 1 and r["mass_ratio"] == pytest.approx(1.0)
               for r in oracle["rows"])
    assert {(r["layer"], r["row"]) for r in quest["rows"]} == {(i, j) for i in (1, 2) for j in range(4)}
    assert {(r["layer"], r["row"]) for r in low["rows"]} == {(i, j) for i in (1, 2) for j in range(2)}
    assert all(-1 <= r["spearman"] <= 1 and 0 < r["mass_ratio"] <= 1 + 1e-9 for r in quest["rows"] + low["rows"])
    text = format_table({"quest": quest}, worst=3)
    assert "## quest: mean spearman" in text and text.count("\n| 1 |") >= 1


def test_config_checks():
    with pytest.raises(ConfigError, match="estimates"):
        SelectionConfig(estimates=(QuestConfig(page_size=16), QuestConfig(page_size=8, token_budget=64)))
    with pytest.raises(ConfigError, match="steps"):
        SelectionConfig(estimates=(QuestConfig(),), steps=0)


def test_command_on_a_tiny_model(tmp_path, capsys):
    out = tmp_path / "sel.json"
    assert main(["--model", "tiny:llama", "--task", "passkey", "--length", "300", "--depth", "0.5",
                 "--methods", "quest", "lowbit:bits=1", "--budget", "32", "--steps", "2", "--out", str(out)]) == 0
    assert "## quest: mean spearman" in capsys.readouterr().out
    table = json.loads(out.read_text())
    assert set(table["methods"]) == {"quest", "lowbit:bits=1"} and table["methods"]["quest"]["rows"]
    assert main(["--model", "tiny:llama", "--task", "passkey", "--length", "300", "--methods", "h2o"]) == 2
    assert "has no page scores" in capsys.readouterr().err
