"""The errors grpo_serve raises.

Every error of a call to the learner is an :class:`RpcError` whose ``str`` is the learner's status
as the ``grpo`` commands print it (``INVALID_ARGUMENT: dataset line 3: ...``).
"""

from __future__ import annotations

import grpc


class GrpoServeError(Exception):
    """Base class of every error grpo_serve raises on purpose."""


class DatasetError(GrpoServeError, ValueError):
    """A dataset the learner would refuse, found before anything was sent.

    The message is the learner's own for the same rows (``dataset line N: ...``), except inside
    the parentheses of ``not valid JSON (...)``, which name Python's parser's complaint.
    """


class RpcError(GrpoServeError):
    """A call to the learner failed: ``code`` is the gRPC status name, ``details`` its message."""

    def __init__(self, code: str, details: str, *, context: str = "") -> None:
        self.code = code
        self.details = details
        self.context = context
        super().__init__(f"{context}: {code}: {details}" if context else f"{code}: {details}")


def from_grpc(error: grpc.RpcError, context: str = "") -> RpcError:
    """The RpcError of a failed grpcio call (a grpc.Call carries code() and details())."""
    code = error.code() if hasattr(error, "code") else None
    details = error.details() if hasattr(error, "details") else None
    name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return RpcError(name, details or str(error), context=context)
