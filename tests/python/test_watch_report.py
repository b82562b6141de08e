"""watch(), `grpo watch --report_to` and the dashboards, on one real job.

One learner and one worker run a job of STEPS steps while three watchers follow it from its start:
the C++ `grpo watch --json` (the reference), `grpo watch --json --report_to
tensorboard,trackio,wandb,mlflow` (which runs this package's `python -m grpo_serve watch` in its
place), and a StepStream through a proxy that drops its connection and
then refuses new ones for a while. Every record and every logged scalar is then checked against
the reference; the dashboards are read back from their own files (TensorBoard's event files,
trackio's SQLite, wandb's offline run file, MLflow's file store).
"""

from __future__ import annotations

import ast
import glob
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import grpo_serve
from conftest import JOB_TIMEOUT, Child, Learner, tail
from tcp_proxy import TcpProxy

# The stream must be back after the drop before step STEPS - REFUSE_STEPS to be refused at all,
# and after the refusal before the learner leaves (LINGER_S after the job's end) to see the end;
# reconnecting takes the stream's backoff and the channel's (about 2 s at worst seen), and 48
# steps can take under a second. So the job pauses while the stream is away (the worker is
# stopped, SIGSTOP, after the learner went REFUSE_STEPS on) and goes on (SIGCONT) at the first
# event of the stream's next call: the test holds at any pace.
STEPS = 48
LINGER_S = 10
DROP_AT = 3  # the proxy resets the stream's connection after this step's record
REFUSE_AT = 8  # ... and after this one refuses connections until the learner is
REFUSE_STEPS = 6  # this many steps on
PROJECT = "grpo-serve-test"
RUN = "watch-report"


