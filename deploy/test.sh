#!/usr/bin/env bash
# The README's test command: installs, builds and runs every test (ctest). Tests labelled
# `gpu` run only where nvidia-smi finds a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

bash deploy/build.sh

label_filter=(-LE gpu)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  label_filter=()
fi
cd build
ctest --output-on-failure -j "${GRPO_TEST_JOBS:-2}" --timeout 1200 "${label_filter[@]}"
echo "deploy/test.sh: setup + build + tests took $(( $(date +%s) - start )) s"
