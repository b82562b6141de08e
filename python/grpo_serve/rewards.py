"""serve_rewards({"name": fn}): Python reward functions as a grpo.v1.RewardService.

Workers call a function served here as ``remote:NAME@HOST:PORT`` in ``reward_funcs``, sending each
sample's prompt, completion text, completion token count and dataset row
(proto/grpo/v1/reward.proto). `fn` has TRL's reward-function signature and is called as
GRPOTrainer calls it (trl/trainer/grpo_trainer.py ``_calculate_rewards``):

    fn(prompts=[...], completions=[...], completion_ids=[...], **columns,
       trainer_state=None, log_extra=None, log_metric=None) -> list[float | None]

- a row with "messages" (and no "prompt") is conversational, as TRL's: its prompt is that list
  of messages and its completion ``[{"role": "assistant", "content": text}]``; otherwise the
  prompt is the prompt text and the completion the text;
- every other field of the dataset row is a keyword argument, a list with one value a sample
  (None where a row lacks it);
- ``completion_ids[i]`` is a :class:`CompletionIds`: the wire carries the number of tokens, not
  their ids, so ``len()`` works (e.g. TRL's soft overlong punishment) and reading an id raises;
- there is no trainer here: ``trainer_state``, ``log_extra`` and ``log_metric`` are None.

A function returns one float (or None: no reward) per sample; NaN counts as None. A coroutine
function is awaited. A function that raises fails the call (INTERNAL, with the error), which the
worker counts as that function's error (rollout/reward.h).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any, NoReturn, overload

import grpc

from grpo_serve._auth import resolve_token
from grpo_serve._serving import ServerHandle, TokenInterceptor, is_loopback
from grpo_serve._wire import MAX_MESSAGE_BYTES, reward_pb2, reward_pb2_grpc
from grpo_serve.errors import GrpoServeError

log = logging.getLogger("grpo_serve.rewards")

# A reward function with TRL's signature.
RewardFunc = Callable[..., Sequence[float | None]]
# grpo reward-server's default port (proto/grpo/v1/reward.proto).
DEFAULT_PORT = 50061
# The keyword arguments TRL's trainer passes besides the columns; none of them exists here.
_TRAINER_KWARGS = ("trainer_state", "log_extra", "log_metric")
# Row fields that are the prompt, not columns (TRL leaves out "prompt", "completion",
# "completion_ids"; a row's "messages" is its conversational prompt).
_NOT_COLUMNS = frozenset({"prompt", "messages", "completion", "completion_ids"})


class UnknownTokenIds(GrpoServeError, LookupError):
    """A reward function read a completion's token ids, which the wire does not carry."""


class CompletionIds(Sequence[int]):
    """A completion's token ids as far as the reward wire knows them: how many there are.

    ``len()`` is the completion's token count; reading an id raises UnknownTokenIds (the
    RewardSample message carries ``completion_tokens``, not the ids).
    """

    __slots__ = ("_count",)

    def __init__(self, count: int) -> None:
        self._count = int(count)

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        raise UnknownTokenIds(
            "completion_ids holds only the number of tokens (len()): the reward wire "
            "(RewardSample in proto/grpo/v1/reward.proto) does not carry the ids")

    def __iter__(self) -> Iterator[int]:
        return self.__getitem__(0)  # type: ignore[return-value]  # raises

    def __repr__(self) -> str:
        return f"CompletionIds(<{self._count} tokens>)"


def _is_conversational(row: Mapping[str, Any]) -> bool:
    return isinstance(row.get("messages"), list) and not isinstance(row.get("prompt"), str)


def trl_inputs(samples: Sequence[Any]) -> dict[str, Any]:
    """The keyword arguments of a TRL reward function for these RewardSamples (see the module
    docstring). ValueError for a row_json that is not a JSON object."""
    rows: list[dict[str, Any]] = []
    for i, s in enumerate(samples):
        row = json.loads(s.row_json) if s.row_json else {}
        if not isinstance(row, dict):
            raise ValueError(f"sample {i}: row_json is not a JSON object")
        rows.append(row)
    prompts: list[Any] = []
    completions: list[Any] = []
    for s, row in zip(samples, rows):
        if _is_conversational(row):
            prompts.append(row["messages"])
            completions.append([{"role": "assistant", "content": s.completion}])
        else:
            prompts.append(row["prompt"] if isinstance(row.get("prompt"), str) else s.prompt)
            completions.append(s.completion)
    columns = sorted({k for row in rows for k in row} - _NOT_COLUMNS - set(_TRAINER_KWARGS))
    kwargs: dict[str, Any] = {k: [row.get(k) for row in rows] for k in columns}
    kwargs.update({k: None for k in _TRAINER_KWARGS})
    return {"prompts": prompts, "completions": completions,
            "completion_ids": [CompletionIds(s.completion_tokens) for s in samples], **kwargs}


