"""The host codec's speed and ratio on tensor-like data (CPU only, no GPU needed).

Workloads (each ``--size`` bytes):

- ``bf16_weights``: N(0, 0.02) float32 truncated to bf16 (upper 16 bits), like
  trained weights;
- ``fp32_adam_v``: Adam's second moment, squares of N(0, 1e-3) gradients scaled by
  noise in [0.5, 1.5), float32;
- ``bf16_relu_act``: ReLU of N(0, 1) in bf16 (half the values are zero), like
  activations;
- ``zeros``: an all-zero buffer.

For each workload, codec settings (``--level``, ``--chunk``) and thread count (1 and
``os.cpu_count()``), with byte planes on (and off, for floating data), it reports the
ratio and encode / decode speed in GB/s of uncompressed bytes (1 GB = 1e9 bytes), the
best of ``--repeat`` runs into an output buffer already touched once (the engine
reuses its pinned buffers). Prints a table and writes JSON with the machine's facts.

Usage: ``python benchmarks/codec.py --size 256M --out benchmarks/results/codec-cpu.json``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

import provenance

from jupyter_vgpu.kernel.codec.zstd import Codec

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``256M`` -> 268435456 (binary units K, M, G; a bare number is bytes)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1] if text and text[-1] in UNITS else ""
    return int(float(text[: len(text) - len(unit)]) * UNITS[unit])


def bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (truncation), as bytes."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def workloads(nbytes: int, seed: int = 0) -> dict[str, tuple[np.ndarray, int, bool]]:
    """name -> (bytes, itemsize, floating)."""
    rng = np.random.default_rng(seed)
    n2, n4 = nbytes // 2, nbytes // 4
    grads = rng.standard_normal(n4, dtype=np.float32) * np.float32(1e-3)
    adam_v = grads * grads * rng.uniform(0.5, 1.5, n4).astype(np.float32)
    return {
        "bf16_weights": (bf16(rng.standard_normal(n2, dtype=np.float32) * np.float32(0.02)), 2, True),
        "fp32_adam_v": (adam_v.view(np.uint8), 4, True),
        "bf16_relu_act": (bf16(np.maximum(rng.standard_normal(n2, dtype=np.float32), 0)), 2, True),
        "zeros": (np.zeros(nbytes, np.uint8), 2, True),
    }


def best_seconds(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(codec: Codec, data: np.ndarray, itemsize: int, floating: bool, repeat: int) -> dict:
    packed = codec.encode(data, itemsize=itemsize, floating=floating)
    out = np.empty_like(data)
    codec.decode(packed, out)
    if not np.array_equal(out, data):
        raise AssertionError("round trip changed the data")
    enc = best_seconds(lambda: codec.encode(data, itemsize=itemsize, floating=floating), repeat)
    dec = best_seconds(lambda: codec.decode(packed, out), repeat)
    kinds = {}
    for c in packed.chunks:
        kinds[c.kind.name] = kinds.get(c.kind.name, 0) + 1
    return {
        "nbytes": data.size,
        "stored_bytes": packed.stored_bytes,
        "ratio": packed.ratio,
        "encode_GBps": data.size / enc / 1e9,
        "decode_GBps": data.size / dec / 1e9,
        "chunks": kinds,
    }


def machine() -> dict:
    return {
        "cpu_count": os.cpu_count(),
        "cpu": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "zstandard": zstandard.__version__,
        "zstd": zstandard.ZSTD_VERSION,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256M", help="bytes per workload (K/M/G binary units; default 256M)")
    ap.add_argument("--out", type=Path, help="write the JSON results here")
    ap.add_argument("--level", type=int, nargs="+", default=[1], help="zstd levels to try (default 1)")
    ap.add_argument("--chunk", nargs="+", default=["1M"], help="chunk sizes to try (default 1M)")
    ap.add_argument("--threads", type=int, nargs="+", help="thread counts (default: 1 and cpu_count)")
    ap.add_argument("--work", nargs="+", help="workloads to run (default: all)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure, best kept (default 3)")
    args = ap.parse_args(argv)
    record = provenance.record()

    nbytes = parse_size(args.size)
    threads = args.threads or sorted({1, os.cpu_count() or 1})
    works = workloads(nbytes)
    if args.work:
        works = {k: works[k] for k in args.work}
    rows = []
    print(
        f"{'work':<14} {'planes':>6} {'lvl':>3} {'chunk':>7} {'thr':>3} "
        f"{'ratio':>9} {'enc GB/s':>8} {'dec GB/s':>8}"
    )
    for level in args.level:
        for chunk in map(parse_size, args.chunk):
            for n in threads:
                with Codec(level=level, chunk_bytes=chunk, threads=n) as codec:
                    for name, (data, itemsize, floating) in works.items():
                        for planes in (True, False) if floating and name != "zeros" else (floating,):
                            row = {
                                "work": name,
                                "byte_planes": planes,
                                "level": level,
                                "chunk_bytes": chunk,
                                "threads": n,
                                **measure(codec, data, itemsize, planes, args.repeat),
                            }
                            rows.append(row)
                            print(
                                f"{name:<14} {'on' if planes else 'off':>6} {level:>3} "
                                f"{chunk >> 10:>6}K {n:>3} "
                                f"{row['ratio']:>9.3f} {row['encode_GBps']:>8.2f} {row['decode_GBps']:>8.2f}",
                                flush=True,
                            )
    record["machine"].update(machine())
    result = {
        **record,
        "benchmark": "codec",
        "size_bytes": nbytes,
        "units": {"encode_GBps": "1e9 uncompressed bytes / s", "decode_GBps": "1e9 uncompressed bytes / s"},
        "rows": rows,
    }
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
