"""Offload engine benchmark: ratio and speed per workload, against the physical limit.

For each workload the same bytes are moved three ways:

- the engine (``OffloadEngine.offload`` / ``restore``: constant check, pinned copies,
  byte planes, zstd on a thread pool; restore timed until the tensor is usable);
- a raw copy through pinned host memory (the bus limit, ~55 GB/s on the H100 box);
- the naive ``t.cpu()`` / ``t.cuda()`` a user would write.

Also: the step-time overhead of the hook on a training loop with nothing offloaded and
with the restore-on-touch mode active, and the pre-cell hook's time with 10,000 live
tensors. Speeds are uncompressed bytes per second (GB = 1e9 bytes).

    python benchmarks/offload.py --out benchmarks/results/offload-h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jupyter_vgpu.kernel.offload.engine import EngineConfig, OffloadEngine


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def workloads(nbytes: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    n2, n4 = nbytes // 2, nbytes // 4
    yield (
        "bf16 weights N(0, 0.02)",
        lambda: (torch.randn(n2, device=device, generator=g) * 0.02).to(torch.bfloat16),
    )
    yield (
        "fp32 Adam exp_avg_sq",
        lambda: (torch.randn(n4, device=device, generator=g) * 1e-3).square_() + 1e-12,
    )
    yield (
        "bf16 ReLU activations",
        lambda: torch.relu(torch.randn(n2, device=device, generator=g)).to(torch.bfloat16),
    )
    yield "all-zero buffer", lambda: torch.zeros(n4, device=device)


def timed(fn, device):
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def bench_workload(name, make, engine, device, repeats):
    t = make()
    ref = t.clone()
    nbytes = t.untyped_storage().nbytes()
    ns = {"t": t}
    off, res, ratio, host = [], [], None, None
    for _ in range(repeats):
        s, report = timed(lambda: engine.offload(ns), device)
        assert report.moved, report
        stats = engine.stats()
        ratio, host = stats["ratio"], stats["host_bytes"] + stats["disk_bytes"]
        off.append(s)
        s, _ = timed(lambda: engine.restore(ns), device)
        res.append(s)
    assert torch.equal(t, ref), "round trip changed the data"
    row = {
        "workload": name,
        "bytes": nbytes,
        "ratio": ratio,
        "host_bytes_held": host,
        "offload_gbps": nbytes / min(off) / 1e9,
        "restore_gbps": nbytes / min(res) / 1e9,
    }
    if device.type == "cuda":
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        flat = t.view(torch.uint8).view(-1)
        d2h = min(timed(lambda: pinned.copy_(flat, non_blocking=True), device)[0] for _ in range(repeats))
        h2d = min(timed(lambda: flat.copy_(pinned, non_blocking=True), device)[0] for _ in range(repeats))
        naive_off, host_copy = timed(lambda: t.cpu(), device)
        naive_res, _ = timed(lambda: host_copy.cuda(), device)
        row.update(
            raw_pinned_d2h_gbps=nbytes / d2h / 1e9,
            raw_pinned_h2d_gbps=nbytes / h2d / 1e9,
            naive_cpu_gbps=nbytes / naive_off / 1e9,
            naive_cuda_gbps=nbytes / naive_res / 1e9,
        )
    return row


def training_overhead(engine, device, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(device)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(256, 1024, device=device)

    def loop():
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

    def best_of(n=5):
        return min(timed(loop, device)[0] for _ in range(n))

    loop()  # warm-up
    plain = best_of()
    ns = {"model": model, "opt": opt, "x": x}
    engine.before_cell("loop()", ns)
    hooked = best_of()  # hook installed, nothing offloaded: no mode pushed
    engine.after_cell(ns)
    idle = {"idle": torch.randn(1024, device=device)}
    engine.offload(idle)  # something offloaded elsewhere: the restore-on-touch mode is active
    with_mode = best_of()
    engine.restore(idle)
    return {
        "step_seconds_plain": plain / steps,
        "overhead_nothing_offloaded": hooked / plain - 1,
        "overhead_mode_active": with_mode / plain - 1,
    }


def precell(engine, device, n=10_000):
    ns = {f"t{i}": torch.zeros(16, device=device) for i in range(n)}
    ns["model"] = torch.nn.Linear(8, 8).to(device)
    times = []
    for i in range(50):
        start = time.perf_counter()
        engine.before_cell(f"y = t{i} + model.weight.sum()", ns)
        times.append(time.perf_counter() - start)
        engine.after_cell(ns)
    return {
        "live_tensors": n,
        "pre_cell_ms_median": statistics.median(times) * 1e3,
        "pre_cell_ms_max": max(times) * 1e3,
    }


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--size", default=None, help="bytes per workload, e.g. 2G (default: 2G on CUDA, 64M on CPU)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    size = args.size or ("2G" if device.type == "cuda" else "64M")
    nbytes = int(float(size[:-1]) * units[size[-1]]) if size[-1] in units else int(size)
    engine = OffloadEngine(EngineConfig(device=str(device)))
    result = {
        "machine": {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "cpu_count": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "codec_threads": engine.codec.threads,
        },
        "workloads": [
            bench_workload(n, make, engine, device, args.repeats) for n, make in workloads(nbytes, device)
        ],
        "training_loop": training_overhead(engine, device, steps=20 if device.type == "cuda" else 3),
        "pre_cell_hook": precell(engine, device),
        "goals": {
            "ratio_bf16": 1.45,
            "ratio_zeros": 1000,
            "restore_gbps": 8,
            "overhead_nothing_offloaded": 0.01,
            "pre_cell_ms": 2,
        },
    }
    engine.close()
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
