"""report(job, to=[...]): every step's metrics on the dashboards a TRL user already has.

The learner's step metrics carry TRL's names (``reward``, ``reward_std``, ``kl``,
``rewards/<fn>/mean``, ``completions/mean_length`` ...). A TRL run reaches each dashboard through
a transformers callback (transformers/integrations/integration_utils.py), which renames them;
each backend here logs them exactly as that callback would:

- tensorboard (TensorBoardCallback): ``add_scalar("train/" + name, value, global_step)`` into
  ``$TENSORBOARD_LOGGING_DIR`` or ``runs/<date>_<host>``;
- trackio (TrackioCallback): ``trackio.log({"train/" + name: value, ..., "train/global_step":
  step})`` in project "huggingface" unless told;
- wandb (WandbCallback): the same dict, with ``train/global_step`` as every metric's step
  (``define_metric``), project ``$WANDB_PROJECT`` or "huggingface";
- mlflow (MLflowCallback): ``log_metrics`` with the names as they are (characters MLflow refuses
  become "_"), ``step=global_step``, in ``$MLFLOW_EXPERIMENT_NAME`` unless told.

Names that start with ``eval_``/``test_`` would become ``eval/``/``test/`` (rewrite_logs); the
learner sends none.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from grpo_serve.errors import GrpoServeError
from grpo_serve.job import JobResult, StepRecord
from grpo_serve.watch import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_WATCH_TIMEOUT

if TYPE_CHECKING:
    from grpo_serve.client import Client, Job

BACKENDS = ("trackio", "tensorboard", "wandb", "mlflow")
# TrainingArguments.project's default, which TrackioCallback and WandbCallback use.
TRL_DEFAULT_PROJECT = "huggingface"
_MLFLOW_REFUSED = re.compile(r"[^0-9A-Za-z_\-\. :/]")


def trl_log_names(metrics: Mapping[str, float]) -> dict[str, float]:
    """transformers' rewrite_logs: "eval_x" -> "eval/x", "test_x" -> "test/x", else "train/x"."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if k.startswith("eval_"):
            out["eval/" + k[5:]] = v
        elif k.startswith("test_"):
            out["test/" + k[5:]] = v
        else:
            out["train/" + k] = v
    return out


def mlflow_names(metrics: Mapping[str, float]) -> dict[str, float]:
    """MLflowCallback's names: the metric names with characters MLflow refuses replaced."""
    return {_MLFLOW_REFUSED.sub("_", k): v for k, v in metrics.items()}


def default_logdir() -> str:
    """transformers' default_logdir: runs/<Mon DD_HH-MM-SS>_<hostname>."""
    return os.path.join("runs", datetime.now().strftime("%b%d_%H-%M-%S") + "_"
                        + socket.gethostname())


