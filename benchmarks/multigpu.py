"""A kernel of two cards against a kernel of one card holding the same bytes: pause,
resume and suspend.

The workload is :mod:`pause`'s (bf16 weights and their fp32 Adam state, the weights a
fifth of the bytes), ``--sizes`` GiB in all: on ``cuda:0`` alone for the one-card kernel,
half on ``cuda:0`` and half on ``cuda:1`` for the two-card one (as ``device_map="auto"``
spreads a model). For each, in one process started with the pausable allocator as a
kernel is: a warm pause and resume first (pinned memory then comes from PyTorch's cache,
as from a kernel's second pause on), then ``--repeats`` timed pauses and resumes
(``pause_s`` and ``resume_s``, their median and every run; a resume counts until every
byte is back and checked), the bytes checked after each; then the driver's checkpoint of
the whole process with its memory on the cards (``suspend_s``, ``restore_s``: what a
kernel that cannot be paused costs) and of the process paused (``suspend_paused_s``:
its CUDA contexts alone). The one-card kernel runs through
:class:`~jupyter_vgpu.kernel.pause.engine.PauseEngine`, the two-card one through
:class:`~jupyter_vgpu.kernel.pause.devices.DevicesEngine` (an engine per device), as a
kernel of such a slice does.

Usage (a host with two GPUs): ``python benchmarks/multigpu.py --out
benchmarks/results/multigpu-h100.json``
"""

from __future__ import annotations

import argparse
import statistics
import time

import provenance
from gpu_common import checkpoint_cycle, preloaded_or_reexec, require_gpu, workload


def on_device(torch, gib: float, device: int, seed: int) -> list:
    """:func:`gpu_common.workload` of ``gib`` GiB on ``cuda:<device>``."""
    gen = torch.Generator(device=f"cuda:{device}").manual_seed(seed)
    with torch.cuda.device(device):
        return workload(torch, gib, gen)


def measure(torch, gib: float, cards: int, repeats: int) -> dict:
    """Pause, resume and suspend figures of a kernel holding ``gib`` GiB over ``cards``
    cards (see the module's doc)."""
    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.devices import DevicesEngine
    from jupyter_vgpu.kernel.pause.engine import PauseEngine
    from jupyter_vgpu.kernel.pause.torch_calls import empty_host_cache

    t0 = time.perf_counter()

    def mark(what: str) -> None:
        print(f"  {gib:g} GiB on {cards} card(s): {what} at {time.perf_counter() - t0:.1f} s", flush=True)

    tensors = [t for d in range(cards) for t in on_device(torch, gib / cards, d, seed=d)]
    for d in range(cards):
        torch.cuda.synchronize(d)
    check = [t.view(torch.uint8)[:: 1 << 20].cpu() for t in tensors]

    def exact() -> bool:
        return all(
            torch.equal(c, x.view(torch.uint8)[:: 1 << 20].cpu()) for c, x in zip(check, tensors, strict=True)
        )

    allocator = vmm.load()
    if cards == 1:
        engine = PauseEngine(torch, allocator, 0)
    else:
        engine = DevicesEngine(torch, allocator, list(range(cards)))
    engine.pause()  # the warm cycle: pins its slabs on the way
    engine.resume()
    mark("warm cycle")
    pauses, resumes, every_exact = [], [], True
    for _ in range(repeats):
        pauses.append(engine.pause().seconds)
        t = time.perf_counter()
        engine.resume()
        resumes.append(time.perf_counter() - t)
        every_exact = every_exact and exact()
    mark(f"{repeats} pauses and resumes")
    on_cards = checkpoint_cycle(mark)
    every_exact = every_exact and exact()
    out = engine.pause()
    paused = checkpoint_cycle(mark)
    engine.resume()
    every_exact = every_exact and exact()
    codec_name = engine.codec_name
    engine.close()
    tensors.clear()
    torch.cuda.empty_cache()
    empty_host_cache(torch)
    return {
        "name": f"{gib:g} GiB: bf16 weights + fp32 Adam state on {cards} card(s)",
        "cards": cards,
        "gpu_bytes": out.segment_bytes,
        "live_bytes": out.live_bytes,
        "host_bytes": out.host_bytes,
        "codecs": list(out.codecs),
        "codec_name": codec_name,  # says why where nvCOMP was not used
        "pause_s": statistics.median(pauses),
        "resume_s": statistics.median(resumes),
        "pause_runs_s": pauses,
        "resume_runs_s": resumes,
        "suspend_s": on_cards["suspend_s"],
        "restore_s": on_cards["restore_s"],
        "suspend_paused_s": paused["suspend_s"],
        "restore_paused_s": paused["restore_s"],
        "bit_exact": every_exact,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8,32", help="bytes of the kernel in all, GiB (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3, help="timed pauses and resumes of each kernel")
    parser.add_argument("--out", required=True, help="the results JSON to write")
    args = parser.parse_args()
    require_gpu(parser)
    from jupyter_vgpu import nvml

    if len(nvml.list_gpus()) < 2:
        parser.error(f"needs two GPUs in one host: NVML lists {len(nvml.list_gpus())}")
    preloaded_or_reexec()
    import torch

    if torch.cuda.device_count() < 2:
        parser.error(f"needs two GPUs visible to CUDA: {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES?)")
    record = provenance.record()
    result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "workloads": []}
    for gib in (float(s) for s in args.sizes.split(",") if s):
        for cards in (1, 2):
            row = measure(torch, gib, cards, args.repeats)
            result["workloads"].append(row)
            print(
                f"{row['name']}: pause {row['pause_s']:.3f} s, resume {row['resume_s']:.3f} s, "
                f"suspend {row['suspend_s']} s, restore {row['restore_s']} s, exact {row['bit_exact']}",
                flush=True,
            )
            provenance.write(provenance.stamped(result, record), args.out)  # kept if a later size fails


if __name__ == "__main__":
    main()
