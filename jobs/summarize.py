"""Summarize a collection of long documents on Ray: Ray Data streams them through a pool of
model replicas and writes Parquet.

    python jobs/summarize.py                      # bundled documents, embedded model, local Ray
    ray job submit --working-dir . -- python jobs/summarize.py --input docs.parquet --output out/

Inputs: Parquet files or folders, JSONL, a `datasets` save_to_disk folder, or a folder of
.txt files. Documents longer than a request's prompt budget are summarized by map-reduce
over chunks cut at paragraph boundaries. The output, `OUTPUT/summaries.parquet/`, holds one
row per input row, errors included; `--resume` continues an interrupted run without
writing any id twice. A bad path, format or column ends with one `error: ...` line and exit
code 2 before any work starts. A run whose rows failed for the infrastructure, or more than
--max-error-fraction of them by their input, exits 1 after writing every row.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from job_cli import (
    Parser,
    add_calibration_dir_argument,
    add_log_arguments,
    add_sampling_arguments,
    configure_job_logging,
    fraction,
    non_negative_float,
    positive_float,
    positive_int,
    run_reporting_errors,
    sampling_params,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = REPO / "data" / "sample.jsonl"
OUTPUT_NAME = "summaries.parquet"
# A run where more than a tenth of the rows fail by their input is more likely misconfigured (a
# wrong column, a wrong encoding, a size limit too low) than fed a few bad rows: it exits 1.
DEFAULT_MAX_ERROR_FRACTION = 0.1

logger = logging.getLogger("summarize")


def _id_list(value: str) -> frozenset[str]:
    ids = frozenset(part.strip() for part in value.split(",") if part.strip())
    if not ids:
        raise argparse.ArgumentTypeError(f"expected comma-separated ids, got {value!r}")
    return ids


def _output_folder(value: str) -> Path:
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*://", value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is a URI; the output is a folder path, local or on a filesystem every node mounts"
        )
    return Path(value)


def _share_or_off(value: str) -> float | None:
    if value.strip().lower() == "off":
        return None
    share = positive_float(value)
    if share > 1:
        raise argparse.ArgumentTypeError(f"expected a share of the budget in (0, 1] or `off`, got {share}")
    return share


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from actors.summarizer import SummarizerConfig as Defaults
    from pipeline.engine import DEFAULT_MAX_BATCH, STRATEGIES
    from pipeline.model.linear import DTYPE_CHOICES
    from pipeline.summarization.summarizer import DEFAULT_REQUEST_TIMEOUT, DEFAULT_SUMMARY_PARAMS

    parser = Parser(prog="summarize.py", description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("data")
    data.add_argument(
        "--input",
        type=Path,
        default=DEFAULT_INPUT,
        help="a .parquet/.jsonl file or folder, a datasets save_to_disk folder, or a folder of .txt files "
        "(default: the bundled sample documents)",
    )
    data.add_argument(
        "--output", type=_output_folder, default=Path("out"), help=f"output folder; rows go to OUTPUT/{OUTPUT_NAME}/"
    )
    data.add_argument("--id-column", default="id")
    data.add_argument("--text-column", default="text")
    data.add_argument(
        "--reference-column", help="reference summaries for ROUGE (default: reference_summary, when present)"
    )
    data.add_argument("--ids", type=_id_list, help="summarize only these ids (comma-separated)")
    data.add_argument("--limit", type=positive_int, help="summarize only the first N input rows")
    data.add_argument(
        "--max-document-bytes",
        type=positive_int,
        default=Defaults.max_document_bytes,
        help="a row whose text is longer is an error row, before it is tokenized "
        f"(default {Defaults.max_document_bytes:,}: ~2.3M tokens of English)",
    )
    data.add_argument(
        "--max-error-fraction",
        type=fraction,
        default=DEFAULT_MAX_ERROR_FRACTION,
        help="exit with status 1 when more than this share of the rows failed by their input (any row failed by "
        f"the infrastructure always does); every row is written either way (default {DEFAULT_MAX_ERROR_FRACTION})",
    )
    data.add_argument("--resume", action="store_true", help="skip ids already written with status ok, redo the rest")
    data.add_argument("--overwrite", action="store_true", help="replace the rows of an earlier run")

    model = parser.add_argument_group("model and decoding")
    model.add_argument(
        "--model", help="a local Hugging Face checkpoint folder on every node (default: the embedded model)"
    )
    model.add_argument("--strategy", default=Defaults.strategy, choices=STRATEGIES)
    model.add_argument(
        "--max-new-tokens",
        type=positive_int,
        default=Defaults.max_new_tokens,
        help=f"per request whose summary is summarized again: a chunk's (default {Defaults.max_new_tokens})",
    )
    model.add_argument(
        "--max-summary-tokens",
        type=positive_int,
        default=Defaults.max_summary_tokens,
        help="the final summary's budget: a short document's one request, a long one's last reduce step "
        f"(default {Defaults.max_summary_tokens})",
    )
    model.add_argument(
        "--end-on-sentence",
        type=_share_or_off,
        default=Defaults.end_on_sentence,
        metavar="SHARE|off",
        help="past this share of its budget an answer ends at its first sentence end, and one that uses its "
        "whole budget loses an unfinished last sentence; `off`: answers end at EOS or the budget "
        f"(default {Defaults.end_on_sentence})",
    )
    model.add_argument(
        "--max-chunk-tokens",
        type=positive_int,
        default=Defaults.max_chunk_tokens,
        help="prompt budget of one request, template included; longer documents are chunked "
        f"(default {Defaults.max_chunk_tokens}, capped by the model's context)",
    )
    model.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    model.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    model.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step kernel by kernel instead of as captured CUDA graphs",
    )
    add_sampling_arguments(
        model,
        seed_help="sampling seed; each request derives its own from it",
        repetition_penalty=DEFAULT_SUMMARY_PARAMS.repetition_penalty,
        no_repeat_ngram_size=DEFAULT_SUMMARY_PARAMS.no_repeat_ngram_size,
        repetition_scope=DEFAULT_SUMMARY_PARAMS.repetition_scope,
    )

    cluster = parser.add_argument_group("Ray")
    cluster.add_argument(
        "--address",
        help="a Ray cluster to join, or `auto` for the one `ray start` began on this machine "
        "(default: the job's cluster under `ray job submit`, else a new local one)",
    )
    cluster.add_argument("--replicas", type=positive_int, default=1, help="model replicas (data parallel)")
    cluster.add_argument(
        "--pipeline-parallel",
        type=positive_int,
        default=1,
        help="pipeline stages per replica, each a Ray actor holding its share of the layers",
    )
    cluster.add_argument("--tensor-parallel", type=positive_int, default=1, help="tensor-parallel ranks per stage")
    cluster.add_argument(
        "--cpus-per-replica",
        type=positive_float,
        help="Ray CPUs reserved per replica (default: 1, less when "
        "the cluster is smaller; 1.25 CPUs stay free for the data stages)",
    )
    cluster.add_argument(
        "--threads-per-replica",
        type=positive_int,
        help="torch threads per replica (default: this machine's cores "
        "shared among the replicas for a local run, else the reserved CPUs)",
    )
    cluster.add_argument(
        "--max-batch",
        type=positive_int,
        default=DEFAULT_MAX_BATCH,
        help=f"requests one replica decodes together in one batch (default {DEFAULT_MAX_BATCH}); a pipelined "
        "replica keeps one batch per stage in flight",
    )
    cluster.add_argument(
        "--documents-in-flight",
        type=positive_int,
        help="documents summarized at once (default: --max-batch per replica and stage)",
    )
    cluster.add_argument(
        "--request-timeout",
        type=positive_float,
        default=DEFAULT_REQUEST_TIMEOUT.base_s,
        metavar="SECONDS",
        help="how long a request may take at its replica, queueing included, plus --request-timeout-per-token "
        f"for each prompt and answer token (default {DEFAULT_REQUEST_TIMEOUT.base_s:g}); a replica past it is "
        "judged hung and its requests go to the others until it answers again",
    )
    cluster.add_argument(
        "--request-timeout-per-token",
        type=non_negative_float,
        default=DEFAULT_REQUEST_TIMEOUT.per_token_s,
        metavar="SECONDS",
        help=f"see --request-timeout (default {DEFAULT_REQUEST_TIMEOUT.per_token_s:g})",
    )
    parser.add_argument("--cache-dir", type=Path, help="where the embedded model's safetensors copy lives")
    add_calibration_dir_argument(parser, os.environ)
    add_log_arguments(parser)
    return parser.parse_args(argv)


def _check_args(args: argparse.Namespace):
    """Everything checkable before Ray starts: input, output, settings. Returns the input spec, the
    resume state, and the output folder's lock, held."""
    from pipeline.engine import StrategyConfig
    from pipeline.errors import ConfigError
    from pipeline.model import checkpoint
    from pipeline.model.linear import resolve_compute_mode
    from pipeline.model.spec import ModelSpec
    from pipeline.parallel.tensor_parallel import check_tensor_parallel
    from pipeline.summarization.inputs import resolve_input
    from pipeline.summarization.output import prepare_output
    from pipeline.summarization.output_lock import OutputLock

    if (args.pipeline_parallel > 1 or args.tensor_parallel > 1) and args.strategy in ("hf", "hf-lookup"):
        raise ConfigError(f"--strategy {args.strategy} runs transformers in one process; it has no pipeline form")
    if args.resume and args.overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if args.tensor_parallel > 1:
        config = checkpoint.load_config(checkpoint.resolve_checkpoint(args.model))
        check_tensor_parallel(ModelSpec.from_hf_config(config), args.tensor_parallel)
    spec = resolve_input(args.input, args.id_column, args.text_column, args.reference_column)
    resolve_compute_mode(args.dtype, args.device)
    StrategyConfig(name=args.strategy)
    sampling_params(args)
    if args.model is not None:
        checkpoint.resolve_checkpoint(args.model)
    # One run per output folder, held from before it touches the folder until the run ends.
    lock = OutputLock(args.output / OUTPUT_NAME)
    lock.acquire()
    try:
        resume = prepare_output(args.output / OUTPUT_NAME, args.resume, args.overwrite)
    except BaseException:
        lock.release()
        raise
    return spec, resume, lock


