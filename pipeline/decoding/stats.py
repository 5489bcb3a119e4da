"""Decoding statistics: one type for a request and for any sum of requests.

Every layer that reports decoding — a request, a document's map-reduce, a job's closing
table, the benchmark — sums these and reads its rates from here, so acceptance and
throughput are defined once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationStats:
    """Counts and seconds of `num_requests` requests. Each request's first new token comes
    from its prefill forward; `steps` counts the full-model forwards after it."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    num_requests: int = 1

    @classmethod
    def total(cls, parts: Iterable[GenerationStats]) -> GenerationStats:
        """The sum of `parts` (no requests at all when empty)."""
        total = cls(num_requests=0)
        for part in parts:
            total += part
        return total

    def __add__(self, other: GenerationStats) -> GenerationStats:
        return GenerationStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def decoded_tokens(self) -> int:
        """Tokens made after the prefills: the first token of each request is the prefill's."""
        return max(self.output_tokens - self.num_requests, 0)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0.0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per full-model forward: accepted drafts plus the target's own token (1.0 for AR)."""
        return (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the prefills, over the time after them."""
        return self.decoded_tokens / self.decode_s if self.decode_s > 0 and self.decoded_tokens else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_len=self.mean_accepted_len,
            tokens_per_s=self.tokens_per_s,
        )
        return d

    @classmethod
    def from_dict(cls, data: Mapping) -> GenerationStats:
        """Back from `to_dict` (the derived rates are recomputed, not read)."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


class BusyClock:
    """A replica's own account: the wall time it held at least one request, and the sum of the
    requests it served. In a batch the requests' decode times overlap, so their sum is no
    throughput; the tokens over the busy time are (prefill included). Thread-safe: a batching
    replica serves its calls on many threads."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0.0
        self._busy_s = 0.0
        self._served = GenerationStats(num_requests=0)
        self._failed = 0

    def start(self) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = self._clock()
            self._in_flight += 1

    def finish(self, stats: GenerationStats | None) -> None:
        """A request left: its statistics, or None where it failed (its time still counts)."""
        with self._lock:
            if self._in_flight == 0:
                raise RuntimeError("BusyClock.finish without a start")
            self._in_flight -= 1
            if self._in_flight == 0:
                self._busy_s += self._clock() - self._since
            if stats is None:
                self._failed += 1
            else:
                self._served += stats

    def usage(self) -> ReplicaUsage:
        """What the replica did so far (a request in flight counts its time, not yet its tokens)."""
        with self._lock:
            busy = self._busy_s + (self._clock() - self._since if self._in_flight else 0.0)
            return ReplicaUsage(replicas=1, busy_s=busy, served=self._served, failed=self._failed)


@dataclass
class ReplicaUsage:
    """Replicas' busy time and what they served, summed over `replicas` of them."""

    replicas: int = 0
    busy_s: float = 0.0
    served: GenerationStats = field(default_factory=lambda: GenerationStats(num_requests=0))
    failed: int = 0  # requests that failed (a retried request counts each failed attempt)
    # The largest peak resident memory of a replica's process, and the most one declared to Ray
    # (0: not known): a peak above its declaration is how a replica could be killed for memory.
    peak_rss: int = 0
    declared_memory: int = 0

    def __add__(self, other: ReplicaUsage) -> ReplicaUsage:
        return ReplicaUsage(
            self.replicas + other.replicas,
            self.busy_s + other.busy_s,
            self.served + other.served,
            self.failed + other.failed,
            max(self.peak_rss, other.peak_rss),
            max(self.declared_memory, other.declared_memory),
        )

    @property
    def over_memory(self) -> bool:
        return 0 < self.declared_memory < self.peak_rss

    @property
    def tokens_per_busy_s(self) -> float | None:
        """Output tokens per second of a replica's busy time (its prefills included)."""
        return self.served.output_tokens / self.busy_s if self.busy_s > 0 else None

    def line(self, documents: int) -> str:
        """`2 replicas busy 312 s each: 41.0 tokens/s generated, 23.1 documents per hour (per
        replica, prefill included; 58 requests)` for `documents` finished over this busy time."""
        if not self.replicas or self.busy_s <= 0:
            return "replicas: no busy time on record"
        per_hour = documents * 3600 / self.busy_s
        failed = f", {self.failed} failed requests" if self.failed else ""
        return (
            f"{self.replicas} replica{'s' if self.replicas > 1 else ''} busy {self.busy_s / self.replicas:.0f} s each: "
            f"{self.tokens_per_busy_s:.1f} tokens/s generated, {per_hour:.1f} documents per hour "
            f"(per replica, prefill included; {self.served.num_requests} requests{failed})"
            + self._memory()
        )

    def _memory(self) -> str:
        if not self.peak_rss:
            return ""
        declared = f" of {self.declared_memory / 2**30:.2f} GiB declared" if self.declared_memory else ""
        return f"; peak memory {self.peak_rss / 2**30:.2f} GiB{declared}"

    def to_dict(self) -> dict:
        return {
            "replicas": self.replicas,
            "busy_s": self.busy_s,
            "served": self.served.to_dict(),
            "failed": self.failed,
            "peak_rss": self.peak_rss,
            "declared_memory": self.declared_memory,
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> ReplicaUsage:
        return cls(
            data["replicas"],
            data["busy_s"],
            GenerationStats.from_dict(data["served"]),
            data["failed"],
            data.get("peak_rss", 0),
            data.get("declared_memory", 0),
        )
