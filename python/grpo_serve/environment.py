"""serve_environment(EnvClass): a Python environment of multi-turn episodes as a
grpo.v1.EnvironmentService (proto/grpo/v1/environment.proto).

A worker steps the environment between the model's turns, one gRPC stream per episode. The server
makes one ``EnvClass()`` per episode and calls, on that stream's thread:

    env.reset(row: dict, seed: int) -> Observation | str | None
    env.step(action: str) -> Observation | str | None
    env.step(action: str, tool_calls: list[dict]) -> ...   # when the reset declared tools
    env.close()                      # optional: when the episode's stream ends, however it ends

``row`` is the dataset row (a dict), ``seed`` the episode's seed (the same for a replayed
episode), ``action`` the text of the model's turn. A string returned by ``step`` is one ``tool``
message, one returned by ``reset`` one ``user`` message, and None is an observation with no
message; a coroutine is awaited. The reset's messages are shown to the model before its first turn,
as turns after the row's prompt (which must then be a "messages" row). ``reset`` runs once, first; the
episode ends when an observation says ``done`` or ``truncated``, when the worker's turn limit is
reached, or when the worker goes away (the stream ends and ``close()`` runs).

A method that raises fails the call: the worker gets the error (as "ExceptionType: message"),
counts it as an environment error and ends the episode. A method that outlasts the worker's step
deadline makes the worker cancel the episode; the method still runs to its end here.

Tools: a reset that returns ``Observation(tools=[{...function schema...}])`` makes the worker
parse every turn's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks and pass
the well-formed ones to ``step(action, tool_calls)`` as ``[{"name": str, "arguments": dict}]``
(empty: the turn called none). A turn with a malformed block never reaches ``step``: the worker
answers it with an error message for the model and counts it.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, NoReturn

import grpc

from grpo_serve._auth import resolve_token
from grpo_serve._serving import ServerHandle, TokenInterceptor, is_loopback
from grpo_serve._wire import MAX_MESSAGE_BYTES, environment_pb2, environment_pb2_grpc
from grpo_serve.errors import GrpoServeError

log = logging.getLogger("grpo_serve.environment")

# grpo env-server's default port (proto/grpo/v1/environment.proto).
DEFAULT_PORT = 50071
# Roles an observation's message may have (rollout/env/environment.h).
ROLES = ("tool", "user")

Message = Mapping[str, str] | str


@dataclass
class Observation:
    """What an environment answers to a reset or a step.

    ``messages`` are shown to the model before its next turn: dicts ``{"role": "tool" | "user",
    "content": str}``, or plain strings (each a ``tool`` message). ``reward`` is this call's
    reward (None: none; the episode's reward is the sum of the given ones). ``done``: the task
    is over; ``truncated``: the environment cut the episode short. ``metadata`` (a JSON-able
    dict) reaches the reward functions with the episode's last observation.
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    truncated: bool = False
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # reset only: the tools offered (function schemas)


def _as_observation(out: Any, method: str) -> Observation:
    if out is None:
        return Observation()
    if isinstance(out, str):  # a step's: a tool message; a reset's: a user message
        return Observation(messages=[out if method == "step" else {"role": "user", "content": out}])
    if isinstance(out, Observation):
        return out
    raise TypeError(f"{method}() returned a {type(out).__name__}: return an Observation, a str "
                    "(one message) or None")


def to_proto(obs: Observation) -> Any:
    """The EnvObservation message of `obs`; TypeError / ValueError naming what is wrong."""
    out = environment_pb2.EnvObservation()
    messages: Any = obs.messages
    if isinstance(messages, (str, Mapping)):
        messages = [messages]  # one message given bare
    for i, m in enumerate(messages):
        role: Any
        content: Any
        if isinstance(m, str):
            role, content = "tool", m
        elif isinstance(m, Mapping):
            role, content = m.get("role", "tool"), m.get("content")
        else:
            raise TypeError(f"message {i} is a {type(m).__name__}: give a str or a dict with "
                            "role and content")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r} (an environment speaks as "
                             f"{' or '.join(ROLES)})")
        if not isinstance(content, str):
            raise TypeError(f"message {i}'s content is a {type(content).__name__}, not a str")
        out.messages.add(role=role, content=content)
    if obs.reward is not None:
        reward = float(obs.reward)
        if math.isnan(reward):
            raise ValueError("reward is NaN (use None for no reward)")
        out.reward = reward
    out.done = bool(obs.done)
    out.truncated = bool(obs.truncated)
    if obs.metadata is not None:
        if not isinstance(obs.metadata, Mapping):
            raise TypeError(f"metadata is a {type(obs.metadata).__name__}, not a dict")
        out.metadata_json = json.dumps(dict(obs.metadata))
    for i, tool in enumerate(obs.tools or ()):
        if not isinstance(tool, Mapping):
            raise TypeError(f"tool {i} is a {type(tool).__name__}, not a dict")
        out.tools_json.append(json.dumps(dict(tool)))
    return out


