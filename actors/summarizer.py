"""Summarization as a Python API in Ray Data's style: build a summarizer from a config, apply
it to a Dataset, get the summarized Dataset back, lazily.

    import ray
    from actors.summarizer import SummarizerConfig, build_summarizer

    docs = ray.data.read_parquet("docs.parquet")      # columns id, text (and reference_summary)
    with build_summarizer(SummarizerConfig(replicas=2)) as summarize, summarize.progress(docs.count()):
        summarize(docs).filter(lambda row: row["status"] == "ok").write_parquet("out/")

`build_summarizer` starts the model replicas at once (they load their models, and the
searching strategies calibrate, before any document streams: nothing else runs on their
devices then). The summarizer it returns adds the summarize stage to a dataset without
running anything; the dataset runs when it is consumed, as any Ray Data pipeline does,
while the summarizer is open. Each input row gives one output row (OUTPUT_SCHEMA of
`pipeline.summarization.output`): a summary, or an error that says why. `jobs/summarize.py`
is a caller of this module: it adds reading, resume and the closing table.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.data import ActorPoolStrategy

from actors.progress import ProgressReporter, start_progress
from actors.replica import ReplicaPool
from actors.resources import DATA_CPUS, USER_TASK_CPUS, ReplicaResources
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.stats import ReplicaUsage
from pipeline.engine import DEFAULT_MAX_BATCH, EngineConfig, StrategyConfig
from pipeline.errors import ConfigError
from pipeline.model import checkpoint
from pipeline.summarization.datasource import DATA_TASK_MEMORY
from pipeline.summarization.dispatch import MAX_TIMEOUTS, POISON_DEATHS
from pipeline.summarization.stage import SummarizeBatch
from pipeline.summarization.summarizer import (
    DEFAULT_END_ON_SENTENCE,
    DEFAULT_MAX_DOCUMENT_BYTES,
    DEFAULT_MAX_SUMMARY_TOKENS,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SUMMARY_PARAMS,
    RequestTimeout,
    SummarizeSettings,
)

logger = logging.getLogger(__name__)

# Documents per summarize actor: each waits on replicas in a thread of its own, so one actor
# keeps many documents in flight without a process (and a torch import) each.
DOCUMENTS_PER_ACTOR = 16
# Every data stage (filter, summarize dispatchers, write) asks for a tenth of a CPU: the
# replicas hold the CPUs, and a stage asking Ray Data's default of one CPU could wait forever
# behind them on a small machine.
DATA_TASK_CPUS = 0.1
# What the job's filter and write tasks ask Ray for (its reads ask the same memory).
DATA_TASK = {"num_cpus": DATA_TASK_CPUS, "memory": DATA_TASK_MEMORY}
# Memory a summarize actor declares, so that Ray places it where it fits and Ray Data's memory
# check has nothing to warn about: its largest unique set in the default run was 471 MiB (the
# tokenizer, ROUGE, Arrow batches of its documents, the dispatcher's threads; 2 cores of an
# AMD EPYC), Ray Data's advice 1.3 times that; a document of several MiB adds its chunks.
SUMMARIZE_ACTOR_MEMORY = 640 * 2**20


@dataclass(frozen=True)
class SummarizerConfig:
    """What `build_summarizer` builds: the model and its decoding, the replicas, the columns."""

    model: str | None = None  # a local Hugging Face checkpoint folder on every node; None: the embedded model
    strategy: str = "knapspec-lookup"
    max_new_tokens: int = 64  # per request whose summary is summarized again (a chunk's)
    max_summary_tokens: int | None = DEFAULT_MAX_SUMMARY_TOKENS  # the final summary's; None: max_new_tokens
    end_on_sentence: float | None = DEFAULT_END_ON_SENTENCE  # share of a budget after which answers end on a sentence
    max_chunk_tokens: int = 4096  # prompt budget of one request, template included
    max_document_bytes: int | None = DEFAULT_MAX_DOCUMENT_BYTES  # a longer text is its row's error; None: no limit
    dtype: str = "auto"
    device: str = "cpu"
    enforce_eager: bool = False  # on CUDA: no captured steps (EngineConfig.enforce_eager)
    params: SamplingParams = DEFAULT_SUMMARY_PARAMS
    replicas: int = 1
    pipeline_parallel: int = 1
    tensor_parallel: int = 1
    max_batch: int = DEFAULT_MAX_BATCH
    cpus_per_replica: float | None = None
    threads_per_replica: int | None = None  # None: a one-node cluster's cores shared, else the reserved CPUs
    documents_in_flight: int | None = None  # None: max_batch per replica and stage
    cache_dir: Path | None = None
    calibration_dir: Path | None = None  # every node's latency-table store; None: its cache's calibration/
    id_column: str = "id"
    text_column: str = "text"
    reference_column: str | None = "reference_summary"  # ROUGE against it where a row has one
    request_timeout: RequestTimeout = DEFAULT_REQUEST_TIMEOUT  # past it, a request's replica is judged hung

    def __post_init__(self) -> None:
        StrategyConfig(name=self.strategy)
        for name in ("replicas", "pipeline_parallel", "tensor_parallel", "max_batch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


class Summarizer:
    """Replicas of one model, and the summarize stage over them (`summarizer(ds)`)."""

    def __init__(self, config: SummarizerConfig) -> None:
        if not ray.is_initialized():
            ray.init()
        self.config = config
        self.model_path = checkpoint.resolve_checkpoint(config.model, config.cache_dir)
        resources = ReplicaResources(
            num_cpus=config.cpus_per_replica,
            num_gpus=1.0 if config.device == "cuda" else 0.0,
            num_threads=_threads(config),
            pipeline_parallel=config.pipeline_parallel,
            tensor_parallel=config.tensor_parallel,
            max_batch=config.max_batch,
        )
        engine = EngineConfig(
            model=config.model,
            dtype=config.dtype,
            device=config.device,
            cache_dir=config.cache_dir,
            calibration_dir=config.calibration_dir,
            # KV slots as long as the longest request the job sends (a chunk's prompt and the longest answer).
            kv_slot_positions=config.max_chunk_tokens + _longest_answer(config),
            enforce_eager=config.enforce_eager,
        )
        self.pool = ReplicaPool(config.replicas, engine, StrategyConfig(name=config.strategy), resources)
        self.progress_name = f"knapspec-progress-{uuid.uuid4().hex[:12]}"
        self.progress_actor = start_progress(self.progress_name)
        self.settings = SummarizeSettings(
            model=checkpoint.EMBEDDED_MODEL if config.model is None else str(config.model),
            strategy=config.strategy,
            max_new_tokens=config.max_new_tokens,
            max_summary_tokens=config.max_summary_tokens,
            end_on_sentence=config.end_on_sentence,
            max_document_bytes=config.max_document_bytes,
            # A document keeps at most every replica's batch busy; beyond that, others' requests interleave.
            max_requests_in_flight=config.replicas * config.pipeline_parallel * config.max_batch,
            max_prompt_tokens=min(config.max_chunk_tokens, self.pool.max_context - _longest_answer(config)),
            params=config.params,
        )

    def __call__(self, ds: ray.data.Dataset, duplicate_ids: dict[str, int] | None = None) -> ray.data.Dataset:
        """`ds` with the summarize stage added (nothing runs yet): one output row per input row.
        `duplicate_ids` (rows.find_duplicate_ids): ids whose rows become errors; finding them
        takes a pass over the data, which a lazy stage cannot make by itself."""
        if not self.pool.handles:
            raise ConfigError("this summarizer is shut down")
        config = self.config
        in_flight = config.documents_in_flight or config.replicas * config.pipeline_parallel * config.max_batch
        actors = -(-in_flight // DOCUMENTS_PER_ACTOR)
        out = ds.map_batches(
            SummarizeBatch,
            fn_constructor_kwargs={
                # Names, not handles: an actor restarted by Ray Data looks them up again (stage.py).
                "replicas": self.pool.names,
                "settings": self.settings,
                "tokenizer_path": str(self.model_path),
                "duplicate_ids": duplicate_ids or {},
                "columns": (config.id_column, config.text_column, config.reference_column),
                "progress": self.progress_name,
                "request_timeout": config.request_timeout,
            },
            batch_size=1,  # a row is written as soon as its document is done
            batch_format="pyarrow",
            compute=ActorPoolStrategy(
                size=actors,
                max_concurrent_calls_per_actor=-(-in_flight // actors),
                max_tasks_in_flight_per_actor=-(-in_flight // actors),
                enable_true_multi_threading=True,
            ),
            # These actors only tokenize and wait on replicas; the replicas hold the CPUs. All of
            # them, one light task of the job and one user task at Ray Data's default of one CPU
            # must fit in what the replicas leave free.
            num_cpus=min(DATA_TASK_CPUS, (DATA_CPUS - USER_TASK_CPUS - DATA_TASK_CPUS) / actors),
            memory=SUMMARIZE_ACTOR_MEMORY,
        )
        # Every request ends within its tries' timeouts, so the run cannot hang silently; Ray
        # Data's own guard must leave a healthy run of the longest requests that long.
        needed = config.request_timeout.no_progress_s(self.settings, MAX_TIMEOUTS + POISON_DEATHS)
        guard = out.context.execution_no_progress_timeout_s
        if guard != -1 and guard < needed:
            out.context.execution_no_progress_timeout_s = needed
        return out

    def progress(self, total: int | None = None) -> ProgressReporter:
        """A context that shows the run while the dataset executes inside it: a live bar and one
        line per finished document (`total`: the documents expected, for the time left)."""
        return ProgressReporter(self.progress_actor, total)

    def usage(self, timeout_s: float = 30.0) -> ReplicaUsage:
        """The replicas' busy time and what they served so far, summed (EngineReplica.usage): the
        documents per hour per replica (ReplicaUsage.line) that the closing table's overlapping
        per-request rates are not. A replica that does not answer is left out (logged); one
        restarted by Ray counts from its restart."""
        calls = [h.usage.remote() for h in self.pool.handles]
        total = ReplicaUsage()
        for name, call in zip(self.pool.names, calls):
            try:
                total += ReplicaUsage.from_dict(ray.get(call, timeout=timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as e:
                logger.warning("Replica %s gave no usage (%s): left out of the throughput", name, type(e).__name__)
        if total.over_memory:
            # Ray placed replicas by the declaration: above it, a node can run out of memory.
            logger.warning(
                "A replica's peak memory (%.2f GiB) passed what it declared to Ray (%.2f GiB): "
                "pipeline/model/footprint.py misses something this run holds",
                total.peak_rss / 2**30,
                total.declared_memory / 2**30,
            )
        return total

    def shutdown(self) -> None:
        """Stop the replicas; a dataset built on this summarizer cannot run after it."""
        self.pool.shutdown()
        ray.kill(self.progress_actor)

    def __enter__(self) -> Summarizer:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def build_summarizer(config: SummarizerConfig = SummarizerConfig()) -> Summarizer:
    """Start the replicas of `config` and return the summarizer over them (see the module's example)."""
    return Summarizer(config)


def _longest_answer(config: SummarizerConfig) -> int:
    return max(config.max_new_tokens, config.max_summary_tokens or 0)


def _threads(config: SummarizerConfig) -> int:
    """Torch threads per replica process (a replica, or each stage and rank of a sharded one)."""
    if config.threads_per_replica is not None:
        return config.threads_per_replica
    shards = config.pipeline_parallel * config.tensor_parallel
    nodes = [node for node in ray.nodes() if node["Alive"]]
    if len(nodes) == 1:
        # One machine: the data stages are light, so the replicas share all its cores.
        cores = int(nodes[0]["Resources"].get("CPU", 1))
        return max(1, cores // (config.replicas * shards))
    return max(1, round((config.cpus_per_replica or 1.0) / shards))
