"""follow(): the progress bar and the reward curve, in a terminal and (with a stand-in for
IPython) in a notebook; start_local(): the learner and workers it starts and stops."""

from __future__ import annotations

import io
import re
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import grpo_serve
from grpo_serve._wire import learner_pb2
from grpo_serve.follow import follow, reward_curve_svg, text_plot
from grpo_serve.job import JobStatus
from grpo_serve.report import report
from grpo_serve.watch import StepStream
from conftest import JOB_TIMEOUT, grpo_bin

SMALL = dict(num_generations=2, per_device_train_batch_size=4, max_completion_length=6,
             reward_funcs=["length"], save_steps=0, linger_seconds=1)


def test_the_text_plot_is_grpo_demos() -> None:
    # By hand: three columns, one per step; rows from the top at 3.00, 2.00, 1.00.
    assert text_plot([1.0, 3.0, 2.0], width=60, height=3) == (
        "     3.00 | * \n"
        "     2.00 | :*\n"
        "     1.00 |*::\n"
        "          +---\n"
        "           step 13\n")


def test_the_text_plot_averages_buckets_of_steps() -> None:
    y = [float(i % 2) for i in range(120)]  # 0, 1, 0, 1 ...: every bucket of two averages 0.5
    lines = text_plot(y, width=60, height=4).splitlines()
    assert len(lines) == 6 and lines[-1].endswith("120")
    assert all(len(line) == 11 + 60 for line in lines[:4])
    assert lines[0].endswith(" " * 60) and lines[3].endswith("*" * 60)  # flat: span 1, all low


def test_the_svg_curve_follows_the_rewards() -> None:
    svg = reward_curve_svg([1, 2, 3, 5], [0.0, 1.0, float("nan"), 0.5], width=200, height=100,
                           pad=10)
    points = re.search(r'<polyline[^>]*points="([^"]+)"', svg).group(1)  # type: ignore[union-attr]
    xy = [tuple(map(float, p.split(","))) for p in points.split()]
    # Step 1 at the left, step 5 at the right; reward 1 at the top, 0 at the bottom; NaN left out.
    assert xy == [(10.0, 90.0), (55.0, 10.0), (190.0, 50.0)]


REWARD_OPTIONS = {"length": {"target_length": 3}}


def local(tmp_path: Path, name: str, workers: int = 1, **config: Any) -> grpo_serve.LocalRun:
    return grpo_serve.start_local(workers=workers, grpo=grpo_bin(), output_dir=tmp_path / name,
                                  reward_options=REWARD_OPTIONS, **{**SMALL, **config})


def test_follow_in_a_terminal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # No worker until follow sets up its dashboard, which it does after its watch opened: the
    # job cannot take a step before the watch starts, so every step must reach the records.
    workers: list[str] = []
    real_reporter = sys.modules["grpo_serve.report"].Reporter

    def reporter_then_worker(*args: Any, **kwargs: Any) -> Any:
        workers.append(run.add_worker())  # start_local's worker flags (its reward options)
        return real_reporter(*args, **kwargs)

    monkeypatch.setattr(sys.modules["grpo_serve.report"], "Reporter", reporter_then_worker)
    out = io.StringIO()
    with local(tmp_path, "terminal", workers=0, max_steps=4) as run:
        client = run.client()
        job = client.submit([{"prompt": f"q{i}"} for i in range(4)])
        result = grpo_serve.follow(job, file=out, notebook=False, timeout=JOB_TIMEOUT,
                                   report_to=["tensorboard"],
                                   report_options={"logging_dir": str(tmp_path / "tb")})
        status = client.status()
        assert run.wait(60) == 0, run.describe("learner")
    assert workers == ["rollout-0"]
    text = out.getvalue()
    assert result.state == "done" and status.state == "done"
    assert [r["step"] for r in result.records] + result.missed_steps == [1, 2, 3, 4]
    assert "4/4" in text  # the bar reached the last step
    assert "\nmean reward per step\n" + text_plot(result.rewards) in text
    assert text.rstrip().endswith("job done at step 4/4: max_steps reached")
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))  # report_to wrote events


def job_event(state: int, global_step: int, step: int = 0,
              metrics: dict[str, float] | None = None) -> Any:
    event = learner_pb2.JobEvent(step=step, metrics=metrics or {})
    event.job.state = state
    event.job.global_step = global_step
    event.job.max_steps = 2
    return event


