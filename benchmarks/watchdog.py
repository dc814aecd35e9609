"""The arbiter's watchdog: CPU per look at the cards with 30 servers, NVML's query aside.

Each look (every ``poll_seconds``, at most 1 s) maps every process NVML lists on a card
to the registered server it belongs to, as the arbiter does (``Arbiter.mapping``: the
server whose cgroup it is in, one read of ``/proc/<pid>/cgroup``; else the process tree,
``/proc/<pid>/stat`` walks), sums each server's processes against its budget, checks
the processes of no server against the allowlist (default deny), and turns the reading
into actions (:meth:`jupyter_vgpu.node.watchdog.Watchdog.step`). Here 30 servers are
real process trees (a root, a kernel below it, a subprocess below that: 90 processes),
each in a cgroup of its own made as the local spawner makes them (where this machine
lets root; ``--tree``: none, known by their trees as before), two processes of each are
"on the card" with synthetic byte counts (one server of every ten over budget), two
processes of no server too, and the same code the arbiter runs is timed in process CPU
time.

With ``--gpu`` (the GPU machine) the subprocess at the bottom of each tree holds real
device memory through the driver (64 MiB; 2.5 GiB in one tree of ten, over its 2 GiB
budget), and each look also reads NVML's per-process figures for the card, as the
arbiter does: the time then includes NVML's query.

Usage: ``python benchmarks/watchdog.py --out benchmarks/results/watchdog-cpu.json``
(any Linux machine), ``python benchmarks/watchdog.py --gpu --out benchmarks/results/watchdog-h100.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import provenance
from gpu_common import require_gpu

from hub_spawner import server_cgroup
from jupyter_vgpu import nvml
from jupyter_vgpu.host import cgroups, peers
from jupyter_vgpu.host.cgroups import Cgroup
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.watchdog import Watchdog, owners
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.percentiles import percentile

GiB = 1 << 30


def parent_of(code: str) -> str:
    """Python code that starts ``code`` in a child process and sleeps."""
    start = f"subprocess.Popen([sys.executable, '-c', {code!r}])"
    return f"import subprocess, sys, time; {start}; time.sleep(600)"


# a server: the root starts a "kernel", which starts a "subprocess"; all sleep
SLEEP = "import time; time.sleep(600)"
TREE = parent_of(parent_of(SLEEP))
# the same tree whose bottom process holds HOLD_BYTES of device memory through the driver
HOLDER = (
    "import ctypes, os, time\n"
    "cu = ctypes.CDLL('libcuda.so.1'); assert cu.cuInit(0) == 0\n"
    "dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()\n"
    "assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0\n"
    "assert cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0 and cu.cuCtxSetCurrent(ctx) == 0\n"
    "assert cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(os.environ['HOLD_BYTES']))) == 0\n"
    "time.sleep(600)\n"
)
GPU_TREE = parent_of(parent_of(HOLDER))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=30)
    parser.add_argument("--looks", type=int, default=200)
    parser.add_argument("--gpu", action="store_true", help="real device memory, read through NVML")
    parser.add_argument(
        "--tree", action="store_true", help="no cgroups: servers known by their process trees"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    record = provenance.record()
    gpu = None
    if args.gpu:
        require_gpu(parser)
        gpu = nvml.list_gpus()[0]

    host, why_not = None, "--tree"
    if not args.tree:
        try:
            host = server_cgroup.probe("cgroupfs", f"/jupyter-vgpu-bench/watchdog-{os.getpid()}")
        except server_cgroup.CgroupUnavailable as e:
            why_not = str(e)
    places: list[Cgroup | None] = []

    def start(i: int) -> subprocess.Popen:
        join = None
        places.append(None)
        if host is not None:
            places[-1] = Cgroup(host.hierarchy, f"{host.parent}/server-{i}")
            directory = host.mount.directory(places[-1].path)
            directory.mkdir(mode=0o755)
            join = server_cgroup.joiner(directory)
        if not args.gpu:
            return subprocess.Popen([sys.executable, "-c", TREE], preexec_fn=join)
        env = {**os.environ, "HOLD_BYTES": str(5 * GiB // 2 if i % 10 == 0 else 64 << 20)}
        return subprocess.Popen([sys.executable, "-c", GPU_TREE], env=env, preexec_fn=join)

    roots = [start(i) for i in range(args.servers)]
    strangers = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]  # processes of no server
    try:
        deadline = time.time() + 60
        while True:  # every tree complete: root, kernel, subprocess
            trees = {r.pid: peers.descendants(r.pid, _all_pids()) for r in roots}
            complete = all(len(t) >= 3 for t in trees.values())
            if args.gpu and complete:  # and every holder on the card
                complete = len(nvml.process_memory(gpu.uuid)) >= args.servers
            if complete or time.time() > deadline:
                break
            time.sleep(0.2)
        s = Slice("GPU-0", 0, "H100", 80 * GiB, 2 * GiB, 25)
        arbiter = Arbiter(ArbiterApp(registrars="none"))
        for i, r in enumerate(roots):
            place = places[i]
            arbiter.register(
                r.pid, f"user{i}", "", s, None, place and place.path, place.hierarchy if place else ""
            )
        reading = {}
        for i, tree in enumerate(trees.values()):
            for pid in sorted(tree)[1:3]:
                reading[pid] = 3 * GiB // 2 if i % 10 == 0 else GiB // 2
        if args.gpu:
            reading = {}
        for stranger in strangers:
            reading[stranger.pid] = GiB
        mapped = {}
        for pid in reading:
            found = arbiter.mapping(pid)
            mapped[found[1] if found else "unowned"] = mapped.get(found[1] if found else "unowned", 0) + 1
        watchdog = Watchdog("report", grace_seconds=10)
        times, warned = [], set()
        nvml_times = []
        for n in range(args.looks):
            t0 = time.process_time()
            if args.gpu:
                reading = nvml.process_memory(gpu.uuid)
                nvml_times.append(time.process_time() - t0)
            owner = owners(arbiter.servers.values(), arbiter.mapping)
            actions = watchdog.step(float(n), reading, owner, arbiter.allowed)
            times.append(time.process_time() - t0)
            warned |= {a.pid for a in actions}
        result = {
            **record,
            "servers": args.servers,
            "processes": sum(len(t) for t in trees.values()),
            "processes_on_card": len(reading),
            "over_budget_seen": len(warned),
            "mapped_by": mapped if not args.gpu else None,
            "cgroups": host.describe() if host else f"none: {why_not}",
            "cpu_ms_per_look_median": percentile(times, 50) * 1e3,
            "cpu_ms_per_look_p95": percentile(times, 95) * 1e3,
            "cpu_percent_at_1s_poll": percentile(times, 50) * 100,
            "nvml_cpu_ms_per_look_median": percentile(nvml_times, 50) * 1e3 if nvml_times else None,
            "excludes": None if args.gpu else "NVML's per-process query (no GPU on this machine)",
            "gpu": gpu.name if gpu else None,
            "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        }
    finally:
        for r in roots:
            for pid in peers.descendants(r.pid, _all_pids()):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
        for stranger in strangers:
            stranger.kill()
        for place in places:
            if place is not None:
                directory = host.mount.directory(place.path)
                server_cgroup.kill_all(directory)
                _rmdir(directory)
        if host is not None:
            _rmdir(host.mount.directory(host.parent))
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


def _rmdir(directory: Path) -> None:
    for _ in range(200):
        if cgroups.try_remove(directory):
            return
        time.sleep(0.01)


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


if __name__ == "__main__":
    main()
