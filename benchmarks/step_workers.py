"""Worker processes that run the same kind of step on one card, alone or together, in
windows that start at one instant: the machinery of ``restore_fairness.py`` and
``time_slicing.py``.

A worker is ``python3 -c SETUP + LOOP``: ``SETUP`` defines ``step()`` (one step, ending
with the card synchronized); :data:`LOOP` says ``ready`` on stdout, then for each line
``START SECONDS`` on stdin (epoch seconds, seconds) waits for ``START``, runs steps until
``START + SECONDS`` and prints their ``[begins, ends]`` (epoch seconds) as one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable

LOOP = r"""
import json, sys, time
print("ready", flush=True)
for line in sys.stdin:
    start, seconds = map(float, line.split())
    while time.time() < start:
        time.sleep(0.0005)
    steps = []
    while time.time() < start + seconds:
        t0 = time.time(); step(); steps.append((t0, time.time()))
    print(json.dumps(steps), flush=True)
"""

#: Seconds left out at either end of a window: its steps that began before the others
#: had started, or ended after some had stopped.
TRIM_S = 0.3


def start(
    setup: str, names: Iterable[str], args: Iterable[str] = (), env: dict[str, str] | None = None
) -> dict[str, subprocess.Popen]:
    """One worker per name running ``setup`` (its ``sys.argv[1:]``: ``args``; its
    environment ``env``, this process's when None), each ready.

    Raises:
        SystemExit: a worker ended or said anything but ``ready`` first (its exit status
            and what it said named).
    """
    workers = {
        name: subprocess.Popen(
            [sys.executable, "-c", setup + LOOP, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for name in names
    }
    for name, w in workers.items():
        said = w.stdout.readline().strip()
        if said != "ready":
            raise SystemExit(f"worker {name} did not start (exit status {w.poll()}; said {said!r})")
    return workers


def run_together(workers: dict, seconds: float) -> dict[str, list[tuple[float, float]]]:
    """The workers' steps (begins, ends; epoch seconds) over one window of ``seconds``
    that starts 0.5 s from now for all of them. Raises SystemExit where a worker ended."""
    begin = time.time() + 0.5
    for w in workers.values():
        w.stdin.write(f"{begin} {seconds}\n")
        w.stdin.flush()
    steps = {}
    for name, w in workers.items():
        line = w.stdout.readline()
        if not line:
            raise SystemExit(f"worker {name} ended during a phase (exit status {w.poll()})")
        steps[name] = json.loads(line)
    return steps


def window(steps: dict[str, list], seconds: float) -> tuple[float, float]:
    """The part of a window every worker ran in: its first step's start plus
    :data:`TRIM_S` to its end less :data:`TRIM_S` (epoch seconds)."""
    first = min(s[0][0] for s in steps.values())
    return first + TRIM_S, first + seconds - TRIM_S


def median_step(steps, lo: float, hi: float) -> float | None:
    """The median seconds of the steps that lie wholly in ``[lo, hi]`` (NumPy's
    percentile, linear interpolation); None where none does."""
    import numpy as np

    inside = [e - s for s, e in steps if s >= lo and e <= hi]
    return float(np.percentile(inside, 50)) if inside else None


def stop(workers: dict) -> None:
    """Close every worker's stdin and wait for it (30 s each)."""
    for w in workers.values():
        w.stdin.close()
        w.wait(timeout=30)
