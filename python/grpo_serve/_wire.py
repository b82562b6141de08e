"""The wire: the gRPC stubs generated from proto/grpo/v1 at build time (setup.py).

They live in the private subpackage ``grpo_serve._proto``, which exists only in a built package:
importing grpo_serve from the source tree, unbuilt, fails here with a message saying so.
"""

from __future__ import annotations

import grpc

try:
    from grpo_serve._proto.grpo.v1 import (
        environment_pb2,
        environment_pb2_grpc,
        learner_pb2,
        learner_pb2_grpc,
        reward_pb2,
        reward_pb2_grpc,
    )
except ImportError as e:  # pragma: no cover - only an unbuilt source tree gets here
    raise ImportError(
        "grpo_serve's gRPC stubs are missing: they are generated from proto/ when the package is "
        "built. Install it (pip install python/, or deploy/setup.sh) instead of importing the "
        f"source tree ({e})") from e

# The learner's message limit (services/auth.h kMaxMessageBytes).
MAX_MESSAGE_BYTES = 64 << 20
# Keepalive pings on an open call: a dead connection under a quiet WatchJob stream shows up
# within KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS. gRPC servers refuse pings more frequent than
# every 5 minutes on a call without data (grpc.http2.min_recv_ping_interval_without_data_ms).
KEEPALIVE_TIME_MS = 300_000
KEEPALIVE_TIMEOUT_MS = 20_000

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    # Reconnect soon after a dropped connection (gRPC's default first backoff is 1 s).
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


def auth_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries `token` (none when empty), as the learner checks it."""
    return (("authorization", "Bearer " + token),) if token else ()


__all__ = ["environment_pb2", "environment_pb2_grpc", "learner_pb2", "learner_pb2_grpc",
           "reward_pb2", "reward_pb2_grpc", "grpc",
           "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "auth_metadata"]
