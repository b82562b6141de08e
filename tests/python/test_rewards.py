"""serve_rewards: TRL-signature functions over grpo.v1.RewardService, called directly over gRPC
and by a real worker training a real learner; TRL's own reward functions run unchanged."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.numpy import load_file
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

import grpo_serve
from grpo_serve._wire import reward_pb2, reward_pb2_grpc
from conftest import JOB_TIMEOUT


def score(server: grpo_serve.RewardServer, fn: str, samples: list[dict[str, Any]],
          token: str | None = None) -> list[float | None]:
    """Calls Score as a worker does; the values (None where absent)."""
    request = reward_pb2.ScoreRequest(reward_fn=fn)
    for s in samples:
        request.samples.add(prompt=s.get("prompt", ""), completion=s["completion"],
                            completion_tokens=s.get("tokens", 0),
                            row_json=json.dumps(s["row"]) if "row" in s else "")
    with grpc.insecure_channel(server.address) as channel:
        stub = reward_pb2_grpc.RewardServiceStub(channel)
        md = (("authorization", "Bearer " + token),) if token else ()
        reply = stub.Score(request, timeout=30, metadata=md)
    return [v.value if v.HasField("value") else None for v in reply.scores]


def rpc_error(server: grpo_serve.RewardServer, fn: str, samples: list[dict[str, Any]],
              token: str | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        score(server, fn, samples, token)
    return e.value


class Recorder:
    """A reward function that keeps the keyword arguments it was called with."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[Any],
                 **kwargs: Any) -> list[float]:
        self.calls.append({"prompts": prompts, "completions": completions,
                           "lengths": [len(ids) for ids in completion_ids], **kwargs})
        return [float(i) for i in range(len(completions))]


def test_a_function_gets_trl_arguments_for_plain_rows() -> None:
    rec = Recorder()
    with grpo_serve.serve_rewards({"rec": rec}, port=0) as server:
        got = score(server, "rec", [
            {"prompt": "What is 2+2?", "completion": "4", "tokens": 1,
             "row": {"prompt": "What is 2+2?", "answer": "4", "level": 1}},
            {"prompt": "Name a colour.", "completion": "blue!", "tokens": 3,
             "row": {"prompt": "Name a colour.", "level": 2, "tags": ["x"]}},
        ])
    assert got == [0.0, 1.0]
    assert rec.calls == [{
        "prompts": ["What is 2+2?", "Name a colour."], "completions": ["4", "blue!"],
        "lengths": [1, 3], "answer": ["4", None], "level": [1, 2], "tags": [None, ["x"]],
        "trainer_state": None, "log_extra": None, "log_metric": None}]


def test_a_function_gets_trl_arguments_for_conversational_rows() -> None:
    rec = Recorder()
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    with grpo_serve.serve_rewards({"rec": rec}, port=0) as server:
        score(server, "rec", [
            {"prompt": "<|im_start|>system\n...", "completion": "hello", "tokens": 5,
             "row": {"messages": chat, "solution": "hello"}},
            {"completion": "no row", "tokens": 2},
        ])
    (call,) = rec.calls
    assert call["prompts"] == [chat, ""]
    assert call["completions"] == [[{"role": "assistant", "content": "hello"}], "no row"]
    assert call["solution"] == ["hello", None] and call["lengths"] == [5, 2]
    assert "messages" not in call and "prompt" not in call


def test_values_none_and_nan_come_back_as_no_value() -> None:
    import numpy as np

    def mixed(completions: list[str], **kwargs: Any) -> list[Any]:
        return [1.5, None, float("nan"), np.float32(0.25), 3, True][: len(completions)]

    rows = [{"completion": str(i), "row": {"prompt": "p"}} for i in range(6)]
    with grpo_serve.serve_rewards({"mixed": mixed}, port=0) as server:
        assert score(server, "mixed", rows) == [1.5, None, None, 0.25, 3.0, 1.0]