def _call(method: Callable[..., Any], *args: Any) -> Any:
    out = method(*args)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out

        return asyncio.run(wait())
    return out


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)  # raises
    raise AssertionError("grpc's ServicerContext.abort returned")


class _EnvironmentServicer(environment_pb2_grpc.EnvironmentServiceServicer):
    def __init__(self, env_class: Callable[[], Any]) -> None:
        self._env_class = env_class
        self._name = getattr(env_class, "__name__", repr(env_class))

    def Episode(self, request_iterator: Iterator[Any],  # noqa: N802 (gRPC's name)
                context: grpc.ServicerContext) -> Iterator[Any]:
        env: Any = None
        tools_declared = False  # the reset offered tools: steps get the parsed calls
        try:
            for action in request_iterator:
                kind = action.WhichOneof("action")
                try:
                    if kind == "reset":
                        if env is not None:
                            raise RuntimeError("a second reset on one episode's stream")
                        env = self._env_class()
                        row = json.loads(action.reset.row_json) if action.reset.row_json else {}
                        if not isinstance(row, dict):
                            raise ValueError("the reset's row_json is not a JSON object")
                        obs = _as_observation(_call(env.reset, row, action.reset.seed), "reset")
                        tools_declared = bool(obs.tools)
                    elif kind == "step":
                        if env is None:
                            raise RuntimeError("a step before the reset")
                        if tools_declared:
                            calls = [{"name": c.name,
                                      "arguments": json.loads(c.arguments_json or "{}")}
                                     for c in action.step.tool_calls]
                            obs = _as_observation(_call(env.step, action.step.text, calls),
                                                  "step")
                        else:
                            obs = _as_observation(_call(env.step, action.step.text), "step")
                    else:
                        raise RuntimeError("an action with neither reset nor step")
                    answer = to_proto(obs)
                except Exception as e:  # the environment's error: the worker counts it
                    log.warning("environment %s: %s failed", self._name, kind, exc_info=True)
                    yield environment_pb2.EnvObservation(error=f"{type(e).__name__}: {e}")
                    return  # an error answer ends the episode
                yield answer
        finally:
            close = getattr(env, "close", None)
            if callable(close):
                try:
                    close()
                except Exception:
                    log.warning("environment %s: close() failed", self._name, exc_info=True)


class EnvironmentServer(ServerHandle):
    """A running environment server (serve_environment). Stop it with stop() or a `with`
    block."""

    def __init__(self, server: grpc.Server, host: str, port: int, name: str) -> None:
        super().__init__(server, host, port)
        self.name = name

    def __repr__(self) -> str:
        return f"EnvironmentServer({self.address}, {self.name})"


def serve_environment(env_class: Callable[[], Any], port: int = 0, token: str | None = None, *,
                      host: str = "127.0.0.1",
                      token_file: str | os.PathLike[str] | None = None,
                      max_episodes: int = 64) -> EnvironmentServer:
    """Starts an EnvironmentService that runs one ``env_class()`` per episode (see the module
    docstring) on HOST:PORT (port 0: any free port; `.port` says which) and returns at once.
    With `token` (or `token_file`, the workers' env_auth_token_file) a stream must carry it.
    `max_episodes` episodes run at once, each on a thread of its own; a worker's episode beyond
    them is refused (RESOURCE_EXHAUSTED).
    """
    if not callable(env_class):
        raise TypeError("serve_environment needs a class (or a factory) of environments")
    for method in ("reset", "step"):
        if isinstance(env_class, type) and not callable(getattr(env_class, method, None)):
            raise TypeError(f"{env_class.__name__} has no {method}() method")
    if max_episodes < 1:
        raise ValueError("max_episodes must be at least 1")
    secret = resolve_token(token, token_file, key="env_auth_token_file")
    if not secret and not is_loopback(host):
        log.warning("environment server: WARNING: auth is off (no token) and it listens on %s: "
                    "anyone who reaches it can run episodes", host)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_episodes, thread_name_prefix="grpo-env"),
        interceptors=([TokenInterceptor(secret, grpc.stream_stream_rpc_method_handler)]
                      if secret else []),
        maximum_concurrent_rpcs=max_episodes,
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    servicer = _EnvironmentServicer(env_class)
    environment_pb2_grpc.add_EnvironmentServiceServicer_to_server(servicer, server)
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise GrpoServeError(f"environment server: cannot bind {bind}: {e}") from e
    if bound == 0:
        raise GrpoServeError(f"environment server: cannot bind {bind}")
    server.start()
    return EnvironmentServer(server, host, bound, servicer._name)


__all__ = ["DEFAULT_PORT", "EnvironmentServer", "Message", "Observation", "serve_environment",
           "to_proto"]
