#!/usr/bin/env bash
# The README's test command: installs, builds and runs every test (ctest). Tests labelled
# `gpu` run only where nvidia-smi finds a GPU; `long` ones only with GRPO_LONG_TESTS=1.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)

bash deploy/build.sh

# `gpu` tests need a GPU; `long` ones (the 2,000-step stability run) run with GRPO_LONG_TESTS=1.
excluded=()
if ! { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
  excluded+=(gpu)
fi
if [ "${GRPO_LONG_TESTS:-0}" != "1" ]; then
  excluded+=(long)
fi
label_filter=()
if [ "${#excluded[@]}" -gt 0 ]; then
  label_filter=(-LE "^($(IFS='|'; echo "${excluded[*]}"))\$")
fi
cd build
ctest --output-on-failure -j "${GRPO_TEST_JOBS:-2}" --timeout 1200 "${label_filter[@]}"
echo "deploy/test.sh: setup + build + tests took $(( $(date +%s) - start )) s"
