"""How many calls into zstd per chunk the host codec's decode can afford on many threads.

Encodes ``--size`` GiB of bf16 weights N(0, 0.02) with the host codec (1 MiB chunks of 4
byte planes, one zstd frame per plane), then decodes every chunk into place from a thread
pool through zstd's C API (zstandard's cffi backend), per thread count:

- ``per_plane``: one ``ZSTD_decompressDCtx`` per frame (4 per chunk);
- ``per_chunk``: one per chunk, the 4 frames in one call (zstd decodes concatenated
  frames into consecutive output);
- ``codec_decode``: :meth:`~jupyter_vgpu.kernel.codec.zstd.Codec.decode` with
  ``planar=True``, as a resume on a GPU runs it.

Each call gives the GIL up and takes it back; GB/s of decoded bytes, best of three.
CPU only.

Usage: ``python benchmarks/zstd_calls.py --out benchmarks/results/zstd-calls-h100.json``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

import numpy as np
from zstandard import backend_cffi

from jupyter_vgpu.kernel.codec.zstd import Codec


def best(f, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="GiB of bf16 weights")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import torch

    n = int(args.size * (1 << 30))
    gen = torch.Generator().manual_seed(0)
    data = (torch.randn(n // 2, generator=gen) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy()
    with Codec() as codec:
        packed = codec.encode(data, itemsize=4, floating=True)
    out = np.empty(n, dtype=np.uint8)
    lib, ffi = backend_cffi.lib, backend_cffi.ffi
    local = threading.local()

    def dctx():
        d = getattr(local, "dctx", None)
        if d is None:
            d = local.dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
        return d

    def per_plane(chunk):
        size, start = chunk.length // chunk.planes, 0
        src = ffi.from_buffer(chunk.payload)
        dst = ffi.from_buffer(out[chunk.offset : chunk.offset + chunk.length])
        for k, part in enumerate(chunk.parts):
            assert lib.ZSTD_decompressDCtx(dctx(), dst + k * size, size, src + start, part) == size
            start += part

    def per_chunk(chunk):
        dst = ffi.from_buffer(out[chunk.offset : chunk.offset + chunk.length])
        src = ffi.from_buffer(chunk.payload)
        assert lib.ZSTD_decompressDCtx(dctx(), dst, chunk.length, src, len(chunk.payload)) == chunk.length

    rows = [{"what": "machine", "cores": os.cpu_count(), "bytes": n, "ratio": packed.ratio}]
    for threads in sorted({1, 4, 8, 12, 16, os.cpu_count() or 1}):
        row = {"threads": threads}
        with ThreadPoolExecutor(threads) as pool:
            for name, f in (("per_plane", per_plane), ("per_chunk", per_chunk)):
                list(pool.map(f, packed.chunks))
                row[f"{name}_gbps"] = n / best(lambda f=f: list(pool.map(f, packed.chunks))) / 1e9
        with Codec(threads=threads) as codec:
            codec.decode(packed, out, planar=True)
            seconds = best(lambda codec=codec: codec.decode(packed, out, planar=True))
            row["codec_decode_gbps"] = n / seconds / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
