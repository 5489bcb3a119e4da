"""Replica actors under load: one replica takes many concurrent requests into one continuous
batch, and a replica killed with many requests in flight is restarted by Ray, its requests
retried, and every output is what an undisturbed run gives."""

from __future__ import annotations

import time

import pytest
import torch

from pipeline.decoding.sampling import SamplingParams
from tests.builders import make_tiny_chat_checkpoint

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)  # on 127.0.0.1: see conftest
    yield
    ray.shutdown()


def prompts(count: int) -> list[list[int]]:
    return [
        torch.randint(300, 40000, (40 + 25 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        for i in range(count)
    ]


@pytest.mark.usefixtures("ray_cluster")
def test_a_killed_replica_with_many_requests_in_flight_gives_the_same_outputs(tmp_path):
    import ray

    from actors.replica import MAX_RESTARTS, MAX_TASK_RETRIES, EngineReplica
    from pipeline.engine import EngineConfig, StrategyConfig

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=4)
    config = EngineConfig(model=str(model), dtype="fp32")
    strategy = StrategyConfig("lookup")
    work = prompts(6)
    alone = EngineReplica(config, strategy, 1, max_batch=1)
    expected = [alone.generate(ids, 150, SamplingParams())["token_ids"] for ids in work]
    replica = (
        ray.remote(EngineReplica)
        .options(num_cpus=1, max_restarts=MAX_RESTARTS, max_task_retries=MAX_TASK_RETRIES, max_concurrency=13)
        .remote(config, strategy, 1, 4)
    )
    first_pid = ray.get(replica.info.remote())["pid"]
    running = [replica.generate.remote(ids, 150, SamplingParams()) for ids in work]
    # Kill it while it decodes: a fixed sleep let a fast machine finish every request first, and
    # then the kill raced the next call. Once a request is in flight and some are unserved, the
    # retried ones can only come back from the restarted replica.
    deadline = time.monotonic() + 120
    while (usage := ray.get(replica.usage.remote()))["busy_s"] <= 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert usage["served"]["num_requests"] < len(work), "every request finished before the kill"
    ray.kill(replica, no_restart=False)
    assert [out["token_ids"] for out in ray.get(running, timeout=300)] == expected
    deadline = time.monotonic() + 60
    while (info := ray.get(replica.info.remote()))["pid"] == first_pid and time.monotonic() < deadline:
        time.sleep(0.05)  # the kill is asynchronous: a call may still reach the old process
    assert info["pid"] != first_pid and info["max_batch"] == 4  # restarted, and batching again
    ray.kill(replica)
