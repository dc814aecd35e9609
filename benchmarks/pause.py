"""Pause and resume of a kernel's GPU memory, beside the raw pinned copy of the same bytes.

Workloads of 1, 8 and 32 GiB on the GPU: bf16 weights (N(0, 0.02)) and their fp32 Adam
state (first and second moment), so the weights are a fifth of the bytes. For each:
``pause_s`` and ``resume_s`` (until the next cell may run: every byte back and its
checksum verified), a warm cycle first so pinned host memory comes from PyTorch's cache
as it does from a kernel's second pause on (the cold first pause, pinning on the way, is
``cold_pause_s``; a first pause after pinning ahead as an idle kernel does,
``prepared_first_pause_s``, after ``prepare_s`` of pinning),
``host_bytes``, NVML's figure for the process while paused and while suspended (the
driver's checkpoint, after the pause), and the raw pinned copies. Then the cost of the
pausable allocator with nothing paused: a training step of a small transformer
(>= 10 ms) in a preloaded process against one without the allocator.

Usage (GPU machine): ``python benchmarks/pause.py --out benchmarks/results/pause-h100.json``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import provenance
from gpu_common import (
    GiB,
    checkpoint_cycle,
    nvml_bytes,
    preloaded_or_reexec,
    raw_copies,
    require_gpu,
    workload,
)

STEP = r"""
import json, statistics, time, torch
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
model = torch.nn.TransformerEncoder(layer, 6).cuda()
opt = torch.optim.AdamW(model.parameters(), 1e-4)
x = torch.randn(16, 256, 1024, device="cuda")
def step():
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    opt.step()
for _ in range(10):
    step()
times = []
for _ in range(%d):
    torch.cuda.synchronize(); t = time.perf_counter(); step(); torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
"""


def step_times(preloaded: bool, steps: int, alloc_conf: str = "") -> list[float]:
    """Seconds of each of ``steps`` training steps in a fresh process, preloaded with the
    pausable allocator or not, under ``PYTORCH_CUDA_ALLOC_CONF=alloc_conf``."""
    from jupyter_vgpu.kernel.pause import vmm

    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTORCH_CUDA_ALLOC_CONF")}
    if alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
    if preloaded:
        env = vmm.preload_environment(env)
    out = subprocess.run(
        [sys.executable, "-c", STEP % steps], env=env, capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(torch, gib: float) -> dict:
    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.engine import PauseEngine
    from jupyter_vgpu.kernel.pause.torch_calls import empty_host_cache

    def mark(what: str) -> None:
        print(f"  {gib:g} GiB: {what} at {time.perf_counter() - t0:.1f} s", flush=True)

    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = workload(torch, gib, gen)
    torch.cuda.synchronize()
    gpu_bytes = sum(t.numel() * t.element_size() for t in tensors)
    check = [t.view(torch.uint8)[:: 1 << 20].cpu() for t in tensors]
    raw_d2h, raw_h2d = raw_copies(torch, tensors)
    mark("raw copies")
    empty_host_cache(torch)  # nothing pinned left over from the raw copies
    engine = PauseEngine(torch, vmm.load(), 0)
    cold = engine.pause()  # pins its slabs on the way
    engine.resume()
    engine.close()  # lets the slabs go
    empty_host_cache(torch)
    mark("cold cycle")
    engine = PauseEngine(torch, vmm.load(), 0)
    t = time.perf_counter()
    prepared = engine.prepare()  # as an idle kernel does (VGPUKernel.prepare_pinned)
    prepare_s = time.perf_counter() - t
    first = engine.pause()
    engine.resume()
    mark(f"pinned {prepared / GiB:.1f} GiB ahead in {prepare_s:.2f} s, then the first pause")
    out = engine.pause()
    paused = nvml_bytes()
    mark("pause")
    checkpoint = checkpoint_cycle(mark)
    t = time.perf_counter()
    back = engine.resume()
    resume_s = time.perf_counter() - t
    exact = all(
        torch.equal(c, x.view(torch.uint8)[:: 1 << 20].cpu()) for c, x in zip(check, tensors, strict=True)
    )
    engine.close()
    del tensors
    torch.cuda.empty_cache()
    return {
        "name": f"{gib:g} GiB: bf16 weights + fp32 Adam state",
        "gpu_bytes": gpu_bytes,
        "host_bytes": out.host_bytes,
        "pause_s": out.seconds,
        "resume_s": resume_s,
        "raw_d2h_s": raw_d2h,
        "raw_h2d_s": raw_h2d,
        "nvml_paused_bytes": paused,
        "nvml_suspended_bytes": checkpoint["nvml_suspended_bytes"],
        "cold_pause_s": cold.seconds,
        "prepared_bytes": prepared,
        "prepare_s": prepare_s,
        "prepared_first_pause_s": first.seconds,
        "prepared_first_vs_warm": first.seconds / out.seconds,
        "suspend_s": checkpoint["suspend_s"],
        "restore_s": checkpoint["restore_s"],
        "codecs": list(out.codecs),
        "resume_vs_raw_h2d": raw_h2d / resume_s,
        "pause_vs_raw_d2h": raw_d2h / out.seconds,
        "bit_exact": exact,
        "resume_inner_s": back.seconds,
    }


def save(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,8,32", help="workload sizes, GiB ('' for none)")
    parser.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    require_gpu(parser)
    preloaded_or_reexec()
    import torch

    result = {
        **provenance.record(),
        "workloads": [],
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    for gib in (float(s) for s in args.sizes.split(",") if s):
        row = measure(torch, gib)
        result["workloads"].append(row)
        print(json.dumps(row), flush=True)
        save(args.out, result)  # kept if a later, larger workload does not finish
    plain, pre = [], []
    for _ in range(2):  # alternate, so drift hits both
        plain += step_times(False, args.steps)
        pre += step_times(True, args.steps)
    result["step_s_plain"] = statistics.median(plain)
    result["step_s_preloaded"] = statistics.median(pre)
    result["step_overhead_idle"] = result["step_s_preloaded"] / result["step_s_plain"] - 1
    save(args.out, result)
    print(
        f"step {result['step_s_plain'] * 1e3:.2f} ms plain, {result['step_s_preloaded'] * 1e3:.2f} ms "
        f"preloaded: overhead {result['step_overhead_idle']:+.4f}"
    )
    for r in result["workloads"]:
        print(
            f"{r['name']}: pause {r['pause_s']:.3f} s (raw {r['raw_d2h_s']:.3f}), "
            f"resume {r['resume_s']:.3f} s "
            f"(raw {r['raw_h2d_s']:.3f}), host/gpu {r['host_bytes'] / r['gpu_bytes']:.3f}, "
            f"NVML paused {r['nvml_paused_bytes'] / GiB:.2f} GiB, suspended {r['nvml_suspended_bytes']}"
        )


if __name__ == "__main__":
    main()
