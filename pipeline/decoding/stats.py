"""Decoding statistics: one type for a request and for any sum of requests.

Every layer that reports decoding — a request, a document's map-reduce, a job's closing
table, the benchmark — sums these and reads its rates from here, so acceptance and
throughput are defined once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields


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
