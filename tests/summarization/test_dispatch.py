"""The dispatcher routes around replicas that die, hang or are killed by one request, on a real
local Ray cluster with stand-in replicas (no model: what a call does is read from its prompt)."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from pipeline.decoding.sampling import SamplingParams
from pipeline.summarization import dispatch
from pipeline.summarization.dispatch import NoHealthyReplica, PoisonRequest, ReplicaDispatcher
from pipeline.summarization.summarizer import RequestTimeout

pytestmark = pytest.mark.ray

KILL = 666  # a prompt holding it kills the replica that runs it
SLOW = 777  # a prompt holding it takes a second


class StandIn:
    """A replica's calls without a model: the answer is the prompt's first token."""

    def ping(self) -> int:
        return os.getpid()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams) -> dict:
        if KILL in prompt_ids:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1.0 if SLOW in prompt_ids else 0.05)
        return {"token_ids": prompt_ids[:1], "pid": os.getpid()}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)  # on 127.0.0.1: see conftest
    yield
    ray.shutdown()


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(dispatch, "POLL_S", 0.05)


def stand_ins(count: int, max_restarts: int = 10) -> list:
    import ray

    actor = ray.remote(StandIn).options(num_cpus=0, max_restarts=max_restarts, max_task_retries=0, max_concurrency=8)
    handles = [actor.remote() for _ in range(count)]
    ray.get([h.ping.remote() for h in handles])
    return handles


def pid_when_up(handle) -> int:
    """The replica's process id once it answers (a restarting one raises ActorUnavailableError)."""
    import ray

    deadline = time.monotonic() + 60
    while True:
        try:
            return ray.get(handle.ping.remote(), timeout=30)
        except ray.exceptions.ActorUnavailableError:
            assert time.monotonic() < deadline, "the replica did not come back"
            time.sleep(0.1)


def documents(dispatcher: ReplicaDispatcher, prompts: list[list[list[int]]]) -> list:
    """Each document's calls from a thread of its own, as the stage's actor runs them."""
    out: list = [None] * len(prompts)

    def run(i: int) -> None:
        try:
            out[i] = dispatcher.generate_many([(p, 4, SamplingParams()) for p in prompts[i]])
        except Exception as e:  # noqa: BLE001 — the document's outcome is what is asserted
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return out


@pytest.mark.usefixtures("ray_cluster")
def test_a_request_that_kills_every_replica_it_runs_on_fails_alone():
    import ray

    handles = stand_ins(2)
    dispatcher = ReplicaDispatcher(handles)
    prompts = [[[10 * d + c, SLOW] for c in range(3)] for d in range(6)]
    prompts[2][1] = [KILL]
    out = documents(dispatcher, prompts)
    assert isinstance(out[2], PoisonRequest) and "killed its replica" in str(out[2])
    for d in (0, 1, 3, 4, 5):
        assert [r["token_ids"] for r in out[d]] == [[10 * d + c] for c in range(3)], out[d]
    # Three deaths at most (one in a batch, two alone), and both replicas serve again.
    assert sum(r.dead for r in dispatcher.replicas) == 0
    assert all(pid_when_up(h) for h in handles)
    for h in handles:
        ray.kill(h)


@pytest.mark.usefixtures("ray_cluster")
def test_a_hung_replica_is_routed_around_and_rejoins_when_it_answers():
    import ray

    handles = stand_ins(2)
    pid = ray.get(handles[0].ping.remote())
    dispatcher = ReplicaDispatcher(handles, timeout=RequestTimeout(base_s=2.0, per_token_s=0.0))
    os.kill(pid, signal.SIGSTOP)
    try:
        out = documents(dispatcher, [[[d, c] for c in range(4)] for d in range(4)])
        assert [[r["token_ids"] for r in doc] for doc in out] == [[[d]] * 4 for d in range(4)]
        assert {r["pid"] for doc in out for r in doc} == {ray.get(handles[1].ping.remote())}
        assert not dispatcher.replicas[0].usable
    finally:
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not dispatcher.replicas[0].usable and time.monotonic() < deadline:
        dispatcher.generate_many([([1], 4, SamplingParams())])
    assert dispatcher.replicas[0].usable  # it answered its ping: back in the rotation
    for h in handles:
        ray.kill(h)


@pytest.mark.usefixtures("ray_cluster")
def test_replicas_killed_while_requests_run_lose_no_request():
    import ray

    handles = stand_ins(2)
    dispatcher = ReplicaDispatcher(handles)
    prompts = [[[d, c, SLOW] for c in range(4)] for d in range(4)]
    killer_done = threading.Event()

    def kill_replica_zero_twice() -> None:
        for _ in range(2):
            time.sleep(0.5)
            os.kill(pid_when_up(handles[0]), signal.SIGKILL)
        killer_done.set()

    killer = threading.Thread(target=kill_replica_zero_twice)
    killer.start()
    out = documents(dispatcher, prompts)
    killer.join()
    assert killer_done.is_set()
    assert [[r["token_ids"] for r in doc] for doc in out] == [[[d]] * 4 for d in range(4)]
    for h in handles:
        ray.kill(h)


@pytest.mark.usefixtures("ray_cluster")
def test_with_every_replica_dead_a_request_fails_at_once():
    handles = stand_ins(2, max_restarts=0)
    dispatcher = ReplicaDispatcher(handles)
    started = time.monotonic()
    with pytest.raises(NoHealthyReplica, match="every replica"):
        dispatcher.generate_many(
            [([KILL], 4, SamplingParams()), ([1], 4, SamplingParams()), ([KILL], 4, SamplingParams())]
        )
    assert time.monotonic() - started < 30
