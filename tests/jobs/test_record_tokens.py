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
    out = capsys.readouterr().out
    assert f"{key}: first different token at 5 of {length}" in out
    shared = sum(len(r["tokens"]) for r in record["runs"].values()) - (length - 5)
    assert f"answers agree on their first {shared / 36:.1f} tokens on average" in out

    # --batch 0: each answer alone only (two compute modes compared, say)
    alone = tmp_path / "alone.json"
    args = ["--strategies", "ar", "--lengths", "96", "--documents", "2", "--max-new-tokens", "6", "--batch", "0"]
    assert job.main([*args, "--output", str(alone), *common]) == 0
    assert sorted(k.split("/")[2] for k in json.loads(alone.read_text())["runs"]) == ["alone", "alone"]


def test_teacher_forcing_measures_how_far_a_mode_moves_the_models_choices(tmp_path, capsys):
    """--forced: a mode against itself agrees everywhere at zero divergence; bf16 against fp32
    agrees at most positions, at a small positive divergence."""
    import torch

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=3)
    job = load_job("record_tokens.py", "record_tokens_job")
    args = ["--lengths", "96", "--documents", "2", "--max-new-tokens", "10", "--model", str(model)]
    assert job.main([*args, "--forced", "fp32", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    agree, positions = (int(n) for n in out.split("agrees at ")[1].split(" positions")[0].split(" of "))
    assert agree == positions > 0 and "mean 0.00e+00" in out
    assert job.main([*args, "--forced", "fp32", "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    agree, positions = (int(n) for n in out.split("agrees at ")[1].split(" positions")[0].split(" of "))
    assert positions // 2 <= agree <= positions
    reference = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 1.0]])
    same, kl = job.forced_agreement(reference, torch.tensor([[2.0, 1.0, 0.0], [3.0, 0.0, 1.0]]))
    assert same == 1 and kl[0] == 0 and kl[1] > 0
