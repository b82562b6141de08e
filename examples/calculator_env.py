#!/usr/bin/env python3
"""A calculator tool for multi-turn GRPO episodes, served with grpo_serve.serve_environment.

Each model turn either calls the tool,

    <tool_call>{"name": "calculator", "arguments": {"expression": "2+3*4"}}</tool_call>

and gets a ``tool`` message with the result ("14"), or answers: a turn without a tool call ends
the episode with reward 1.0 when the dataset row's "answer" appears in it (as a whole number or
word: "14" does not count as "4"), else 0.0. Expressions are arithmetic only (+ - * / // % **,
parentheses, numbers), evaluated over Python's ast: nothing else runs.

    python examples/calculator_env.py --port 50071 [--token-file FILE]

prints {"port": N} on one line once serving (port 0 picks a free one); SIGTERM or Ctrl-C stops it.
Rows look like {"prompt": "What is 17 * 23 - 4?", "answer": "387"}.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import operator
import re
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from grpo_serve import Observation, serve_environment

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_EXPRESSION_CHARS = 200
MAX_RESULT_BITS = 4000  # about 1200 digits: no expression may build a huge number

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos,
                                                         ast.USub: operator.neg}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > MAX_RESULT_BITS:
        raise ValueError("number too large")
    return value


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(
            node.value, bool):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value: int | float = _UNARY[type(node.op)](_eval(node.operand))
        return value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            # |left| ** right has about log2|left| * right bits: refuse before computing it.
            if abs(right) > 1000 or (abs(left) > 1 and
                                     abs(right) * math.log2(abs(left)) > MAX_RESULT_BITS):
                raise ValueError("number too large")
        result: int | float = _BINARY[type(node.op)](left, right)
        return _check_size(result)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression as text ("14", "3.75"); ValueError / ZeroDivisionError
    for anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an expression: {e.msg}") from None
    value = _eval(tree)
    if isinstance(value, complex):  # (-8) ** 0.5
        raise ValueError("the result is not a real number")
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def contains_answer(text: str, answer: str) -> bool:
    """Whether `answer` appears in `text` with no letter or digit glued to either side."""
    if not answer:
        return False
    return re.search(rf"(?<![\w.]){re.escape(answer)}(?![\w]|\.\d)", text) is not None


class CalculatorEnv:
    """One episode: a calculator tool until the model answers."""

    def reset(self, row: dict[str, Any], seed: int) -> Observation:
        self.answer = str(row.get("answer", "")).strip()
        return Observation()  # the row's prompt poses the question; nothing to add

    def step(self, action: str) -> Observation:
        match = TOOL_CALL.search(action)
        if match is None:  # a final answer
            reward = 1.0 if contains_answer(action, self.answer) else 0.0
            return Observation(reward=reward, done=True)
        try:
            call = json.loads(match.group(1))
            if not isinstance(call, dict) or call.get("name") != "calculator":
                raise ValueError('the only tool is "calculator"')
            expression = (call.get("arguments") or {}).get("expression")
            if not isinstance(expression, str):
                raise ValueError('calculator needs {"expression": "..."}')
            result = evaluate(expression)
        except (ValueError, ArithmeticError, TypeError, AttributeError, RecursionError) as e:
            return Observation(messages=[f"error: {e}"])
        return Observation(messages=[result])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=50071, help="gRPC port (0: any free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--token-file", help="the token workers must send (env_auth_token_file)")
    args = parser.parse_args()
    server = serve_environment(CalculatorEnv, port=args.port, host=args.host,
                               token_file=args.token_file)
    print(json.dumps({"port": server.port}), flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):  # wakes for the signal handlers
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
