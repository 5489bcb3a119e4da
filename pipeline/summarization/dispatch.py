"""Requests to model replicas, routed around replicas that die, hang or go bad.

The summarize stage's actors send each request to a healthy replica with the fewest requests
in flight from their process. Ray restarts a dead replica (actors/replica.py) but does not
retry its calls: this module does, knowing what Ray does not.

- A call that dies with its replica is run again elsewhere. The replica is skipped until it
  answers a ping (a restarted one rejoins; one whose restarts are spent never does).
- A call past its timeout (`RequestTimeout`, from its size) marks its replica hung: every call
  on it is sent elsewhere at once, and the replica rejoins when it answers again.
- A request that was running when its replica died is a suspect: it runs again alone on a
  replica (nothing else this process sends goes there meanwhile), elsewhere where it can. A
  suspect that kills the replica it ran alone on `POISON_DEATHS` times is its own error row
  (`PoisonRequest`) rather than the end of every replica's restarts.
- With no replica healthy for `NO_REPLICA_GRACE_S`, or every one dead, a request fails for
  the infrastructure (`NoHealthyReplica`), as does one that timed out `MAX_TIMEOUTS` times.

Isolation is per process: suspects of two stage actors may still meet on one replica.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray

from pipeline.decoding.sampling import SamplingParams
from pipeline.errors import ConfigError, RowError
from pipeline.summarization.summarizer import DEFAULT_REQUEST_TIMEOUT, RequestTimeout

logger = logging.getLogger(__name__)

POISON_DEATHS = 2  # deaths of a replica running the request alone before the request is blamed
MAX_TIMEOUTS = 2  # timeouts of one request before it fails for the infrastructure
NO_REPLICA_GRACE_S = 600.0  # a replica restarts by reloading its model: minutes on a large one
POLL_S = 0.5  # how often a waiting request looks at its replicas' health

Call = tuple[list[int], int, SamplingParams]  # a replica's generate(prompt_ids, max_new_tokens, params)


class PoisonRequest(RowError):
    """A request whose replica died every time it ran it alone: its document's error row."""


class NoHealthyReplica(RuntimeError):
    """No replica could take a request: all dead, or none answering for the grace period."""


class RequestTimedOut(RuntimeError):
    """A request that outlived its timeout on every replica it was sent to."""


@dataclass
class _Replica:
    handle: object
    name: str
    in_flight: int = 0
    down_since: float | None = None  # when it was judged dead or hung; None: healthy
    hung: bool = False  # judged down by a timeout, not by a death
    dead: bool = False  # its restarts are spent: it never answers again
    reserved: bool = False  # held for a suspect: nothing else is sent to it
    probe: object = None  # a ping in flight while it is down

    @property
    def usable(self) -> bool:
        return self.down_since is None and not self.dead


@dataclass
class _Request:
    index: int
    call: Call
    timeout_s: float
    suspect: bool = False  # was running when a replica died
    deaths_alone: int = 0
    timeouts: int = 0
    tried: list[int] = field(default_factory=list)  # replicas it died or timed out on
    reservation: int | None = None  # the replica a suspect waits to have to itself
    waiting_since: float | None = None  # when it last found no replica to go to
    # While in flight:
    replica: int | None = None
    sent_at: float = 0.0
    alone: bool = False


