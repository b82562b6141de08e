"""The processes grpo_serve.start_local starts end with the process that started them, by the
grpo binary's own parent-death signal (GRPO_PARENT_PID), with no Python run in the child between
fork and exec (a preexec_fn there let grpcio's fork handlers kill a starting learner with SIGABRT
about once in 60 starts)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import grpo_serve
from conftest import grpo_bin

PARENT = textwrap.dedent("""
    import json, sys, time
    import grpo_serve
    run = grpo_serve.start_local(workers=1, output_dir=sys.argv[1], max_steps=1000,
                                 reward_funcs=["length"])
    print(json.dumps({name: p.pid for name, p in run.processes.items()}), flush=True)
    time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_start_local_children_end_when_their_parent_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    err = open(tmp_path / "parent.err", "wb")
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "run")],
                              stdout=subprocess.PIPE, stderr=err,
                              env=dict(os.environ, GRPO_BIN=grpo_bin()))
    try:
        assert parent.stdout is not None
        ready, _, _ = select.select([parent.stdout], [], [], 90)
        assert ready, "start_local did not return within 90 s"
        line = parent.stdout.readline().decode()
        assert line, (tmp_path / "parent.err").read_text()
        pids = json.loads(line)
        assert set(pids) == {"learner", "rollout-0"}, line
        assert all(alive(pid) for pid in pids.values())
    finally:
        parent.kill()  # SIGKILL: no Python cleanup runs; only the kernel's signal can end them
        parent.wait()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [name for name, pid in pids.items() if alive(pid)]
    for name in left:
        os.kill(pids[name], signal.SIGKILL)
    assert not left, f"still running 20 s after their parent was killed: {left}"


def test_grpo_started_for_a_parent_that_is_gone_ends_at_once() -> None:
    # pid 1 is not the parent of this child: its parent (this process) is taken as gone.
    r = subprocess.run([grpo_bin(), "reward-server", "--port", "0", "--reward_funcs", "length"], capture_output=True,
                       timeout=30, env=dict(os.environ, GRPO_PARENT_PID="1"))
    assert r.returncode == -signal.SIGTERM, r.stderr.decode()


def test_grpo_refuses_a_parent_pid_that_is_not_a_number_and_runs_on() -> None:
    p = subprocess.Popen([grpo_bin(), "reward-server", "--port", "0", "--reward_funcs", "length"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=dict(os.environ, GRPO_PARENT_PID="12x"))
    try:
        assert p.stdout is not None
        ready, _, _ = select.select([p.stdout], [], [], 30)
        assert ready and json.loads(p.stdout.readline())["port"] > 0
    finally:
        p.terminate()
        _, err = p.communicate(timeout=30)
    assert "GRPO_PARENT_PID='12x' is not a process id; ignored" in err.decode()


def test_add_worker_takes_the_next_free_name_and_start_locals_worker_flags(tmp_path: Path) -> None:
    run = grpo_serve.LocalRun(tmp_path, tmp_path / "token")
    run.address = "127.0.0.1:5"
    run._binary = "/bin/true"  # exits at once: only its command line is checked
    run._worker_args = ["--reward_options", '{"length": {}}']
    try:
        assert run.add_worker() == "rollout-0"
        assert run.add_worker("late") == "late"
        assert run.add_worker() == "rollout-1"
        with pytest.raises(ValueError, match="late"):
            run.add_worker("late")
        argv = run.processes["rollout-1"].args
        assert argv[:4] == ["/bin/true", "--log_level", "info", "rollout"]
        assert argv[argv.index("--learner_address") + 1] == "127.0.0.1:5"
        assert argv[argv.index("--worker_id") + 1] == "rollout-1"
        assert argv[argv.index("--auth_token_file") + 1] == str(tmp_path / "token")
        assert argv[-2:] == ["--reward_options", '{"length": {}}']
        assert (tmp_path / "rollout-1.log").exists()
    finally:
        run.stop()
