"""Shared helpers of the grpo_serve tests: the real `grpo` binary's learner and workers as child
processes (started here with explicit arguments, independently of grpo_serve.start_local), the
`grpo` client commands as the reference, and the learner's ledger read with sqlite3.

$GRPO_BIN is the binary under test (CTest sets it to the build's); $GRPO_SOURCE_DIR the
repository. The tests fail, never skip, when either is missing.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("GRPO_SOURCE_DIR", Path(__file__).resolve().parents[2]))
START_TIMEOUT = 60.0  # the learner builds its model before it prints its port
JOB_TIMEOUT = 120.0


def grpo_bin() -> str:
    path = os.environ.get("GRPO_BIN", "")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(f"GRPO_BIN={path!r} is not the grpo binary: run these tests through ctest "
                    "(tests/CMakeLists.txt sets it), or set it to build/services/grpo")
    return path


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Child:
    """One child process with its log file."""

    def __init__(self, name: str, argv: Sequence[str], log: Path, stdout_pipe: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log = log
        self._log_file = open(log, "ab")
        self.proc = subprocess.Popen(
            list(argv), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else self._log_file, stderr=self._log_file,
            env=env)

    def first_line(self, timeout: float) -> str:
        """The first stdout line (stdout_pipe), or a test failure with the log's end."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None and not buf:
                pytest.fail(f"{self.name} printed no line within {timeout} s "
                            f"(exit {self.proc.poll()}):\n{tail(self.log)}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    time.sleep(0.05)
                buf += chunk
        return buf.split(b"\n", 1)[0].decode()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log_file.close()


class Learner:
    """A `grpo learner` on 127.0.0.1 with a token (tests/services/process_util.h LearnerCommand's
    small settings: num_generations 2, per_device_train_batch_size 4)."""

    def __init__(self, dir: Path, *keys: str, token: bool = True, name: str = "learner") -> None:
        self.dir = dir
        dir.mkdir(parents=True, exist_ok=True)
        self.out = dir / "out"
        self.token_file: Path | None = None
        self.token = ""
        args = [grpo_bin(), "--log_level", "info", "learner", "--output_dir", str(self.out),
                "--grpc_port", "0", "--metrics_port", "0", "--grpc_bind_address", "127.0.0.1",
                "--metrics_bind_address", "127.0.0.1", "--weight_sync_hostname", "127.0.0.1",
                "--num_generations", "2", "--per_device_train_batch_size", "4"]
        if token:
            self.token = secrets.token_hex(16)
            self.token_file = dir / "token"
            self.token_file.write_text(self.token + "\n")
            args += ["--auth_token_file", str(self.token_file)]
        self.child = Child(name, [*args, *keys], dir / f"{name}.log", stdout_pipe=True)
        info = json.loads(self.child.first_line(START_TIMEOUT))
        self.port = int(info["port"])
        self.address = f"127.0.0.1:{self.port}"
        self.workers: list[Child] = []

    def auth_args(self) -> list[str]:
        return ["--auth_token_file", str(self.token_file)] if self.token_file else []

    def start_worker(self, *extra: str) -> Child:
        name = f"worker-{len(self.workers)}"
        w = Child(name, [grpo_bin(), "--log_level", "info", "rollout", "--learner_address",
                         self.address, "--worker_id", name, "--metrics_port", "0",
                         "--weight_sync_hostname", "127.0.0.1", *self.auth_args(), *extra],
                  self.dir / f"{name}.log")
        self.workers.append(w)
        return w

    def grpo(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """A grpo client command against this learner (the reference client)."""
        cmd = [grpo_bin(), args[0], "--learner_address", self.address, *self.auth_args(),
               *args[1:]]
        return subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                              timeout=timeout)

    def ledger(self) -> sqlite3.Connection:
        """The learner's prompt ledger, read-only."""
        return sqlite3.connect(f"file:{self.out / 'ledger.sqlite'}?mode=ro", uri=True,
                               timeout=10)

    def logs(self) -> str:
        parts = [f"--- {self.child.name}:\n{tail(self.child.log)}"]
        parts += [f"--- {w.name}:\n{tail(w.log)}" for w in self.workers]
        return "\n".join(parts)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()
        self.child.stop()


@pytest.fixture
def make_learner(tmp_path: Path) -> Iterator[object]:
    """A factory of Learners under tmp_path, all stopped at the end of the test."""
    made: list[Learner] = []

    def make(*keys: str, token: bool = True, name: str = "learner") -> Learner:
        learner = Learner(tmp_path / f"{name}{len(made)}", *keys, token=token, name=name)
        made.append(learner)
        return learner

    yield make
    for learner in made:
        learner.stop()


def python() -> str:
    return sys.executable
