"""TRL 1.16's own built-in reward functions on completion lengths, for reward_test.

stdin: {"soft_overlong_punishment": [{"max_completion_len": L, "soft_punish_cache": C,
        "lengths": [n, ...]}]}
stdout: {"soft_overlong_punishment": [[reward, ...], ...]}: trl.rewards.get_soft_overlong_punishment
called on completions of those many tokens.
"""
import json
import sys

from trl.rewards import get_soft_overlong_punishment


def main():
    request = json.loads(sys.stdin.read())
    out = []
    for case in request["soft_overlong_punishment"]:
        fn = get_soft_overlong_punishment(case["max_completion_len"], case["soft_punish_cache"])
        out.append(fn([[0] * n for n in case["lengths"]]))
    json.dump({"soft_overlong_punishment": out}, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
