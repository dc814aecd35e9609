"""How two CUDA contexts share one card when one of them was checkpointed and restored.

The 12x MLP runs (``sessions-h100.json``, b5a12b8) showed cells whose context was
restored from a suspend advancing about three times faster than cells of contexts never
suspended, while they ran at the same time (steps of 0.20 s against 0.65 s; 0.15 s
alone), and pairs of the same kind sharing the card evenly (``sessions_tail.py``,
``steps_by_pair``). This benchmark takes the sessions, the Hub and the arbiter out of
it: two worker processes (``A``, ``B``) run the same steps of fp32 matrix products, first
alone, then together in phases:

1. ``neither restored``: both contexts as created;
2. ``A locked``: after A's process was locked and unlocked, with no checkpoint between
   (whether the lock alone changes anything);
3. ``B restored``: after B's process was checkpointed and restored by the arbiter's own
   calls (``jupyter_vgpu.host.checkpoint.suspend`` and ``restore``:
   ``cuCheckpointProcessLock``/``Checkpoint``/``Restore``/``Unlock``);
4. ``B restored, later``: the same after ``--later`` seconds with both idle, to see
   whether it lasts (a kernel restored for one cell meets others in its next);
5. ``both restored``: after A too was checkpointed and restored.

Each phase runs both workers from the same instant for ``--seconds``; a worker's figure
is the median of its steps that lie wholly inside the phase's window less 0.3 s at
either end (``numpy.percentile``, linear interpolation), and its share of the card is
its step alone over its step in the phase (two workers sharing evenly: 0.5 each).

Usage (on a GPU machine, with the package's dependencies: ``scripts/gpu-steps start
fairness`` installs them): ``python3 benchmarks/restore_fairness.py --out
benchmarks/results/restore-fairness-h200.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed copy

import provenance  # noqa: E402
import step_workers  # noqa: E402 - benchmarks/step_workers.py, beside this file

SETUP = r"""
import sys
import torch
torch.backends.cuda.matmul.allow_tf32 = False
n, k = int(sys.argv[1]), int(sys.argv[2])
a = torch.randn(n, n, device="cuda"); b = torch.randn(n, n, device="cuda")
def step():
    for _ in range(k):
        c = a @ b
    torch.cuda.synchronize()
for _ in range(3):
    step()
"""


def checkpoint_and_restore(pid: int, *, lock_only: bool = False) -> float:
    """Checkpoint and restore ``pid`` as the arbiter's suspend and restore do
    (:mod:`jupyter_vgpu.host.checkpoint`); where ``lock_only``, only lock and unlock it
    (no such move in the node: cuda-bindings directly). Returns the seconds it took.

    Raises:
        jupyter_vgpu.host.checkpoint.CheckpointError: the driver refused (the process is
            left as it was).
        SystemExit: a lock or unlock of ``lock_only`` failed (its CUresult named).
    """
    from jupyter_vgpu.host import checkpoint

    t0 = time.perf_counter()
    if not lock_only:
        checkpoint.suspend(pid)
        checkpoint.restore(pid)
        return time.perf_counter() - t0
    from cuda.bindings import driver

    (err,) = driver.cuInit(0)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"the CUDA driver does not start: {err}")
    lock = driver.CUcheckpointLockArgs()
    lock.timeoutMs = 10_000
    for name, args in (
        ("cuCheckpointProcessLock", lock),
        ("cuCheckpointProcessUnlock", driver.CUcheckpointUnlockArgs()),
    ):
        err = getattr(driver, name)(pid, args)
        err = err[0] if isinstance(err, tuple) else err
        if err != driver.CUresult.CUDA_SUCCESS:
            raise SystemExit(f"{name}({pid}) failed: {err}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=4096, help="matrix side (fp32)")
    parser.add_argument("--products", type=int, default=20, help="matrix products per step")
    parser.add_argument("--seconds", type=float, default=3.0, help="each phase's length")
    parser.add_argument("--later", type=float, default=20.0, help="idle seconds before the fourth phase")
    parser.add_argument("--out", help="JSON to write (stdout when absent)")
    args = parser.parse_args()
    doc = provenance.record()
    workers = step_workers.start(SETUP, ("A", "B"), (str(args.size), str(args.products)))
    solo = {}
    for name, w in workers.items():
        steps = step_workers.run_together({name: w}, args.seconds)
        solo[name] = step_workers.median_step(steps[name], *step_workers.window(steps, args.seconds))
    phases = []
    plan = [  # (phase, whose process, lock only, idle seconds before)
        ("neither restored", None, False, 0.0),
        ("A locked", "A", True, 0.0),
        ("B restored", "B", False, 0.0),
        ("B restored, later", None, False, args.later),
        ("both restored", "A", False, 0.0),
    ]
    for phase, restore, lock_only, idle in plan:
        time.sleep(idle)
        restore_s = checkpoint_and_restore(workers[restore].pid, lock_only=lock_only) if restore else None
        steps = step_workers.run_together(workers, args.seconds)
        lo, hi = step_workers.window(steps, args.seconds)
        row = {
            "phase": phase,
            "process": restore,
            "lock_only": lock_only,
            "idle_before_s": idle,
            "driver_s": restore_s,
        }
        for name in workers:
            m = step_workers.median_step(steps[name], lo, hi)
            row[name] = {"p50_step_s": m, "share": solo[name] / m if m else None, "steps": len(steps[name])}
        phases.append(row)
        print(json.dumps(row), flush=True)
    step_workers.stop(workers)
    doc.update(
        {
            "size": args.size,
            "products_per_step": args.products,
            "phase_s": args.seconds,
            "later_s": args.later,
            "trim_s": step_workers.TRIM_S,
            "percentiles": "numpy.percentile, linear interpolation (NumPy's default)",
            "solo_p50_step_s": solo,
            "phases": phases,
        }
    )
    provenance.write(doc, args.out)


if __name__ == "__main__":
    main()
