"""The arbiter's watchdog: CPU per look at the cards with 30 servers, NVML's query aside.

Each look (every ``poll_seconds``, at most 1 s) maps every process NVML lists on a card
to the registered server whose process tree it belongs to (``/proc/<pid>/stat`` walks,
:mod:`jupyter_vgpu.node.peers`) and turns the reading into actions
(:meth:`jupyter_vgpu.node.watchdog.Watchdog.step`). Here 30 servers are real process
trees (a root, a kernel below it, a subprocess below that: 90 processes), two processes
of each are "on the card" with synthetic byte counts (one of every ten over budget),
and the same code the arbiter runs is timed in process CPU time. NVML's per-process
query itself is not included (no GPU here): add its cost on the GPU machine.

Usage (any Linux machine): ``python benchmarks/watchdog.py --out benchmarks/results/watchdog-cpu.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_vgpu.node import peers
from jupyter_vgpu.node.books import Server
from jupyter_vgpu.node.watchdog import Watchdog, owners
from jupyter_vgpu.slice import Slice

GiB = 1 << 30
# a server: the root starts a "kernel", which starts a "subprocess"; all sleep
SLEEP = "import time; time.sleep(600)"
KERNEL = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEP!r}]); time.sleep(600)"
TREE = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {KERNEL!r}]); time.sleep(600)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--servers", type=int, default=30)
    parser.add_argument("--looks", type=int, default=200)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    roots = [subprocess.Popen([sys.executable, "-c", TREE]) for _ in range(args.servers)]
    try:
        deadline = time.time() + 60
        while True:  # every tree complete: root, kernel, subprocess
            trees = {r.pid: peers.descendants(r.pid, _all_pids()) for r in roots}
            if all(len(t) >= 3 for t in trees.values()) or time.time() > deadline:
                break
            time.sleep(0.2)
        s = Slice("GPU-0", 0, "H100", 80 * GiB, 2 * GiB, 25)
        servers = {r.pid: Server(r.pid, f"user{i}", "", s) for i, r in enumerate(roots)}
        reading = {}
        for i, tree in enumerate(trees.values()):
            for pid in sorted(tree)[1:3]:
                reading[pid] = 3 * GiB if i % 10 == 0 else GiB
        watchdog = Watchdog("report", grace_seconds=10)
        times, warned = [], set()
        for n in range(args.looks):
            t0 = time.process_time()
            owner = owners(servers.values(), lambda pid: peers.root_in(pid, servers))
            actions = watchdog.step(float(n), reading, owner)
            times.append(time.process_time() - t0)
            warned |= {a.pid for a in actions}
        result = {
            "servers": args.servers,
            "processes": sum(len(t) for t in trees.values()),
            "processes_on_card": len(reading),
            "over_budget_seen": len(warned),
            "cpu_ms_per_look_median": statistics.median(times) * 1e3,
            "cpu_ms_per_look_p95": sorted(times)[int(0.95 * len(times))] * 1e3,
            "cpu_percent_at_1s_poll": statistics.median(times) * 100,
            "excludes": "NVML's per-process query (no GPU on this machine)",
            "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
        }
    finally:
        for r in roots:
            for pid in peers.descendants(r.pid, _all_pids()):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


if __name__ == "__main__":
    main()
