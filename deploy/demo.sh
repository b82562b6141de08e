#!/usr/bin/env bash
# The README's first command: installs, builds, and runs the main job.
# `grpo demo` runs the distributed system on this machine: a learner and two rollout workers as
# separate processes on loopback (gRPC, a generated auth token), a tiny policy initialised from
# scratch, the built-in task (answer in about 8 tokens; TRL's length reward) submitted by the
# client, one line per optimizer step followed over WatchJob, and the reward curve at the end.
# Logs, checkpoints and the config land in $GRPO_DEMO_DIR. `grpo train-local` runs the same task
# in one process.
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/build.sh grpo

out="${GRPO_DEMO_DIR:-build/demo-run}"
rm -rf "$out"
exec build/services/grpo demo --output_dir "$out" --max_steps "${GRPO_DEMO_STEPS:-60}" "$@"
