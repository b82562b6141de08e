#!/usr/bin/env bash
# deploy/gpu-check.sh: the GPU check of issue 15 §3, for a bare H200 machine (torch 2.11 + CUDA 13
# under `python3`, CMake, ninja, nvcc, 16 cores; no apt, pip or network). It builds the
# libtorch-only configuration (-DGRPO_BUILD_SERVICES=OFF) against python3's torch, runs the
# `gpu`-labelled tests and the device-generic ones, then the GPU benchmarks, and prints ONE JSON
# summary line at the end (everything before it is progress on stderr; logs in $BUILD/logs).
#
#   deploy/gpu-check.sh                  build here from source, then test and bench
#   deploy/gpu-check.sh --bundle DIR     use binaries built elsewhere (--make-bundle) instead
#   deploy/gpu-check.sh --make-bundle DIR
#                                        build here and copy the test/bench binaries and the
#                                        shared libraries they need beyond libtorch, CUDA and libc
#                                        into DIR, to carry to a machine that cannot build them
#                                        (one without GTest, yaml-cpp, spdlog ... headers)
# Every step has a time limit (GRPO_GPU_CHECK_* below, 590 s in all) so the whole run fits in the
# device tool's 10 minutes a call.
# Without a GPU the CUDA tests skip and the benchmarks run in their --small form on the CPU
# (how this script is checked on the build machines); the figures then mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GRPO_GPU_CHECK_BUILD:-$ROOT/build-gpu}
PY=${GRPO_GPU_CHECK_PYTHON:-python3}
T_CONFIGURE=${GRPO_GPU_CHECK_CONFIGURE_S:-45}
T_BUILD=${GRPO_GPU_CHECK_BUILD_S:-200}
T_TEST=${GRPO_GPU_CHECK_TEST_S:-140}
T_BENCH=${GRPO_GPU_CHECK_BENCH_S:-110}
T_HF=${GRPO_GPU_CHECK_HF_S:-55}
T_LONG_TAIL=${GRPO_GPU_CHECK_LONG_TAIL_S:-40}
JOBS=${GRPO_GPU_CHECK_JOBS:-16}
MODE=source
BUNDLE=""
case "${1:-}" in
  --bundle) MODE=bundle; BUNDLE=${2:?--bundle DIR} ;;
  --make-bundle) MODE=make-bundle; BUNDLE=${2:?--make-bundle DIR} ;;
  "") ;;
  *) echo "usage: $0 [--bundle DIR | --make-bundle DIR]" >&2; exit 2 ;;
