"""What memory released just before costs a resume, on the GPU machine.

The driver clears device memory after it is released, in the background. Memory mapped
while that runs is written more slowly. This measures it two ways:

- ``resume_gbps_by_idle_s``: a pause of ``--size`` GiB of bf16 weights N(0, 0.02) through
  the GPU path, then a resume started that many seconds later (median of ``--reps``
  cycles after a warm one, GB/s of uncompressed bytes, the wait not timed);
- ``driver_ms``: the same size through the CUDA driver alone, no codec (cuda-bindings'
  ``cuMemCreate``, ``cuMemMap``): the milliseconds of one raw pinned copy to the device
  (``copy_*``) and of one ``cuMemsetD32Async`` (``memset_*``) into memory that was
  ``never_released`` (mapped, then written once already), mapped right after
  releasing as much (``just_released``), mapped ``--wait`` seconds after releasing
  (``released_then_waited``), or mapped right after releasing and then left ``--wait``
  seconds (``mapped_then_waited``): median of ``--reps``.

Usage (GPU machine): ``python benchmarks/resume_fresh.py --out benchmarks/results/resume-fresh-h100.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_common import GiB, make, preloaded_or_reexec, raw_copies

IDLE_S = (0.0, 0.005, 0.01, 0.02, 0.05, 0.2, 1.0)


def engine_figures(torch, size: int, reps: int) -> dict[str, float]:
    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.engine import PauseEngine

    engine = PauseEngine(torch, vmm.load(), 0)
    if engine.device_codec is None:
        raise SystemExit(f"the nvCOMP path is not available: {engine.nvcomp_reason}")
    t = make(torch, "bf16_weights", size, torch.Generator(device="cuda").manual_seed(0))
    engine.pause()
    engine.resume()  # warm
    figures = {}
    for idle in IDLE_S:
        samples = []
        for _ in range(reps):
            engine.pause()
            time.sleep(idle)
            samples.append(size / engine.resume().seconds / 1e9)
        figures[str(idle)] = statistics.median(samples)
    engine.close()
    del t
    torch.cuda.empty_cache()
    return figures


def driver_figures(torch, size: int, reps: int, wait: float) -> dict[str, float]:
    from cuda.bindings import driver as cu

    def check(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(result)
        return result[1] if len(result) > 1 else None

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    access = cu.CUmemAccessDesc()
    access.location = prop.location
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = check(cu.cuMemAddressReserve(size, 0, 0, 0))
    host = torch.ones(size, dtype=torch.uint8, pin_memory=True)
    stream = cu.CUstream(int(torch.cuda.Stream().cuda_stream))
    handle = []

    def mapped():
        handle.append(check(cu.cuMemCreate(size, prop, 0)))
        check(cu.cuMemMap(va, size, 0, handle[-1], 0))
        check(cu.cuMemSetAccess(va, size, [access], 1))

    def released():
        check(cu.cuMemUnmap(va, size))
        check(cu.cuMemRelease(handle.pop()))

    def timed(kind: str) -> float:
        t0 = time.perf_counter()
        if kind == "copy":
            check(cu.cuMemcpyHtoDAsync(va, host.data_ptr(), size, stream))
        else:
            check(cu.cuMemsetD32Async(va, 7, size // 4, stream))
        check(cu.cuStreamSynchronize(stream))
        return (time.perf_counter() - t0) * 1e3

    samples: dict[str, list[float]] = {}
    mapped()
    timed("copy")
    for _ in range(reps):
        for kind in ("copy", "memset"):
            samples.setdefault(f"{kind}_never_released", []).append(timed(kind))
            released()
            mapped()
            samples.setdefault(f"{kind}_just_released", []).append(timed(kind))
            released()
            time.sleep(wait)
            mapped()
            samples.setdefault(f"{kind}_released_then_waited", []).append(timed(kind))
            released()
            mapped()
            time.sleep(wait)
            samples.setdefault(f"{kind}_mapped_then_waited", []).append(timed(kind))
            time.sleep(wait)  # the next figure starts on settled memory
    released()
    check(cu.cuMemAddressFree(va, size))
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--wait", type=float, default=0.5, help="seconds of the driver's waits")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    preloaded_or_reexec()
    import torch

    size = int(args.size * GiB)
    probe = torch.empty(size, dtype=torch.uint8, device="cuda")
    _, h2d = raw_copies(torch, [probe])
    del probe
    torch.cuda.empty_cache()
    doc = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": size,
        "raw_h2d_gbps": size / h2d / 1e9,
        "resume_gbps_by_idle_s": engine_figures(torch, size, args.reps),
        "wait_s": args.wait,
        "driver_ms": driver_figures(torch, size, args.reps, args.wait),
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
