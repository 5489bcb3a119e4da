"""Decoding statistics: sums of requests, and a replica's own busy time."""

from __future__ import annotations

import threading

import pytest

from pipeline.decoding.stats import BusyClock, GenerationStats, ReplicaUsage


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def request(output_tokens: int, decode_s: float) -> GenerationStats:
    return GenerationStats(prompt_tokens=100, output_tokens=output_tokens, steps=output_tokens - 1, decode_s=decode_s)


def test_overlapping_requests_count_their_wall_time_once():
    """Two requests decoded together for 10 s each: the replica was busy 10 s, not 20."""
    clock = FakeClock()
    busy = BusyClock(clock)
    busy.start()
    clock.now = 1.0
    busy.start()  # joins the batch
    clock.now = 10.0
    busy.finish(request(33, 9.0))
    clock.now = 11.0
    busy.finish(request(21, 10.0))
    clock.now = 20.0  # idle: not counted
    busy.start()
    clock.now = 22.0
    busy.finish(None)  # a failed request's time still counts
    usage = busy.usage()
    assert usage.busy_s == pytest.approx(13.0)
    assert usage.served.num_requests == 2 and usage.served.output_tokens == 54 and usage.failed == 1
    assert usage.tokens_per_busy_s == pytest.approx(54 / 13.0)
    # Tokens over the sum of the requests' own decode times read a batch low: they overlap.
    assert usage.served.tokens_per_s < usage.tokens_per_busy_s


def test_a_request_in_flight_counts_its_time_so_far():
    clock = FakeClock()
    busy = BusyClock(clock)
    busy.start()
    clock.now = 4.0
    assert busy.usage().busy_s == pytest.approx(4.0)
    with pytest.raises(RuntimeError, match="without a start"):
        BusyClock(clock).finish(None)


def test_many_threads_at_once():
    busy = BusyClock()

    def serve() -> None:
        for _ in range(200):
            busy.start()
            busy.finish(request(3, 0.0))

    threads = [threading.Thread(target=serve) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    usage = busy.usage()
    assert usage.served.num_requests == 1600 and usage.served.output_tokens == 4800


def test_usage_sums_round_trip_and_reads_as_one_line():
    a = ReplicaUsage(1, 100.0, GenerationStats.total([request(50, 40.0)] * 4), 0)
    b = ReplicaUsage(1, 300.0, GenerationStats.total([request(50, 40.0)] * 12), 2)
    total = ReplicaUsage() + a + b
    assert ReplicaUsage.from_dict(total.to_dict()) == total
    assert (total.replicas, total.busy_s, total.served.num_requests, total.failed) == (2, 400.0, 16, 2)
    # 8 documents over 400 replica-seconds: 72 per replica-hour; 800 tokens over 400 s.
    assert total.line(8) == (
        "2 replicas busy 200 s each: 2.0 tokens/s generated, 72.0 documents per hour "
        "(per replica, prefill included; 16 requests, 2 failed requests)"
    )
    assert ReplicaUsage().line(3) == "replicas: no busy time on record"


def test_usage_keeps_the_largest_peak_memory_beside_the_declared_and_says_when_it_passed_it():
    a = ReplicaUsage(1, 100.0, GenerationStats.total([request(50, 40.0)] * 4), 0, 700 * 2**20, 2**30)
    b = ReplicaUsage(1, 300.0, GenerationStats.total([request(50, 40.0)] * 12), 0, 900 * 2**20, 2**30)
    total = ReplicaUsage() + a + b
    assert ReplicaUsage.from_dict(total.to_dict()) == total
    assert (total.peak_rss, total.declared_memory, total.over_memory) == (900 * 2**20, 2**30, False)
    assert total.line(8).endswith("16 requests); peak memory 0.88 GiB of 1.00 GiB declared")
    assert (total + ReplicaUsage(1, 1.0, peak_rss=2**31, declared_memory=2**30)).over_memory
    assert not ReplicaUsage(1, 1.0, peak_rss=2**31).over_memory  # nothing declared: nothing to pass
