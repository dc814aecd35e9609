"""Sessions per GPU: N real kernels sharing one card through the node arbiter.

Every session is a real IPython kernel started as a jupyter-vgpu server starts it (the
pausable allocator preloaded, the arbiter's socket in its environment), registered with
a standalone arbiter with the same slice. Each holds a working set: a bf16 MLP
(``--layers`` blocks of ``--width`` -> 4x ``--width`` -> ``--width``) with its AdamW
state (bf16), gradients freed after each step. Each runs an interactive duty cycle:
a cell of ``--steps`` training steps (about one second on an empty card), then
``--think`` seconds idle, ``--cycles`` times, starting at staggered times.

Baseline: static partitioning, the most sessions whose peak (working set, gradients,
activations and CUDA context, measured on the empty card) fit on the card side by side.
For each N the cell latencies (send to reply, resume and any wait for room included)
are compared with the same cell on the empty card. Paused working sets live in host
memory, so N is also bounded by the host's memory: ``--sessions`` should stay within it
(each run reports the host's peak memory in use).

Usage (GPU machine): ``python benchmarks/sessions.py --out benchmarks/results/sessions-h100.json``
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_vgpu import nvml  # noqa: E402
from jupyter_vgpu.slice import Slice  # noqa: E402
from tests.arbiter_process import ArbiterProcess  # noqa: E402
from tests.gpu.preloaded import environment  # noqa: E402
from tests.kernel_runner import Kernel  # noqa: E402

GiB = 1 << 30

SETUP = """
import os, time, torch
torch.manual_seed(int(os.environ.get("SESSION", "0")))
width, layers = {width}, {layers}
blocks = []
for _ in range(layers):
    blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)]
model = torch.nn.Sequential(*blocks).to("cuda", torch.bfloat16)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
x = torch.randn({batch}, width, device="cuda", dtype=torch.bfloat16)
def train(steps):
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
    torch.cuda.synchronize()
train(2)
print("ready", sum(p.numel() for p in model.parameters()))
"""


class Session(Kernel):
    """One kernel, started preloaded, with the arbiter's socket in its environment."""

    def __init__(self, index: int, runtime: Path, socket: str):
        env = environment(JUPYTER_VGPU_ARBITER=socket, SESSION=str(index))
        super().__init__(runtime, env, load_extension=True, ready_timeout=120)
        self.index = index

    def timed(self, code: str, timeout: float = 180) -> tuple[float, str, bool]:
        """``(seconds, output, failed)`` of one cell."""
        out: list[str] = []
        failed = False

        def hook(msg):
            nonlocal failed
            c, kind = msg["content"], msg["header"]["msg_type"]
            if kind == "stream":
                out.append(c["text"])
            elif kind == "error":
                failed = True
                out.append(f"{c['ename']}: {c['evalue']}")

        t0 = time.perf_counter()
        reply = self.client.execute_interactive(code, output_hook=hook, timeout=timeout)
        failed = failed or reply["content"]["status"] != "ok"
        return time.perf_counter() - t0, "".join(out), failed


class HostMemory:
    """The host's peak memory in use (``MemTotal - MemAvailable`` of /proc/meminfo, bytes),
    sampled every 0.5 s in a thread."""

    def __init__(self):
        self.total = self._read()["MemTotal"]
        self.peak_used = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _read() -> dict[str, int]:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}

    def _run(self) -> None:
        while not self._done.wait(0.5):
            info = self._read()
            self.peak_used = max(self.peak_used, info["MemTotal"] - info["MemAvailable"])

    def start(self) -> HostMemory:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def start_arbiter(directory: Path, think: float) -> ArbiterProcess:
    return ArbiterProcess(
        directory,
        "--ArbiterApp.poll_seconds=0.25",
        "--ArbiterApp.watermark=0.8",
        f"--ArbiterApp.suspend_after={max(2.0, think / 2)}",
    ).start()


