"""The run's numbers as Ray metrics (`ray.util.metrics`), so that they appear on the Ray
dashboard and its Prometheus endpoint (exported with Ray's `ray_` prefix, counters with
`_total`): requests and tokens per replica — drafted and accepted as vLLM exports them
(`spec_decode_num_draft_tokens`, `..._accepted_tokens`) — prefill and decode seconds, and
requests in flight. Every series is tagged by model and strategy. The summarize stage counts
documents by status itself (`knapspec_documents`, pipeline/summarization/stage.py)."""

from __future__ import annotations

import threading

from ray.util.metrics import Counter, Gauge, Histogram

TAGS = ("model", "strategy")
# Seconds of one request's prefill or decode: from a short chunk on a GPU to a long one on a CPU.
SECONDS_BOUNDARIES = [0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 150, 400]


class ReplicaMetrics:
    """One replica's series; `start` and `finish` bracket each request it serves."""

    def __init__(self, model: str, strategy: str) -> None:
        self.tags = {"model": model, "strategy": strategy}
        tagged = dict(tag_keys=TAGS)
        self.requests = Counter("knapspec_requests", "requests decoded", **tagged)
        self.prompt_tokens = Counter("knapspec_prompt_tokens", "prompt tokens prefilled", **tagged)
        self.generated_tokens = Counter("knapspec_generated_tokens", "tokens generated", **tagged)
        self.steps = Counter("knapspec_spec_decode_steps", "full-model (verify) forwards after each prefill", **tagged)
        self.drafted_tokens = Counter("knapspec_spec_decode_draft_tokens", "tokens drafted", **tagged)
        self.accepted_tokens = Counter("knapspec_spec_decode_accepted_tokens", "drafted tokens accepted", **tagged)
        self.prefill_s = Histogram(
            "knapspec_prefill_seconds", "a request's prefill", boundaries=SECONDS_BOUNDARIES, **tagged
        )
        self.decode_s = Histogram(
            "knapspec_decode_seconds", "a request's decode", boundaries=SECONDS_BOUNDARIES, **tagged
        )
        self.in_flight = Gauge("knapspec_requests_in_flight", "requests this replica holds", tag_keys=(*TAGS, "replica"))
        self._count = 0
        self._lock = threading.Lock()

    def start(self, replica: str) -> None:
        self._move(replica, +1)

    def finish(self, replica: str, stats: dict | None) -> None:
        """A request left (`stats`: its GenerationStats.to_dict(); None: it failed)."""
        self._move(replica, -1)
        if stats is None:
            return
        tags = self.tags
        self.requests.inc(1, tags=tags)
        for counter, key in (
            (self.prompt_tokens, "prompt_tokens"),
            (self.generated_tokens, "output_tokens"),
            (self.steps, "steps"),
            (self.drafted_tokens, "drafted_tokens"),
            (self.accepted_tokens, "accepted_tokens"),
        ):
            if stats[key]:
                counter.inc(stats[key], tags=tags)
        self.prefill_s.observe(stats["prefill_s"], tags=tags)
        self.decode_s.observe(stats["decode_s"], tags=tags)

    def _move(self, replica: str, delta: int) -> None:
        with self._lock:
            self._count += delta
            self.in_flight.set(self._count, tags=self.tags | {"replica": replica})

