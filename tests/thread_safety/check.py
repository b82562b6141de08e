#!/usr/bin/env python3
"""thread_safety_test: clang's -Wthread-safety over the production sources that lock
common::Mutex, with each file's own flags from the build's compile_commands.json (the build
itself is gcc's, which ignores the annotations: this is where they are checked).

The negative control (violation.cc) must be REJECTED with thread-safety errors, else the check
proves nothing (a clang without the analysis, macros expanding to nothing, a flag lost).

Usage: check.py --clang CLANG --build-dir BUILD --source-dir SRC --violation FILE [--jobs N]
"""
import argparse
import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
import time

# Production directories (tests are not annotated).
DIRS = ("common", "learner", "rollout", "services")
# A file is checked when it or its own header (same name, .h) uses the annotated mutex: code
# that locks, or the class it defines methods of (learner_ingest.cc, prompt_ledger_training.cc
# lock common::Mutex too and match on their own).
MARKERS = re.compile(r'#include "common/(mutex|thread_annotations)\.h"|\bMutexLock\b|\bCondVar\b')
# Arguments of gcc's command line that clang does not need or rejects; the output and
# dependency-file options go too (-fsyntax-only writes nothing).
DROP_WITH_VALUE = {"-o", "-MF", "-MT", "-MQ"}
DROP = {"-c", "-MD", "-MMD", "-fno-semantic-interposition", "-fconserve-stack",
        "-fno-gnu-unique", "-fuse-linker-plugin"}
DROP_PREFIX = ("-fdiagnostics-color", "-flto", "-fno-fat-lto-objects")
# Sources every build has that must be among those checked: if the selection above stopped
# finding them, the test would pass while checking nothing.
MUST_CHECK = ("learner/learner.cc", "learner/learner_ingest.cc",
              "common/weight_sync/epoch_store.cc")
# What clang must report on violation.cc (one error each).
EXPECTED_VIOLATIONS = (
    "writing variable 'count_' requires holding mutex 'mu_' exclusively "
    "[-Werror,-Wthread-safety-analysis]",
    "calling function 'CountLocked' requires holding mutex 'mu_' exclusively "
    "[-Werror,-Wthread-safety-analysis]",
)
CLANG_FLAGS = [
    "-fsyntax-only",
    # Only the analysis matters here: other warnings are gcc's (the build) to report.
    "-Wno-everything",
    "-Wthread-safety",
    "-Wthread-safety-beta",
    "-Werror=thread-safety",
    "-Werror=thread-safety-beta",
    "-Wno-unknown-warning-option",
]


def uses_annotations(path):
    texts = []
    for p in (path, os.path.splitext(path)[0] + ".h"):
        if os.path.exists(p):
            with open(p, encoding="utf-8", errors="replace") as f:
                texts.append(f.read())
    # Comments do not count (some still describe a lock in words).
    return any(MARKERS.search(re.sub(r"//.*", "", t)) for t in texts)


def clang_command(clang, entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out = [clang]
    skip = False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a in DROP_WITH_VALUE:
            skip = True
            continue
        if a in DROP or a.startswith(DROP_PREFIX) or a.startswith("-o"):
            continue
        if os.path.abspath(os.path.join(entry["directory"], a)) == entry["file"]:
            continue
        out.append(a)
    return out + CLANG_FLAGS + [entry["file"]]


def run(cmd, cwd):
    start = time.monotonic()
    p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return p.returncode, p.stdout, time.monotonic() - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clang", required=True)
    ap.add_argument("--build-dir", required=True)
    ap.add_argument("--source-dir", required=True)
    ap.add_argument("--violation", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    opts = ap.parse_args()
    src = os.path.abspath(opts.source_dir)

    with open(os.path.join(opts.build_dir, "compile_commands.json")) as f:
        entries = json.load(f)
    checked = []
    template = None  # flags for the negative control: those of a checked common/ file
    for e in entries:
        e["file"] = os.path.abspath(os.path.join(e["directory"], e["file"]))
        rel = os.path.relpath(e["file"], src).replace(os.sep, "/")
        if not rel.endswith(".cc") or rel.split("/")[0] not in DIRS:
            continue
        if not uses_annotations(e["file"]):
            continue
        if any(c[0] == rel for c in checked):
            continue  # one source built into two targets: once is enough
        checked.append((rel, e))
        if template is None or rel.startswith("common/"):
            template = e
    missing = [m for m in MUST_CHECK if m not in {c[0] for c in checked}]
    if missing:
        print("thread_safety_test: not found as annotated sources in compile_commands.json: " +
              ", ".join(missing))
        return 1

    failures = 0
    violation = dict(template, file=os.path.abspath(opts.violation))
    jobs = [("negative control " + os.path.relpath(violation["file"], src), violation, True)]
    jobs += [(rel, e, False) for rel, e in sorted(checked, key=lambda c: c[0])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, opts.jobs)) as pool:
        futures = [(name, must_fail, pool.submit(run, clang_command(opts.clang, e),
                                                 e["directory"]))
                   for name, e, must_fail in jobs]
        for name, must_fail, fut in futures:
            rc, out, secs = fut.result()
            if must_fail:
                # Both violations must be caught, as errors of the analysis, and nothing else:
                # a file that fails for another reason (a bad flag, a missing header) proves
                # nothing.
                ok = (rc != 0 and all(e in out for e in EXPECTED_VIOLATIONS) and
                      out.count("error:") == len(EXPECTED_VIOLATIONS))
                print(f"{'ok  ' if ok else 'FAIL'} {name} ({secs:.1f} s): "
                      f"{'rejected' if rc != 0 else 'ACCEPTED'}")
                if not ok:
                    failures += 1
                    print(out)
            else:
                print(f"{'ok  ' if rc == 0 else 'FAIL'} {name} ({secs:.1f} s)")
                if rc != 0:
                    failures += 1
                    print(out)
    print(f"thread_safety_test: {len(checked)} sources checked, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
