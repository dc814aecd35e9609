"""The escape suite: ways a user gets past the in-kernel budget, each caught from outside.

A real kernel with a 2 GiB slice, in a cgroup of its own as the local spawner starts
servers (where this machine lets root make one; else known by its process tree), and
registered with a standalone arbiter whose watchdog ends offenders
(``--over-budget=kill``, 1 s of grace, NVML read every 0.25 s), tries each escape to hold
4 GiB: lifting PyTorch's memory fraction, setting it before CUDA starts, CuPy (with its
environment limit edited), ``cudaMalloc`` through ctypes, a subprocess of the kernel, a
process typed into a terminal of a real Jupyter server; then every way a process leaves
the server's process tree (``tests/gpu/escape_cases.py``: a double fork, ``setsid -f``,
``nohup … & disown``, a daemonizing tool, re-parenting to init through a subreaper, and
``setsid -f`` typed into a terminal); and a GPU process started outside every server
(as by ``at``, cron or ``systemd-run --user``), which default deny catches. For each
case: whether the arbiter caught it, how long after the memory was taken (the escape
prints the wall-clock time it finished allocating; the arbiter logs its decisions with
theirs), what it did, and how it knew whose the process was (``mapped_by``: ``cgroup``,
``tree``, or ``unowned``); ``goals`` says whether every case was caught within the
issue's 2 s.

Usage (GPU machine): ``python benchmarks/escapes.py --out benchmarks/results/escapes-h100.json``
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402
from gpu_common import require_gpu  # noqa: E402

from jupyter_vgpu import nvml  # noqa: E402
from jupyter_vgpu.slice import Slice  # noqa: E402
from jupyter_vgpu.testing import escape_cases  # noqa: E402
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess  # noqa: E402
from jupyter_vgpu.testing.kernel_runner import Kernel  # noqa: E402
from jupyter_vgpu.testing.lab_client import LabClient  # noqa: E402
from jupyter_vgpu.testing.preloaded import environment  # noqa: E402
from jupyter_vgpu.testing.server_process import TERMINALS_ON, JupyterServer  # noqa: E402

GiB = 1 << 30
#: The issue's bound: an escape is caught (warned) within this many seconds of holding
#: the memory. Tests check the catch with a bound a loaded machine meets; this is where
#: the bound itself is measured.
CATCH_GOAL_S = 2.0
HOLD = "import time\nprint('took', time.time(), flush=True)\ntime.sleep(6)\n"
CASES = {
    "fraction lifted in the kernel": (
        "import torch\ntorch.cuda.set_per_process_memory_fraction(1.0)\n"
        "x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda')\n" + HOLD
    ),
    "fraction set before CUDA starts": (
        "import torch\ntorch.cuda.memory.set_per_process_memory_fraction(1.0, 0)\n"
        "x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda')\n" + HOLD
    ),
    "CuPy, its environment limit edited": (
        "import os\nos.environ['CUPY_GPU_MEMORY_LIMIT'] = str(80 << 30)\nimport cupy\n"
        "x = cupy.empty(4 << 30, dtype=cupy.uint8)\n" + HOLD
    ),
    "cuMemAlloc through ctypes (the driver, raw)": (
        "import ctypes\ncu = ctypes.CDLL('libcuda.so.1')\nassert cu.cuInit(0) == 0\n"
        "dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()\n"
        "assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0\n"
        "assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0\n"
        "assert cu.cuCtxSetCurrent(ctx) == 0\n"
        "assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(4 << 30)) == 0\n" + HOLD
    ),
    "a subprocess of the kernel": (
        "import subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "\"import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
        "print('took', time.time(), flush=True); time.sleep(8)\"], stdout=subprocess.PIPE, text=True)\n"
        "print(child.stdout.readline(), flush=True)\nchild.wait()\n"
    ),
    "the slice in the environment edited (120 GiB), then a subprocess": (
        "import json, os, subprocess, sys\n"
        "from jupyter_vgpu.slice import Slice\n"
        "os.environ['JUPYTER_VGPU_SLICE'] = Slice('GPU-x', 0, 'H100', 120 << 30, 120 << 30, 100).to_json()\n"
        "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = ''\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "\"import torch, time; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
        "print('took', time.time(), flush=True); time.sleep(8)\"], stdout=subprocess.PIPE, text=True)\n"
        "print(child.stdout.readline(), flush=True)\nchild.wait()\n"
    ),
    "a process from a terminal of the same server": None,  # terminal_case
    **{f"leaves the tree: {name}": None for name in escape_cases.CASES},  # daemon_case
    "leaves the tree: setsid -f typed into a terminal": None,  # terminal_case
    "a GPU process outside every server (at, cron, systemd-run --user)": None,  # outside_case
}
OUTSIDE_CASE = "a GPU process outside every server (at, cron, systemd-run --user)"
TERMINAL_DAEMON_CASE = "leaves the tree: setsid -f typed into a terminal"
TERMINAL_CASE = "a process from a terminal of the same server"
# typed into the terminal; prints "took <time>" (spelt apart so that the echo does not match)
TERMINAL = (
    "python3 -c \"import time, torch; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); "
    "print('to' + 'ok', time.time(), flush=True); time.sleep(8)\""
)


def run(kernel: Kernel, code: str) -> str:
    """The output of ``code``, also when the watchdog ends the kernel halfway."""
    parts: list[str] = []

    def hook(msg):
        if msg["header"]["msg_type"] == "stream":
            parts.append(msg["content"]["text"])

    try:
        kernel.client.execute_interactive(code, output_hook=hook, timeout=20)
    except TimeoutError:
        parts.append("(no reply: the kernel was ended)")
    return "".join(parts)


def judge(arbiter: ArbiterProcess, since: float, took: float | None, output: str) -> dict:
    """What the arbiter decided about an escape that held its memory from ``took`` on."""
    deadline = time.time() + 5
    while True:  # until it acted, or 5 s: the escapes hold their memory 6 s or more
        decisions = [
            d
            for d in arbiter.books()["decisions"]
            if d["what"].startswith(("over budget", "unowned")) and d["time"] >= since
        ]
        warned = next((d for d in decisions if d["what"].endswith(": warn")), None)
        acted = next((d for d in decisions if d["what"].endswith(": kill")), None)
        if acted or time.time() > deadline:
            break
        time.sleep(0.1)
    seconds = round(warned["time"] - took, 3) if warned and took else None
    return {
        "caught": warned is not None,
        "seconds_to_catch": seconds,
        f"caught_within_{CATCH_GOAL_S:g}_s": seconds is not None and seconds < CATCH_GOAL_S,
        "action": "kill" if acted else ("warn" if warned else None),
        "seconds_to_action": round(acted["time"] - took, 3) if acted and took else None,
        "mapped_by": warned.get("mapped_by") if warned else None,
        "output_tail": output[-300:],
    }


def register(arbiter: ArbiterProcess, pid: int, slice_: Slice) -> escape_cases.cgroups.Cgroup | None:
    """Put ``pid`` in a cgroup of its own (where one can be made) and register it as
    mallory's server; returns the cgroup (None: known by its process tree)."""
    cgroup, _ = escape_cases.server_cgroup(pid, "/jupyter-vgpu-bench")
    with arbiter.control() as c:
        c.register(pid, "mallory", "", slice_, cgroup=str(cgroup) if cgroup else None)
    return cgroup