def _score_values(name: str, out: Any, n: int) -> list[float | None]:
    """The function's output as one optional float a sample; ValueError naming what is wrong."""
    if isinstance(out, (str, bytes, Mapping)):
        raise ValueError(f"reward function '{name}' returned a {type(out).__name__}, not a list "
                         "of floats")
    if not isinstance(out, Sequence):
        try:
            out = list(out)  # a tensor or an array
        except TypeError:
            raise ValueError(f"reward function '{name}' returned a {type(out).__name__}, not a "
                             "list of floats") from None
    if len(out) != n:
        raise ValueError(f"reward function '{name}' returned {len(out)} rewards for {n} samples "
                         "(one per completion)")
    values: list[float | None] = []
    for i, v in enumerate(out):
        if v is None:
            values.append(None)
            continue
        if hasattr(v, "item") and not isinstance(v, numbers.Number):
            v = v.item()  # a 0-d tensor or array
        if not isinstance(v, numbers.Real):
            raise ValueError(f"reward function '{name}' returned {v!r} for sample {i}, not a "
                             "float or None")
        f = float(v)
        values.append(None if math.isnan(f) else f)
    return values


def _call(fn: RewardFunc, kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return asyncio.run(fn(**kwargs))
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        async def wait() -> Any:
            return await out

        return asyncio.run(wait())
    return out


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> NoReturn:
    context.abort(code, message)  # raises
    raise AssertionError("grpc's ServicerContext.abort returned")


class _RewardServicer(reward_pb2_grpc.RewardServiceServicer):
    def __init__(self, funcs: Mapping[str, RewardFunc]) -> None:
        self._funcs = dict(funcs)

    def Score(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (gRPC's)
        fn = self._funcs.get(request.reward_fn)
        if fn is None:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"unknown reward function '{request.reward_fn}' (this server has "
                   f"{', '.join(sorted(self._funcs))})")
        try:
            kwargs = trl_inputs(request.samples)
        except ValueError as e:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            values = _score_values(request.reward_fn, _call(fn, kwargs), len(request.samples))
        except Exception as e:  # the function's own error: the worker counts it
            log.warning("reward function '%s' failed", request.reward_fn, exc_info=True)
            _abort(context, grpc.StatusCode.INTERNAL,
                   f"reward function '{request.reward_fn}' raised {type(e).__name__}: {e}")
        response = reward_pb2.ScoreResponse()
        for v in values:
            score = response.scores.add()
            if v is not None:
                score.value = v
        return response


class RewardServer(ServerHandle):
    """A running reward server (serve_rewards). Stop it with stop() or a `with` block."""

    def __init__(self, server: grpc.Server, host: str, port: int, names: Sequence[str]) -> None:
        super().__init__(server, host, port)
        self.names = list(names)

    def spec(self, name: str) -> str:
        """The `reward_funcs` entry for function `name`: remote:NAME@HOST:PORT."""
        if name not in self.names:
            raise KeyError(f"this server has no reward function '{name}' ({', '.join(self.names)})")
        return f"remote:{name}@{self.address}"

    def __repr__(self) -> str:
        return f"RewardServer({self.address}, {self.names})"


def serve_rewards(funcs: Mapping[str, RewardFunc] | Sequence[RewardFunc], *,
                  port: int = DEFAULT_PORT, host: str = "127.0.0.1", token: str | None = None,
                  token_file: str | os.PathLike[str] | None = None,
                  max_workers: int = 4) -> RewardServer:
    """Starts a RewardService serving `funcs` (name -> function, or a list of functions named by
    their __name__, as TRL's reward_funcs) on HOST:PORT (port 0: any free port; `.port` says
    which) and returns at once. With `token` (or `token_file`, the workers'
    reward_auth_token_file) a call must carry it. `max_workers` calls run at once.
    """
    if isinstance(funcs, Mapping):
        table = dict(funcs)
    else:
        table = {}
        for fn in funcs:
            name = getattr(fn, "__name__", None)
            if not name or name == "<lambda>":
                raise ValueError("name the functions: pass {'name': fn, ...}")
            table[name] = fn
    if not table:
        raise ValueError("serve_rewards needs at least one reward function")
    for name, fn in table.items():
        if not callable(fn):
            raise TypeError(f"reward function '{name}' is not callable")
        if not name or "@" in name:
            raise ValueError(f"bad reward function name {name!r} (no '@', not empty)")
    secret = resolve_token(token, token_file, key="reward_auth_token_file")
    if not secret and not is_loopback(host):
        log.warning("reward server: WARNING: auth is off (no token) and it listens on %s: anyone "
                    "who reaches it can call Score", host)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpo-reward"),
        interceptors=([TokenInterceptor(secret, grpc.unary_unary_rpc_method_handler)]
                      if secret else []),
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                 ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    reward_pb2_grpc.add_RewardServiceServicer_to_server(_RewardServicer(table), server)
    bind = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
    try:
        bound = server.add_insecure_port(bind)
    except RuntimeError as e:
        raise GrpoServeError(f"reward server: cannot bind {bind}: {e}") from e
    if bound == 0:
        raise GrpoServeError(f"reward server: cannot bind {bind}")
    server.start()
    return RewardServer(server, host, bound, sorted(table))
