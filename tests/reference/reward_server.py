#!/usr/bin/python3
"""An external reward server written independently of the C++ code, as a user of the Python
package: three reward functions with TRL's signature served by grpo_serve.serve_rewards
(grpo.v1.RewardService/Score, proto/grpo/v1/reward.proto). deploy/setup.sh installs grpo_serve
into the venv whose python runs this.

Usage: reward_server.py [--port 0] [--token TOKEN] [--log FILE] [--proto_root DIR]
Prints {"port": N} on one stdout line once serving; runs until SIGTERM/SIGINT.

Reward functions (ScoreRequest.reward_fn):
  codepoints   the number of Unicode code points of the completion
  vowels       the number of ASCII vowels (aeiou, either case) in the completion
  near_target  -|codepoints - row["target"]|; no value when the row has no integer "target"
An unknown name fails the call with INVALID_ARGUMENT; with --token, a call without
`authorization: Bearer TOKEN` fails with UNAUTHENTICATED. --log appends one JSON line per
scored sample: {"fn", "completion", "completion_tokens", "score"}. --proto_root is accepted for
older callers and unused: the package's stubs were generated from proto/ when it was built.
"""
import argparse
import json
import signal
import sys
import threading

try:
    import grpo_serve
except ImportError as e:
    sys.exit(f"reward_server.py: cannot import grpo_serve ({e}): run deploy/setup.sh, which "
             "installs the Python package (python/) into the venv")


def text_of(completion):
    """A TRL completion's text: the string, or a conversational completion's message content."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def codepoints(completions, **kwargs):
    return [float(len(text_of(c))) for c in completions]


def vowels(completions, **kwargs):
    return [float(sum(1 for ch in text_of(c) if ch in "aeiouAEIOU")) for c in completions]


def near_target(completions, target=None, **kwargs):
    targets = target if target is not None else [None] * len(completions)
    out = []
    for c, t in zip(completions, targets):
        if not isinstance(t, int) or isinstance(t, bool):
            out.append(None)
        else:
            out.append(-float(abs(len(text_of(c)) - t)))
    return out


def logged(name, fn, path, lock):
    """`fn`, appending one JSON line per scored sample to `path`."""
    def wrapper(completions, completion_ids, **kwargs):
        scores = fn(completions=completions, completion_ids=completion_ids, **kwargs)
        with lock, open(path, "a", encoding="utf-8") as f:
            for c, ids, s in zip(completions, completion_ids, scores):
                f.write(json.dumps({"fn": name, "completion": text_of(c),
                                    "completion_tokens": len(ids), "score": s}) + "\n")
        return scores
    return wrapper


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default="")
    parser.add_argument("--log", default="")
    parser.add_argument("--proto_root", default="", help="unused (see the module docstring)")
    args = parser.parse_args()

    funcs = {"codepoints": codepoints, "vowels": vowels, "near_target": near_target}
    if args.log:
        lock = threading.Lock()
        funcs = {name: logged(name, fn, args.log, lock) for name, fn in funcs.items()}
    server = grpo_serve.serve_rewards(funcs, port=args.port, token=args.token or None)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"port": server.port}), flush=True)
    stop.wait()
    server.stop(grace=1)


if __name__ == "__main__":
    main()
