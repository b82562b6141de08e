#!/usr/bin/env bash
# The README's first command: installs, builds, and runs the main job.
# Today the main job is `grpo train-local`: a tiny policy initialised from scratch learns the
# built-in task (answer in about 8 tokens; TRL's length reward) with the full GRPO loop
# (generation with the KV cache, rewards, memory-flat training steps, checkpoints) in one
# process, and ends with the reward curve. The multi-process demo (learner + workers + client
# over gRPC) replaces it when the services land.
set -euo pipefail
cd "$(dirname "$0")/.."

bash deploy/build.sh grpo

out="${GRPO_DEMO_DIR:-build/demo-run}"
rm -rf "$out"
exec build/services/grpo train-local --output_dir "$out" --max_steps "${GRPO_DEMO_STEPS:-60}" "$@"