def kernel_case(arbiter: ArbiterProcess, tmp: Path, slice_: Slice, code: str) -> dict:
    """Run ``code`` in a fresh kernel registered as a server with ``slice_``."""
    kernel = Kernel(tmp, environment(JUPYTER_VGPU_ARBITER=str(arbiter.socket)), load_extension=True)
    cgroup = None
    try:
        cgroup = register(arbiter, kernel.pid, slice_)
        kernel.run("import os")
        since = time.time()
        out = run(kernel, code)
        return judge(arbiter, since, took_time(out), out)
    finally:
        kernel.shutdown()
        escape_cases.remove_cgroup(cgroup)


def outside_case(arbiter: ArbiterProcess, tmp: Path) -> dict:
    """A process no server started takes 4 GiB (a job of ``at``, cron or a user's systemd
    manager runs outside every server's cgroup)."""
    took_file = tmp / "outside-took"
    since = time.time()
    process = subprocess.Popen(
        [sys.executable, "-c", escape_cases.DAEMON.format(took=str(took_file))], env=environment()
    )
    try:
        while process.poll() is None and not (took_file.exists() and took_file.read_text()):
            time.sleep(0.02)
        text = took_file.read_text() if took_file.exists() else ""
        return judge(arbiter, since, took_time(text), text)
    finally:
        process.kill()
        process.wait()


