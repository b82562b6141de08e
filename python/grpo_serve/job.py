"""A learner's job as the client sees it: its status and the step records of its stream."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from grpo_serve._wire import learner_pb2

# learner/job.h JobStateName, by grpo.v1.JobState number.
STATE_NAMES = {
    learner_pb2.JOB_STATE_UNSPECIFIED: "unknown",
    learner_pb2.JOB_STATE_WAITING_FOR_DATA: "waiting_for_data",
    learner_pb2.JOB_STATE_RUNNING: "running",
    learner_pb2.JOB_STATE_DONE: "done",
    learner_pb2.JOB_STATE_CANCELLED: "cancelled",
    learner_pb2.JOB_STATE_FAILED: "failed",
}
TERMINAL_STATES = frozenset({"done", "cancelled", "failed"})

# A step record: the step's metrics under TRL's names (floats) and "step" (an int), the fields
# `grpo watch --json` prints.
StepRecord = dict[str, Any]


@dataclass(frozen=True)
class PromptCounts:
    """The learner's prompts by state, and the pass (epoch) it is in."""

    queued: int = 0
    leased: int = 0
    trained: int = 0
    rejected: int = 0
    filtered: int = 0
    pass_: int = 0

    @property
    def total(self) -> int:
        return self.queued + self.leased + self.trained + self.rejected + self.filtered


@dataclass(frozen=True)
class JobStatus:
    """grpo.v1.Job: what `grpo status` prints."""

    state: str  # waiting_for_data | running | done | cancelled | failed
    global_step: int
    max_steps: int
    policy_version: int
    workers: int
    prompts: PromptCounts
    last_metrics: dict[str, float] = field(default_factory=dict)
    message: str = ""

    @property
    def terminal(self) -> bool:
        """True once the job is done, cancelled or failed (nothing more will happen)."""
        return self.state in TERMINAL_STATES

    @classmethod
    def from_proto(cls, job: Any) -> JobStatus:
        p = job.prompts
        return cls(
            state=STATE_NAMES.get(job.state, "unknown"),
            global_step=job.global_step,
            max_steps=job.max_steps,
            policy_version=job.policy_version,
            workers=job.workers,
            # `filtered` is newer than some learners; an older one sends 0.
            prompts=PromptCounts(p.queued, p.leased, p.trained, p.rejected,
                                 getattr(p, "filtered", 0), getattr(p, "pass")),
            last_metrics=dict(job.last_metrics),
            message=job.message,
        )


def step_record(metrics: Any, step: int) -> StepRecord:
    """The record of one step: its metrics and "step" (services/learner_client.cc StepJson)."""
    record: StepRecord = {k: float(v) for k, v in metrics.items()}
    record["step"] = int(step)
    return record


def json_value(value: Any) -> Any:
    """`value` as grpo watch --json writes it: nlohmann's dump writes NaN and infinities as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


@dataclass
class JobResult:
    """How a followed job ended: its step records, final state and what the stream missed."""

    records: list[StepRecord]
    state: str | None  # the final state; None when the stream was closed before the job ended
    missed_steps: list[int] = field(default_factory=list)
    status: JobStatus | None = None  # the last status seen

    @property
    def rewards(self) -> list[float]:
        """The mean reward of each step record, in order (the reward curve)."""
        return [float(r.get("reward", math.nan)) for r in self.records]
