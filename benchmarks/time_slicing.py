"""What time-slicing itself costs contexts that share one card: each one's speed while
``k`` of them run at once, against its speed alone.

The driver runs the CUDA contexts of different processes on one card in turns; the
turns' switches are time in which no context advances, so ``k`` contexts each advance at
less than ``1/k``. Two fp32 workers on an H200 advanced at 0.448 each
(``restore-fairness-h200.json``, ``neither restored``), and in the 12x MLP runs a step
beside one other cell took 0.324 s where one alone took 0.146 s (``cell-tails-*``,
``steps_by_pair``). The compute-sharing model (``jupyter_vgpu/testing/compute_share.py``)
shares evenly unless given these speeds (its ``rates``); ``sessions_tail.py
--time-slicing`` sets each run's cells beside the model with them.

``--contexts K`` workers (``step_workers.py``) each build the MLP sessions' model and
run their training step (``benchmarks/sessions.py``'s own cell code at its defaults:
width 4096, 2 blocks, batch 61,440 rows, bf16, AdamW), first each alone, then the first
``k`` together for ``k`` = 2 .. ``K``, ``--seconds`` each; a worker's figure is the
median of its steps that lie wholly inside the window less 0.3 s at either end
(``numpy.percentile``, linear interpolation). ``rates[k]`` is the median over the ``k``
workers of their step alone over their step together: 1/k is even sharing at no cost.
``--rounds`` repeats the phases (rates over all rounds' medians).

``--mps``: the workers are instead clients of an MPS control daemon on the first card,
started as the arbiter starts it (:class:`jupyter_vgpu.node.mps.MPSDaemons`) and stopped
at the end, each client with the whole card (no ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``):
one MPS server runs every client's kernels in one context, so there are no switches
between contexts to pay for, and a card total near 1.0 is what MPS would give the sessions
(``"isolation"`` in the output says which was measured).

Writes ``--out`` (JSON; seconds). About 60 s on an H200 with the defaults.

    python3 benchmarks/time_slicing.py --out benchmarks/results/time-slicing-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
import sessions  # noqa: E402 - benchmarks/sessions.py: the cell code
import step_workers  # noqa: E402


def setup(width: int, layers: int, batch: int) -> str:
    """The MLP session's cell code (its model, optimizer and ``train``), and ``step()``:
    one training step."""
    return (
        sessions.MLP.format(width=width, layers=layers)
        + sessions.TRAIN.format(step=sessions.MLP_STEP.format(batch=batch))
        + "def step():\n    train(1)\n"
    )


@contextlib.contextmanager
def mps_clients() -> Iterator[dict[str, str]]:
    """The environment of a client of an MPS control daemon on the first card, which
    runs while the block does. Raises MPSUnavailable (the daemon did not start)."""
    from jupyter_vgpu import nvml
    from jupyter_vgpu.testing.mps_client import own_daemons

    gpu = nvml.list_gpus()[0]
    with own_daemons([gpu.uuid]) as daemons:
        pipe = str(daemons.directories(gpu.uuid)[0])
        yield {**os.environ, "CUDA_VISIBLE_DEVICES": gpu.uuid, "CUDA_MPS_PIPE_DIRECTORY": pipe}


def measure(args: argparse.Namespace, env: dict[str, str] | None) -> tuple[dict, float, dict, list]:
    """``(rates, solo_p50_step_s, solo medians by worker, phases)`` of ``args.contexts``
    workers started with ``env`` (this process's environment when None)."""
    names = [f"W{i}" for i in range(args.contexts)]
    workers = step_workers.start(setup(args.width, args.layers, args.batch), names, env=env)
    phases = []
    solo: dict[str, list[float]] = {name: [] for name in names}
    together: dict[int, list[float]] = {k: [] for k in range(2, args.contexts + 1)}
    for _ in range(args.rounds):
        for name in names:
            steps = step_workers.run_together({name: workers[name]}, args.seconds)
            lo, hi = step_workers.window(steps, args.seconds)
            solo[name].append(step_workers.median_step(steps[name], lo, hi))
        for k in range(2, args.contexts + 1):
            some = {name: workers[name] for name in names[:k]}
            steps = step_workers.run_together(some, args.seconds)
            lo, hi = step_workers.window(steps, args.seconds)
            row = {"contexts": k, "p50_step_s": {n: step_workers.median_step(steps[n], lo, hi) for n in some}}
            phases.append(row)
            print(row, flush=True)
            together[k] += [m for m in row["p50_step_s"].values() if m]
    step_workers.stop(workers)
    solo_s = float(np.percentile([m for v in solo.values() for m in v if m], 50))
    rates = {k: solo_s / float(np.percentile(v, 50)) for k, v in together.items() if v}
    return rates, solo_s, solo, phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=4, help="the most processes together (>= 2)")
    parser.add_argument("--seconds", type=float, default=6.0, help="each phase's length")
    parser.add_argument("--rounds", type=int, default=2, help="times each phase runs")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=61440)
    parser.add_argument("--mps", action="store_true", help="the workers as clients of one MPS daemon")
    parser.add_argument("--out", help="JSON to write (stdout when absent)")
    args = parser.parse_args()
    if args.contexts < 2 or args.rounds < 1:
        parser.error("--contexts must be >= 2 and --rounds >= 1")
    doc = provenance.record()
    with mps_clients() if args.mps else contextlib.nullcontext() as env:
        rates, solo_s, solo, phases = measure(args, env)
    doc.update(
        {
            "isolation": "mps" if args.mps else "time_slicing",
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "phase_s": args.seconds,
            "rounds": args.rounds,
            "trim_s": step_workers.TRIM_S,
            "percentiles": "numpy.percentile, linear interpolation (NumPy's default)",
            "solo_p50_step_s": solo_s,
            "solo_p50_step_s_by_worker": solo,
            "phases": phases,
            # each context's speed with k together, 1.0 alone (compute_share's ``rates``)
            "rates": {str(k): r for k, r in rates.items()},
            "card_total_by_contexts": {str(k): k * r for k, r in rates.items()},
        }
    )
    provenance.write(doc, args.out)


if __name__ == "__main__":
    main()
