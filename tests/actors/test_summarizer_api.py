"""The Python API: build a summarizer from a config, apply it to a user's own Dataset (their
column names, their filters, their writes), lazily; and README's example, run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.builders import REPO, make_tiny_chat_checkpoint, sample_documents

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    # On 127.0.0.1 (see conftest); metrics reported every second, so a test reads them back soon.
    ray.init(address="local", num_cpus=2, include_dashboard=False, _system_config={"metrics_report_interval_ms": 1000})
    yield
    ray.shutdown()


def scrape(names: tuple[str, ...], timeout_s: float = 60.0) -> dict[str, list[tuple[dict, float]]]:
    """The series of each metric in `names` from this node's Prometheus endpoint, once all appear."""
    import ray

    port = ray._private.worker.global_worker.node.metrics_export_port
    deadline = time.monotonic() + timeout_s
    while True:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        found: dict[str, list[tuple[dict, float]]] = {}
        for line in text.splitlines():
            match = re.match(r"^(\w+)\{(.*)\} ([0-9.e+-]+)$", line)
            if match and match.group(1) in names:
                labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
                found.setdefault(match.group(1), []).append((labels, float(match.group(3))))
        if set(found) == set(names) or time.monotonic() > deadline:
            return found
        time.sleep(1.0)


@pytest.mark.usefixtures("ray_cluster")
def test_a_users_dataset_is_summarized_lazily_with_its_own_columns(tmp_path):
    import ray

    from actors.summarizer import SummarizerConfig, build_summarizer
    from pipeline.decoding.sampling import SamplingParams
    from pipeline.summarization.output import OUTPUT_COLUMNS

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=2)
    doc = sample_documents()[1]
    items = [
        {"doc": "a", "body": "The committee met on Tuesday.\n\nIt approved the budget.", "gold": None},
        {"doc": "b", "body": doc["text"][:2000], "gold": doc["reference_summary"]},
        {"doc": "c", "body": "", "gold": None},
        {"doc": "skip-me", "body": "Filtered out before summarizing.", "gold": None},
    ]
    config = SummarizerConfig(
        model=str(model),
        strategy="lookup",
        dtype="fp32",
        max_new_tokens=8,
        max_chunk_tokens=256,
        params=SamplingParams(no_repeat_ngram_size=3, repetition_scope="answer"),
        threads_per_replica=1,
        id_column="doc",
        text_column="body",
        reference_column="gold",
    )
    with build_summarizer(config) as summarize:
        ds = ray.data.from_items(items).filter(lambda row: row["doc"] != "skip-me")
        summarized = summarize(ds)
        assert isinstance(summarized, ray.data.Dataset)  # nothing has run: a plan, composable
        summarized = summarized.materialize()
        summarized.filter(lambda row: row["status"] == "ok").write_parquet(str(tmp_path / "ok"))
        rows = {row["id"]: row for row in summarized.take_all()}
    written = ray.data.read_parquet(str(tmp_path / "ok")).take_all()
    assert sorted(row["id"] for row in written) == ["a", "b"]
    assert set(rows) == {"a", "b", "c"} and set(rows["a"]) == set(OUTPUT_COLUMNS)
    assert rows["a"]["status"] == "ok" and rows["a"]["summary"] and rows["a"]["rouge1"] is None
    assert rows["b"]["status"] == "ok" and rows["b"]["num_chunks"] >= 2 and rows["b"]["rouge1"] is not None
    assert rows["c"]["status"] == "error" and rows["c"]["error"] == "text is empty"
    with pytest.raises(Exception, match="shut down"):
        summarize(ds)

    # The same run, as Ray metrics on the node's Prometheus endpoint.
    names = ("ray_knapspec_documents_total", "ray_knapspec_generated_tokens_total", "ray_knapspec_requests_total",
             "ray_knapspec_prompt_tokens_total", "ray_knapspec_decode_seconds_count")  # fmt: skip
    metrics = scrape(names)
    assert set(metrics) == set(names), sorted(metrics)
    documents = {labels["status"]: value for labels, value in metrics["ray_knapspec_documents_total"]}
    assert documents == {"ok": 2.0, "error": 1.0}
    assert all(labels["strategy"] == "lookup" and labels["model"] for labels, _ in metrics["ray_knapspec_requests_total"])
    requests = sum(value for _, value in metrics["ray_knapspec_requests_total"])
    assert requests >= 1 + rows["b"]["num_chunks"] + 1  # a; b's chunks and at least one reduce step
    generated = sum(value for _, value in metrics["ray_knapspec_generated_tokens_total"])
    assert generated == rows["a"]["output_tokens"] + rows["b"]["output_tokens"]


@pytest.mark.slow
def test_the_readme_example_runs_as_written(tmp_path):
    """The README's example, executed as a user would paste it (the embedded model, a local cluster)."""
    readme = (REPO / "README.md").read_text()
    (example,) = re.findall(r"<!-- python-api-example -->\n```python\n(.*?)```", readme, re.S)
    assert len(example.strip().splitlines()) <= 12
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", example], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "summaries").is_dir() and list((tmp_path / "summaries").glob("*.parquet"))
    printed = {line.split(" -> ")[0]: line for line in proc.stdout.splitlines() if " -> " in line}
    assert set(printed) == {"budget", "wallpaper"}, proc.stdout
