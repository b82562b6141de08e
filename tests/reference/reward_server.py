#!/usr/bin/python3
"""An external reward server written independently of the C++ code: grpo.v1.RewardService/Score
(proto/grpo/v1/reward.proto) on grpcio's generic handler, with message classes that protoc
generates at start-up (no grpc_tools needed).

Usage: reward_server.py [--port 0] [--proto_root DIR] [--token TOKEN] [--log FILE]
Prints {"port": N} on one stdout line once serving; runs until SIGTERM/SIGINT.

Reward functions (ScoreRequest.reward_fn):
  codepoints   the number of Unicode code points of the completion
  vowels       the number of ASCII vowels (aeiou, either case) in the completion
  near_target  -|codepoints - row["target"]|; no value when the row has no integer "target"
An unknown name fails the call with INVALID_ARGUMENT; with --token, a call without
`authorization: Bearer TOKEN` fails with UNAUTHENTICATED. --log appends one JSON line per
scored sample: {"fn", "completion", "completion_tokens", "score"}.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent import futures

import grpc


def generate_messages(proto_root, out_dir):
    """Runs protoc --python_out for the two wire files; returns the reward_pb2 module."""
    subprocess.run(
        ["protoc", "-I", proto_root, "--python_out=" + out_dir,
         "grpo/v1/learner.proto", "grpo/v1/reward.proto"],
        check=True)
    sys.path.insert(0, out_dir)
    try:
        from grpo.v1 import reward_pb2  # noqa: E402 (generated just above)
    finally:
        sys.path.remove(out_dir)
        shutil.rmtree(out_dir, ignore_errors=True)
    return reward_pb2


def score_one(fn, sample):
    """The score of one RewardSample under `fn`, or None for no value."""
    text = sample.completion
    if fn == "codepoints":
        return float(len(text))
    if fn == "vowels":
        return float(sum(1 for ch in text if ch in "aeiouAEIOU"))
    if fn == "near_target":
        row = json.loads(sample.row_json) if sample.row_json else {}
        target = row.get("target") if isinstance(row, dict) else None
        if not isinstance(target, int) or isinstance(target, bool):
            return None
        return -float(abs(len(text) - target))
    raise KeyError(fn)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--proto_root",
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                             "..", "..", "proto"))
    parser.add_argument("--token", default="")
    parser.add_argument("--log", default="")
    args = parser.parse_args()

    gen_dir = tempfile.mkdtemp(prefix="grpo_reward_pb2_")
    pb = generate_messages(args.proto_root, gen_dir)
    log_lock = threading.Lock()

    def score(request, context):
        if args.token:
            md = dict(context.invocation_metadata())
            if md.get("authorization") != "Bearer " + args.token:
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad or missing token")
        response = pb.ScoreResponse()
        for sample in request.samples:
            try:
                value = score_one(request.reward_fn, sample)
            except KeyError:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "unknown reward function '%s'" % request.reward_fn)
            out = response.scores.add()
            if value is not None:
                out.value = value
            if args.log:
                with log_lock, open(args.log, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"fn": request.reward_fn,
                                        "completion": sample.completion,
                                        "completion_tokens": sample.completion_tokens,
                                        "score": value}) + "\n")
        return response

    handler = grpc.method_handlers_generic_handler("grpo.v1.RewardService", {
        "Score": grpc.unary_unary_rpc_method_handler(
            score,
            request_deserializer=pb.ScoreRequest.FromString,
            response_serializer=pb.ScoreResponse.SerializeToString),
    })
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:%d" % args.port)
    if port == 0:
        sys.exit("reward_server.py: cannot bind 127.0.0.1:%d" % args.port)
    server.start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"port": port}), flush=True)
    stop.wait()
    server.stop(grace=1).wait()


if __name__ == "__main__":
    main()