def test_a_wrong_count_an_error_and_an_unknown_name_fail_the_call() -> None:
    def short(completions: list[str], **kwargs: Any) -> list[float]:
        return [0.0]

    def broken(completions: list[str], **kwargs: Any) -> list[float]:
        return [1 / 0]

    def text(completions: list[str], **kwargs: Any) -> str:
        return "1.0"

    two = [{"completion": "a", "row": {"prompt": "p"}}, {"completion": "b", "row": {"prompt": "p"}}]
    with grpo_serve.serve_rewards({"short": short, "broken": broken, "text": text},
                                  port=0) as server:
        e = rpc_error(server, "short", two)
        assert e.code() == grpc.StatusCode.INTERNAL
        assert "reward function 'short' returned 1 rewards for 2 samples" in e.details()
        e = rpc_error(server, "broken", two)
        assert e.code() == grpc.StatusCode.INTERNAL and "raised ZeroDivisionError" in e.details()
        e = rpc_error(server, "text", two)
        assert e.code() == grpc.StatusCode.INTERNAL and "not a list of floats" in e.details()
        e = rpc_error(server, "nope", two)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.details() == "unknown reward function 'nope' (this server has broken, short, text)"


def test_a_coroutine_function_is_awaited() -> None:
    async def slow_len(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    with grpo_serve.serve_rewards([slow_len], port=0) as server:
        assert server.names == ["slow_len"]
        assert score(server, "slow_len", [{"completion": "abc"}]) == [3.0]


def test_with_a_token_a_call_must_carry_it(tmp_path: Path) -> None:
    def one(completions: list[str], **kwargs: Any) -> list[float]:
        return [1.0] * len(completions)

    token_file = tmp_path / "reward_token"
    token_file.write_text("s3cret\n")
    with grpo_serve.serve_rewards({"one": one}, port=0, token_file=token_file) as server:
        sample = [{"completion": "x"}]
        e = rpc_error(server, "one", sample)
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAUTHENTICATED,
                                           "missing authorization metadata")
        e = rpc_error(server, "one", sample, token="guess")
        assert (e.code(), e.details()) == (grpc.StatusCode.UNAUTHENTICATED, "bad token")
        assert score(server, "one", sample, token="s3cret") == [1.0]


def test_completion_ids_have_a_length_and_no_ids() -> None:
    def reads_ids(completion_ids: list[Any], **kwargs: Any) -> list[float]:
        return [float(ids[0]) for ids in completion_ids]

    ids = grpo_serve.CompletionIds(7)
    assert len(ids) == 7
    with pytest.raises(LookupError, match="does not carry the ids"):
        list(ids)
    with grpo_serve.serve_rewards({"reads_ids": reads_ids}, port=0) as server:
        e = rpc_error(server, "reads_ids", [{"completion": "x", "tokens": 3}])
    assert e.code() == grpc.StatusCode.INTERNAL and "does not carry the ids" in e.details()


def test_trl_reward_functions_run_unchanged() -> None:
    # Expected values by hand: 1/3 is 1/3 and not 1/2; an unparseable solution is skipped (None);
    # the think format wants <think>...</think> first; DAPO's soft overlong punishment with
    # max_completion_len 10 and cache 4 is 0 up to 6 tokens, (6 - L) / 4 up to 10, then -1.
    overlong = get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    funcs = {"accuracy": accuracy_reward, "think": think_format_reward, "overlong": overlong}
    chat = [{"role": "user", "content": "What is 1/3 as a fraction?"}]

    def sample(text: str, solution: str, tokens: int = 1) -> dict[str, Any]:
        return {"completion": text, "tokens": tokens,
                "row": {"messages": chat, "solution": solution}}

    with grpo_serve.serve_rewards(funcs, port=0) as server:
        assert score(server, "accuracy", [
            sample(r"It is \boxed{\frac{1}{3}}", r"$\frac{1}{3}$"),
            sample(r"It is \boxed{\frac{1}{2}}", r"$\frac{1}{3}$"),
            sample(r"It is \boxed{\frac{1}{3}}", "no answer here"),
        ]) == [1.0, 0.0, None]
        assert score(server, "think", [sample("<think>\nsteps\n</think>\n1/3", ""),
                                       sample("1/3 <think>late</think>", "")]) == [1.0, 0.0]
        assert score(server, "overlong", [sample("x", "", n) for n in (5, 6, 7, 10, 12)]) == [
            0.0, 0.0, -0.25, -1.0, -1.0]


