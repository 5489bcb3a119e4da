"""What a benchmark run is asked to do, and the names its parts share: the strategies and
compute modes compared, the reference they are measured against, the control, and a
pipelined replica's measurement. The job builds these from its options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import short_attention

CONTROL = "ar-control"  # the reference strategy, run a second time
# Whose plan predicts their speed (the hybrid mixes in copied drafts its layer plan does not predict).
SEARCHING = ("knapspec", "knapspec-coupled")
MATMUL = short_attention.MATMUL_ROUTE  # DTYPE+matmul: attention by PyTorch's matmuls, not the fused kernel


@dataclass(frozen=True)
class ComparisonSettings:
    """Every (document, context length) decoded by every strategy in turn at every batch size."""

    pairs: tuple[tuple[str, str], ...]  # (strategy, compute mode), the reference among them
    reference: tuple[str, str]  # what the speed-ups are relative to
    context_lengths: tuple[int, ...]  # prompt tokens
    batch_sizes: tuple[int, ...]  # ascending, each once
    max_new_tokens: int
    repeats: int
    params: SamplingParams  # repetition control, every strategy alike
    model: str | None = None  # a checkpoint folder; None: the embedded model
    calibration_dir: Path | None = None  # the latency-table store; None: the cache's
    recalibrate: bool = False  # measure the searching strategies' latency model afresh first
    no_fallback: bool = False  # also run the DP's best candidates as forced draft models
    num_forced: int = 4  # how many of them


@dataclass(frozen=True)
class PipelineSettings:
    """Requests through one replica of `stages` stage actors, one at a time vs several in flight."""

    stages: int
    in_flight: tuple[int, ...]  # requests in flight, the first the baseline
    context_tokens: int
    strategy: str
    dtype: str
    max_new_tokens: int
    requests: int  # per measurement
    repeats: int
    model: str | None = None
    calibration_dir: Path | None = None
