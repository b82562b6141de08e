"""The README's "From Python" example, run as it is written: a learner and two workers with the
demo's settings, a Python reward function, a `datasets` dataset, follow()."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import SOURCE_DIR, grpo_bin

MARKER = "<!-- from-python-example: tests/python/test_readme.py runs this block -->"


def readme_example() -> str:
    readme = (SOURCE_DIR / "README.md").read_text()
    section = readme.split("\n## From Python\n", 1)[1].split("\n## ", 1)[0]
    after = section.split(MARKER, 1)[1]
    m = re.match(r"\s*```python\n(.*?)\n```", after, re.S)
    assert m, "the block after the marker is not a python code block"
    return m.group(1)


def test_the_readme_example_runs(tmp_path: Path) -> None:
    code = readme_example()
    assert "grpo_serve.start_local" in code and "job.follow()" in code
    script = tmp_path / "example.py"
    script.write_text(code + "\n")
    env = dict(os.environ, GRPO_BIN=grpo_bin())
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "mean reward per step" in r.stdout  # follow()'s curve
    assert "job done at step 20/20" in r.stdout
    last = r.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"job done: mean reward -?\d+\.\d\d -> -?\d+\.\d\d", last), last
    assert "20/20" in r.stderr  # the progress bar