def _metrics(record: StepRecord) -> tuple[int, dict[str, float]]:
    step = int(record["step"])
    return step, {k: float(v) for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _need(module: str, backend: str, package: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise GrpoServeError(f"report_to {backend!r} needs the {package} package "
                             f"(pip install {package}): {e}") from e


class _Backend:
    def log(self, step: int, metrics: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _TensorBoard(_Backend):
    """Events as torch.utils.tensorboard's add_scalar writes them (one scalar an event)."""

    def __init__(self, logging_dir: str | None) -> None:
        writer = _need("tensorboard.summary.writer.event_file_writer", "tensorboard",
                       "tensorboard")
        self._pb = _need("tensorboard.compat.proto.event_pb2", "tensorboard", "tensorboard")
        self._summary = _need("tensorboard.compat.proto.summary_pb2", "tensorboard",
                              "tensorboard")
        self.logging_dir = (logging_dir or os.environ.get("TENSORBOARD_LOGGING_DIR")
                            or default_logdir())
        self._writer = writer.EventFileWriter(os.path.expanduser(self.logging_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        for tag, value in trl_log_names(metrics).items():
            summary = self._summary.Summary(
                value=[self._summary.Summary.Value(tag=tag, simple_value=value)])
            self._writer.add_event(self._pb.Event(wall_time=time.time(), step=step,
                                                  summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Trackio(_Backend):
    def __init__(self, project: str | None, run_name: str | None,
                 config: Mapping[str, Any] | None) -> None:
        self._trackio = _need("trackio", "trackio", "trackio")
        self._trackio.init(project=project or TRL_DEFAULT_PROJECT, name=run_name,
                           resume="allow", config=dict(config) if config else None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._trackio.log({**trl_log_names(metrics), "train/global_step": step}, step=step)

    def close(self) -> None:
        self._trackio.finish()


class _Wandb(_Backend):
    def __init__(self, project: str | None, run_name: str | None, wandb_dir: str | None,
                 config: Mapping[str, Any] | None) -> None:
        wandb = _need("wandb", "wandb", "wandb")
        self._run = wandb.init(project=project or os.getenv("WANDB_PROJECT", TRL_DEFAULT_PROJECT),
                               name=run_name, dir=wandb_dir,
                               config=dict(config) if config else None)
        self._run.define_metric("train/global_step")
        self._run.define_metric("*", step_metric="train/global_step", step_sync=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log({**trl_log_names(metrics), "train/global_step": step})

    def close(self) -> None:
        self._run.finish()


class _MLflow(_Backend):
    def __init__(self, project: str | None, run_name: str | None,
                 tracking_uri: str | None, config: Mapping[str, Any] | None) -> None:
        self._mlflow = _need("mlflow", "mlflow", "mlflow-skinny")
        if tracking_uri:
            self._mlflow.set_tracking_uri(tracking_uri)
        experiment = project or os.getenv("MLFLOW_EXPERIMENT_NAME")
        if experiment:
            self._mlflow.set_experiment(experiment)
        self.run = self._mlflow.start_run(run_name=run_name)
        if config:
            self._mlflow.log_params(dict(config))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._mlflow.log_metrics(mlflow_names(metrics), step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _backend_names(to: str | Sequence[str] | None) -> list[str]:
    names = [to] if isinstance(to, str) else list(to or [])
    names = [n.strip() for item in names for n in item.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown report_to {', '.join(map(repr, unknown))}: expected "
                         f"{', '.join(BACKENDS)} (or none)")
    return list(dict.fromkeys(names))


class Reporter:
    """The dashboards of `to` (names of BACKENDS, a list or comma-separated), opened now and
    logged to by log(record) until close(). `project`: the trackio project, wandb project and
    MLflow experiment (each backend's TRL default when None); `run_name`: the run's name;
    `logging_dir`: TensorBoard's directory; `wandb_dir`: wandb's `dir`; `mlflow_tracking_uri`;
    `config`: run parameters to record. Not thread-safe."""

    def __init__(self, to: str | Sequence[str] | None, *, project: str | None = None,
                 run_name: str | None = None, logging_dir: str | None = None,
                 wandb_dir: str | None = None, mlflow_tracking_uri: str | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        self.backends: dict[str, _Backend] = {}
        try:
            for name in _backend_names(to):
                if name == "tensorboard":
                    self.backends[name] = _TensorBoard(logging_dir)
                elif name == "trackio":
                    self.backends[name] = _Trackio(project, run_name, config)
                elif name == "wandb":
                    self.backends[name] = _Wandb(project, run_name, wandb_dir, config)
                else:
                    self.backends[name] = _MLflow(project, run_name, mlflow_tracking_uri, config)
        except BaseException:
            self.close()
            raise
        self.logged_steps = 0

    def log(self, record: StepRecord) -> None:
        """Logs one step record (metrics and "step") to every backend."""
        step, metrics = _metrics(record)
        for backend in self.backends.values():
            backend.log(step, metrics)
        self.logged_steps += 1

    def close(self) -> None:
        """Flushes and closes every backend (idempotent)."""
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def report(job: Job | Client, to: str | Sequence[str] = ("tensorboard",), *,
           timeout: float = DEFAULT_WATCH_TIMEOUT,
           reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT, **options: Any) -> JobResult:
    """Logs every step of `job` to the dashboards `to` until the job ends (Reporter's keywords
    in `options`); returns the JobResult. Blocks: run it in a thread beside other work, or use
    follow(job, report_to=...)."""
    from grpo_serve.client import Client

    handle = job.job() if isinstance(job, Client) else job
    records: list[StepRecord] = []
    # The watch first (its start is now), then the dashboards, whose imports take seconds.
    stream = handle.client.watch(handle, timeout=timeout, reconnect_timeout=reconnect_timeout)
    with stream, Reporter(to, **options) as reporter:
        for record in stream:
            reporter.log(record)
            records.append(record)
    return JobResult(records, stream.state, list(stream.missed_steps), stream.status)