class ReplicaDispatcher:
    """Sends requests to the healthy replica with the fewest requests in flight from this process."""

    def __init__(self, replicas: list, progress=None, timeout: RequestTimeout = DEFAULT_REQUEST_TIMEOUT) -> None:
        """`replicas`: actor handles, or the names of named replica actors (ReplicaPool.names).
        `progress`: the run's progress actor (actors/progress.py), told of requests in flight."""
        if not replicas:
            raise ConfigError("no replicas to send requests to")
        self.replicas = [
            _Replica(ray.get_actor(r) if isinstance(r, str) else r, r if isinstance(r, str) else f"replica {i}")
            for i, r in enumerate(replicas)
        ]
        self.progress = progress
        self.timeout = timeout
        self._lock = threading.Lock()

    def generate_many(self, calls: list[Call]) -> list[dict]:
        """Every call's result, in order; raises the first request's error that no retry mends
        (the replica's own exception for what the request asked, or this module's)."""
        requests = [_Request(i, c, self.timeout.seconds(len(c[0]), c[1])) for i, c in enumerate(calls)]
        pending = list(requests)
        results: list[dict | None] = [None] * len(calls)
        running: dict = {}  # ObjectRef -> _Request
        self._report(len(calls))
        try:
            while pending or running:
                pending = self._send(pending, running)
                if not running:
                    time.sleep(POLL_S)
                    continue
                ready, _ = ray.wait(list(running), num_returns=1, timeout=POLL_S)
                for ref in ready:
                    request = running.pop(ref)
                    outcome = self._collect(request, ref)
                    if outcome is None:
                        pending.append(request)
                    else:
                        results[request.index] = outcome
                pending += self._overdue(running)
        finally:
            for ref, request in running.items():  # an error ends the document: its other calls go
                self._abandon(request, ref)
            with self._lock:
                for request in requests:
                    if request.reservation is not None:
                        self.replicas[request.reservation].reserved = False
                        request.reservation = None
            self._report(-len(calls))
        return results

    # ------------------------------------------------------------------ sending

    def _send(self, pending: list[_Request], running: dict) -> list[_Request]:
        """Send what can go now; returns what must wait (no usable replica, or a suspect
        waiting for its replica to empty)."""
        left = []
        with self._lock:
            self._probe_down_replicas()
            for request in pending:
                index = self._pick_for_suspect(request) if request.suspect else self._pick()
                if index is None:
                    self._check_waiting(request)
                    left.append(request)
                    continue
                replica = self.replicas[index]
                replica.in_flight += 1
                request.replica, request.sent_at, request.alone = index, time.monotonic(), request.suspect
                request.waiting_since = None
                running[replica.handle.generate.remote(*request.call)] = request
        return left

    def _pick(self) -> int | None:
        usable = [i for i, r in enumerate(self.replicas) if r.usable and not r.reserved]
        return min(usable, key=lambda i: self.replicas[i].in_flight, default=None)

    def _pick_for_suspect(self, request: _Request) -> int | None:
        """A suspect runs alone: it reserves a replica (one it has not failed on, where there
        is one), and goes once nothing else is running there."""
        if request.reservation is not None and not self.replicas[request.reservation].usable:
            self.replicas[request.reservation].reserved = False
            request.reservation = None
        if request.reservation is None:
            free = [i for i, r in enumerate(self.replicas) if r.usable and not r.reserved]
            fresh = [i for i in free if i not in request.tried] or free
            if not fresh:
                return None
            request.reservation = min(fresh, key=lambda i: self.replicas[i].in_flight)
            self.replicas[request.reservation].reserved = True
        replica = self.replicas[request.reservation]
        if replica.in_flight:
            return None
        index, request.reservation = request.reservation, None
        return index  # still reserved while it runs alone: released when it returns (_returned)

    def _check_waiting(self, request: _Request) -> None:
        now = time.monotonic()
        if all(r.dead for r in self.replicas):
            raise NoHealthyReplica(f"every replica ({len(self.replicas)}) died and used up its restarts")
        if any(r.usable for r in self.replicas):
            request.waiting_since = None  # a healthy one is busy (a suspect's reservation): not a fault
            return
        request.waiting_since = request.waiting_since or now
        if now - request.waiting_since > NO_REPLICA_GRACE_S:
            raise NoHealthyReplica(f"no replica answered for {NO_REPLICA_GRACE_S:.0f} s")

    # ------------------------------------------------------------------ results

    def _collect(self, request: _Request, ref) -> dict | None:
        """The call's result, or None when it must run again; raises when it must not."""
        self._returned(request)
        replica = self.replicas[request.replica]
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            with self._lock:
                self._mark_down(replica, dead=isinstance(e, ray.exceptions.ActorDiedError))
            if isinstance(e, ray.exceptions.ActorUnavailableError) and "restarting" in str(e):
                return None  # sent while another caller's request had it down: not this one's doing
            request.tried.append(request.replica)
            if request.alone:
                request.deaths_alone += 1
                if request.deaths_alone >= POISON_DEATHS:
                    raise PoisonRequest(
                        f"the request killed its replica each of the {request.deaths_alone} times it ran alone "
                        f"({len(request.call[0])} prompt tokens); the job went on without it"
                    ) from e
            logger.warning(
                "%s died with a request of %d prompt tokens in flight (%s); sending it again, alone",
                replica.name, len(request.call[0]), type(e).__name__,
            )  # fmt: skip
            request.suspect = True
            return None
        except ray.exceptions.RayTaskError:
            raise  # the replica ran it and it failed: the request's own error (its row's)

    def _overdue(self, running: dict) -> list[_Request]:
        """Calls past their timeout (their replica is then judged hung) and every call on a
        replica judged down after it was sent: taken back, to be sent again."""
        now = time.monotonic()
        back = []
        for ref, request in list(running.items()):
            replica = self.replicas[request.replica]
            if now - request.sent_at > request.timeout_s:
                request.timeouts += 1
                request.tried.append(request.replica)
                logger.warning(
                    "%s has not answered a request of %d prompt tokens in %.0f s: judged hung, its requests go "
                    "elsewhere until it answers again", replica.name, len(request.call[0]), request.timeout_s,
                )  # fmt: skip
                with self._lock:
                    self._mark_down(replica, hung=True)
                if request.timeouts >= MAX_TIMEOUTS:
                    del running[ref]
                    self._abandon(request, ref)
                    raise RequestTimedOut(
                        f"the request ({len(request.call[0])} prompt tokens) timed out {request.timeouts} times "
                        f"after {request.timeout_s:.0f} s (--request-timeout)"
                    )
            elif not replica.hung or replica.down_since < request.sent_at:
                continue  # a dead replica's calls come back with their own errors: suspects, each
            del running[ref]
            self._abandon(request, ref)
            back.append(request)
        return back

    def _returned(self, request: _Request) -> None:
        with self._lock:
            replica = self.replicas[request.replica]
            replica.in_flight -= 1
            if request.alone:
                replica.reserved = False

    def _abandon(self, request: _Request, ref) -> None:
        self._returned(request)
        try:
            ray.cancel(ref)  # a queued call is dropped; a running one finishes unread
        except Exception as e:  # noqa: BLE001 — cancelling is a courtesy to the replica
            logger.debug("Could not cancel a call on %s: %s", self.replicas[request.replica].name, e)

    # ------------------------------------------------------------------ health

    def _mark_down(self, replica: _Replica, dead: bool = False, hung: bool = False) -> None:
        if replica.down_since is None:
            replica.down_since, replica.hung = time.monotonic(), hung
        replica.dead = replica.dead or dead

    def _probe_down_replicas(self) -> None:
        """Ping each replica judged down; one that answers rejoins."""
        for replica in self.replicas:
            if replica.usable or replica.dead:
                continue
            if replica.probe is None:
                replica.probe = replica.handle.ping.remote()
                continue
            ready, _ = ray.wait([replica.probe], timeout=0)
            if not ready:
                continue
            probe, replica.probe = replica.probe, None
            try:
                ray.get(probe)
            except ray.exceptions.ActorDiedError:
                replica.dead = True
                logger.warning("%s is dead: its restarts are spent", replica.name)
            except ray.exceptions.RayError:
                pass  # restarting still: pinged again next time
            else:
                down_s = time.monotonic() - replica.down_since
                logger.info("%s answers again after %.0f s: it rejoins", replica.name, down_s)
                replica.down_since, replica.hung = None, False

    def _report(self, delta: int) -> None:
        if self.progress is not None:
            self.progress.requests.remote(delta)  # not awaited: progress never slows the work
