"""start_local(): a learner and rollout workers on this machine, on loopback.

What ``grpo demo`` starts before it submits its task (services/cli/cli_demo.cc), for a notebook or
a script: the ``grpo`` binary's ``learner`` and ``rollout`` subcommands as child processes, a fresh
token, every port on 127.0.0.1. The package talks to them only over the wire.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from grpo_serve.client import Client
from grpo_serve.errors import GrpoServeError

# The learner initialises (or loads) its model before it prints its port (cli_demo.cc).
DEFAULT_START_TIMEOUT = 120.0
# Between SIGTERM and SIGKILL when stopping the children.
DEFAULT_KILL_GRACE = 10.0
_LOG_TAIL_LINES = 8


def find_grpo(grpo: str | os.PathLike[str] | None = None) -> str:
    """The grpo binary: `grpo`, else $GRPO_BIN, else `grpo` on PATH."""
    candidate = os.fspath(grpo) if grpo is not None else os.environ.get("GRPO_BIN")
    if candidate:
        if not (os.path.isfile(candidate) and os.access(candidate, os.X_OK)):
            raise GrpoServeError(f"grpo binary {candidate} is not an executable file")
        return candidate
    found = shutil.which("grpo")
    if found is None:
        raise GrpoServeError("no grpo binary: pass grpo=PATH, set GRPO_BIN, or put grpo on PATH "
                             "(the build's build/services/grpo)")
    return found


def _child_env() -> dict[str, str]:
    """This process's environment plus GRPO_PARENT_PID: the grpo binary ends with this process
    (PR_SET_PDEATHSIG, set by grpo itself). Not a preexec_fn: that makes subprocess fork without
    exec and run Python in the child, where grpcio's fork handlers could restart a poller thread
    that the closing of the child's descriptors then killed (the learner died of SIGABRT)."""
    return dict(os.environ, GRPO_PARENT_PID=str(os.getpid()))


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    except OSError:
        return ""
    return "".join("    " + line + "\n" for line in lines)


