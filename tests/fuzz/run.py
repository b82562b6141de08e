#!/usr/bin/env python3
"""fuzz_smoke_test (issue 22 item 8): builds the libFuzzer targets in tests/fuzz/ with clang
(-fsanitize=fuzzer,address,undefined; the project's build is gcc's, so the sources each target
parses with are compiled again here, instrumented, with their flags from compile_commands.json)
and runs each over its seed corpus for a fixed number of inputs from a fixed seed, so that a run
is deterministic: a crash, a leak, undefined behaviour or a broken invariant fails the test and
leaves the input that caused it in the work directory. `--runs` 0 with `--seconds` fuzzes for
that long instead (the `long` label: hours, not CI).

Usage: run.py --clang CLANG --build-dir BUILD --source-dir SRC [--runs N | --runs 0 --seconds S]
       [--only TARGET ...]
"""
import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

# Each target: its harness, the project sources it exercises, the libraries they link.
TARGETS = {
    "config_yaml": (["common/status.cc", "common/logging.cc", "common/utf8.cc", "common/config.cc"],
                    ["-lyaml-cpp", "-lspdlog", "-lfmt"]),
    "dataset_row": (["common/status.cc", "common/tokenizer/dataset_row.cc",
                     "common/tokenizer/chat_template.cc"], []),
    "tokenizer_json": (["common/status.cc", "common/logging.cc", "common/utf8.cc",
                        "common/tokenizer/tokenizer.cc",
                        "common/tokenizer/tokenizer_util.cc", "common/tokenizer/added_tokens.cc",
                        "common/tokenizer/byte_tokenizer.cc", "common/tokenizer/bpe_tokenizer.cc"],
                       ["-lpcre2-8", "-licuuc", "-licudata", "-lspdlog", "-lfmt"]),
}
# Inputs per target in the CI smoke (about 10 s each on 2 cores; yaml-cpp is the slow one).
SMOKE_RUNS = {"config_yaml": 4000, "dataset_row": 100000, "tokenizer_json": 20000}
SANITIZE = ["-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=undefined",
            "-fno-omit-frame-pointer", "-g", "-O1"]


def flags_of(build_dir, source_dir, source):
    """-D and -I flags gcc compiled `source` with (compile_commands.json)."""
    with open(os.path.join(build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    path = os.path.join(source_dir, source)
    for e in entries:
        if os.path.realpath(e["file"]) == os.path.realpath(path):
            args = shlex.split(e["command"]) if "command" in e else e["arguments"]
            return [a for a in args if a.startswith(("-D", "-I", "-std="))]
    raise SystemExit(f"{source} is not in {build_dir}/compile_commands.json")


def build(clang, build_dir, source_dir, work, name):
    sources, libs = TARGETS[name]
    flags = flags_of(build_dir, source_dir, sources[-1])
    harness = os.path.join(source_dir, "tests", "fuzz", f"{name}_fuzz.cc")
    exe = os.path.join(work, f"{name}_fuzz")
    cmd = [clang, *flags, *SANITIZE, harness, *[os.path.join(source_dir, s) for s in sources],
           "-o", exe, *libs]
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
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="grpo-fuzz-")
    failed = []
    for name in a.only:
        exe = build(a.clang, a.build_dir, a.source_dir, work, name)
        corpus = os.path.join(work, f"{name}_corpus")  # seeds copied: the fuzzer adds to it
        shutil.copytree(os.path.join(a.source_dir, "tests", "fuzz", "corpus", name), corpus)
        runs = SMOKE_RUNS[name] if a.runs < 0 else a.runs
        limit = [f"-max_total_time={a.seconds}"] if runs == 0 else [f"-runs={runs}"]
        cmd = [exe, "-seed=1", "-max_len=16384", "-rss_limit_mb=2048", "-timeout=10",
               f"-artifact_prefix={work}/{name}-", *limit, corpus]
        t0 = time.monotonic()
        r = subprocess.run(cmd, capture_output=True, text=True)
        tail = "\n".join(r.stderr.splitlines()[-3:])
        print(f"fuzz: {name}: exit {r.returncode} in {time.monotonic() - t0:.0f} s\n{tail}",
              flush=True)
        if r.returncode != 0:
            print(r.stderr[-6000:], file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"fuzz: FAILED: {', '.join(failed)}; inputs and binaries kept in {work}")
        return 1
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
