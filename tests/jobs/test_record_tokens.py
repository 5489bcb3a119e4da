"""jobs/record_tokens.py: greedy tokens recorded, and a second record compared with the first."""

from __future__ import annotations

import json

from tests.builders import load_job, make_tiny_chat_checkpoint


def test_a_record_compares_equal_to_itself_and_names_a_changed_answer(tmp_path, capsys):
    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=3)
    job = load_job("record_tokens.py", "record_tokens_job")
    common = ["--model", str(model), "--dtype", "fp32"]
    before, after = tmp_path / "before.json", tmp_path / "after.json"
    for path in (before, after):
        args = ["--strategies", "ar,lookup,knapspec", "--lengths", "96,160", "--documents", "3",
                "--max-new-tokens", "12", "--batch", "2", "--output", str(path), *common]  # fmt: skip
        assert job.main(args) == 0
    record = json.loads(before.read_text())
    assert len(record["runs"]) == 3 * 2 * 2 * 3  # strategies × lengths × (alone, batch) × documents
    assert {len(p) for key, p in record["prompts"].items() if key.startswith("96/")} <= set(range(80, 97))
    assert job.main(["--compare", str(before), str(after), *common]) == 0
    assert "36 of 36 answers identical token for token" in capsys.readouterr().out

    key = next(k for k, r in record["runs"].items() if k.startswith("lookup/160/alone/") and len(r["tokens"]) > 5)
    length = len(record["runs"][key]["tokens"])
    record["runs"][key]["tokens"][5] = (record["runs"][key]["tokens"][5] + 1) % 1000 + 300
    after.write_text(json.dumps(record))
    assert job.main(["--compare", str(before), str(after), *common]) == 1
    assert f"{key}: first different token at 5 of {length}" in capsys.readouterr().out
