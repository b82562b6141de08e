"""``python -m grpo_serve watch`` (also installed as ``grpo-serve watch``).

``grpo watch`` with ``--report_to``: follows a learner's job, prints one line per step (the step
table, or with ``--json`` the objects ``grpo watch --json`` prints) and logs every step to the
dashboards named (grpo_serve.report). Exit 0 when the job ended done or cancelled, 1 when it
failed or the stream broke, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from grpo_serve.client import DEFAULT_CALL_TIMEOUT, Client
from grpo_serve.errors import GrpoServeError, RpcError
from grpo_serve.job import JobStatus, StepRecord, json_value
from grpo_serve.report import BACKENDS, Reporter
from grpo_serve.watch import DEFAULT_WATCH_TIMEOUT


def step_json(record: StepRecord) -> str:
    """One record as grpo watch --json writes it: keys sorted, no spaces, NaN as null."""
    return json.dumps({k: json_value(v) for k, v in record.items()}, sort_keys=True,
                      separators=(",", ":"))


def step_table_header() -> str:
    """services/learner_client.cc StepTableHeader."""
    return (f"{'step':>6}{'reward':>10}{'reward_std':>11}{'loss':>10}{'kl':>10}"
            f"{'grad_norm':>10}{'len':>8}{'tok/s':>10}\n")


def step_table_row(r: StepRecord) -> str:
    """services/learner_client.cc StepTableRow (a missing metric prints as 0)."""
    def m(name: str) -> float:
        return float(r.get(name, 0.0))

    return (f"{r['step']:>6}{m('reward'):>10.4f}{m('reward_std'):>11.4f}{m('loss'):>10.4f}"
            f"{m('kl'):>10.4f}{m('grad_norm'):>10.4f}{m('completions/mean_length'):>8.1f}"
            f"{m('tokens_per_second'):>10.1f}\n")


def _state_line(s: JobStatus) -> str:
    return (f"job {s.state} at step {s.global_step}/{s.max_steps}"
            + (f": {s.message}" if s.message else ""))


def _watch(args: argparse.Namespace) -> int:
    client = Client(args.learner_address, token_file=args.auth_token_file,
                    tls_ca=args.tls_ca_file, timeout=args.timeout_seconds)
    last_state: list[str] = []

    def on_status(s: JobStatus) -> None:
        if not last_state or last_state[-1] != s.state:
            last_state.append(s.state)
            print(_state_line(s), file=sys.stderr, flush=True)

    # The watch first (it starts at the learner's step now), then the dashboards, whose imports
    # take seconds.
    stream = client.watch(timeout=args.watch_timeout_seconds, on_status=on_status)
    reporter = None
    header = False
    try:
        reporter = Reporter(args.report_to, project=args.project, run_name=args.run_name,
                            logging_dir=args.logging_dir) if args.report_to else None
        with stream:
            for record in stream:
                if reporter is not None:
                    reporter.log(record)
                if args.json:
                    sys.stdout.write(step_json(record) + "\n")
                else:
                    if not header:
                        sys.stdout.write(step_table_header())
                        header = True
                    sys.stdout.write(step_table_row(record))
                sys.stdout.flush()
    finally:
        stream.close()
        if reporter is not None:
            reporter.close()
        client.close()
    if stream.missed_steps:
        print(f"grpo-serve watch: steps {stream.missed_steps} went by while the stream was "
              "broken (the learner keeps no history)", file=sys.stderr)
    return 1 if stream.state == "failed" else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-serve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("watch", help="follow a learner's job: one line per step, and dashboards")
    w.add_argument("--learner_address", default="127.0.0.1:50051", help="HOST:PORT")
    w.add_argument("--auth_token_file", default=None, help="file holding the shared token")
    w.add_argument("--tls_ca_file", default=None, help="PEM CA: connect with TLS, verify against it")
    w.add_argument("--timeout_seconds", type=float, default=DEFAULT_CALL_TIMEOUT,
                   help="deadline of each call")
    w.add_argument("--watch_timeout_seconds", type=float, default=DEFAULT_WATCH_TIMEOUT,
                   help="deadline of the whole stream")
    w.add_argument("--json", action="store_true", help="one JSON object per step, as grpo watch")
    w.add_argument("--report_to", default=None,
                   help=f"comma-separated dashboards to log every step to: {', '.join(BACKENDS)}")
    w.add_argument("--project", default=None, help="trackio/wandb project, MLflow experiment")
    w.add_argument("--run_name", default=None, help="the dashboards' run name")
    w.add_argument("--logging_dir", default=None, help="TensorBoard's directory")
    args = parser.parse_args(argv)
    try:
        return _watch(args)
    except (ValueError, GrpoServeError) as e:
        print(f"grpo-serve {args.command}: {e}", file=sys.stderr)
        code = e.code if isinstance(e, RpcError) else "INVALID_ARGUMENT"
        return 2 if code in ("INVALID_ARGUMENT", "NOT_FOUND") else 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