esac
LOGS=$BUILD/logs
mkdir -p "$LOGS"
rm -f "$LOGS"/*.xml "$LOGS"/steps.jsonl "$LOGS"/bench.jsonl
start=$(date +%s)
log() { echo "gpu-check [$(( $(date +%s) - start ))s]: $*" >&2; }

# step NAME LIMIT_S CMD...: runs CMD under `timeout`, its output in $LOGS/NAME.log; records rc.
step() {
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  log "$name (limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "{\"step\": \"$name\", \"rc\": $rc, \"seconds\": $(( $(date +%s) - t0 )), \"limit_s\": $limit}" \
    >>"$LOGS/steps.jsonl"
  [ $rc -ne 0 ] && log "$name failed (rc $rc): tail of $LOGS/$name.log:" && tail -n 15 "$LOGS/$name.log" >&2
  return $rc
}

# The device-generic tests (run on the GPU machine too: they must pass there) and the benches.
GENERIC_TESTS="config_test model_test chunked_logprobs_test optimizer_test grpo_trainer_test
  rollout_sampler_test rollout_generator_test device_test precision_test"
GPU_TESTS_DEFAULT="cuda_parity_test nccl_weight_sync_test cuda_ipc_weight_sync_test rank_group_nccl_test"
TARGETS="$GENERIC_TESTS cuda_parity_test grpo_gpu_bench"
GPU_BUILT=""

HAVE_GPU=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then HAVE_GPU=1; fi
GPU_NAME=$( [ $HAVE_GPU = 1 ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 || echo none)

TORCH_PREFIX=$(timeout 60 "$PY" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)' 2>"$LOGS/torch.log")
TORCH_LIB=$(timeout 60 "$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))' 2>>"$LOGS/torch.log")
TORCH_VERSION=$(timeout 60 "$PY" -c 'import torch; print(torch.__version__)' 2>>"$LOGS/torch.log")

BIN=""
if [ "$MODE" = source ] || [ "$MODE" = make-bundle ]; then
  if [ -z "$TORCH_PREFIX" ]; then
    log "$PY cannot import torch"
  else
    # GRPO_PYTHON: CMakeLists.txt takes Torch_DIR from its torch.utils.cmake_prefix_path
    # ($TORCH_PREFIX/Torch) and puts that torch's root first in the prefix path.
    log "torch $TORCH_VERSION: Torch_DIR $TORCH_PREFIX/Torch"
    step configure "$T_CONFIGURE" cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DGRPO_BUILD_SERVICES=OFF -DTORCH_CUDA_ARCH_LIST=9.0 \
      -DGRPO_PYTHON="$(command -v "$PY")" &&
      GPU_BUILT=$( (cd "$BUILD" && ctest -N -L gpu) | awk '/Test +#/{print $3}' | tr '\n' ' ') &&
      step build "$T_BUILD" cmake --build "$BUILD" -j "$JOBS" --target $TARGETS $GPU_BUILT &&
      BIN=$BUILD/tests
  fi
  if [ -z "$BIN" ] && [ "$MODE" = source ] && [ -d "$ROOT/deploy/gpu-bundle/bin" ]; then
    log "source build failed: falling back to the carried deploy/gpu-bundle"
    MODE=bundle; BUNDLE=$ROOT/deploy/gpu-bundle
  fi
fi
if [ "$MODE" = make-bundle ] && [ -n "$BIN" ]; then
  mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
  for t in $TARGETS $GPU_BUILT; do cp "$BIN/$t" "$BUNDLE/bin/"; done
  # Shared libraries beyond libtorch/CUDA (python3's torch brings those) and the C runtime.
  for t in $TARGETS $GPU_BUILT; do ldd "$BIN/$t"; done | awk '/=> \//{print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|libutil|ld-linux[^/]*|libgcc_s|libstdc\+\+)\.so|torch/lib|/nvidia/|/cuda[^/]*/|libcuda\.so|libcudart|libnccl|libnvidia' |
    while read -r lib; do cp -L "$lib" "$BUNDLE/lib/"; done
  echo "$TORCH_VERSION" >"$BUNDLE/TORCH_VERSION"
  echo "$GPU_BUILT" >"$BUNDLE/GPU_TESTS"
  log "bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE (built against torch $TORCH_VERSION)"
fi
if [ "$MODE" = bundle ]; then
  BIN=$BUNDLE/bin
  # CUDA's runtime and NCCL from the wheels python3's torch uses (site-packages/nvidia/*/lib).
  NV_LIBS=$(ls -d "$TORCH_LIB"/../../nvidia/*/lib "$TORCH_LIB"/../../nvidia/cu*/lib 2>/dev/null | tr '\n' ':')
  export LD_LIBRARY_PATH="$BUNDLE/lib:$TORCH_LIB:$NV_LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "bundle mode: $BIN (built against torch $(cat "$BUNDLE/TORCH_VERSION" 2>/dev/null), here $TORCH_VERSION)"
fi

# Tests: each binary once, with its gtest XML report. In a source build the gpu list is ctest's
# `-L gpu` selection; a bundle carries the default list.
GPU_TESTS=$GPU_TESTS_DEFAULT
[ "$MODE" = bundle ] && [ -f "$BUNDLE/GPU_TESTS" ] && GPU_TESTS=$(cat "$BUNDLE/GPU_TESTS")
if [ "$MODE" = source ] && [ -n "$BIN" ]; then
  GPU_TESTS=$( (cd "$BUILD" && ctest -N -L gpu) | awk '/Test +#/{print $3}' | tr '\n' ' ')
