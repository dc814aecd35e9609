"""CPU cost of jupyter-vgpu's usage sampling: one server, five idle kernels, 1 Hz.

Runs a real ``jupyter server`` twice with five real ipykernel kernels:

- ``off``: the server extension and the kernel hook disabled (plain Jupyter);
- ``on``: both enabled with a simulated slice, and one client reading
  ``/api/vgpu/usage/stream`` (so the sampler runs at 1 Hz, as with the panel open).

For each it measures, over the same window, the CPU time of the server process and
of each kernel process (psutil), as percent of one core. The difference is what the
sampler and the kernels' watcher threads cost. Usage::

    python benchmarks/sampler.py --seconds 30 --out benchmarks/results/sampler-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import provenance
import psutil
import requests

from jupyter_vgpu.slice import Slice

GiB = 2**30
KERNELS = 5
SLICE = Slice("GPU-sim-0", 0, "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, 8 * GiB, 25, simulated=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run(mode: str, seconds: float, root: Path) -> dict:
    """Start a server in ``mode`` ("on"/"off"), five kernels, measure; return the figures."""
    root.mkdir(parents=True)
    config_dir, ipython_dir = root / "config", root / "ipython"
    config_dir.mkdir()
    (ipython_dir / "profile_default").mkdir(parents=True)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(config_dir), "IPYTHONDIR": str(ipython_dir)}
    env.pop("JUPYTER_VGPU_CHANNEL", None)
    if mode == "off":
        server_config = {"ServerApp": {"jpserver_extensions": {"jupyter_vgpu": False}}}
        (config_dir / "jupyter_server_config.json").write_text(json.dumps(server_config))
        kernel_config = {"InteractiveShellApp": {"extensions": []}}
        (ipython_dir / "profile_default" / "ipython_kernel_config.json").write_text(json.dumps(kernel_config))
        env.pop("JUPYTER_VGPU_SLICE", None)
    else:
        env["JUPYTER_VGPU_SLICE"] = SLICE.to_json()
    port, token = _port(), secrets.token_hex(16)
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"token {token}"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            f"--ServerApp.port={port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}",
            "--ServerApp.allow_root=True",
        ],
        env=env,
        stdout=open(root / "server.log", "w"),  # noqa: SIM115 - the child writes it
        stderr=subprocess.STDOUT,
    )
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{url}/api/status", headers=headers, timeout=5).ok:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError((root / "server.log").read_text()[-2000:])
            time.sleep(0.3)
        for _ in range(KERNELS):
            requests.post(f"{url}/api/kernels", json={"name": "python3"}, headers=headers, timeout=30)
        time.sleep(10)  # kernels start, load the hook and settle
        server = psutil.Process(proc.pid)
        kernels = [p for p in server.children(recursive=True) if "ipykernel" in " ".join(p.cmdline())]
        events = [0]

        def stream():
            with requests.get(f"{url}/api/vgpu/usage/stream", headers=headers, stream=True, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        events[0] += 1
                    if stop.is_set():
                        return

        if mode == "on":
            threading.Thread(target=stream, daemon=True).start()
        start = time.monotonic()
        s0 = _cpu_seconds(server)
        k0 = [_cpu_seconds(k) for k in kernels]
        time.sleep(seconds)
        wall = time.monotonic() - start
        server_pct = 100 * (_cpu_seconds(server) - s0) / wall
        kernel_pct = [100 * (_cpu_seconds(k) - c) / wall for k, c in zip(kernels, k0, strict=True)]
        return {
            "mode": mode,
            "seconds": round(wall, 2),
            "kernels": len(kernels),
            "server_cpu_percent": round(server_pct, 3),
            "kernel_cpu_percent_mean": round(sum(kernel_pct) / max(1, len(kernel_pct)), 3),
            "kernel_cpu_percent_each": [round(p, 3) for p in kernel_pct],
            "stream_events": events[0],
        }
    finally:
        stop.set()
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="measuring window per mode, seconds")
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    record = provenance.record()
    with tempfile.TemporaryDirectory() as tmp:
        off = run("off", args.seconds, Path(tmp) / "off")
        on = run("on", args.seconds, Path(tmp) / "on")
    result = {
        **record,
        "benchmark": "sampler CPU cost: one server, five idle kernels, usage stream at 1 Hz",
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()},
        "off": off,
        "on": on,
        "server_overhead_cpu_percent": round(on["server_cpu_percent"] - off["server_cpu_percent"], 3),
        "kernel_overhead_cpu_percent": round(
            on["kernel_cpu_percent_mean"] - off["kernel_cpu_percent_mean"], 3
        ),
        "unit": "percent of one CPU core",
    }
    provenance.write(result, args.out)


if __name__ == "__main__":
    main()
