"""grpo_serve: the Python side of grpo-serve.

- :class:`Client`: submit a dataset to a learner (``datasets``, lists of dicts, JSON Lines or
  parquet), watch, follow, query and cancel its job;
- :func:`follow`: a live progress bar and the reward curve, in a terminal or a notebook;
- :func:`report`: every step's metrics on TensorBoard, Trackio, Weights & Biases or MLflow under
  TRL's names;
- :func:`serve_rewards`: Python reward functions with TRL's signature as a reward server;
- :func:`serve_environment`: a Python environment of multi-turn episodes (reset/step returning
  an :class:`Observation`) as an environment server;
- :func:`start_local`: a learner and rollout workers on this machine (the ``grpo`` binary).

It reaches the C++ services only through the wire protocol (proto/grpo/v1), whose stubs are
generated when the package is built.
"""

from grpo_serve.client import Client, Job
from grpo_serve.dataset import content_key, to_lines, validate_lines
from grpo_serve.environment import EnvironmentServer, Observation, serve_environment
from grpo_serve.errors import DatasetError, GrpoServeError, RpcError
from grpo_serve.follow import follow
from grpo_serve.job import JobResult, JobStatus, PromptCounts, StepRecord
from grpo_serve.local import LocalRun, start_local
from grpo_serve.report import BACKENDS, Reporter, report
from grpo_serve.rewards import CompletionIds, RewardServer, serve_rewards
from grpo_serve.watch import StepStream

__version__ = "0.1.0"

__all__ = [
    "BACKENDS", "Client", "CompletionIds", "DatasetError", "EnvironmentServer", "GrpoServeError",
    "Job", "JobResult", "JobStatus", "LocalRun", "Observation", "PromptCounts", "Reporter",
    "RewardServer", "RpcError", "StepRecord", "StepStream", "content_key", "follow", "report",
    "serve_environment", "serve_rewards", "start_local", "to_lines", "validate_lines",
    "__version__",
]
