"""Replica actors under load: one replica takes many concurrent requests into one continuous
batch, a replica killed with many requests in flight is restarted by Ray, its requests retried
by the dispatcher, and every output is what an undisturbed run gives; a replica whose device
goes bad exits itself to be restarted."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pipeline.decoding.sampling import SamplingParams
from tests.builders import REPO, make_tiny_chat_checkpoint

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
    from pipeline.summarization.dispatch import ReplicaDispatcher

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
    # Ray does not retry a dead replica's calls (MAX_TASK_RETRIES is 0): the dispatcher does.
    dispatcher = ReplicaDispatcher([replica])
    answers = []
    caller = threading.Thread(
        target=lambda: answers.extend(dispatcher.generate_many([(i, 150, SamplingParams()) for i in work]))
    )
    caller.start()
    # Kill it while it decodes: a fixed sleep let a fast machine finish every request first, and
    # then the kill raced the next call. Once a request is in flight and some are unserved, the
    # retried ones can only come back from the restarted replica.
    deadline = time.monotonic() + 120
    while (usage := ray.get(replica.usage.remote()))["busy_s"] <= 0.05 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert usage["served"]["num_requests"] < len(work), "every request finished before the kill"
    ray.kill(replica, no_restart=False)
    caller.join(timeout=300)
    assert [out["token_ids"] for out in answers] == expected
    deadline = time.monotonic() + 60
    while (info := ray.get(replica.info.remote()))["pid"] == first_pid and time.monotonic() < deadline:
        time.sleep(0.05)  # the kill is asynchronous: a call may still reach the old process
    assert info["pid"] != first_pid and info["max_batch"] == 4  # restarted, and batching again
    ray.kill(replica)


@pytest.mark.usefixtures("ray_cluster")
def test_a_replica_with_a_sticky_device_fault_exits_and_is_restarted(tmp_path):
    """After a fault that leaves its device unusable (here injected: tests/faults), a replica
    that stayed up would fail every later request. It exits instead, Ray restarts it, and the
    dispatcher sends its requests again: every answer is the undisturbed one."""
    import ray

    from actors.replica import MAX_RESTARTS, MAX_TASK_RETRIES, EngineReplica
    from pipeline.engine import EngineConfig, StrategyConfig
    from pipeline.summarization.dispatch import ReplicaDispatcher

    model = make_tiny_chat_checkpoint(tmp_path / "model", num_hidden_layers=2)
    config = EngineConfig(model=str(model), dtype="fp32")
    work = prompts(3)
    alone = EngineReplica(config, StrategyConfig("ar"), 1, max_batch=1)
    expected = [alone.generate(ids, 20, SamplingParams())["token_ids"] for ids in work]
    flag = tmp_path / "fault-fired"
    replica = (
        ray.remote(EngineReplica)
        .options(
            num_cpus=1,
            max_restarts=MAX_RESTARTS,
            max_task_retries=MAX_TASK_RETRIES,
            max_concurrency=9,
            runtime_env={"env_vars": fault_env({"device_fault_once": str(flag)})},
        )
        .remote(config, StrategyConfig("ar"), 1, 4)
    )
    first_pid = ray.get(replica.ping.remote())
    answers = ReplicaDispatcher([replica]).generate_many([(ids, 20, SamplingParams()) for ids in work])
    assert flag.exists(), "the fault never fired"
    assert [a["token_ids"] for a in answers] == expected
    assert ray.get(replica.ping.remote()) != first_pid  # it exited and came back
    ray.kill(replica)


def fault_env(faults: dict) -> dict[str, str]:
    """The environment that makes a replica's process inject `faults` (tests/faults/sitecustomize.py)."""
    import json
    import os

    path = os.pathsep.join(p for p in (str(REPO / "tests" / "faults"), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, "KNAPSPEC_FAULTS": json.dumps(faults)}