def transformers_rewrite_logs() -> Any:
    """transformers' own rewrite_logs (the renaming of every Trainer dashboard callback), taken
    from its source: importing transformers.integrations costs about 6 s."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent / "integrations" / "integration_utils.py"
    tree = ast.parse(path.read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "rewrite_logs"]
    scope: dict[str, Any] = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)
    return scope["rewrite_logs"]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def json_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class Run:
    learner: Learner
    reference: list[dict[str, Any]]
    cli: list[dict[str, Any]]
    cli_rc: int | None
    cli_err: str
    stream_records: list[dict[str, Any]]
    stream: grpo_serve.StepStream
    status_after: grpo_serve.JobStatus
    dirs: dict[str, Path] = field(default_factory=dict)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("watch")
    lr = Learner(root / "job", "--num_generations", "4", "--per_device_train_batch_size", "8",
                 "--max_completion_length", "16", "--max_steps", str(STEPS),
                 "--reward_funcs", "length", "--save_steps", "0", "--linger_seconds", str(LINGER_S))
    dirs = {"tensorboard": root / "tb", "trackio": root / "trackio", "wandb": root / "wandb",
            "mlflow": root / "mlruns"}
    dirs["wandb"].mkdir()
    # `grpo watch --report_to` hands over to this package's watch, run by GRPO_PYTHON.
    env = dict(os.environ, GRPO_PYTHON=sys.executable, TRACKIO_DIR=str(dirs["trackio"]),
               WANDB_MODE="offline",
               WANDB_SILENT="true", WANDB_DIR=str(dirs["wandb"]),
               MLFLOW_TRACKING_URI=dirs["mlflow"].as_uri(), MLFLOW_ALLOW_FILE_STORE="true")
    auth = ["--learner_address", lr.address, "--auth_token_file", str(lr.token_file)]
    ref_out = root / "reference.jsonl"
    ref = subprocess.Popen([os.environ["GRPO_BIN"], "watch", *auth, "--json"],
                           stdout=open(ref_out, "wb"), stderr=open(root / "reference.err", "wb"))
    cli = Child("grpo-watch-report-to", [
        os.environ["GRPO_BIN"], "watch", *auth, "--json",
        "--report_to", "tensorboard,trackio,wandb,mlflow", "--project", PROJECT,
        "--run_name", RUN, "--logging_dir", str(dirs["tensorboard"])],
        root / "cli.log", stdout_pipe=False, env=env)
    cli_out = root / "cli.log"  # stdout and stderr: JSON lines and state lines

    proxy = TcpProxy(lr.address)
    client = grpo_serve.Client(proxy.address, token=lr.token)
    seen_first = threading.Event()
    worker: list[Child] = []  # the job's one worker, once started
    # SIGCONT the stopped worker at the first event of a call after the `reconnects`-th.
    resume_after: list[int] = []

    def on_status(_: Any) -> None:
        seen_first.set()
        if resume_after and stream.reconnects > resume_after[0]:
            resume_after.clear()
            worker[0].proc.send_signal(signal.SIGCONT)

    def pause_until_the_stream_is_back() -> None:
        worker[0].proc.send_signal(signal.SIGSTOP)
        resume_after.append(stream.reconnects)

    stream = client.watch(reconnect_timeout=30, on_status=on_status)
    records: list[dict[str, Any]] = []
    failure: list[BaseException] = []

    def reference_step() -> int:
        lines = [json.loads(x) for x in ref_out.read_text().splitlines() if x.strip()]
        return lines[-1]["step"] if lines else 0

    def consume() -> None:
        done: set[str] = set()
        try:
            for record in stream:
                records.append(record)
                step = record["step"]
                if step >= DROP_AT and "drop" not in done:
                    done.add("drop")
                    pause_until_the_stream_is_back()
                    proxy.drop_all()
                elif step >= REFUSE_AT and "refuse" not in done:
                    done.add("refuse")
                    proxy.refuse(True)
                    proxy.drop_all()
                    wait_for(lambda: reference_step() >= step + REFUSE_STEPS, JOB_TIMEOUT,
                             f"the learner to go {REFUSE_STEPS} steps on")
                    pause_until_the_stream_is_back()
                    proxy.refuse(False)
        except BaseException as e:  # reported by the test
            failure.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    try:
        # Every watcher has its first event (the job waiting for data) before the job starts.
        wait_for(lambda: b"job waiting_for_data" in (root / "reference.err").read_bytes(), 30,
                 "grpo watch to start")
        wait_for(lambda: "job waiting_for_data" in cli_out.read_text(errors="replace"), 60,
                 "grpo watch --report_to to start:\n" + tail(cli_out))
        assert seen_first.wait(30)
        with grpo_serve.Client(lr.address, token=lr.token) as direct:
            direct.submit([{"messages": [{"role": "user", "content": f"Question {i}?"}]}
                           for i in range(8)])
            worker.append(lr.start_worker("--reward_options",
                                          '{"length": {"target_length": 8}}'))
            consumer.join(JOB_TIMEOUT)
            assert not consumer.is_alive(), "the StepStream did not end"
            status_after = direct.status()
        assert ref.wait(30) == 0, (root / "reference.err").read_text()
        cli_rc = cli.wait(60)
        assert lr.child.wait(JOB_TIMEOUT) == 0, lr.logs()
    finally:
        stream.close()
        client.close()
        proxy.close()
        if ref.poll() is None:
            ref.kill()
        cli.stop()
    if failure:
        raise failure[0]
    log = cli_out.read_text(errors="replace")
    yield Run(lr, json_lines(ref_out),
              [json.loads(x) for x in log.splitlines() if x.startswith("{")], cli_rc, log,
              records, stream, status_after, dirs)
    lr.stop()


def metric_names(record: dict[str, Any]) -> set[str]:
    return {k for k in record if k != "step"}


def test_the_reference_saw_every_step(run: Run) -> None:
    assert [r["step"] for r in run.reference] == list(range(1, STEPS + 1))
    assert run.status_after.state == "done" and run.status_after.global_step == STEPS
    # GetJob's last_metrics are the last step's (with "step" as a float, which StepJson and
    # step records replace by the int step).
    assert run.status_after.last_metrics == {**run.reference[-1], "step": float(STEPS)}


def test_watch_resumes_after_dropped_connections_without_duplicates(run: Run) -> None:
    s = run.stream
    steps = [r["step"] for r in run.stream_records]
    assert s.state == "done"
    assert steps == sorted(set(steps)), "steps out of order or twice"
    assert s.reconnects >= 2
    # Everything the learner did is either yielded or known to be missed, never both.
    assert sorted(steps + s.missed_steps) == list(range(1, STEPS + 1))
    by_step = {r["step"]: r for r in run.reference}
    for record in run.stream_records:
        assert record == by_step[record["step"]]


def test_after_a_gap_the_last_step_comes_from_the_snapshot(run: Run) -> None:
    s = run.stream
    gap = [m for m in s.missed_steps if m > REFUSE_AT]
    # The proxy refused while the learner went 6 steps on; a step or two may have been on the
    # wire already when it dropped the connection.
    assert len(gap) >= 2, s.missed_steps
    by_step = {r["step"]: r for r in run.stream_records}
    after = max(gap) + 1  # yielded from the new stream's snapshot (its last_metrics)
    assert after in by_step
    assert by_step[after] == run.reference[after - 1]


def test_the_cli_prints_what_grpo_watch_prints(run: Run) -> None:
    assert run.cli_rc == 0, run.cli_err
    assert run.cli == run.reference
    assert f"job done at step {STEPS}/{STEPS}: max_steps reached" in run.cli_err


def test_report_to_names_the_python_it_could_not_start(tmp_path: Path) -> None:
    missing = tmp_path / "no-python"
    r = subprocess.run([os.environ["GRPO_BIN"], "watch", "--learner_address", "127.0.0.1:1",
                        "--report_to", "tensorboard"], capture_output=True, text=True,
                       env=dict(os.environ, GRPO_PYTHON=str(missing)), timeout=60)
    assert r.returncode == 1
    assert f"runs the grpo_serve Python package with {missing}, which could not be started" \
        in r.stderr, r.stderr
    assert "deploy/setup.sh" in r.stderr


def test_tensorboard_holds_every_step_under_trl_names(run: Run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rewrite = transformers_rewrite_logs()
    acc = EventAccumulator(str(run.dirs["tensorboard"]), size_guidance={"scalars": 0})
    acc.Reload()
    names = metric_names(run.reference[0])
    assert set(acc.Tags()["scalars"]) == set(rewrite({k: 0 for k in names}))
    for name in names:
        tag = "train/" + name
        got = [(e.step, e.value) for e in acc.Scalars(tag)]
        # TensorBoard keeps float32.
        want = [(r["step"], float(np.float32(r[name]))) for r in run.reference]
        assert got == want, tag


def test_trackio_holds_every_step_under_trl_names(run: Run) -> None:
    import sqlite3

    rewrite = transformers_rewrite_logs()
    db = sqlite3.connect(str(run.dirs["trackio"] / f"{PROJECT}.db"))
    rows = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step",
                      (RUN,)).fetchall()
    db.close()
    assert [step for step, _ in rows] == list(range(1, STEPS + 1))
    for (step, metrics), ref in zip(rows, run.reference):
        want = {**rewrite({k: v for k, v in ref.items() if k != "step"}),
                "train/global_step": step}
        assert json.loads(metrics) == want, step


def wandb_history(run_file: Path) -> list[dict[str, Any]]:
    """The history rows of a wandb offline run file: a LevelDB-style log (7-byte header, 32 KiB
    blocks of records with a 7-byte header each) of wandb's Record protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0 and length == 0:
            break
        chunk, pos = data[pos:pos + length], pos + length
        if kind in (1, 4):  # FULL, LAST
            records.append(pending + chunk)
            pending = b""
        else:  # FIRST, MIDDLE
            pending += chunk
    history = []
    for raw in records:
        rec = pb.Record()
        rec.ParseFromString(raw)
        if rec.WhichOneof("record_type") == "history":
            history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                            for i in rec.history.item
                            if not (i.key or i.nested_key[0]).startswith("_")})
    return history