class FakeCall:
    """A WatchJob call: the snapshot at step 0 it opened with, steps 1 and 2, the job's end."""

    def __init__(self) -> None:
        running, done = learner_pb2.JOB_STATE_RUNNING, learner_pb2.JOB_STATE_DONE
        self.events = [job_event(running, 0), job_event(running, 1, 1, {"reward": 1.0}),
                       job_event(running, 2, 2, {"reward": 2.0}), job_event(done, 2)]

    def __iter__(self) -> Any:
        return iter(self.events)

    def cancel(self) -> None:
        pass


class FakeLearner:
    """A client and its job whose WatchJob calls are FakeCalls; counts the calls opened."""

    def __init__(self) -> None:
        self.opened = 0
        self.client = self

    def open_call(self, seconds_left: float) -> FakeCall:
        self.opened += 1
        return FakeCall()

    def watch(self, job: Any, **kwargs: Any) -> StepStream:
        return StepStream(self.open_call, **kwargs)

    def status(self) -> JobStatus:
        return JobStatus.from_proto(job_event(learner_pb2.JOB_STATE_RUNNING, 0).job)


def test_a_step_stream_opens_its_first_watch_when_made() -> None:
    # The learner's snapshot, which sets where the stream starts, is taken when the call opens:
    # at the StepStream's making, so steps taken before the first next() are still yielded.
    learner = FakeLearner()
    stream = learner.watch(None, timeout=60, reconnect_timeout=1)
    assert learner.opened == 1
    assert [r["step"] for r in stream] == [1, 2] and stream.state == "done"
    assert learner.opened == 1  # the iteration read that call, it opened no other


def test_follow_and_report_watch_before_they_set_up_the_dashboards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A dashboard's set-up (its import) can take seconds, in which a small job takes all its
    # steps: the watch must already be open when the dashboards are made.
    seen: list[int] = []

    class Dashboards:
        def __init__(self, to: Any, **options: Any) -> None:
            seen.append(learner.opened)

        def log(self, record: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> Any:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    monkeypatch.setattr(sys.modules["grpo_serve.report"], "Reporter", Dashboards)
    learner = FakeLearner()
    result = follow(learner, file=io.StringIO(), notebook=False, report_to=["fake"])
    assert seen == [1] and [r["step"] for r in result.records] == [1, 2]
    learner = FakeLearner()
    result = report(learner, to=["fake"])
    assert seen == [1, 1] and [r["step"] for r in result.records] == [1, 2]


class FakeDisplay:
    """IPython.display's display() and SVG, recording what the notebook cell would show."""

    def __init__(self) -> None:
        self.shown: list[str] = []

    def display(self, obj: Any, display_id: bool = False) -> Any:
        assert display_id
        self.shown.append(obj.data)
        fake = self

        class Handle:
            def update(self, new: Any) -> None:
                fake.shown.append(new.data)

        return Handle()

    class SVG:
        def __init__(self, data: str) -> None:
            self.data = data


def test_follow_in_a_notebook_redraws_the_curve(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeDisplay()
    ipython = types.ModuleType("IPython")
    ipython.get_ipython = lambda: types.SimpleNamespace(kernel=object(), config={})  # type: ignore
    display = types.ModuleType("IPython.display")
    display.display = fake.display  # type: ignore[attr-defined]
    display.SVG = FakeDisplay.SVG  # type: ignore[attr-defined]
    ipython.display = display  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", ipython)
    monkeypatch.setitem(sys.modules, "IPython.display", display)
    from grpo_serve.follow import in_notebook

    assert in_notebook()
    with local(tmp_path, "notebook", max_steps=3) as run:
        client = run.client()
        client.submit([{"prompt": f"q{i}"} for i in range(4)])
        result = client.job().follow(timeout=JOB_TIMEOUT)
    assert result.state == "done" and fake.shown[0].count("<polyline") == 0
    final = fake.shown[-1]
    steps = [r["step"] for r in result.records]
    assert final == reward_curve_svg(steps, result.rewards)  # redrawn with every step at the end


def test_start_local_names_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(grpo_serve.GrpoServeError, match="not an executable file"):
        grpo_serve.start_local(grpo=tmp_path / "no-grpo", **SMALL)
    with pytest.raises(grpo_serve.GrpoServeError, match="did not start") as e:
        grpo_serve.start_local(grpo=grpo_bin(), output_dir=tmp_path / "bad",
                               **{**SMALL, "num_generations": 1})
    assert "num_generations" in str(e.value)  # the end of the learner's log says why
