"""What serve_rewards and serve_environment share on the serving side: the bearer-token check
before a call's handler runs, which hosts count as loopback (no token needed there), and the
handle of a running server."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any, Self

import grpc

# Seconds a stopping server gives the calls (or episodes) in flight.
DEFAULT_STOP_GRACE = 2.0


class TokenInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]  # grpcio has no stubs
    """Refuses a call without `authorization: Bearer <token>` before its handler runs.
    `make_handler` is grpc's handler factory of the service's one kind of method (e.g.
    grpc.unary_unary_rpc_method_handler); the refusal is UNAUTHENTICATED."""

    def __init__(self, token: str, make_handler: Callable[..., Any]) -> None:
        self._want = ("Bearer " + token).encode()

        def refuse(message: str) -> grpc.RpcMethodHandler:
            def abort(request: Any, context: grpc.ServicerContext) -> Any:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

            return make_handler(abort)

        self._missing = refuse("missing authorization metadata")
        self._bad = refuse("bad token")

    def intercept_service(self, continuation: Callable[[Any], Any],
                          handler_call_details: Any) -> Any:
        got = dict(handler_call_details.invocation_metadata or ()).get("authorization")
        if got is None:
            return self._missing
        if not hmac.compare_digest(str(got).encode(), self._want):
            return self._bad
        return continuation(handler_call_details)


def is_loopback(host: str) -> bool:
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return host in ("localhost", "::1") or host.startswith("127.")


class ServerHandle:
    """A running gRPC server on HOST:PORT. Stop it with stop() or a `with` block."""

    def __init__(self, server: grpc.Server, host: str, port: int) -> None:
        self._server = server
        self.host = host
        self.port = port

    @property
    def address(self) -> str:
        """HOST:PORT a worker on this machine dials (127.0.0.1 for a wildcard host)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "[::]", "") else self.host
        return f"{host}:{self.port}"

    def stop(self, grace: float = DEFAULT_STOP_GRACE) -> None:
        """Stops serving; calls in flight get `grace` seconds. Idempotent."""
        self._server.stop(grace).wait(grace + 1.0)

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        """Blocks until stop() (or `timeout` seconds); True when stopped."""
        timed_out = self._server.wait_for_termination(timeout)
        return not timed_out

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