def test_wandb_offline_holds_every_step_under_trl_names(run: Run) -> None:
    rewrite = transformers_rewrite_logs()
    (run_file,) = glob.glob(str(run.dirs["wandb"] / "wandb" / "offline-run-*" / "run-*.wandb"))
    history = wandb_history(Path(run_file))
    assert len(history) == STEPS
    for row, ref in zip(history, run.reference):
        want = {**rewrite({k: v for k, v in ref.items() if k != "step"}),
                "train/global_step": ref["step"]}
        assert row == want, ref["step"]


def test_mlflow_holds_every_step_under_its_names(run: Run) -> None:
    # MLflowCallback logs the names as they are (our names hold no character MLflow refuses).
    runs = [Path(p).parent for p in glob.glob(str(run.dirs["mlflow"] / "*" / "*" / "meta.yaml"))
            if f"run_name: {RUN}" in Path(p).read_text()]
    assert len(runs) == 1, runs
    metrics_dir = runs[0] / "metrics"
    names = metric_names(run.reference[0])
    logged = {str(p.relative_to(metrics_dir)) for p in metrics_dir.rglob("*") if p.is_file()}
    assert logged == names
    for name in names:
        lines = (metrics_dir / name).read_text().split("\n")
        got = [(int(step), float(value)) for _, value, step in
               (line.split() for line in lines if line.strip())]
        assert got == [(r["step"], r[name]) for r in run.reference], name


def test_cancel_ends_the_job_and_its_watch(make_learner: Any) -> None:
    lr = make_learner("--reward_funcs", "length")
    with grpo_serve.Client(lr.address, token=lr.token) as client:
        job = client.submit([{"prompt": "never trained"}])
        stream = job.watch(timeout=60)
        cancelled = job.cancel("enough for today")
        assert cancelled.state == "cancelled" and "enough for today" in cancelled.message
        assert list(stream) == [] and stream.state == "cancelled"
        status = client.status()
    assert status.state == "cancelled" and status.terminal
    assert status.prompts.queued == 1 and status.global_step == 0


def test_watch_gives_up_when_no_learner_answers() -> None:
    proxy = TcpProxy("127.0.0.1:9")  # connections to it are refused
    proxy.refuse(True)
    started = time.monotonic()
    try:
        with grpo_serve.Client(proxy.address) as client:
            with pytest.raises(grpo_serve.RpcError) as e:
                list(client.watch(reconnect_timeout=1.5))
    finally:
        proxy.close()
    assert e.value.code == "UNAVAILABLE" and "no stream for 1.5 s" in str(e.value)
    assert time.monotonic() - started < 10
