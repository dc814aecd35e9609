"""Both codec paths on the GPU machine, per workload, beside the raw pinned copy.

For each workload (bf16 weights N(0, 0.02), fp32 Adam second moment, bf16 ReLU
activations, zeros; ``--size`` each) and each path (nvCOMP ANS on the GPU, zstandard on
the CPU threads): the ratio (live bytes over host bytes), the offload speed (a pause of
the process holding just that tensor, in GB/s of uncompressed bytes, 1 GB = 1e9 bytes)
and the resume speed (until usable on the GPU, checksums verified): the median of
``--reps`` cycles after one warm cycle (every sample is kept). The raw pinned copy of
the same bytes is measured in the same run.

A paused kernel sits idle before it resumes; a cycle waits ``--idle`` seconds (default
0.2) between its pause and its resume (not timed). The driver clears device memory after
it is released, in the background, and memory mapped while that runs is written more
slowly (docs/design.md): ``resume_right_after_pause_gbps`` is a resume
started at once after a pause of the same bytes, as when the arbiter resumes one kernel
into the memory another's pause has just released.

Usage (GPU machine): ``python benchmarks/codec_paths.py --out benchmarks/results/codec-h100.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import provenance
from gpu_common import GiB, make, preloaded_or_reexec, raw_copies, require_gpu

WORKLOADS = ("bf16_weights", "fp32_adam_v", "bf16_relu_act", "zeros")


def save(path: str, rows: list, torch, record: dict) -> None:
    with open(path, "w") as f:
        doc = {**record, "workloads": rows, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        json.dump(doc, f, indent=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=2.0, help="GiB per workload")
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=5, help="measured cycles per workload and path")
    parser.add_argument("--idle", type=float, default=0.2, help="seconds paused before each resume")
    parser.add_argument(
        "--direct",
        action="store_true",
        help="also run the nvCOMP path without its per-slot CUDA graphs (path nvcomp-direct)",
    )
    args = parser.parse_args()
    require_gpu(parser)
    preloaded_or_reexec()
    import torch

    record = provenance.record()
    from jupyter_vgpu.kernel.pause import vmm
    from jupyter_vgpu.kernel.pause.engine import PauseEngine

    engines = {
        "nvcomp": PauseEngine(torch, vmm.load(), 0, use_nvcomp=True),
        "zstd": PauseEngine(torch, vmm.load(), 0, use_nvcomp=False),
    }
    if engines["nvcomp"].device_codec is None:
        raise SystemExit(f"the nvCOMP path is not available: {engines['nvcomp'].nvcomp_reason}")
    if args.direct:
        direct = PauseEngine(torch, vmm.load(), 0, use_nvcomp=True)
        direct.device_codec.graph_reason = "turned off (--direct)"
        engines["nvcomp-direct"] = direct
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in WORKLOADS:
        t = make(torch, name, int(args.size * GiB), gen)
        nbytes = t.numel() * t.element_size()
        check = t.view(torch.uint8)[:: 1 << 16].cpu()
        d2h, h2d = raw_copies(torch, [t])
        for path, engine in engines.items():
            engine.pause()
            engine.resume()  # warm: pinned memory from the cache, as from a kernel's second pause on
            offload, resume, at_once = [], [], []
            for _ in range(args.reps):
                out = engine.pause()
                time.sleep(args.idle)
                back = engine.resume()
                offload.append(nbytes / out.seconds / 1e9)
                resume.append(nbytes / back.seconds / 1e9)
                engine.pause()
                at_once.append(nbytes / engine.resume().seconds / 1e9)
            assert torch.equal(check, t.view(torch.uint8)[:: 1 << 16].cpu()), (name, path)
            row = {
                "name": name,
                "path": path,
                "codec": list(out.codecs),
                "ratio": out.ratio,
                "offload_gbps": statistics.median(offload),
                "resume_gbps": statistics.median(resume),
                "offload_samples_gbps": offload,
                "resume_samples_gbps": resume,
                "resume_right_after_pause_gbps": statistics.median(at_once),
                "resume_right_after_pause_samples_gbps": at_once,
                "idle_s": args.idle,
                "raw_d2h_gbps": nbytes / d2h / 1e9,
                "raw_h2d_gbps": nbytes / h2d / 1e9,
                "host_bytes": out.host_bytes,
                "gpu_bytes": nbytes,
            }
            if engine.device_codec is not None:
                row["graph_reason"] = engine.device_codec.graph_reason
            else:
                row["join_reason"] = engine.host_path.join_reason
            rows.append(row)
            print(json.dumps(row), flush=True)
            save(args.out, rows, torch, record)
        del t
        torch.cuda.empty_cache()
    for r in rows:
        print(
            f"{r['name']:>14} {r['path']:>6}: ratio {r['ratio'] or 0:8.2f}  "
            f"offload {r['offload_gbps']:6.1f}  "
            f"resume {r['resume_gbps']:6.1f} ({r['resume_right_after_pause_gbps']:5.1f} at once)  "
            f"raw {r['raw_d2h_gbps']:.1f}/{r['raw_h2d_gbps']:.1f} GB/s"
        )


if __name__ == "__main__":
    main()
