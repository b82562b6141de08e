"""The learner's client: submit a dataset, follow, watch, query and cancel its job.

The Python counterpart of ``grpo submit/watch/status/cancel`` (services/cli/cli_client.cc,
services/learner_client.cc), over the same wire (proto/grpo/v1/learner.proto). Every call has a
deadline; every call carries the shared token.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from grpo_serve import dataset as ds
from grpo_serve._auth import read_pem, resolve_token
from grpo_serve._wire import CHANNEL_OPTIONS, auth_metadata, learner_pb2, learner_pb2_grpc
from grpo_serve.errors import RpcError, from_grpc
from grpo_serve.job import JobResult, JobStatus
from grpo_serve.watch import (DEFAULT_RECONNECT_TIMEOUT, DEFAULT_WATCH_TIMEOUT, StepStream,
                              open_watch)

if TYPE_CHECKING:
    from tqdm import tqdm

PathLike = str | os.PathLike[str]

# Deadline of one unary call and of a whole upload (services/learner_client.h
# kDefaultCallTimeoutSeconds).
DEFAULT_CALL_TIMEOUT = 60.0
# SubmitDataset message payload (a line is never split), as SubmitLines sends it.
SUBMIT_CHUNK_BYTES = 1 << 20
# Uploads at least this large show a progress bar unless progress=False.
PROGRESS_MIN_BYTES = 4 << 20
# What a retried upload may have met: a dropped connection or a restarting learner
# (UNAVAILABLE), an upload that broke off, which stored nothing (ABORTED).
_RETRIED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED})
_RETRY_FIRST_S = 0.5


@dataclass(frozen=True)
class Job:
    """The learner's job, as a handle: what submit() returns, and what watch(), follow() and
    report() take. A learner runs one job over every dataset submitted to it; `dataset_id`,
    `prompt_count` and `created` describe the submission (empty when the handle came from
    Client.job())."""

    client: Client
    dataset_id: str = ""
    prompt_count: int = 0
    created: bool = False  # False: the key was seen before and nothing was added
    idempotency_key: str = ""

    def status(self, timeout: float | None = None) -> JobStatus:
        return self.client.status(timeout=timeout)

    def cancel(self, reason: str = "", timeout: float | None = None) -> JobStatus:
        return self.client.cancel(reason, timeout=timeout)

    def watch(self, **kwargs: Any) -> StepStream:
        return self.client.watch(self, **kwargs)

    def follow(self, **kwargs: Any) -> JobResult:
        from grpo_serve.follow import follow

        return follow(self, **kwargs)


class Client:
    """A connection to a learner's LearnerService.

    `address` is HOST:PORT; `token` (or `token_file`, as ``--auth_token_file``) the shared token;
    `tls_ca` a PEM CA file (or its bytes) to connect with TLS and verify the learner against, as
    ``--tls_ca_file``; `timeout` the deadline of each call (seconds). The channel connects
    lazily: an unreachable learner is the first call's error. Thread-safe.
    """

    def __init__(self, address: str = "127.0.0.1:50051", *, token: str | None = None,
                 token_file: PathLike | None = None, tls_ca: PathLike | bytes | None = None,
                 timeout: float = DEFAULT_CALL_TIMEOUT) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.address = address
        self.timeout = timeout
        self._metadata = auth_metadata(resolve_token(token, token_file))
        if tls_ca is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=read_pem(tls_ca))
            self._channel = grpc.secure_channel(address, creds, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = learner_pb2_grpc.LearnerServiceStub(self._channel)

    def close(self) -> None:
        """Closes the channel; calls in flight fail."""
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Client({self.address!r})"

    # --- The job.

    def job(self) -> Job:
        """A handle on the learner's job without submitting anything."""
        return Job(self)

    def status(self, timeout: float | None = None) -> JobStatus:
        """The job's state (GetJob), as ``grpo status``."""
        return JobStatus.from_proto(self._unary("GetJob", learner_pb2.GetJobRequest(), timeout))

    def cancel(self, reason: str = "", timeout: float | None = None) -> JobStatus:
        """Ends the job as cancelled (CancelJob); `reason` goes into its message."""
        request = learner_pb2.CancelJobRequest(reason=reason)
        return JobStatus.from_proto(self._unary("CancelJob", request, timeout))

    def watch(self, job: Job | None = None, *, timeout: float = DEFAULT_WATCH_TIMEOUT,
              reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT,
              on_status: Callable[[JobStatus], None] | None = None) -> StepStream:
        """An iterator of the job's step records, from the next step until the job ends,
        watching again after a dropped connection (see StepStream). `job` documents which job
        (a learner has one); `on_status` sees every status the stream brings."""
        self._check_job(job)
        return StepStream(open_watch(self._stub, self._metadata), timeout=timeout,
                          reconnect_timeout=reconnect_timeout, on_status=on_status)

    def follow(self, job: Job | None = None, **kwargs: Any) -> JobResult:
        """grpo_serve.follow(job): a live progress bar and the reward curve until the job ends."""
        from grpo_serve.follow import follow

        self._check_job(job)
        return follow(job if job is not None else self.job(), **kwargs)

    # --- Datasets.

    def submit(self, dataset: Any, *, name: str | None = None, idempotency_key: str | None = None,
               split: str | None = None, validate: bool = True, progress: bool | None = None,
               timeout: float | None = None, retries: int = 3) -> Job:
        """Uploads `dataset` (see grpo_serve.dataset.to_lines: a datasets.Dataset, a DatasetDict
        with `split`, a list of dicts, a JSON Lines or parquet path) as one SubmitDataset call:
        the learner stores it whole or not at all.

        The rows are checked first with the learner's own rules (DatasetError with its
        message; `validate=False` leaves that to the learner). The idempotency key defaults to
        the content's (grpo submit's), so resubmitting the same rows adds nothing and a retry is
        safe: a dropped connection or a broken-off upload is retried up to `retries` times. A
        progress bar (tqdm, on stderr) shows for uploads of PROGRESS_MIN_BYTES or more, or as
        `progress` says. `timeout` is the deadline of each attempt. RpcError with the learner's
        status otherwise (e.g. ALREADY_EXISTS for a key used for other rows).
        """
        if retries < 0:
            raise ValueError("retries must be >= 0")
        lines = ds.to_lines(dataset, split=split)
        if validate:
            ds.validate_lines(lines.lines)
        key = idempotency_key if idempotency_key else ds.content_key(lines.lines)
        show = progress if progress is not None else lines.total_bytes >= PROGRESS_MIN_BYTES
        bar = _progress_bar(lines.total_bytes) if show else None
        try:
            for attempt in range(retries + 1):
                if bar is not None:
                    bar.reset(total=lines.total_bytes)
                try:
                    response = self._stub.SubmitDataset(
                        _submit_requests(lines.lines, key, name or lines.name, bar),
                        timeout=self._timeout(timeout), metadata=self._metadata)
                    break
                except grpc.RpcError as e:
                    if e.code() not in _RETRIED or attempt == retries:
                        raise from_grpc(e, "SubmitDataset") from None
                    time.sleep(_RETRY_FIRST_S * 2**attempt)
        finally:
            if bar is not None:
                bar.close()
        return Job(self, response.dataset_id, response.prompt_count, response.created, key)

    # --- Helpers.

    def _timeout(self, timeout: float | None) -> float:
        t = self.timeout if timeout is None else timeout
        if not t > 0:
            raise ValueError("timeout must be > 0")
        return t

    def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        try:
            return getattr(self._stub, method)(request, timeout=self._timeout(timeout),
                                               metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_grpc(e, method) from None

    def _check_job(self, job: Job | None) -> None:
        if job is not None and job.client is not self:
            raise ValueError("that job belongs to another Client")


def _progress_bar(total: int) -> tqdm[Any]:
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="upload",
                file=sys.stderr, leave=True)


def _submit_requests(lines: list[bytes], key: str, name: str,
                     bar: tqdm[Any] | None) -> Iterator[Any]:
    """The upload's messages: the first carries the key and the name, the last is marked last
    with the number of lines (without it the learner stores nothing)."""
    first = True
    chunks = list(ds.iter_chunks(lines, SUBMIT_CHUNK_BYTES))
    for i, chunk in enumerate(chunks):
        msg = learner_pb2.SubmitDatasetRequest(lines=chunk)
        if first:
            msg.idempotency_key = key
            msg.name = name
            first = False
        if i + 1 == len(chunks):
            msg.last = True
            msg.total_lines = len(lines)
        yield msg
        if bar is not None:
            bar.update(sum(len(line) + 1 for line in chunk))


__all__ = ["Client", "Job", "RpcError", "DEFAULT_CALL_TIMEOUT"]
