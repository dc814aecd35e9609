"""Every allocation path of a kernel, taken off the card and brought back.

For each path a real kernel (started as a server starts it: the pausable allocator
preloaded, the vGPU extension loaded) fills about 4 GiB through that path, then runs
``%vgpu pause``, which pauses the kernel or, where a pause is not safe, suspends it (the
driver's checkpoint), as the node arbiter would; the kernel's next cell brings it back.
The first cycle warms the pinned host memory (its pause is ``cold_pause_s``); the others
(``--cycles``, two in all by default) are measured, and their median is kept. Per path:

- ``gpu_bytes``: NVML's bytes for the kernel (and the processes it shares memory with)
  before, CUDA context included;
- ``nvml_away_bytes``: the same while paused or suspended (goal: at most the CUDA
  context, 0.75 GiB, when paused; 0 when suspended);
- ``tier``: ``pause``, ``suspend`` or ``gpu`` (neither: it stays), what the kernel chose,
  and ``why`` when not paused;
- ``pause_s`` / ``resume_s``: the kernel's own figures, the median of the measured
  cycles (each in ``pause_s_all`` / ``resume_s_all``; a suspend's checkpoint and restore
  for the suspend tier);
- ``bit_exact``: a SHA-256 of every byte the path holds, before and after.

Then the allocator's cost with nothing paused: the training step of ``pause.py`` in a
preloaded process against a plain one, with PyTorch's default allocator and with its
expandable segments (goal: at most 1%).

Usage (GPU machine): ``python benchmarks/coverage.py --out benchmarks/results/coverage-h100.json``
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import provenance
from gpu_common import GiB, require_gpu
from pause import step_times

from jupyter_vgpu import nvml
from jupyter_vgpu.channel import kernel_path, read_json
from jupyter_vgpu.testing.digest_code import DIGEST
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

# The same 4 GiB for the three PyTorch allocators: bf16 weights N(0, 0.02)
TORCH = (
    "import torch\ng = torch.Generator(device='cuda').manual_seed(0)\n"
    "held = [(torch.randn(2**28, device='cuda', generator=g) * 0.02).to(torch.bfloat16) for _ in range(8)]\n"
    "torch.cuda.empty_cache()\n"
    "host = lambda: [t.view(torch.uint8).cpu().numpy() for t in held]\n"
)
CUPY = (
    "import cupy as cp\n{setup}rs = cp.random.RandomState(0)\n"
    "held = [(rs.standard_normal(2**28, dtype=cp.float32) * 0.02) for _ in range(4)]\n"
    "host = lambda: [cp.asnumpy(a) for a in held]\n"
)
JAX = (
    "import jax, jax.numpy as jnp\n"
    "held = [jax.random.normal(jax.random.PRNGKey(i), (2**28,)) * 0.02 for i in range(4)]\n"
    "jax.block_until_ready(held)\nhost = lambda: [np.asarray(a + 0) for a in held]\n"
)
DRIVER = (
    "import ctypes, torch\nlib = ctypes.CDLL('libcuda.so.1')\nptrs = []\n"
    "torch.zeros(1, device='cuda')  # the primary context, current in this thread for the driver calls\n"
    "g = torch.Generator(device='cuda').manual_seed(0)\n"
    "for i in range(8):\n"
    "    p = ctypes.c_uint64()\n"
    "    assert lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(2**29)) == 0\n"
    "    src = (torch.randn(2**28, device='cuda', generator=g) * 0.02).to(torch.bfloat16)\n"
    "    lib.cuMemcpyDtoD_v2(p, ctypes.c_uint64(src.data_ptr()), ctypes.c_size_t(2**29))\n"
    "    ptrs.append(p)\n"
    "del src\ntorch.cuda.synchronize()\ntorch.cuda.empty_cache()\n"
    "def host():\n"
    "    out = []\n"
    "    for p in ptrs:\n"
    "        t = torch.empty(2**29, dtype=torch.uint8, device='cuda')\n"
    "        lib.cuMemcpyDtoD_v2(ctypes.c_uint64(t.data_ptr()), p, ctypes.c_size_t(2**29))\n"
    "        torch.cuda.synchronize()\n"
    "        out.append(t.cpu().numpy())\n"
    "        del t\n"
    "    torch.cuda.empty_cache()\n"
    "    return out\n"
)
WORKER = """
import torch

