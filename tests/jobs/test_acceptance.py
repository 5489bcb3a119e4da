"""jobs/acceptance.py: α per share of skipped items, on a tiny model with redundant layers."""

from __future__ import annotations

import json

from tests.builders import load_job, make_tiny_chat_checkpoint


def test_the_job_measures_alpha_per_kind_and_count(tmp_path, capsys):
    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=6, quiet_layers=(2, 3))
    acceptance = load_job("acceptance.py", "acceptance_job")
    output = tmp_path / "acceptance.json"
    code = acceptance.main(
        ["--model", str(model), "--dtype", "fp32", "--ids", "gao-26-109008,crs-r47194", "--context-length", "160",
         "--reference-tokens", "6", "--max-new-tokens", "30", "--gamma", "3", "--attention", "1,2", "--mlp", "2",
         "--both", "4", "--output", str(output)]
    )  # fmt: skip
    assert code == 0
    table = json.loads(output.read_text())
    assert table["num_layers"] == 6 and table["gamma"] == 3 and table["documents"] == ["gao-26-109008", "crs-r47194"]
    rows = {(row["kind"], row["count"]): row for row in table["rows"]}
    assert set(rows) <= {("attention", 1), ("attention", 2), ("mlp", 2), ("both", 4)} and ("attention", 2) in rows
    assert rows["attention", 2]["attention_skipped"] == 2 / 6 and rows["attention", 2]["mlp_skipped"] == 0
    for row in table["rows"]:
        assert 0.0 <= row["alpha"] <= 1.0 and 1.0 <= row["tokens_per_step"] <= 4.0 and row["documents"] == 2
    for rows_of_document in table["per_document"].values():
        assert all(row["tokens_equal"] for row in rows_of_document)
    shown = capsys.readouterr().out
    assert "| attention | 2 | 33% | 0% |" in shown
