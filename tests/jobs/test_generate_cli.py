"""jobs/generate.py: input loading, error reporting, and one real generation per strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import ConfigError, RowError
from tests.builders import assert_same_or_near_tie, load_job, sample_documents

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "jobs" / "generate.py"
SAMPLE = REPO / "data" / "sample.jsonl"
SAMPLE_ID = "gao-26-109008"


generate = load_job("generate.py", "generate_cli")


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    # With two OpenMP threads per process, a test running beside another busy process
    # can slow down tens of times (threads spin waiting for a shared core); one is steady.
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_clean_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error:"), proc.stderr
    for fragment in fragments:
        assert fragment in last, last
    assert proc.stdout == ""
    return last


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------- load_document


def test_load_txt_uses_the_file_stem_as_id(tmp_path):
    path = tmp_path / "report-1.txt"
    path.write_text("A short document.\nSecond line.\n", encoding="utf-8")
    assert generate.load_document(path, None) == ("report-1", "A short document.\nSecond line.\n")
    assert generate.load_document(str(path), "named")[0] == "named"


def test_load_jsonl_picks_the_row_by_id(tmp_path):
    path = write_jsonl(
        tmp_path / "docs.jsonl",
        [{"id": "a", "text": "first"}, {"id": "b", "text": "second", "title": "x"}, {"id": 7, "text": "third"}],
    )
    assert generate.load_document(path, "b") == ("b", "second")
    assert generate.load_document(path, "7") == ("7", "third")  # ids compare as strings
    with pytest.raises(ConfigError, match=r"no row with id 'zz'.*available: a, b, 7"):
        generate.load_document(path, "zz")
    with pytest.raises(ConfigError, match="3 rows; choose one with --id"):
        generate.load_document(path, None)


def test_load_jsonl_single_row_needs_no_id(tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", [{"id": "only", "text": "the text"}])
    assert generate.load_document(path, None) == ("only", "the text")


def test_load_jsonl_rejects_bad_rows(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            {"id": "blank", "text": "  \n"},
            {"id": "null", "text": None},
            {"id": "dup", "text": "x"},
            {"id": "dup", "text": "y"},
        ],
    )
    with pytest.raises(RowError, match="empty"):
        generate.load_document(path, "blank")
    with pytest.raises(RowError, match="not a string"):
        generate.load_document(path, "null")
    with pytest.raises(ConfigError, match="occurs 2 times"):
        generate.load_document(path, "dup")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"id": "a", "text": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        generate.load_document(broken, "a")


def test_load_parquet_reads_the_row_from_its_row_group(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    table = pa.table({"id": ["a", "b", "c"], "text": ["first", "second", "third"], "words": [1, 2, 3]})
    pq.write_table(table, path, row_group_size=1)  # three row groups
    assert generate.load_document(path, "c") == ("c", "third")
    assert generate.load_document(path, "a") == ("a", "first")
    with pytest.raises(ConfigError, match=r"no row with id 'd'.*available: a, b, c"):
        generate.load_document(path, "d")

    numbered = tmp_path / "numbered.parquet"
    pq.write_table(pa.table({"id": [10, 20], "text": ["ten", "twenty"]}), numbered)
    assert generate.load_document(numbered, "20") == ("20", "twenty")

    single = tmp_path / "single.parquet"
    pq.write_table(pa.table({"text": ["lonely"]}), single)
    assert generate.load_document(single, None) == ("single", "lonely")
    with pytest.raises(ConfigError, match="no column 'id'"):
        generate.load_document(single, "x")


def test_load_document_rejects_missing_and_unknown_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        generate.load_document(tmp_path / "absent.txt", None)
    other = tmp_path / "doc.csv"
    other.write_text("id,text\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="unknown extension '.csv'"):
        generate.load_document(other, None)


def test_parse_args_reads_skip_items():
    args = generate.parse_args(["--input", "x.txt", "--strategy", "static", "--skip", "4, 6,8"])
    assert args.skip == (4, 6, 8)
    assert args.strategy == "static" and args.max_new_tokens == 128 and args.max_context is None


def test_repetition_flags_reach_the_sampling_params():
    args = generate.parse_args(["--input", "x.txt", "--no-repeat-ngram-size", "3", "--repetition-penalty", "1.2",
                                "--repetition-scope", "answer"])  # fmt: skip
    _, params = generate._check_settings(args)
    assert (params.no_repeat_ngram_size, params.repetition_penalty, params.repetition_scope) == (3, 1.2, "answer")
    _, plain = generate._check_settings(generate.parse_args(["--input", "x.txt"]))
    assert not plain.controls_repetition  # off unless asked for, as in transformers


@pytest.mark.parametrize(
    "flags, fragment",
    [(["--repetition-penalty", "0"], "--repetition-penalty"), (["--no-repeat-ngram-size", "-1"], ">= 0"),
     (["--repetition-scope", "prompt"], "--repetition-scope")],
)  # fmt: skip
def test_bad_repetition_flags_are_one_error_line(flags, fragment):
    proc = run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, *flags)
    assert proc.returncode == 2 and fragment in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# ------------------------------------------------------------- error paths


def test_missing_input_file(tmp_path):
    assert_clean_error(run_cli("--input", str(tmp_path / "absent.jsonl")), "does not exist")


def test_unknown_extension(tmp_path):
    path = tmp_path / "doc.md"
    path.write_text("# a document\n", encoding="utf-8")
    assert_clean_error(run_cli("--input", str(path)), "unknown extension")


def test_unknown_id_lists_available_ids():
    assert_clean_error(run_cli("--input", str(SAMPLE), "--id", "no-such-doc"), "no-such-doc", SAMPLE_ID)


def test_empty_document(tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("  \n\t \n", encoding="utf-8")
    assert_clean_error(run_cli("--input", str(path)), "empty")


def test_unknown_strategy(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text("Some text.", encoding="utf-8")
    assert_clean_error(run_cli("--input", str(path), "--strategy", "knapsack-magic"), "--strategy")


def test_unsupported_model_type(tmp_path):
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}), encoding="utf-8")
    assert_clean_error(run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, "--model", str(model)), "gpt2")


def test_pickled_model_weights_are_refused(tmp_path):
    model = tmp_path / "pickled"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}), encoding="utf-8")
    assert_clean_error(run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, "--model", str(model)), "pickled")


def test_pickle_only_folder_without_config_is_refused(tmp_path):
    model = tmp_path / "bare"
    model.mkdir()
    (model / "pytorch_model.bin").write_bytes(b"")
    assert_clean_error(run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, "--model", str(model)), "config.json")


def test_skip_item_out_of_range():
    # Needs the model's item count, so this one loads the embedded model (a few seconds).
    proc = run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, "--strategy", "static", "--skip", "4,9999", "--quiet")
    assert_clean_error(proc, "9999", "out of range")


# ------------------------------------------------------------ real model


@pytest.mark.slow
@pytest.mark.parametrize(
    "repetition",
    [
        [],
        ["--no-repeat-ngram-size", "3", "--repetition-penalty", "1.2"],
        # A document whose answer has a sentence end past 4 tokens (the later flags win).
        ["--end-on-sentence-after", "4", "--id", "rfc3986", "--max-new-tokens", "24"],
    ],
)
def test_greedy_output_is_the_same_for_every_strategy(repetition):
    """transformers' generate() (`hf`) stops at EOS and the budget only: the sentence rule cuts its
    stream afterwards, and must give what the loop's rule gives online."""
    records = {}
    for strategy in ("ar", "static", "hf"):
        proc = run_cli(
            "--input", str(SAMPLE), "--id", SAMPLE_ID, "--strategy", strategy,
            "--max-context", "600", "--max-new-tokens", "12", "--json", "--quiet", *repetition,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        records[strategy] = json.loads(proc.stdout)  # stdout holds the JSON object and nothing else

    sentence_rule = repetition[:1] == ["--end-on-sentence-after"]
    keys = {"id", "token_ids", "text", "prompt_tokens", "output_tokens", "strategy", "truncated", "finish_reason"}
    for strategy, record in records.items():
        assert keys | {"stats"} <= record.keys()
        assert record["id"] == (SAMPLE_ID if not sentence_rule else "rfc3986") and record["strategy"] == strategy
        assert record["output_tokens"] == len(record["token_ids"]) == record["stats"]["output_tokens"]
        assert all(isinstance(t, int) for t in record["token_ids"])
        assert record["truncated"] is True and record["prompt_tokens"] <= 600
        assert record["finish_reason"] in (("sentence",) if sentence_rule else ("eos", "length"))
        assert record["text"].strip()
    assert records["ar"]["token_ids"] == records["static"]["token_ids"] == records["hf"]["token_ids"]
    assert len({r["prompt_tokens"] for r in records.values()}) == 1
    assert records["static"]["stats"]["drafted_tokens"] > 0


@pytest.mark.slow
def test_several_ids_decoded_together_equal_each_alone():
    """The issue's command: --ids A,B,C,D --max-batch 4 --json prints one JSON object per id,
    each with the tokens of that id run alone (a differing token only at a near-tie). Alone:
    --max-batch 1 with `ar` (a batch of one is the single forward bit for bit,
    tests/model/test_batched_forward.py), and one id by --id, the single-request path."""
    ids = [doc["id"] for doc in sample_documents()[:4]]
    common = ["--input", str(SAMPLE), "--max-context", "700", "--max-new-tokens", "16", "--json", "--quiet"]
    proc = run_cli(*common, "--ids", ",".join(ids), "--max-batch", "4", "--strategy", "lookup")
    assert proc.returncode == 0, proc.stderr
    batched = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [record["id"] for record in batched] == ids
    one_by_one = run_cli(*common, "--ids", ",".join(ids), "--max-batch", "1", "--strategy", "ar")
    single = run_cli(*common, "--id", ids[0], "--strategy", "ar")
    assert one_by_one.returncode == 0 and single.returncode == 0, one_by_one.stderr + single.stderr
    alone = [json.loads(line) for line in one_by_one.stdout.splitlines()]
    assert [record["id"] for record in alone] == ids
    assert alone[0]["token_ids"] == json.loads(single.stdout)["token_ids"]
    engine = None
    for record, expected in zip(batched, alone):
        assert record["prompt_tokens"] == expected["prompt_tokens"]
        if record["token_ids"] != expected["token_ids"]:
            from pipeline.engine import Engine, EngineConfig
            from pipeline.summarization.prompts import build_prompt

            engine = engine or Engine(EngineConfig())
            doc = next(d for d in sample_documents() if d["id"] == record["id"])
            prompt = build_prompt(engine.tokenizer, doc["text"], 700).token_ids
            assert_same_or_near_tie(engine.model, prompt, record["token_ids"], expected["token_ids"])


def test_id_and_ids_exclude_each_other():
    proc = run_cli("--input", str(SAMPLE), "--id", SAMPLE_ID, "--ids", f"{SAMPLE_ID},x")
    assert proc.returncode == 2 and "not allowed with" in proc.stderr


@pytest.mark.parametrize(
    "script, argv, option",
    [("generate.py", ["--input", "x.txt"], "calibration_dir"),
     ("summarize.py", ["--input", "x.jsonl", "--output", "out"], "calibration_dir"),
     ("benchmark.py", [], "calibration_dir"), ("calibrate.py", [], "store")],
)  # fmt: skip
def test_the_jobs_take_the_store_folder_from_the_environment_unless_named(monkeypatch, script, argv, option):
    """The jobs read $KNAPSPEC_CALIBRATION_DIR (nothing below them does) and hand it on; the
    flag wins; with neither, None leaves the cache's calibration/ to the store."""
    from job_cli import CALIBRATION_DIR_ENV

    job = load_job(script, f"{Path(script).stem}_store_option")
    flag = "--store" if option == "store" else "--calibration-dir"
    monkeypatch.setenv(CALIBRATION_DIR_ENV, "~/shared-tables")
    assert getattr(job.parse_args(argv), option) == Path.home() / "shared-tables"
    assert getattr(job.parse_args([*argv, flag, "named"]), option) == Path("named")
    monkeypatch.delenv(CALIBRATION_DIR_ENV)
    assert getattr(job.parse_args(argv), option) is None