class LocalRun:
    """A learner (and workers) started by start_local. `address` is the learner's HOST:PORT,
    `token_file` its token, `output_dir` holds the checkpoints, the config and every log."""

    def __init__(self, output_dir: Path, token_file: Path) -> None:
        self.output_dir = output_dir
        self.token_file = token_file
        self.address = ""
        self.metrics_port = 0
        self.processes: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: dict[str, IO[bytes]] = {}
        self._binary = ""
        self._worker_args: list[str] = []  # start_local's flags for every worker

    def client(self, **kwargs: Any) -> Client:
        """A Client of this learner, with its token."""
        return Client(self.address, token_file=self.token_file, **kwargs)

    def log_path(self, name: str) -> Path:
        """The log file of child `name` ("learner", "rollout-0", ...)."""
        return self.output_dir / f"{name}.log"

    def describe(self, name: str) -> str:
        """How child `name` is doing, with the end of its log."""
        p = self.processes[name]
        rc = p.poll()
        how = "is running" if rc is None else (
            f"was killed by signal {-rc}" if rc < 0 else f"exited with code {rc}")
        tail = _tail(self.log_path(name))
        return (f"{name} (pid {p.pid}) {how}; its log is {self.log_path(name)}"
                + (", ending:\n" + tail if tail else ""))

    def add_worker(self, name: str | None = None) -> str:
        """Starts one more ``grpo rollout`` worker of this learner, with the flags start_local
        gave its workers; returns its name (default ``rollout-N``, N the next free index), which
        names its log and its entry in `processes`. ValueError for a name already taken."""
        if name is None:
            n = 0
            while f"rollout-{n}" in self.processes:
                n += 1
            name = f"rollout-{n}"
        if name in self.processes:
            raise ValueError(f"a child named {name} already exists")
        self._spawn(name, [
            self._binary, "--log_level", "info", "rollout", "--learner_address", self.address,
            "--worker_id", name, "--metrics_port", "0", "--auth_token_file", str(self.token_file),
            "--weight_sync_hostname", "127.0.0.1", *self._worker_args])
        return name

    def _spawn(self, name: str, argv: list[str], stdout_pipe: bool = False) -> None:
        log = open(self.log_path(name), "ab")
        self._logs[name] = log
        self.processes[name] = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if stdout_pipe else log,
            stderr=log, env=_child_env())

    def _read_port(self, timeout: float) -> None:
        learner = self.processes["learner"]
        assert learner.stdout is not None
        deadline = time.monotonic() + timeout
        buf = b""
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise GrpoServeError(f"the learner printed no port within {timeout:g} s; "
                                     + self.describe("learner"))
            ready, _, _ = select.select([learner.stdout], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(learner.stdout.fileno(), 4096)
                buf += chunk
                if not chunk and learner.poll() is not None:
                    raise GrpoServeError("the learner did not start: " + self.describe("learner"))
            elif learner.poll() is not None:
                raise GrpoServeError("the learner did not start: " + self.describe("learner"))
        line = buf.split(b"\n", 1)[0]
        try:
            info = json.loads(line)
            port = int(info["port"])
        except (ValueError, KeyError, TypeError):
            raise GrpoServeError(f"unexpected first line from the learner: {line!r}") from None
        self.address = f"127.0.0.1:{port}"
        self.metrics_port = int(info.get("metrics_port", 0))

    def poll(self) -> dict[str, int | None]:
        """Each child's exit code (None while it runs)."""
        return {name: p.poll() for name, p in self.processes.items()}

    def wait(self, timeout: float) -> int | None:
        """Waits up to `timeout` seconds for the learner to exit (it does once the job ended and
        it lingered); its exit code, or None when it still runs."""
        try:
            return self.processes["learner"].wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = DEFAULT_KILL_GRACE) -> dict[str, int | None]:
        """SIGTERM to every child still running, SIGKILL after `grace` seconds; their exit
        codes. Idempotent."""
        for p in self.processes.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in self.processes.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for p in self.processes.values():
            if p.stdout is not None:
                p.stdout.close()
        for log in self._logs.values():
            log.close()
        return self.poll()

    def __enter__(self) -> LocalRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local(*, workers: int = 1, grpo: str | os.PathLike[str] | None = None,
                output_dir: str | os.PathLike[str] | None = None,
                reward_options: Mapping[str, Any] | None = None,
                reward_token: str | None = None,
                worker_args: Sequence[str] = (), linger_seconds: float | None = None,
                start_timeout: float = DEFAULT_START_TIMEOUT, **config: Any) -> LocalRun:
    """Starts ``grpo learner`` with the config keys `config` (TRL's GRPOConfig names, e.g.
    ``max_steps=20, num_generations=4, reward_funcs=["remote:short@127.0.0.1:50061"]``;
    ``grpo config --help`` lists them) and `workers` ``grpo rollout`` workers, all on loopback
    with a fresh token, and returns once the learner listens. `reward_options`: the workers'
    built-in reward options; `reward_token`: the token they send reward servers; `worker_args`:
    more ``grpo rollout`` flags; `linger_seconds`: how long the learner keeps serving after the
    job ended (``grpo learner --linger_seconds``); `output_dir`: default a fresh temporary
    directory. GrpoServeError, with the end of the learner's log, when it does not start within
    `start_timeout` seconds. The children get SIGTERM when the thread that started them exits
    (Linux's parent-death signal); stop() (or the `with` block's end) ends them. More workers:
    LocalRun.add_worker().
    """
    if workers < 0:
        raise ValueError("workers must be >= 0")
    binary = find_grpo(grpo)
    out = Path(output_dir) if output_dir is not None else Path(tempfile.mkdtemp(prefix="grpo-"))
    out.mkdir(parents=True, exist_ok=True)
    token_file = out / "auth_token"
    token_file.write_text(secrets.token_hex(16) + "\n")
    token_file.chmod(0o600)
    config_path = out / "learner_config.yaml"  # JSON is YAML
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    run = LocalRun(out, token_file)
    try:
        run._spawn("learner", [
            binary, "--log_level", "info", "learner", "--config", str(config_path),
            "--output_dir", str(out), "--auth_token_file", str(token_file),
            "--grpc_port", "0", "--grpc_bind_address", "127.0.0.1",
            "--metrics_port", "0", "--metrics_bind_address", "127.0.0.1",
            "--weight_sync_hostname", "127.0.0.1",
            *(["--linger_seconds", str(linger_seconds)] if linger_seconds is not None else [])],
            stdout_pipe=True)
        run._read_port(start_timeout)
        run._binary = binary
        run._worker_args = list(worker_args)
        if reward_options:
            run._worker_args += ["--reward_options", json.dumps(dict(reward_options))]
        if reward_token is not None:
            reward_token_file = out / "reward_token"
            reward_token_file.write_text(reward_token + "\n")
            reward_token_file.chmod(0o600)
            run._worker_args += ["--reward_auth_token_file", str(reward_token_file)]
        for i in range(workers):
            run.add_worker(f"rollout-{i}")
    except BaseException:
        run.stop()
        raise
    return run
