"""serve_environment: a Python environment class over grpo.v1.EnvironmentService, driven here over
gRPC as a worker drives it (one Episode stream per episode). The C++ client against the example
calculator is tests/services/environment_grpc_test.cc."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

import grpo_serve
from grpo_serve._wire import environment_pb2, environment_pb2_grpc


class Episode:
    """One Episode stream: send() writes an action and returns its answer."""

    def __init__(self, server: grpo_serve.EnvironmentServer, token: str | None = None) -> None:
        self._channel = grpc.insecure_channel(server.address)
        self._actions: queue.Queue[Any] = queue.Queue()
        md = (("authorization", "Bearer " + token),) if token else ()
        stub = environment_pb2_grpc.EnvironmentServiceStub(self._channel)
        self._answers: Iterator[Any] = stub.Episode(iter(self._actions.get, None), metadata=md,
                                                    timeout=30)

    def send(self, **action: Any) -> Any:
        self._actions.put(environment_pb2.EnvAction(**action))
        return next(self._answers)

    def reset(self, row: dict[str, Any], seed: int = 0) -> Any:
        return self.send(reset=environment_pb2.EnvReset(row_json=json.dumps(row), seed=seed))

    def step(self, text: str) -> Any:
        return self.send(step=environment_pb2.EnvStep(text=text))

    def close(self) -> None:
        self._actions.put(None)  # WritesDone
        for _ in self._answers:
            pass
        self._channel.close()


class Counter:
    """Counts to the row's "target"; a step "boom" raises; records closes."""

    closed: list[int] = []
    lock = threading.Lock()

    def reset(self, row: dict[str, Any], seed: int) -> grpo_serve.Observation:
        self.target, self.seed, self.n = row["target"], seed, 0
        return grpo_serve.Observation(messages=[{"role": "user", "content": "count"}])

    def step(self, action: str) -> grpo_serve.Observation | str:
        if action == "boom":
            raise ValueError("no explosions")
        self.n += 1
        if self.n == self.target:
            return grpo_serve.Observation(reward=1.0, done=True, metadata={"seed": self.seed})
        return f"{self.n} so far"  # a plain string: one tool message

    def close(self) -> None:
        with self.lock:
            Counter.closed.append(self.seed)


class Tools:
    """Declares a calculator at reset; step gets the worker's parsed calls."""
    def reset(self, row: dict[str, Any], seed: int) -> grpo_serve.Observation:
        return grpo_serve.Observation(tools=[{"name": "calculator"}])

    def step(self, action: str, tool_calls: list[dict[str, Any]]) -> str:
        return json.dumps(tool_calls)


def test_declared_tools_reach_the_worker_and_steps_get_the_parsed_calls() -> None:
    with grpo_serve.serve_environment(Tools, port=0) as server:
        ep = Episode(server)
        obs = ep.reset({})
        assert [json.loads(t) for t in obs.tools_json] == [{"name": "calculator"}]
        step = environment_pb2.EnvStep(text="t", tool_calls=[
            environment_pb2.EnvToolCall(name="calculator", arguments_json='{"x": 1}'),
            environment_pb2.EnvToolCall(name="calculator")])
        obs = ep.send(step=step)
        assert json.loads(obs.messages[0].content) == [
            {"name": "calculator", "arguments": {"x": 1}},
            {"name": "calculator", "arguments": {}}]
        ep.close()


def test_an_episode_resets_steps_and_ends_with_the_reward() -> None:
    with grpo_serve.serve_environment(Counter, port=0) as server:
        ep = Episode(server)
        obs = ep.reset({"target": 2}, seed=7)
        assert [(m.role, m.content) for m in obs.messages] == [("user", "count")]
        assert not obs.HasField("reward") and not obs.done and obs.error == ""
        obs = ep.step("one")
        assert [(m.role, m.content) for m in obs.messages] == [("tool", "1 so far")]
        obs = ep.step("two")
        assert obs.reward == 1.0 and obs.done and json.loads(obs.metadata_json) == {"seed": 7}
        ep.close()
        deadline = time.monotonic() + 10
        while 7 not in Counter.closed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert 7 in Counter.closed  # close() ran when the stream ended


class Greeter:
    """A reset that returns a plain string."""
    def reset(self, row: dict[str, Any], seed: int) -> str:
        return f"hello {seed}"

    def step(self, action: str) -> str:
        return "again"


def test_a_reset_string_is_a_user_message_and_a_step_string_a_tool_message() -> None:
    with grpo_serve.serve_environment(Greeter, port=0) as server:
        ep = Episode(server)
        obs = ep.reset({}, seed=3)
        assert [(m.role, m.content) for m in obs.messages] == [("user", "hello 3")]
        obs = ep.step("hi")
        assert [(m.role, m.content) for m in obs.messages] == [("tool", "again")]
        ep.close()


def test_a_method_that_raises_answers_the_error_and_ends_the_stream() -> None:
    with grpo_serve.serve_environment(Counter, port=0) as server:
        ep = Episode(server)
        ep.reset({"target": 5}, seed=8)
        obs = ep.step("boom")
        assert obs.error == "ValueError: no explosions"
        with pytest.raises(StopIteration):
            ep.step("one")  # the stream ended with the error answer
        ep.close()


def test_a_step_before_the_reset_is_an_error_answer() -> None:
    with grpo_serve.serve_environment(Counter, port=0) as server:
        ep = Episode(server)
        assert "before the reset" in ep.step("one").error
        ep.close()


def test_a_token_is_required_when_given() -> None:
    with grpo_serve.serve_environment(Counter, port=0, token="env-s3cret") as server:
        with pytest.raises(grpc.RpcError) as e:
            Episode(server, token="wrong").reset({"target": 1})
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        ep = Episode(server, token="env-s3cret")
        assert ep.reset({"target": 1}).error == ""
        ep.close()


def test_observations_convert_as_documented() -> None:
    to_proto = grpo_serve.environment.to_proto
    out = to_proto(grpo_serve.Observation(messages=["7", {"role": "user", "content": "go"}],
                                          reward=0, truncated=True))
    assert [(m.role, m.content) for m in out.messages] == [("tool", "7"), ("user", "go")]
    assert out.HasField("reward") and out.reward == 0.0 and out.truncated and not out.done
    with pytest.raises(ValueError, match="role 'assistant'"):
        to_proto(grpo_serve.Observation(messages=[{"role": "assistant", "content": "x"}]))
    with pytest.raises(ValueError, match="NaN"):
        to_proto(grpo_serve.Observation(reward=float("nan")))
