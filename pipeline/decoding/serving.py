"""A continuous batcher driven by one background thread, for callers on many threads.

A replica actor takes many concurrent `generate` calls (Ray runs each in a thread of the
actor); every call submits its request here and waits on a future, while the one decode
thread steps the batch: the model only ever runs on that thread.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from pipeline.decoding.loop import GenerationResult
from pipeline.decoding.scheduler import ContinuousBatcher, GenerationRequest

logger = logging.getLogger(__name__)


class BatchingThread:
    def __init__(self, batcher: ContinuousBatcher, name: str = "decode") -> None:
        self.batcher = batcher
        self._futures: dict[int, Future] = {}
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Future:
        """The future of a request's GenerationResult; a request that could never run fails at once."""
        future: Future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("this batcher is closed")
            try:
                ticket = self.batcher.submit(request)
            except Exception as e:
                future.set_exception(e)
                return future
            self._futures[ticket] = future
            self._wake.notify()
        return future

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.submit(request).result()

    def close(self) -> None:
        """Stop the thread; requests not finished fail."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._closed and not self.batcher.num_requests:
                    self._wake.wait()
                if self._closed:
                    break
            # The lock is not held while the model runs: callers submit during a step.
            try:
                finished = self.batcher.step()
            except Exception as e:  # a bug in the batcher itself: fail everything, keep serving
                logger.exception("A batch step failed")
                self._fail_all(e)
                continue
            with self._wake:
                for done in finished:
                    future = self._futures.pop(done.ticket)
                    if done.error is not None:
                        future.set_exception(done.error)
                    else:
                        future.set_result(done.result)
        self._fail_all(RuntimeError("the batcher was closed before this request finished"))

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            futures, self._futures = self._futures, {}
            self.batcher.abort()
        for future in futures.values():
            future.set_exception(error)
