#!/usr/bin/env python3
"""fuzz_smoke_test (issue 22 item 8): builds the libFuzzer targets in tests/fuzz/ with clang
(-fsanitize=fuzzer,address,undefined; the project's build is gcc's, so the sources each target
parses with are compiled again here, instrumented, with their flags from compile_commands.json)
and runs each over its seed corpus for a fixed number of inputs from a fixed seed, so that a run
is deterministic: a crash, a leak, undefined behaviour or a broken invariant fails the test and
leaves the input that caused it in the work directory. `--runs` 0 with `--seconds` fuzzes for
that long instead (the `long` label: hours, not CI).

Usage: run.py --clang CLANG --build-dir BUILD --source-dir SRC [--runs N | --runs 0 --seconds S]
       [--only TARGET ...] [--skip TARGET ...] [--jobs N] [--keep]
"""
import argparse
import concurrent.futures
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# Each target: its harness, the project sources it exercises (a "build:" path is generated into
# the build tree), the libraries they link. "TORCH" stands for libtorch's (the wheel's lib/).
TOKENIZER_SOURCES = ["common/status.cc", "common/logging.cc", "common/utf8.cc",
                     "common/atomic_file.cc", "common/tokenizer/tokenizer.cc",
                     "common/tokenizer/tokenizer_util.cc", "common/tokenizer/added_tokens.cc",
                     "common/tokenizer/byte_tokenizer.cc", "common/tokenizer/bpe_tokenizer.cc"]
TOKENIZER_LIBS = ["-lpcre2-8", "-licuuc", "-licudata", "-lspdlog", "-lfmt"]
TARGETS = {
    "config_yaml": (["common/status.cc", "common/logging.cc", "common/utf8.cc", "common/config.cc"],
                    ["-lyaml-cpp", "-lspdlog", "-lfmt"]),
    "dataset_row": (["common/status.cc", "common/tokenizer/dataset_row.cc",
                     "common/tokenizer/chat_template.cc"], []),
    "tokenizer_json": (TOKENIZER_SOURCES, TOKENIZER_LIBS),
    "tokenizer_config": (TOKENIZER_SOURCES, TOKENIZER_LIBS),
    "model_config": (["common/status.cc", "common/logging.cc", "common/utf8.cc", "common/config.cc",
                      "common/model/model_config.cc", "learner/distributed/memory_plan.cc",
                      "common/malloc_info.cc"],
                     ["-lyaml-cpp", "-lspdlog", "-lfmt"]),
    "safetensors": (["common/status.cc", "common/model/safetensors.cc"], ["TORCH"]),
    "http_request": (["common/status.cc", "common/logging.cc", "common/utf8.cc", "common/config.cc",
                      "common/metrics/metrics.cc", "common/metrics/http_exposer.cc"],
                     ["-lprometheus-cpp-core", "-lboost_system", "-lyaml-cpp", "-lspdlog", "-lfmt",
                      "-lpthread"]),
    "wire_message": (["common/status.cc", "learner/group_check.cc",
                      "learner/distributed/group_codec.cc", "build:proto/grpo/v1/learner.pb.cc",
                      "services/convert.cc"],
                     ["-lgrpc++", "-lgpr", "-lprotobuf", "-lpthread"]),
}
# Inputs per target in the CI smoke: about 5-10 s each on one core (yaml-cpp and the tokenizer
# directory's files are the slow ones; http_request opens a connection or two an input).
SMOKE_RUNS = {"config_yaml": 4000, "dataset_row": 100000, "tokenizer_json": 20000,
              "tokenizer_config": 5000, "model_config": 150000, "safetensors": 100000,
              "http_request": 10000, "wire_message": 300000}
SANITIZE = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g", "-O1"]


def flags_of(build_dir, source_dir, source):
    """-D, -I and -isystem flags gcc compiled `source` with (compile_commands.json)."""
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    path = os.path.join(source_dir, source)
    for e in entries:
        if os.path.realpath(e["file"]) == os.path.realpath(path):
            args = shlex.split(e["command"]) if "command" in e else e["arguments"]
            flags = []
            for i, a in enumerate(args):
                if a.startswith(("-D", "-I", "-std=", "-isystem")):
                    flags.append(a)
                    if a == "-isystem" and i + 1 < len(args):
                        flags.append(args[i + 1])
            return flags
    raise SystemExit(f"{source} is not in {build_dir}/compile_commands.json")