def _expected_rows(id_counts, num_rows: int, args: argparse.Namespace, done_ids) -> int:
    """The rows this run will write, for the progress bar's time left."""
    if args.ids is not None:
        rows = sum(id_counts[i] for i in args.ids if i not in done_ids)
    else:
        rows = num_rows - sum(id_counts[i] for i in done_ids if i in id_counts)
    return rows if args.limit is None else min(rows, args.limit)


def _check_ids(census: tuple[Counter, int], args: argparse.Namespace) -> tuple[Counter, int]:
    """The census, once every id of --ids is in it."""
    from pipeline.errors import ConfigError

    missing = sorted(args.ids - census[0].keys())
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ConfigError(f"--ids not in {args.input}: {shown}")
    return census


def _starts_local_cluster(address: str | None) -> bool:
    return address is None and not os.environ.get("RAY_ADDRESS")


def _init_ray(address: str | None) -> bool:
    """Join the given or ambient cluster; else start a local one. True when we started it."""
    import ray

    if not _starts_local_cluster(address):
        ray.init(address=address, log_to_driver=True)
        return False
    # "local" starts a new cluster even where a `ray start` left its address behind;
    # `--address auto` joins that one instead.
    ray.init(address="local", include_dashboard=False)
    return True


def run(args: argparse.Namespace) -> int:
    import ray

    from actors.summarizer import DATA_TASK, SummarizerConfig, build_summarizer
    from pipeline.model import checkpoint
    from pipeline.summarization.compaction import BackgroundCompaction
    from pipeline.summarization.datasource import read_documents
    from pipeline.summarization.output_nodes import check_output_visible
    from pipeline.summarization.rows import find_duplicate_ids, id_census
    from pipeline.summarization.sink import SummarySink
    from pipeline.summarization.summarizer import RequestTimeout

    spec, resume, lock = _check_args(args)
    started = time.perf_counter()
    summarize = None
    census = None
    local = False
    try:
        # The embedded model is converted once here, not by every replica at once.
        checkpoint.resolve_checkpoint(args.model, args.cache_dir)
        local = _init_ray(args.address)
        check_output_visible(args.output / OUTPUT_NAME)
        documents = read_documents(spec)
        if args.ids is None:
            # The census is a pass over the input (Ray Data tasks on the cores the replicas leave
            # free); it runs while the replicas load their model rather than before.
            census = ThreadPoolExecutor(1, thread_name_prefix="id-census").submit(id_census, documents)
        else:  # ids that must exist are checked before any replica starts
            id_counts, num_rows = _check_ids(id_census(documents), args)
        summarize = build_summarizer(
            SummarizerConfig(
                model=args.model,
                strategy=args.strategy,
                max_new_tokens=args.max_new_tokens,
                max_summary_tokens=args.max_summary_tokens,
                end_on_sentence=args.end_on_sentence,
                max_document_bytes=args.max_document_bytes,
                max_chunk_tokens=args.max_chunk_tokens,
                dtype=args.dtype,
                device=args.device,
                enforce_eager=args.enforce_eager,
                params=sampling_params(args),
                replicas=args.replicas,
                pipeline_parallel=args.pipeline_parallel,
                tensor_parallel=args.tensor_parallel,
                max_batch=args.max_batch,
                cpus_per_replica=args.cpus_per_replica,
                threads_per_replica=args.threads_per_replica,
                documents_in_flight=args.documents_in_flight,
                cache_dir=args.cache_dir,
                calibration_dir=args.calibration_dir,
                request_timeout=RequestTimeout(args.request_timeout, args.request_timeout_per_token),
                # The reader's columns (readers.DOCUMENT_SCHEMA), whatever the input called them.
                id_column="id",
                text_column="text",
                reference_column="reference",
            )
        )
        if census is not None:
            id_counts, num_rows = census.result()
        duplicates = find_duplicate_ids(id_counts)
        if duplicates:
            logger.warning("%d ids occur more than once; their rows become errors", len(duplicates))
        if args.ids is not None:
            wanted = args.ids
            documents = documents.filter(lambda row: row["id"] in wanted, **DATA_TASK)
        if args.limit is not None:
            documents = documents.limit(args.limit)
        if resume.done_ids:
            done = resume.done_ids
            documents = documents.filter(
                lambda row: row["id"] is None or row["id"] not in done, **DATA_TASK
            )
        sink = SummarySink(args.output / OUTPUT_NAME)
        with (
            summarize.progress(_expected_rows(id_counts, num_rows, args, resume.done_ids)),
            BackgroundCompaction(sink.folder),
        ):
            summarize(documents, duplicates).write_datasink(sink, ray_remote_args=DATA_TASK)
        # The replicas' own account: in a batch the requests' decode times overlap, so the table's
        # per-request tokens/s is no throughput; tokens over the replicas' busy time are.
        usage = summarize.usage()
    finally:
        if census is not None:
            # A failed start waits for the census: its Ray Data tasks end before the cluster does.
            wait([census])
        if summarize is not None:
            summarize.shutdown()
        if local:
            ray.shutdown()
        lock.release()
    wall_s = time.perf_counter() - started
    totals = sink.totals
    print(f"\nWrote {totals.rows} rows to {args.output / OUTPUT_NAME} in {wall_s:.0f} s", end="")
    print(f" ({len(resume.done_ids)} ids done earlier)" if resume.done_ids else "")
    print(totals.table(wall_s))
    print(usage.line(totals.ok))
    for line in totals.first_errors:
        print(f"  error row {line}")
    status, verdict = totals.outcome(args.max_error_fraction, earlier_ok=resume.kept_rows)
    print(verdict)
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if _starts_local_cluster(args.address):
        # A local run needs no network: Ray on loopback, not the machine's address (read at import).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    configure_job_logging(args)
    from pipeline.errors import KnapSpecError

    # Not every ValueError: a bug in a data stage should show its traceback.
    return run_reporting_errors(
        lambda: run(args), errors=(KnapSpecError, OSError), interrupted="interrupted; rerun with --resume to continue"
    )


if __name__ == "__main__":
    sys.exit(main())