fi
export GRPO_SOURCE_DIR=$ROOT GRPO_BINARY_DIR=$BUILD GRPO_PYTHON="$(command -v "$PY")"
run_tests() {
  for t in $GPU_TESTS $GENERIC_TESTS; do
    [ -x "$BIN/$t" ] || { echo "{\"binary\": \"$t\", \"missing\": true}" >>"$LOGS/missing.jsonl"; continue; }
    log "test $t"
    "$BIN/$t" --gtest_output="xml:$LOGS/$t.xml" >"$LOGS/$t.log" 2>&1 || log "$t: failures (see $LOGS/$t.log)"
  done
}
rm -f "$LOGS/missing.jsonl"
if [ -n "$BIN" ]; then
  export -f run_tests log; export BIN LOGS GPU_TESTS GENERIC_TESTS start
  step tests "$T_TEST" bash -c run_tests
  # Benchmarks: ours, then transformers' generate on the same decode shape.
  SMALL=$( [ $HAVE_GPU = 1 ] || echo --small)
  step bench "$T_BENCH" bash -c "set -o pipefail; \"$BIN/grpo_gpu_bench\" $SMALL --only matmul_bf16,learner_step,decode,logprob_memory | tee \"$LOGS/bench.jsonl\""
  # The long tail with and without in-flight weight updates (issue 26), in its own time limit.
  step long_tail "$T_LONG_TAIL" bash -c "set -o pipefail; \"$BIN/grpo_gpu_bench\" $SMALL --only long_tail | tee -a \"$LOGS/bench.jsonl\""
  step hf_generate "$T_HF" bash -c "set -o pipefail; PYTHONUNBUFFERED=1 \"$PY\" \"$ROOT/tests/bench/hf_generate_bench.py\" $SMALL | tee -a \"$LOGS/bench.jsonl\""
  # The CUDA-IPC sync time of a 0.6B-sized model is measured inside its two-process test.
  grep -h '^{"bench": "cuda_ipc_sync"' "$LOGS/cuda_ipc_weight_sync_test.log" >>"$LOGS/bench.jsonl" 2>/dev/null || true
fi

# The one JSON summary line.
GPU_NAME="$GPU_NAME" MODE="$MODE" TORCH_VERSION="$TORCH_VERSION" ELAPSED=$(( $(date +%s) - start )) \
  "$PY" - "$LOGS" <<'PYEOF' || echo '{"gpu_check": "summary failed"}'
import glob, json, os, sys
import xml.etree.ElementTree as ET
logs = sys.argv[1]
passed, failed, skipped, binaries = [], [], [], {}
for path in sorted(glob.glob(os.path.join(logs, "*.xml"))):
    b = os.path.basename(path)[:-4]
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        failed.append(b + " (no report: crashed?)")
        continue
    n = 0
    for case in root.iter("testcase"):
        n += 1
        name = f"{b}:{case.get('classname')}.{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(name)
        elif case.find("skipped") is not None or case.get("result") == "skipped" \
                or case.get("status") == "notrun":
            skipped.append(name)
        else:
            passed.append(name)
    binaries[b] = n
missing = []
mp = os.path.join(logs, "missing.jsonl")
if os.path.exists(mp):
    missing = [json.loads(l)["binary"] for l in open(mp) if l.strip()]
steps = [json.loads(l) for l in open(os.path.join(logs, "steps.jsonl"))] \
    if os.path.exists(os.path.join(logs, "steps.jsonl")) else []
bench = {}
bp = os.path.join(logs, "bench.jsonl")
if os.path.exists(bp):
    for line in open(bp):
        line = line.strip()
        if line.startswith("{"):
            try:
                j = json.loads(line)
                bench[j.get("bench", "?")] = j
            except json.JSONDecodeError:
                pass
# Decode against transformers' generate on the same shape (same run).
if "decode" in bench and "hf_generate" in bench and "tokens_per_second" in bench["hf_generate"]:
    bench["decode"]["baseline_hf_generate_tokens_per_second"] = bench["hf_generate"]["tokens_per_second"]
    bench["decode"]["speedup_vs_hf_generate"] = (
        bench["decode"]["tokens_per_second"] / bench["hf_generate"]["tokens_per_second"])
    bench["decode"]["goal_speedup_vs_hf_generate"] = 2.0
# CUDA-IPC sync of the 0.6B model against a learner step of the same shape (goal <= 5%).
if "cuda_ipc_sync" in bench and "learner_step" in bench and bench["learner_step"].get("step_seconds"):
    bench["cuda_ipc_sync"]["fraction_of_learner_step"] = (
        bench["cuda_ipc_sync"]["seconds_median"] / bench["learner_step"]["step_seconds"])
    bench["cuda_ipc_sync"]["goal_fraction_of_learner_step"] = 0.05
print(json.dumps({
    "gpu_check": "ok" if steps and not failed and not missing and all(s["rc"] == 0 for s in steps) else "failed",
    "gpu": os.environ.get("GPU_NAME"), "mode": os.environ.get("MODE"),
    "torch": os.environ.get("TORCH_VERSION"), "elapsed_s": int(os.environ.get("ELAPSED", 0)),
    "steps": steps,
    "tests": {"passed": len(passed), "failed": len(failed), "skipped": len(skipped),
              "failed_names": failed, "skipped_names": skipped, "missing_binaries": missing,
              "binaries": binaries},
    "bench": bench,
}))
PYEOF