def terminal_case(
    arbiter: ArbiterProcess, tmp: Path, slice_: Slice, gpu_uuid: str, command: str = TERMINAL
) -> dict:
    """A real ``jupyter server`` registered with ``slice_``; a process typed into one of
    its terminals (terminado, as JupyterLab's terminal) takes 4 GiB."""
    server = JupyterServer(tmp / "terminal-server", {"CUDA_VISIBLE_DEVICES": gpu_uuid}, args=[TERMINALS_ON])
    cgroup = None
    try:
        cgroup = register(arbiter, server.proc.pid, slice_)
        since = time.time()
        _, out = LabClient(server.url + "/", server.token).terminal(command, until="took 1", timeout=60)
        time.sleep(0.5)  # the rest of the line
        return judge(arbiter, since, took_time(out), out)
    finally:
        server.stop()
        escape_cases.remove_cgroup(cgroup)


def took_time(output: str) -> float | None:
    """The wall-clock time an escape printed after ``took``."""
    match = re.search(r"took (\d+\.\d+)", output)
    return float(match.group(1)) if match else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--cases", default="", help="only the cases whose names contain one of these, comma-separated"
    )
    args = parser.parse_args()
    require_gpu(parser)
    wanted = [w for w in args.cases.split(",") if w]
    cases = {n: c for n, c in CASES.items() if not wanted or any(w in n for w in wanted)}
    record = provenance.record()
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 2 * GiB, 100)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        arbiter = ArbiterProcess(
            tmp, "--over-budget=kill", "--ArbiterApp.grace_seconds=1", "--ArbiterApp.poll_seconds=0.25"
        ).start()
        try:
            for name, code in cases.items():
                if name == TERMINAL_CASE:
                    row = terminal_case(arbiter, tmp, slice_, gpu.uuid)
                elif name == TERMINAL_DAEMON_CASE:
                    command = escape_cases.terminal_command(tmp / "terminal-took")
                    row = terminal_case(arbiter, tmp, slice_, gpu.uuid, command)
                elif name == OUTSIDE_CASE:
                    row = outside_case(arbiter, tmp)
                elif code is None:
                    took = tmp / f"took-{len(rows)}"
                    row = kernel_case(
                        arbiter, tmp, slice_, escape_cases.kernel_code(name.split(": ", 1)[1], took)
                    )
                else:
                    row = kernel_case(arbiter, tmp, slice_, code)
                row = {"name": name, **row}
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(args.out, "w") as f:
                    doc = {
                        **record,
                        "cases": rows,
                        "gpu": gpu.name,
                        "policy": "kill after 1 s",
                        "budget_bytes": 2 * GiB,
                        "goals": {
                            f"every_case_caught_within_{CATCH_GOAL_S:g}_s": all(
                                r[f"caught_within_{CATCH_GOAL_S:g}_s"] for r in rows
                            ),
                        },
                    }
                    json.dump(doc, f, indent=2)
        finally:
            arbiter.stop()


if __name__ == "__main__":
    main()
