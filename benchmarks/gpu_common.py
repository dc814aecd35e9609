"""What the GPU benchmarks share: running preloaded, workloads, timing, NVML.

A process measures the pause path only if its ``cudaMalloc`` is the pausable
allocator's, as a kernel's is: :func:`preloaded_or_reexec` starts the script again
under ``LD_PRELOAD`` when it is not.
"""

from __future__ import annotations

import os
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

GiB = 1 << 30


def require_gpu(parser) -> None:
    """End the run at once, through ``parser.error`` (exit status 2), with the reason where
    NVML lists no GPU here: a GPU benchmark measures nothing without one."""
    from jupyter_vgpu import nvml

    try:
        cards = nvml.list_gpus()
    except nvml.NVMLUnavailable as e:
        parser.error(f"needs an NVIDIA GPU: {e}")
    if not cards:
        parser.error("needs an NVIDIA GPU: NVML lists none on this machine")


def preloaded_or_reexec() -> None:
    """Return in a preloaded process; otherwise replace this one with a preloaded copy."""
    from jupyter_vgpu.kernel.pause import vmm

    if vmm.load().preloaded:
        return
    env = vmm.preload_environment(dict(os.environ))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def nvml_bytes(pid: int | None = None) -> int:
    """This process's (or ``pid``'s) memory on GPU 0 per NVML, bytes."""
    from jupyter_vgpu import nvml

    return nvml.process_memory(nvml.list_gpus()[0].uuid).get(pid or os.getpid(), 0)


def make(torch, name: str, nbytes: int, gen):
    """A workload tensor of ``nbytes``: ``bf16_weights`` (N(0, 0.02)), ``fp32_adam_m``
    (N(0, 1e-3)), ``fp32_adam_v`` (its square), ``bf16_relu_act`` (ReLU of N(0, 1)),
    ``zeros``."""
    if name == "bf16_weights":
        return (torch.randn(nbytes // 2, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    if name == "fp32_adam_m":
        return torch.randn(nbytes // 4, device="cuda", generator=gen) * 1e-3
    if name == "fp32_adam_v":
        return (torch.randn(nbytes // 4, device="cuda", generator=gen) * 1e-3).square()
    if name == "bf16_relu_act":
        return torch.relu(torch.randn(nbytes // 2, device="cuda", generator=gen)).to(torch.bfloat16)
    if name == "zeros":
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    raise ValueError(name)


def workload(torch, gib: float, gen) -> list:
    """``gib`` GiB of a training state on the current CUDA device: bf16 weights and their
    fp32 Adam moments (:func:`make`), the weights a fifth of the bytes."""
    w = int(gib * GiB) // 5 // 2 * 2
    return [
        make(torch, "bf16_weights", w, gen),
        make(torch, "fp32_adam_m", 2 * w, gen),
        make(torch, "fp32_adam_v", 2 * w, gen),
    ]


def _copy_all(torch, flat, slab, target, to_host: bool) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for t in flat:
        for off in range(0, t.numel(), slab.numel()):
            n = min(slab.numel(), t.numel() - off)
            if to_host:
                slab[:n].copy_(t[off : off + n], non_blocking=True)
            else:
                target[:n].copy_(slab[:n], non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def raw_copies(torch, tensors, slab_bytes: int = 4 * GiB, reps: int = 3) -> tuple[float, float]:
    """Seconds to copy every tensor's bytes to pinned host memory, and as many bytes back
    to the device, through one reused pinned buffer (the bus's speed, as a kernel's own
    ``non_blocking`` copies get it): the median of ``reps`` runs each way (the bus of the
    shared GPU machine varies from run to run). The tensors are not written."""
    slab = torch.empty(slab_bytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(slab_bytes, dtype=torch.uint8, device="cuda")
    flat = [t.view(torch.uint8).view(-1) for t in tensors]
    for to_host in (True, False):  # warm
        _copy_all(torch, flat, slab, target, to_host)
    runs = [
        (_copy_all(torch, flat, slab, target, True), _copy_all(torch, flat, slab, target, False))
        for _ in range(reps)
    ]
    times = statistics.median(d for d, _ in runs), statistics.median(h for _, h in runs)
    del target
    torch.cuda.empty_cache()
    return times


def nvml_bytes_elsewhere(pid: int) -> int:
    """NVML's figure for ``pid`` on GPU 0, read by a fresh process (a process locked by the
    driver's checkpoint waits in its own NVML calls until restored)."""
    here = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {here!r}); import gpu_common; print(gpu_common.nvml_bytes({pid}))"
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    return int(
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
    )


def checkpoint_cycle(mark=lambda what: None, timeout: float = 120.0) -> dict:
    """Suspend this process through the driver's checkpoint (``jupyter_vgpu.host.checkpoint
    hold``, the helper a kernel uses), read NVML's figure for it while suspended, and
    restore it.

    Returns:
        ``suspend_s`` and ``restore_s`` (the helper's own timings, seconds; None where it
        did not report one) and ``nvml_suspended_bytes`` (GPU 0, bytes; None where the
        suspend failed). ``mark(text)`` is told each answer of the helper.
    """
    helper = subprocess.Popen(
        [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "hold", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([helper.stdout], [], [], timeout)
    line = helper.stdout.readline().split() if ready else [f"no answer in {timeout:g} s"]
    mark(" ".join(line))
    suspended = nvml_bytes_elsewhere(os.getpid()) if line[:1] == ["suspended"] else None
    helper.stdin.write("\n")
    helper.stdin.flush()
    ready, _, _ = select.select([helper.stdout], [], [], timeout)
    restored = helper.stdout.readline().split() if ready else [f"no answer in {timeout:g} s"]
    helper.kill()
    mark(" ".join(restored))
    return {
        "suspend_s": float(line[1]) if line[:1] == ["suspended"] else None,
        "restore_s": float(restored[1]) if restored[:1] == ["restored"] else None,
        "nvml_suspended_bytes": suspended,
    }
