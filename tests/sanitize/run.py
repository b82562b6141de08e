#!/usr/bin/env python3
"""Sanitizer runs of the tests (issue 22 item 8): builds the project again in a tree of its own
with GRPO_SANITIZE (CMakeLists.txt) and runs a set of its CTest tests there.

  --kind asan   ASan + UBSan (-fsanitize=address,undefined, UB fatal): the unit tests (every
                gtest binary labelled `unit`; the script-driven ones are checks of the sources,
                not of the running code, and stay out).
  --kind tsan   TSan: the threaded tests (the learner, the weight publisher and receivers, the
                epoch store, the rollout loop, the ledger, the metrics server, the gRPC
                services, the learner ranks as threads).

Any report fails the test that printed it (halt_on_error) and so this run. The sanitizers'
options and the suppressions for code we do not build (tests/sanitize/*.supp: libtorch, gRPC,
Gloo and the system libraries are prebuilt, uninstrumented) are set here and printed: to rerun
one test by hand in the tree (`cd build-asan && ctest -R x`), export that environment first.

The tree is reused (ccache makes a fresh one cheap after the first build on a machine).

Usage: run.py --kind asan|tsan --source-dir SRC [--build-dir DIR] [--jobs N] [--only TEST ...]
"""
import argparse
import json
import os
import subprocess
import sys
import time

# The threaded tests (TSan). Each runs its threads on our code; libtorch stays on one thread
# (OMP_NUM_THREADS=1) so that its pool, which TSan cannot see into, does not run our lambdas.
# Not here: the tests whose threads meet through gRPC (learner_service_test,
# learner_reliability_test, rollout_worker_test, remote_reward_test, learner_metrics_test).
# Debian's gRPC and Abseil are prebuilt: their completion queues hand buffers between their
# threads and ours under absl::Mutex, which TSan cannot see, so every RPC reads as a race (memory
# gRPC allocates on its threads, read by the inline grpcpp code in ours). The engines behind
# those shells are here without gRPC: the Learner with its threads (learner_test), the
# worker's loop through FakeLearnerLink (rollout_loop_test).
TSAN_TESTS = [
    "learner_test", "weight_publisher_test", "weight_sync_group_test", "weight_sync_test",
    "gloo_weight_sync_test", "rollout_loop_test", "prompt_ledger_test", "metrics_test",
    "http_exposer_test", "data_parallel_test", "process_test", "cancel_token_test",
    "rollout_episode_test",
]
# Unit tests that are not gtest binaries of our code: they check sources (format, lock
# annotations) or build their own instrumented binaries (fuzzing).
NOT_BINARIES = {"format_test", "thread_safety_test", "fuzz_smoke_test"}

SANITIZE = {"asan": "address,undefined", "tsan": "thread"}


def sanitizer_env(kind, source_dir):
    supp = os.path.join(source_dir, "tests", "sanitize")
    env = {"OMP_NUM_THREADS": "1"}
    if kind == "asan":
        # detect_leaks: LeakSanitizer runs at exit; its suppressions name prebuilt libraries.
        env["ASAN_OPTIONS"] = ":".join([
            "detect_leaks=1", "halt_on_error=1", "abort_on_error=1", "strict_string_checks=1",
            "detect_stack_use_after_return=0", "check_initialization_order=1",
            "protect_shadow_gap=0",  # CUDA's runtime maps memory there (libtorch loads it)
        ])
        env["LSAN_OPTIONS"] = f"suppressions={supp}/lsan.supp:print_suppressions=0"
        env["UBSAN_OPTIONS"] = "print_stacktrace=1:halt_on_error=1"
    else:
        env["TSAN_OPTIONS"] = ":".join([
            "halt_on_error=1", "abort_on_error=1", "second_deadlock_stack=1",
            f"suppressions={supp}/tsan.supp", "print_suppressions=0", "report_signal_unsafe=0",
        ])
    return env


def run(cmd, env=None, cwd=None):
    print("sanitize: $", " ".join(cmd), flush=True)
    return subprocess.run(cmd, env=env, cwd=cwd).returncode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=sorted(SANITIZE), required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--build-dir", default="")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", nargs="*", default=[])
    ap.add_argument("--timeout", type=int, default=1200, help="per test, seconds")
    a = ap.parse_args()
    src = os.path.abspath(a.source_dir)
    build = os.path.abspath(a.build_dir or os.path.join(src, f"build-{a.kind}"))
    t0 = time.monotonic()

    # -O1 (the sanitizers' advice: fast enough to run, readable stacks, and a quicker build than
    # -O3); NDEBUG as in the Release build, so the code under test is the code that ships.
    cmake = ["cmake", "-S", src, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
             "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG", f"-DGRPO_SANITIZE={SANITIZE[a.kind]}"]
    if run(cmake) != 0:
        return f"sanitize: configuring {build} failed"
    # Which tests: the unit-labelled gtest binaries (asan), or the threaded list (tsan).
    listing = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, capture_output=True,
                             text=True, check=True)
    tests = {}
    for t in json.loads(listing.stdout)["tests"]:
        labels = set()
        for p in t.get("properties", []):
            if p["name"] == "LABELS":
                labels = set(p["value"])
        tests[t["name"]] = labels
    if a.only:
        names = a.only
    elif a.kind == "asan":
        names = sorted(n for n, labels in tests.items()
                       if "unit" in labels and n not in NOT_BINARIES)
    else:
        names = [n for n in TSAN_TESTS if n in tests]
    missing = [n for n in names if n not in tests]
    if missing:
        return f"sanitize: no such tests in {build}: {', '.join(missing)}"
    # Build only what the chosen tests run: grpo_add_test names each executable as its test.
    if run(["cmake", "--build", build, "-j", str(a.jobs), "--target", *names]) != 0:
        return "sanitize: build failed"
    t_built = time.monotonic()

    env = dict(os.environ)
    extra = sanitizer_env(a.kind, src)
    env.update(extra)
    print("sanitize: environment:", " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)
    regex = "^(" + "|".join(names) + ")$"
    rc = run(["ctest", "--output-on-failure", "-j", str(a.jobs), "--timeout", str(a.timeout),
              "-R", regex], env=env, cwd=build)
    print(f"sanitize: {a.kind}: {len(names)} tests; build {t_built - t0:.0f} s, "
          f"tests {time.monotonic() - t_built:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
