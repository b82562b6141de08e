"""follow(job): a live progress bar and the reward curve, in a terminal or a notebook.

In a terminal the bar is tqdm's on stderr and the curve is printed when the job ends, as
``grpo demo`` prints it (services/cli/demo_task.cc TextPlot). In a Jupyter notebook the bar is
tqdm's widget (text where ipywidgets is missing) and the curve an SVG redrawn as steps arrive.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from grpo_serve.job import JobResult, JobStatus, StepRecord
from grpo_serve.watch import DEFAULT_RECONNECT_TIMEOUT, DEFAULT_WATCH_TIMEOUT

if TYPE_CHECKING:
    from grpo_serve.client import Client, Job

# The notebook curve is redrawn at most this often (seconds), and once at the end.
_REDRAW_INTERVAL_S = 0.5


def text_plot(y: Sequence[float], width: int = 60, height: int = 12) -> str:
    """A text plot of `y` over steps: `height` rows, one column per bucket of steps (at most
    `width`), each column the mean of its bucket; grpo demo's TextPlot, character for character."""
    if not y:
        return ""
    n = len(y)
    cols = min(width, n)
    v = []
    for c in range(cols):
        b = n * c // cols
        e = max(b + 1, n * (c + 1) // cols)
        v.append(sum(y[b:e]) / (e - b))
    lo, hi = min(v), max(v)
    span = hi - lo if hi > lo else 1.0
    rows = [math.floor((x - lo) / span * (height - 1) + 0.5) for x in v]  # std::lround, x >= 0
    out = []
    for r in range(height - 1, -1, -1):
        level = lo + span * r / (height - 1)
        marks = "".join("*" if row == r else (":" if row > r else " ") for row in rows)
        out.append(f"{level:9.2f} |{marks}\n")
    out.append(" " * 10 + "+" + "-" * cols + "\n")
    out.append(" " * 11 + "step 1" + " " * max(0, cols - 12) + str(n) + "\n")
    return "".join(out)


def reward_curve_svg(steps: Sequence[int], rewards: Sequence[float], width: int = 480,
                     height: int = 200, pad: int = 32) -> str:
    """An SVG line of `rewards` over `steps` (non-finite rewards are left out), with the axis
    ranges written at the corners."""
    points = [(s, r) for s, r in zip(steps, rewards) if math.isfinite(r)]
    head = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">')
    if not points:
        return head + f'<text x="{pad}" y="{height // 2}">no reward yet</text></svg>'
    s_lo, s_hi = points[0][0], points[-1][0]
    r_lo, r_hi = min(r for _, r in points), max(r for _, r in points)
    s_span = (s_hi - s_lo) or 1
    r_span = (r_hi - r_lo) or 1.0
    w, h = width - 2 * pad, height - 2 * pad

    def xy(s: int, r: float) -> str:
        return f"{pad + (s - s_lo) / s_span * w:.2f},{pad + (r_hi - r) / r_span * h:.2f}"

    line = " ".join(xy(s, r) for s, r in points)
    return (head
            + f'<rect x="{pad}" y="{pad}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>'
            + f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/>'
            + f'<text x="{pad}" y="{pad - 8}">mean reward per step</text>'
            + f'<text x="2" y="{pad + 4}">{r_hi:.3g}</text>'
            + f'<text x="2" y="{pad + h}">{r_lo:.3g}</text>'
            + f'<text x="{pad}" y="{height - 8}">step {s_lo}</text>'
            + f'<text x="{pad + w - 40}" y="{height - 8}">{s_hi}</text></svg>')


def in_notebook() -> bool:
    """True inside a Jupyter kernel (IPython with a kernel attached)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return shell is not None and getattr(shell, "kernel", None) is not None


class _NotebookCurve:
    """The reward curve in a notebook cell's output, redrawn in place."""

    def __init__(self) -> None:
        from IPython.display import SVG, display

        self._svg = SVG
        self._handle = display(SVG(reward_curve_svg([], [])), display_id=True)
        self._drawn = 0.0

    def draw(self, records: list[StepRecord], force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._drawn < _REDRAW_INTERVAL_S:
            return
        self._drawn = now
        svg = reward_curve_svg([r["step"] for r in records],
                               [float(r.get("reward", math.nan)) for r in records])
        self._handle.update(self._svg(svg))


def _postfix(record: StepRecord | None, status: JobStatus | None) -> str:
    parts = []
    if record is not None and "reward" in record:
        parts.append(f"reward {record['reward']:.3f}")
    if status is not None:
        p = status.prompts
        parts.append(f"prompts {p.trained + p.filtered}/{p.total} (pass {p.pass_})")
    return " | ".join(parts)


def follow(job: Job | Client, *, file: TextIO | None = None, notebook: bool | None = None,
           report_to: str | Sequence[str] | None = None,
           report_options: dict[str, Any] | None = None,
           timeout: float = DEFAULT_WATCH_TIMEOUT,
           reconnect_timeout: float = DEFAULT_RECONNECT_TIMEOUT) -> JobResult:
    """Follows `job` until it ends: a progress bar of the optimizer steps (with the last reward
    and the prompts trained in the pass) and the reward curve. Returns the JobResult (the step
    records, the final state, the steps the stream missed).

    `file`: where the bar and the curve go in a terminal (default: the bar on stderr, the curve
    on stdout); `notebook`: force (or refuse) the notebook display, default: detected;
    `report_to`: also log every step to these dashboards (grpo_serve.report's backends, with
    `report_options` as report()'s keywords). Ctrl-C stops following (the job goes on).
    """
    from tqdm import tqdm as text_tqdm

    from grpo_serve.report import Reporter

    from grpo_serve.client import Client

    handle = job.job() if isinstance(job, Client) else job
    client = handle.client
    # The watch first: its start (the learner's snapshot) is now, not after the set-up below
    # (a dashboard's import takes seconds, in which a small job can take all its steps).
    stream = client.watch(handle, timeout=timeout, reconnect_timeout=reconnect_timeout)
    try:
        use_notebook = in_notebook() if notebook is None else notebook
        status = client.status()
        if use_notebook:
            from tqdm.auto import tqdm as auto_tqdm

            bar = auto_tqdm(total=status.max_steps or None, initial=status.global_step, unit="step",
                            desc="grpo")
            curve: _NotebookCurve | None = _NotebookCurve()
        else:
            bar = text_tqdm(total=status.max_steps or None, initial=status.global_step, unit="step",
                            desc="grpo", file=file if file is not None else sys.stderr,
                            dynamic_ncols=file is None)
            curve = None
        reporter = Reporter(report_to, **(report_options or {})) if report_to else None
    except BaseException:
        stream.close()
        raise
    records: list[StepRecord] = []
    try:
        for record in stream:
            records.append(record)
            if reporter is not None:
                reporter.log(record)
            bar.update(record["step"] - bar.n)
            bar.set_postfix_str(_postfix(record, stream.status), refresh=True)
            if curve is not None:
                curve.draw(records)
    except KeyboardInterrupt:
        stream.close()
    finally:
        if reporter is not None:
            reporter.close()
        if stream.status is not None:
            bar.set_postfix_str(_postfix(records[-1] if records else None, stream.status))
        bar.close()
    result = JobResult(records, stream.state, list(stream.missed_steps), stream.status)
    if curve is not None:
        curve.draw(records, force=True)
    else:
        out = file if file is not None else sys.stdout
        final = stream.status
        if records:
            finite = [r for r in result.rewards if math.isfinite(r)]
            out.write("\nmean reward per step\n" + text_plot(finite) + "\n")
        if final is not None:
            out.write(f"job {stream.state or final.state} at step {final.global_step}/"
                      f"{final.max_steps}{': ' + final.message if final.message else ''}\n")
        out.flush()
    return result