def test_a_function_name_must_be_usable() -> None:
    with pytest.raises(ValueError, match="name the functions"):
        grpo_serve.serve_rewards([lambda completions, **kw: [0.0]], port=0)
    with pytest.raises(ValueError, match="no '@'"):
        grpo_serve.serve_rewards({"a@b": think_format_reward}, port=0)
    with grpo_serve.serve_rewards({"think": think_format_reward}, port=0) as server:
        assert server.spec("think") == f"remote:think@127.0.0.1:{server.port}"
        with pytest.raises(KeyError):
            server.spec("other")


def codepoints(completions: list[Any], **kwargs: Any) -> list[float]:
    """A user's function: the length of the answer in code points."""
    return [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]


QUESTIONS = {
    "What is one third?": r"$\frac{1}{3}$",
    "Give the number three.": "$3$",
    "Say something.": "no answer here",  # unparseable: accuracy_reward gives None
    "Name a fraction.": r"$\frac{2}{5}$",
}


def decode(ids: Any, mask: Any) -> str:
    """A byte tokenizer's text (ids < 256 are bytes; specials add no text), as the worker
    decodes it (invalid UTF-8 becomes U+FFFD)."""
    data = bytes(int(i) for i, m in zip(ids, mask) if m != 0 and 0 <= int(i) < 256)
    return data.decode("utf-8", errors="replace")


def test_a_worker_trains_on_trl_rewards_served_from_python(make_learner: Any,
                                                         tmp_path: Path) -> None:
    funcs = {"accuracy": accuracy_reward, "codepoints": codepoints}
    steps = 2
    with grpo_serve.serve_rewards(funcs, port=0) as server:
        dumps = tmp_path / "dumps"
        lr = make_learner("--reward_funcs",
                          json.dumps([server.spec("accuracy"), server.spec("codepoints")]),
                          "--max_steps", str(steps), "--max_completion_length", "8",
                          "--save_steps", "0", "--max_staleness", "1000",
                          "--dump_batches_dir", str(dumps), "--linger_seconds", "2")
        with grpo_serve.Client(lr.address, token=lr.token) as client:
            job = client.submit([{"messages": [{"role": "user", "content": q}], "solution": s}
                                 for q, s in QUESTIONS.items()])
            assert job.prompt_count == len(QUESTIONS)
            lr.start_worker()
            rc = lr.child.wait(JOB_TIMEOUT)
        assert rc == 0, lr.logs()
    rows = 0
    for step in range(1, steps + 1):
        t = load_file(str(dumps / f"step-{step:08d}.safetensors"))
        per_func = t["rewards_per_func"]
        for r in range(per_func.shape[0]):
            prompt = decode(t["prompt_ids"][r], t["prompt_mask"][r])
            (question,) = [q for q in QUESTIONS if q in prompt]
            text = decode(t["completion_ids"][r], t["completion_mask"][r])
            want_acc = accuracy_reward([[{"role": "assistant", "content": text}]],
                                       [QUESTIONS[question]])[0]
            got_acc, got_len = per_func[r]
            assert (math.isnan(got_acc) if want_acc is None else got_acc == want_acc), (
                step, r, text, got_acc, want_acc)
            assert got_len == float(len(text)), (step, r, text)
            rows += 1
    assert rows == steps * 4  # per_device_train_batch_size 4 a step
