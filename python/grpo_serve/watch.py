"""Following a job's WatchJob stream across dropped connections.

The learner keeps no history of its stream: a new WatchJob starts with a snapshot of the job
(its step and the last step's metrics), then sends each step as it happens. So after a dropped
connection :class:`StepStream` watches again, skips the steps it already yielded, yields the last
step from the snapshot when it has not seen it, and records the steps in between, which no
learner can send again, in ``missed_steps``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from grpo_serve._wire import learner_pb2
from grpo_serve.errors import RpcError, from_grpc
from grpo_serve.job import JobStatus, StepRecord, step_record

# Deadline of a whole WatchJob stream (services/learner_client.h kDefaultWatchTimeoutSeconds).
DEFAULT_WATCH_TIMEOUT = 7 * 24 * 3600.0
# How long the stream may stay broken before the watch gives up.
DEFAULT_RECONNECT_TIMEOUT = 60.0
# Waits between attempts to watch again: the first, doubled up to the last.
_RETRY_FIRST_S = 0.1
_RETRY_MAX_S = 2.0
# What a broken stream ends with: the connection dropped or the learner restarting or stopping
# (UNAVAILABLE), the learner dropping a watcher that fell behind (RESOURCE_EXHAUSTED), a stream
# reset by a proxy (INTERNAL).
RESUMABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.INTERNAL})


class StepStream(Iterator[StepRecord]):
    """An iterator over a job's step records until the job ends.

    Each record is the step's metrics (TRL names) and "step", as ``grpo watch --json`` prints
    them; steps are strictly increasing, none twice. Like ``grpo watch`` it starts with the next
    step (the snapshot that opens the first stream only sets where it starts); that first stream
    opens when the StepStream is made, so its start is then, not at the first next().

    After iteration: ``state`` is the final state (done, cancelled, failed), ``missed_steps``
    the steps taken while the stream was broken that could not be replayed, ``reconnects`` how
    often it watched again. A learner that restarted from a checkpoint redoes steps already
    yielded; they are not yielded again. RpcError when the stream stays broken for `reconnect_timeout`
    seconds, on any other error, or at the `timeout` deadline. Not thread-safe, except close().
    """

    def __init__(self, open_call: Callable[[float], Any], *, timeout: float = DEFAULT_WATCH_TIMEOUT,
                 reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
                 on_status: Callable[[JobStatus], None] | None = None) -> None:
        if not timeout > 0 or not reconnect_timeout > 0:
            raise ValueError("timeout and reconnect_timeout must be > 0")
        self._open_call = open_call  # seconds left -> a WatchJob call (an iterator of JobEvent)
        self._deadline = time.monotonic() + timeout
        self._reconnect_timeout = reconnect_timeout
        self._on_status = on_status
        self._lock = threading.Lock()
        self._call: Any = None
        self._closed = False
        self.state: str | None = None
        self.status: JobStatus | None = None
        self.missed_steps: list[int] = []
        self.reconnects = 0
        # The first WatchJob call opens here, not at the first next(): the learner's snapshot,
        # which sets where the stream starts, is taken now, so steps taken while the caller sets
        # up (a dashboard's import can take seconds) are still yielded.
        self._call = open_call(timeout)
        self._events = self._run()

    def __iter__(self) -> StepStream:
        return self

    def __next__(self) -> StepRecord:
        return next(self._events)

    def close(self) -> None:
        """Ends the stream (from any thread): the iteration stops, ``state`` stays None."""
        with self._lock:
            self._closed = True
            call = self._call
        if call is not None:
            call.cancel()

    def __enter__(self) -> StepStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _seen(self, status: JobStatus) -> None:
        self.status = status
        if self._on_status is not None:
            self._on_status(status)

    def _run(self) -> Iterator[StepRecord]:
        last_step: int | None = None  # the newest step yielded (or where the watch started)
        broken_since: float | None = None
        wait = _RETRY_FIRST_S
        resumed = False
        while True:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise RpcError("DEADLINE_EXCEEDED", "the watch's deadline passed",
                               context="WatchJob")
            with self._lock:
                if self._closed:
                    return
                if self._call is None:
                    self._call = self._open_call(left)
                call = self._call
            try:
                first = True
                for event in call:
                    broken_since, wait = None, _RETRY_FIRST_S
                    status = JobStatus.from_proto(event.job)
                    self._seen(status)
                    if last_step is None:
                        last_step = status.global_step  # the first watch starts here
                    if event.metrics:
                        if event.step > last_step:
                            if event.step > last_step + 1 and resumed:
                                self.missed_steps.extend(range(last_step + 1, event.step))
                            last_step = event.step
                            yield step_record(event.metrics, event.step)
                    elif (first and resumed and status.global_step > last_step
                          and status.last_metrics):
                        # Steps went by while the stream was broken: the snapshot holds the last.
                        self.missed_steps.extend(range(last_step + 1, status.global_step))
                        last_step = status.global_step
                        yield step_record(status.last_metrics, status.global_step)
                    first = False
                    if not event.metrics and status.terminal:
                        self.state = status.state
                        return
                # The stream ended without the job's end: watch again.
                code: grpc.StatusCode | None = grpc.StatusCode.UNAVAILABLE
                error: grpc.RpcError | None = None
            except grpc.RpcError as e:
                code, error = e.code(), e
            finally:
                # Also when the consumer stops early (GeneratorExit): no stream left open.
                call.cancel()
                with self._lock:
                    self._call = None
            with self._lock:
                if self._closed:
                    return
            if code not in RESUMABLE:
                assert error is not None
                raise from_grpc(error, "WatchJob")
            now = time.monotonic()
            broken_since = broken_since if broken_since is not None else now
            if now - broken_since > self._reconnect_timeout:
                details = error.details() if error is not None else "the stream ended early"
                raise RpcError(code.name if code else "UNAVAILABLE",
                               f"{details} (no stream for {self._reconnect_timeout:g} s)",
                               context="WatchJob")
            time.sleep(min(wait, max(0.0, self._deadline - now)))
            wait = min(2 * wait, _RETRY_MAX_S)
            self.reconnects += 1
            resumed = True


def open_watch(stub: Any, metadata: tuple[tuple[str, str], ...]) -> Callable[[float], Any]:
    """The open_call of a StepStream on `stub` (a LearnerServiceStub)."""

    def call(seconds: float) -> Any:
        return stub.WatchJob(learner_pb2.WatchJobRequest(), timeout=seconds, metadata=metadata)

    return call
