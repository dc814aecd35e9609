"""Code that runs between cells on the GPU: every pattern in both chaos modes, and what a
stuck driver call costs a neighbour. Writes ``benchmarks/results/liveness-<card>.json``.

    python benchmarks/liveness.py [--out FILE] [--patterns NAME ...] [--modes pause suspend]

Rows (one per pattern and mode, :class:`jupyter_vgpu.testing.liveness.Row`): whether the
kernel left the card (paused, suspended) or was kept and why, whether every step ran and
the data came back bit-exact, the longest a step waited (the way back included), and the
seconds from a cell sent while the kernel was away to its answer.

``neighbour``: the node arbiter's driver calls (:mod:`jupyter_vgpu.node.checkpoint_pool`)
on a kernel holding ``--neighbour-gib`` GiB, suspended and restored, alone and while
another kernel's restore hangs in the pool (a driver call that never returns, made to
hang for the test: ``JUPYTER_VGPU_CHECKPOINT_HANG``); seconds of each, median of
``--repeats``. ``lifecycle``: seconds a restart and a shutdown of a suspended kernel take.

Goals (issue 39): every row answers within 5 s of the message (plus the restore's own copy
time); the neighbour's times within 1.5x of alone; restart and shutdown within 10 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import gpu_common  # noqa: F401 - puts this checkout first on the path
import provenance

from jupyter_vgpu.host import checkpoint
from jupyter_vgpu.node.checkpoint_pool import CheckpointPool, CheckpointTimeout
from jupyter_vgpu.testing import liveness
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30


def holder(tmp: Path, gib: int) -> Kernel:
    """A plain kernel (no chaos) holding ``gib`` GiB on the card."""
    kernel = Kernel(tmp, environment(), load_extension=True)
    kernel.run(f"import torch\nx = torch.ones({gib} * 2**28, device='cuda')\ntorch.cuda.synchronize()")
    return kernel


def neighbour(gib: int, repeats: int) -> dict:
    """Suspend and restore seconds of one kernel's process through the pool, alone and
    beside another kernel whose restore hangs."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        near, stuck = holder(tmp, gib), holder(tmp, 1)
        need = None
        try:

            def cycle(pool: CheckpointPool) -> tuple[float, float]:
                t0 = time.monotonic()
                pool.suspend([near.pid], nbytes=gib * GiB)
                t1 = time.monotonic()
                pool.restore([near.pid], need)
                return t1 - t0, time.monotonic() - t1

            alone = [cycle(CheckpointPool()) for _ in range(repeats)]
            os.environ[checkpoint.HANG_ENV] = f"restore:{stuck.pid}"
            pool = CheckpointPool(base_timeout=600)
            try:
                pool.suspend([stuck.pid], nbytes=GiB)
                hanging = threading.Thread(target=lambda: _quiet(pool.restore, [stuck.pid]), daemon=True)
                hanging.start()
                wait_for(lambda: hanging.is_alive(), 10, "the stuck restore to start")
                beside = [cycle(pool) for _ in range(repeats)]
            finally:
                os.environ.pop(checkpoint.HANG_ENV, None)
                pool.close()
                CheckpointPool().restore([stuck.pid])  # a new worker brings it back
        finally:
            near.shutdown()
            stuck.shutdown()

    def med(rows, i):
        return round(statistics.median(r[i] for r in rows), 4)

    return {
        "bytes": gib * GiB,
        "repeats": repeats,
        "alone": {"suspend_seconds": med(alone, 0), "restore_seconds": med(alone, 1)},
        "beside_a_stuck_restore": {"suspend_seconds": med(beside, 0), "restore_seconds": med(beside, 1)},
    }


def _quiet(call, *args) -> None:
    try:
        call(*args)
    except CheckpointTimeout:
        pass


def lifecycle() -> dict:
    """Seconds a restart and a shutdown of a suspended kernel (chaos ``suspend``) take."""
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        channel = tmp / "channel"
        channel.mkdir()
        env = environment(JUPYTER_VGPU_CHAOS="suspend", JUPYTER_VGPU_CHANNEL=str(channel))
        kernel = Kernel(tmp, env, load_extension=True)

        def suspended() -> bool:
            try:
                report = json.loads((channel / f"kernel-{kernel.id}.json").read_text())
            except (OSError, ValueError):
                return False
            return (report.get("pause") or {}).get("state") == "suspended"

        kernel.run("import torch\nx = torch.ones(2**28, device='cuda')")
        wait_for(suspended, 60, "the kernel suspended")
        t0 = time.monotonic()
        kernel.manager.restart_kernel(now=False)
        kernel.client.wait_for_ready(timeout=60)
        restart = time.monotonic() - t0
        kernel.run("import torch\nx = torch.ones(2**28, device='cuda')")
        wait_for(suspended, 60, "the new kernel suspended")
        t0 = time.monotonic()
        kernel.manager.shutdown_kernel(now=False)
        shutdown = time.monotonic() - t0
        kernel.client.stop_channels()
    return {"restart_seconds": round(restart, 3), "shutdown_seconds": round(shutdown, 3)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--out", default=None, help="the JSON to write (default: results/liveness-<card>.json)"
    )
    parser.add_argument("--patterns", nargs="*", default=list(liveness.PATTERNS), help="patterns to run")
    parser.add_argument("--modes", nargs="*", default=["pause", "suspend"], choices=["pause", "suspend"])
    parser.add_argument("--neighbour-gib", type=int, default=8, help="GiB the neighbour holds (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="suspend/restore cycles of the neighbour")
    args = parser.parse_args(argv)
    unknown = set(args.patterns) - set(liveness.PATTERNS)
    if unknown:
        parser.error(f"no such pattern: {', '.join(sorted(unknown))}")
    try:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA GPU")
        card = torch.cuda.get_device_name(0)
    except Exception as e:
        sys.exit(f"liveness.py needs a CUDA GPU with PyTorch: {e}")
    why = checkpoint.unavailable()
    if why:
        sys.exit(f"liveness.py needs the driver's process checkpoint: {why}")
    doc = provenance.record()
    rows = []
    for pattern in args.patterns:
        for mode in args.modes:
            with tempfile.TemporaryDirectory() as d:
                row = liveness.run_pattern(Path(d), pattern, mode)
            rows.append(row.__dict__ | {"longest_call": round(row.longest_call, 3),
                                        "message_seconds": round(row.message_seconds, 3)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    doc.update(
        card=card,
        rows=rows,
        neighbour=neighbour(args.neighbour_gib, args.repeats),
        lifecycle=lifecycle(),
    )
    short = "h100" if "H100" in card else "h200" if "H200" in card else card.split()[-1].lower()
    out = Path(args.out or Path(__file__).parent / "results" / f"liveness-{short}.json")
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"neighbour": doc["neighbour"], "lifecycle": doc["lifecycle"]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