def run_sessions(n: int, args, slice_: Slice, solo_steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        arbiter = start_arbiter(tmp, args.think)
        socket = str(arbiter.socket)
        sessions: list[Session] = []
        try:
            started: queue.Queue[Session] = queue.Queue()
            starters = [
                threading.Thread(target=lambda i=i: started.put(Session(i, tmp, socket))) for i in range(n)
            ]
            for t in starters:
                t.start()
            for t in starters:
                t.join()
            sessions = sorted(started.queue, key=lambda s: s.index)
            with arbiter.control() as control:
                for s in sessions:
                    control.register(s.pid, f"user{s.index}", "", slice_)
            setup = SETUP.format(width=args.width, layers=args.layers, batch=args.batch)
            ooms = 0
            for s in sessions:  # one after another: each setup is a cell that asks for room
                _, _, failed = s.timed(setup)
                ooms += failed
            latencies: queue.Queue[float] = queue.Queue()
            errors: list[str] = []

            def duty(s: Session) -> None:
                time.sleep(random.uniform(0, args.think))
                for _ in range(args.cycles):
                    seconds, out, failed = s.timed(f"train({solo_steps})")
                    if failed:
                        errors.append(out[-500:])
                    else:
                        latencies.put(seconds)
                    time.sleep(args.think)

            threads = [threading.Thread(target=duty, args=(s,)) for s in sessions]
            t0 = time.time()
            host = HostMemory().start()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            host.stop()
            cells = sorted(latencies.queue)
            books = arbiter.books()
            return {
                "sessions": n,
                "cells": len(cells),
                "p50_cell_s": statistics.median(cells) if cells else None,
                "p95_cell_s": cells[int(0.95 * (len(cells) - 1))] if cells else None,
                "ooms": ooms + sum("OutOfMemory" in e or "MemoryError" in e for e in errors),
                "errors": errors[:5],
                "wall_s": time.time() - t0,
                "pauses": sum(d["what"] == "pause" for d in books["decisions"]),
                "suspends": sum(d["what"] == "suspend" for d in books["decisions"]),
                "queued": sum(d["what"] == "queued" for d in books["decisions"]),
                "host_used_peak_bytes": host.peak_used,
                "host_total_bytes": host.total,
            }
        finally:
            for s in sessions:
                s.shutdown()
            arbiter.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4096, help="tokens per step")
    parser.add_argument("--think", type=float, default=6.0, help="idle seconds between two cells")
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--sessions", default="", help="N to try, e.g. 6,12,24 (default: --multiples)")
    parser.add_argument(
        "--multiples", default="1,2,2.5", help="N to try as multiples of the static partitioning's count"
    )
    parser.add_argument("--cell-seconds", type=float, default=1.0, help="length of a cell on an empty card")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    gpu = nvml.list_gpus()[0]
    card = gpu.memory_total
    probe = Slice(gpu.uuid, gpu.index, gpu.name, card, card, 100, placement="binpack")
    # solo: calibrate the cell to about --cell-seconds, measure the peak
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        arbiter = start_arbiter(tmp, args.think)
        socket = str(arbiter.socket)
        s = Session(0, tmp, socket)
        try:
            with arbiter.control() as control:
                control.register(s.pid, "solo", "", probe)
            s.timed(SETUP.format(width=args.width, layers=args.layers, batch=args.batch))
            seconds, _, _ = s.timed("train(4)")
            steps = max(1, round(4 * args.cell_seconds / seconds))
            s.timed(f"train({steps})")
            solo = sorted(s.timed(f"train({steps})")[0] for _ in range(5))
            peak = nvml.process_memory(gpu.uuid).get(s.pid, 0)
            _, out, _ = s.timed("print(torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved())")
            max_reserved, idle_reserved = (int(v) for v in out.split())
        finally:
            s.shutdown()
            arbiter.stop()
    context = peak - idle_reserved
    session_peak = max_reserved + context
    static = int(card // session_peak)
    budget = min(card, max_reserved + (1 << 30))
    slice_ = Slice(
        gpu.uuid, gpu.index, gpu.name, card, budget, 100, placement="binpack", overcommit_ratio=8.0,
        idle_seconds=max(1.0, args.think / 3),
    )  # fmt: skip
    print(
        f"card {card / GiB:.1f} GiB, session peak {session_peak / GiB:.2f} GiB (working set "
        f"{idle_reserved / GiB:.2f} GiB idle), static {static}, solo cell {statistics.median(solo):.3f} s "
        f"({steps} steps)",
        flush=True,
    )
    multiples = [float(v) for v in args.multiples.split(",")]
    wanted = (
        [int(v) for v in args.sessions.split(",")]
        if args.sessions
        else [round(m * static) for m in multiples]
    )
    result = {
        "card_bytes": card,
        "working_set_bytes": idle_reserved,
        "session_peak_bytes": session_peak,
        "think_s": args.think,
        "static_sessions": static,
        "solo_cell_s": statistics.median(solo),
        "steps_per_cell": steps,
        "model": {"width": args.width, "layers": args.layers, "batch": args.batch, "dtype": "bf16"},
        "runs": [],
    }
    for n in wanted:
        row = run_sessions(n, args, slice_, steps)
        row["solo_p50_cell_s"] = statistics.median(solo)
        result["runs"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:  # after every N: a larger one may not finish
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
