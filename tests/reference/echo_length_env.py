#!/usr/bin/python3
"""A multi-turn environment written as a user of the Python package would (grpo_serve
.serve_environment), for tests/services/multi_turn_e2e_test.cc: after every model turn it answers
one `tool` message holding the number of UTF-8 bytes of the turn's text, and it ends the episode
(done) after the second turn. Each step is worth 1.0. With --fail-resets N its first N resets
fail (an environment that is down for a while).

Usage: echo_length_env.py [--port 0] [--token-file FILE] [--fail-resets N]
Prints {"port": N} on one stdout line once serving; runs until SIGTERM/SIGINT.
"""
import argparse
import json
import signal
import sys
import threading

from grpo_serve import Observation, serve_environment

# Resets still to fail (--fail-resets), over every session of the server.
FAILING = {"resets": 0}
FAILING_LOCK = threading.Lock()


class EchoLength:
    def reset(self, row: dict, seed: int) -> Observation:
        with FAILING_LOCK:
            if FAILING["resets"] > 0:
                FAILING["resets"] -= 1
                raise RuntimeError("the environment is down")
        self.turns = 0
        return Observation()

    def step(self, action: str) -> Observation:
        self.turns += 1
        if self.turns >= 2:
            return Observation(reward=1.0, done=True, metadata={"turns": self.turns})
        return Observation(messages=[{"role": "tool", "content": str(len(action.encode()))}],
                           reward=1.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-file")
    parser.add_argument("--fail-resets", type=int, default=0)
    args = parser.parse_args()
    FAILING["resets"] = args.fail_resets
    server = serve_environment(EchoLength, port=args.port, host="127.0.0.1",
                               token_file=args.token_file)
    print(json.dumps({"port": server.port}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
