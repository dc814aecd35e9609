"""Where the zstd path's decode time goes on many cores (CPU only, no GPU needed).

Decodes ``GiB`` (default 1) of bf16 weights N(0, 0.02) packed by the host codec, then
times its parts on the machine's cores: the whole ``Codec.decode`` per thread count;
zstd alone (one ``decompress`` per plane, from a thread pool); the join of the planes
alone, by shifts on whole words (``join only``, the former join) and by one strided
copy (``join np.stack``, :func:`~jupyter_vgpu.kernel.codec.zstd.join_planes`); a plain
copy per chunk; and zstandard's ``multi_decompress_to_buffer`` (every frame in one call
on its own threads). GB/s of decoded bytes, best of three.

Usage: ``python benchmarks/zstd_decode_parts.py 1 benchmarks/results/zstd-decode-parts-h100.json``
"""

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from jupyter_vgpu.kernel.codec.zstd import Codec


def join_planes(rows, target, tmp):
    """The former join: a widening copy of plane 0, then a shift and an OR per plane."""
    dtype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[len(rows)]
    words = target.view(dtype)
    np.copyto(words, rows[0], casting="unsafe")
    tmp = tmp[: target.size].view(dtype)
    for k in range(1, len(rows)):
        np.left_shift(rows[k], 8 * k, out=tmp, dtype=dtype, casting="unsafe")
        np.bitwise_or(words, tmp, out=words)


N = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 2**30
out_path = sys.argv[2] if len(sys.argv) > 2 else "/dev/stdout"
rows = []


def emit(**kw):
    rows.append(kw)
    print(json.dumps(kw), flush=True)


def best(f, n=3):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return min(ts)


torch.manual_seed(0)
x = (torch.randn(N // 2) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().copy()
cores = os.cpu_count()
emit(what="machine", cores=cores, bytes=N)
with Codec() as c:
    p = c.encode(x, itemsize=4, floating=True)
    emit(what="encode", gbps=N / best(lambda: c.encode(x, itemsize=4, floating=True), 2) / 1e9, ratio=p.ratio)
out = np.empty(N, np.uint8)
for t in sorted({1, 2, 4, 8, cores}):
    with Codec(threads=t) as c:
        c.decode(p, out)
        emit(what="decode", threads=t, gbps=N / best(lambda: c.decode(p, out)) / 1e9)
assert (out == x).all()
chunks = p.chunks
pool = ThreadPoolExecutor(cores)

local = threading.local()


def dctx():
    d = getattr(local, "d", None)
    if d is None:
        d = local.d = zstandard.ZstdDecompressor()
    return d


def zonly(ch):
    mv = memoryview(ch.payload)
    s = 0
    rows_ = []
    for part in ch.parts:
        rows_.append(dctx().decompress(mv[s : s + part], max_output_size=ch.length // 4))
        s += part
    return rows_


emit(
    what="zstd only (bytes per plane)",
    threads=cores,
    gbps=N / best(lambda: list(pool.map(zonly, chunks))) / 1e9,
)
planes = list(pool.map(zonly, chunks))


def jonly(i):
    ch = chunks[i]
    tmp = getattr(local, "tmp", None)
    if tmp is None:
        tmp = local.tmp = np.empty(ch.length, np.uint8)
    join_planes([np.frombuffer(r, np.uint8) for r in planes[i]], out[ch.offset : ch.offset + ch.length], tmp)


emit(what="join only", threads=cores, gbps=N / best(lambda: list(pool.map(jonly, range(len(chunks))))) / 1e9)


def jstack(i):
    ch = chunks[i]
    np.stack(
        [np.frombuffer(r, np.uint8) for r in planes[i]],
        axis=1,
        out=out[ch.offset : ch.offset + ch.length].reshape(-1, 4),
    )


emit(
    what="join np.stack",
    threads=cores,
    gbps=N / best(lambda: list(pool.map(jstack, range(len(chunks))))) / 1e9,
)
pool4 = ThreadPoolExecutor(4)
emit(what="join only", threads=4, gbps=N / best(lambda: list(pool4.map(jonly, range(len(chunks))))) / 1e9)
emit(
    what="zstd only (bytes per plane)", threads=4, gbps=N / best(lambda: list(pool4.map(zonly, chunks))) / 1e9
)


def cp(ch):
    np.copyto(out[ch.offset : ch.offset + ch.length], x[ch.offset : ch.offset + ch.length])


emit(what="memcpy per chunk", threads=cores, gbps=N / best(lambda: list(pool.map(cp, chunks))) / 1e9)
# one C call decodes every frame on its own threads
frames = []
for ch in chunks:
    mv = memoryview(ch.payload)
    s = 0
    for part in ch.parts:
        frames.append(mv[s : s + part])
        s += part
d = zstandard.ZstdDecompressor()
for t in sorted({4, 8, cores}):
    emit(
        what="multi_decompress_to_buffer",
        threads=t,
        gbps=N / best(lambda t=t: d.multi_decompress_to_buffer(frames, threads=t)) / 1e9,
    )
# the share of planes stored as raw zstd blocks (noisy mantissa bytes)
emit(
    what="planes raw share",
    raw=sum(1 for ch in chunks for q in ch.parts if q > ch.length // 4) / max(1, len(frames)),
)
if out_path != "/dev/stdout":
    Path(out_path).write_text(json.dumps(rows, indent=1))