def torch_libs(build_dir):
    """libtorch's link flags: its lib/, where the build found libc10 (CMakeCache.txt). libstdc++
    goes first, as CMakeLists.txt says why (the wheel exports part of GCC 13's)."""
    with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
        for line in f:
            if line.startswith("c10_LIBRARY:"):
                lib = os.path.dirname(line.split("=", 1)[1].strip())
                return ["-Wl,--no-as-needed", "-lstdc++", f"-L{lib}", f"-Wl,-rpath,{lib}",
                        "-ltorch_cpu", "-lc10", "-Wl,--as-needed"]
    raise SystemExit(f"no c10_LIBRARY in {build_dir}/CMakeCache.txt: libtorch was not found")


def source_path(build_dir, source_dir, source):
    if source.startswith("build:"):
        return os.path.join(build_dir, source[len("build:"):])
    return os.path.join(source_dir, source)


def build(clang, build_dir, source_dir, work, name):
    sources, libs = TARGETS[name]
    project = [s for s in sources if not s.startswith("build:")]
    flags = flags_of(build_dir, source_dir, project[-1])
    libs = [f for lib in libs for f in (torch_libs(build_dir) if lib == "TORCH" else [lib])]
    harness = os.path.join(source_dir, "tests", "fuzz", f"{name}_fuzz.cc")
    exe = os.path.join(work, f"{name}_fuzz")
    cmd = [clang, *flags, *SANITIZE, harness,
           *[source_path(build_dir, source_dir, s) for s in sources], "-o", exe, *libs]
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(" ".join(cmd), "\n", r.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"fuzz: building {name} failed")
    print(f"fuzz: built {name} in {time.monotonic() - t0:.0f} s", flush=True)
    return exe


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clang", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--runs", type=int, default=-1, help="inputs per target; -1: SMOKE_RUNS")
    ap.add_argument("--seconds", type=int, default=0)
    ap.add_argument("--only", nargs="*", default=list(TARGETS))
    ap.add_argument("--skip", nargs="*", default=[])
    ap.add_argument("--keep", action="store_true", help="keep the binaries and corpora")
    ap.add_argument("--jobs", type=int, default=1, help="targets built at once")
    a = ap.parse_args()
    unknown = [n for n in a.only + a.skip if n not in TARGETS]
    if unknown:
        return f"fuzz: no such targets: {', '.join(unknown)} (there are {', '.join(TARGETS)})"
    work = tempfile.mkdtemp(prefix="grpo-fuzz-")
    failed = []
    names = [n for n in a.only if n not in a.skip]
    # Builds (clang, one core each) run --jobs at a time; the fuzzers then one after another.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:
        exes = dict(zip(names, pool.map(
            lambda n: build(a.clang, a.build_dir, a.source_dir, work, n), names)))
    for name in names:
        exe = exes[name]
        corpus = os.path.join(work, f"{name}_corpus")  # seeds copied: the fuzzer adds to it
        shutil.copytree(os.path.join(a.source_dir, "tests", "fuzz", "corpus", name), corpus)
        runs = SMOKE_RUNS[name] if a.runs < 0 else a.runs
        limit = [f"-max_total_time={a.seconds}"] if runs == 0 else [f"-runs={runs}"]
        cmd = [exe, "-seed=1", "-max_len=16384", "-rss_limit_mb=2048", "-timeout=10",
               f"-artifact_prefix={work}/{name}-", *limit, corpus]
        t0 = time.monotonic()
        # Files a harness makes (tokenizer_config's model directory) go under the work directory,
        # which goes with it: libFuzzer may end without running atexit handlers.
        r = subprocess.run(cmd, capture_output=True, text=True,
                           env={**os.environ, "TMPDIR": work})
        tail = "\n".join(r.stderr.splitlines()[-3:])
        print(f"fuzz: {name}: exit {r.returncode} in {time.monotonic() - t0:.0f} s\n{tail}",
              flush=True)
        if r.returncode != 0:
            print(r.stderr[-6000:], file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"fuzz: FAILED: {', '.join(failed)}; inputs and binaries kept in {work}")
        return 1
    if a.keep:
        print(f"fuzz: binaries and corpora kept in {work}")
    else:
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