def serve(inbox, outbox):
    held = None
    while True:
        msg = inbox.get()
        if msg is None:
            return
        held = msg
        outbox.put(float(held[0]))
"""
IPC = (
    TORCH + "import sys, torch.multiprocessing as mp\nsys.path.insert(0, {dir!r})\n"
    "from ipcworker import serve\n"
    "ctx = mp.get_context('spawn')\ninbox, outbox = ctx.Queue(), ctx.Queue()\n"
    "worker = ctx.Process(target=serve, args=(inbox, outbox), daemon=True)\nworker.start()\n"
    "inbox.put(held[0])\nprint('worker', worker.pid, outbox.get(timeout=120))\n"
)
LOADER = (
    TORCH + "from torch.utils.data import DataLoader, TensorDataset\n"
    "dl = DataLoader(TensorDataset(torch.randn(4096, 64)), batch_size=64, num_workers=2, "
    "persistent_workers=True, pin_memory=True)\n_ = [b for b in dl]\n"
)

ASYNC_POOL = "cp.cuda.set_allocator(cp.cuda.MemoryAsyncPool().malloc)\n"
PATHS = [
    ("runtime (cudaMalloc: PyTorch's caching allocator)", {}, TORCH),
    (
        "runtime async (PyTorch's cudaMallocAsync backend)",
        {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"},
        TORCH,
    ),
    (
        "driver cuMemCreate (PyTorch's expandable segments)",
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        TORCH,
    ),
    ("driver cuMemAlloc (ctypes)", {}, DRIVER),
    ("CuPy, default pool", {}, CUPY.format(setup="")),
    ("CuPy, stream-ordered pool", {}, CUPY.format(setup=ASYNC_POOL)),
    ("JAX, allocating on demand", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, JAX),
    ("JAX, preallocating 10% of the card", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}, JAX),
    ("IPC-shared (a torch.multiprocessing worker maps the kernel's memory)", {}, IPC),
    ("persistent DataLoader workers with pinned memory", {}, LOADER),
]


def report(directory: Path, kernel: Kernel) -> dict:
    return read_json(kernel_path(directory, kernel.id)) or {}


def nvml_of(pids: list[int]) -> int:
    used = nvml.process_memory(nvml.list_gpus()[0].uuid)
    return sum(used.get(p, 0) for p in pids)


def cycle(kernel: Kernel, channel: Path, pids: list[int]) -> dict:
    """``%vgpu pause``, wait until the kernel is away (or stays: it says so), read NVML,
    bring it back."""
    said = kernel.run("%vgpu pause")
    if "will not be paused" in said:  # neither paused nor suspended: it stays on the GPU
        away = nvml_of(pids)
        out = kernel.run("print(digest(host()))", timeout=600).strip().splitlines()
        why = report(channel, kernel)["pause"].get("not_pausable")
        return {"tier": "gpu", "away": away, "pause_s": None, "resume_s": None, "digest": out[-1], "why": why}
    wait_for(
        lambda: report(channel, kernel).get("state") in ("paused", "suspended"),
        timeout=300,
        what="the kernel paused or suspended after %vgpu pause",
    )
    time.sleep(1.0)  # NVML's figure settles (it is read from outside: a suspended process's own calls wait)
    away = nvml_of(pids)
    state = report(channel, kernel)["state"]
    out = kernel.run("print(digest(host()))", timeout=600).strip().splitlines()
    digest = out[-1] if out else ""
    pause = report(channel, kernel)["pause"]
    paused = state == "paused"
    partly = pause.get("unpausable_bytes", 0) > 0  # shared or managed memory stays on the card
    return {
        "tier": ("pause, in part" if partly else "pause") if paused else "suspend",
        "away": away,
        "pause_s": pause["last_pause_seconds" if paused else "last_suspend_seconds"],
        "resume_s": pause["last_resume_seconds" if paused else "last_restore_seconds"],
        "digest": digest,
        "why": None if paused else pause.get("not_pausable"),
    }


def measure(name: str, env: dict, fill: str, workdir: Path, cycles: int = 2) -> dict:
    channel = workdir / "channel"
    channel.mkdir(parents=True)
    (workdir / "ipcworker.py").write_text(WORKER)
    kernel = Kernel(workdir, environment(JUPYTER_VGPU_CHANNEL=str(channel), **env), load_extension=True)
    try:
        out = kernel.run(DIGEST + fill.format(dir=str(workdir)) + "print(digest(host()))", timeout=600)
        lines = out.strip().splitlines()
        before = lines[-1] if lines else ""
        if not re.fullmatch(r"[0-9a-f]{64}", before):
            raise RuntimeError(f"filling failed: {out[-1500:]}")
        pids = [kernel.pid] + [int(x.split()[1]) for x in lines if x.startswith("worker ")]
        gpu_bytes = nvml_of(pids)
        first, *measured = [cycle(kernel, channel, pids) for _ in range(max(2, cycles))]
        last = measured[-1]

        def median(key):
            values = [c[key] for c in measured]
            return None if None in values else statistics.median(values)

        return {
            "name": name,
            "gpu_bytes": gpu_bytes,
            "nvml_away_bytes": max(c["away"] for c in measured),
            "tier": last["tier"],
            "pause_s": median("pause_s"),
            "resume_s": median("resume_s"),
            "pause_s_all": [c["pause_s"] for c in measured],
            "resume_s_all": [c["resume_s"] for c in measured],
            "bit_exact": all(c["digest"] == before for c in (first, *measured)),
            "cold_pause_s": first["pause_s"],
            "why": last["why"],
        }
    finally:
        kernel.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--only", default="", help="run the paths whose name holds this text")
    parser.add_argument("--steps", type=int, default=40, help="timed training steps per run (0: none)")
    parser.add_argument("--cycles", type=int, default=2, help="cycles per path (the first unmeasured)")
    args = parser.parse_args()
    require_gpu(parser)
    result = {**provenance.record(), "gpu": nvml.list_gpus()[0].name, "paths": []}
    for name, env, fill in PATHS:
        if args.only and args.only not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                row = measure(name, env, fill, Path(tmp), args.cycles)
            except Exception as e:  # one path's failure is a result too
                row = {"name": name, "error": f"{type(e).__name__}: {e}"[:2000]}
        result["paths"].append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.steps:
        for conf, key in (("", "default"), ("expandable_segments:True", "expandable_segments")):
            plain, pre = [], []
            for _ in range(2):  # alternate, so drift hits both
                plain += step_times(False, args.steps, conf)
                pre += step_times(True, args.steps, conf)
            result[f"step_overhead_idle_{key}"] = statistics.median(pre) / statistics.median(plain) - 1
            result[f"step_s_plain_{key}"] = statistics.median(plain)
            print(key, result[f"step_overhead_idle_{key}"], flush=True)
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in result["paths"]:
        if "error" in row:
            print(f"{row['name']}: {row['error']}")
            continue
        times = ""
        if row["pause_s"] is not None:
            times = f", pause {row['pause_s']:.3f} s, resume {row['resume_s']:.3f} s"
        print(
            f"{row['name']}: {row['gpu_bytes'] / GiB:.2f} GiB, {row['tier']}, "
            f"away {row['nvml_away_bytes'] / GiB:.2f} GiB{times}, bit-exact {row['bit_exact']}"
        )


if __name__ == "__main__":
    main()
