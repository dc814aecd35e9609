"""What freshly mapped device memory costs a resume, on the GPU machine.

A resume maps new physical memory behind the paused addresses and writes the stored
pieces into it. This measures, for ``--size`` GiB of bf16 weights N(0, 0.02) through
the GPU path (median of ``--reps`` cycles after a warm one, GB/s of uncompressed bytes):

- ``resume_gbps``: the whole resume, as the engine runs it;
- ``unpack_fresh_gbps``: the codec's part of it, writing memory mapped just before;
- ``unpack_settled_gbps``: the same, started ``--wait`` seconds after the mapping;
- ``unpack_touched_gbps``: the codec writing the same pieces again into that memory;
- ``raw_h2d_gbps``: the raw pinned copy of the same bytes, for scale.

Usage (GPU machine): ``python benchmarks/resume_fresh.py --out benchmarks/results/resume-fresh-h100.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from gpu_common import GiB, make, preloaded_or_reexec, raw_copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB of bf16 weights")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--wait", type=float, default=0.05, help="seconds between mapping and unpacking")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    preloaded_or_reexec()
    import torch

    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.engine import PauseEngine

    engine = PauseEngine(torch, vmm.load(), 0)
    codec = engine.device_codec
    if codec is None:
        raise SystemExit(f"the nvCOMP path is not available: {engine.nvcomp_reason}")
    t = make(torch, "bf16_weights", int(args.size * GiB), torch.Generator(device="cuda").manual_seed(0))
    nbytes = t.numel() * t.element_size()
    _, h2d = raw_copies(torch, [t])
    unpacked: list[float] = []
    plain_unpack, plain_map = codec.unpack, engine.vmm.map

    def timed_unpack(*a):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        plain_unpack(*a)
        torch.cuda.synchronize()
        unpacked.append(time.perf_counter() - t0)

    def settled_map(ptr):
        plain_map(ptr)
        torch.cuda.synchronize()
        time.sleep(args.wait)

    codec.unpack = timed_unpack
    engine.pause()
    engine.resume()  # warm
    figures: dict[str, list[float]] = {k: [] for k in ("resume", "fresh", "settled", "touched")}
    for _ in range(args.reps):
        engine.pause()
        items = [
            (engine._view(p.segment.ptr + r.offset, r.length), r.pieces)
            for p in engine._paused
            for r in p.ranges
            if r.path == "device"
        ]
        keep, engine.arena.clear = engine.arena.clear, lambda: None  # the pieces outlive the resume
        figures["resume"].append(nbytes / engine.resume().seconds / 1e9)
        figures["fresh"].append(nbytes / unpacked[-1] / 1e9)
        scratch = engine._scratch()
        timed_unpack(items, engine.arena)
        figures["touched"].append(nbytes / unpacked[-1] / 1e9)
        engine._free_scratch(scratch)
        engine.arena.clear = keep
        engine.arena.clear()
        engine.vmm.map = settled_map
        engine.pause()
        engine.resume()
        figures["settled"].append(nbytes / unpacked[-1] / 1e9)
        engine.vmm.map = plain_map
    doc = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "bytes": nbytes,
        "wait_s": args.wait,
        "raw_h2d_gbps": nbytes / h2d / 1e9,
        **{
            ("resume_gbps" if k == "resume" else f"unpack_{k}_gbps"): statistics.median(v)
            for k, v in figures.items()
        },
        "samples_gbps": figures,
    }
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
    print(json.dumps({k: v for k, v in doc.items() if k != "samples_gbps"}, indent=1))


if __name__ == "__main__":
    main()
