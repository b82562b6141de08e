"""An OpenEnv environment server (openenv-core 0.3.0's create_app), written as an OpenEnv user
would, for tests/services/openenv_environment_test.cc.

Word guessing: reset picks the secret word (the `word` reset argument, else WORDS[seed % 5]);
each step's `guess` is answered with how many letters are in place (same index, same letter);
reward = in place / word length (none at reset), done when the guess is the word. Test hooks: a guess
"sleep SECONDS" sleeps that long before answering; a guess "raise" raises.

Served apps (one process):
  /            WordGuessEnvironment, up to 8 concurrent sessions
  /ambiguous   the same game whose observation has two string fields (feedback, hint)
  /single      the same game, one session at a time (max_concurrent_envs=1)

Usage: openenv_server.py [--host 127.0.0.1] [--port 0]; prints {"port": N} on its first line.
"""

import argparse
import json
import socket
import sys
import time
from typing import Optional

import uvicorn
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

WORDS = ["apple", "bread", "chair", "delta", "eagle"]


class GuessAction(Action):
    guess: str = Field(..., description="A word")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="What the guess got right")
    attempts: int = Field(default=0, description="Guesses so far")


class HintedObservation(GuessObservation):
    hint: str = Field(default="", description="The secret word's first letter")


class WordGuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._word = WORDS[0]
        self._state = State(step_count=0)

    def reset(
        self, seed: Optional[int] = None, episode_id: Optional[str] = None, word: Optional[str] = None
    ) -> GuessObservation:
        self._word = word if word else WORDS[(seed or 0) % len(WORDS)]
        self._state = State(episode_id=episode_id, step_count=0)
        return self._observe(f"Guess the {len(self._word)}-letter word.")

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        if action.guess.startswith("sleep "):
            time.sleep(float(action.guess.split()[1]))
        if action.guess == "raise":
            raise RuntimeError("asked to raise")
        self._state.step_count += 1
        in_place = sum(a == b for a, b in zip(action.guess, self._word))
        if action.guess == self._word:
            return self._observe("correct", done=True, reward=1.0)
        return self._observe(f"{in_place} letters in place", reward=in_place / len(self._word))

    def _observe(
        self, feedback: str, done: bool = False, reward: Optional[float] = None
    ) -> GuessObservation:
        return GuessObservation(
            feedback=feedback, attempts=self._state.step_count, done=done, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


class HintedWordGuessEnvironment(WordGuessEnvironment):
    def _observe(
        self, feedback: str, done: bool = False, reward: Optional[float] = None
    ) -> HintedObservation:
        return HintedObservation(
            feedback=feedback,
            attempts=self._state.step_count,
            hint=f"starts with {self._word[0]}",
            done=done,
            reward=reward,
        )


def build_app():
    app = create_app(WordGuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)
    app.mount(
        "/ambiguous",
        create_app(HintedWordGuessEnvironment, GuessAction, HintedObservation, max_concurrent_envs=8),
    )
    app.mount(
        "/single",
        create_app(WordGuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=1),
    )
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = build_app()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
