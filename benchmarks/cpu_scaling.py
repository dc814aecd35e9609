"""How work scales with threads on this machine (CPU only): a copy, zlib's CRC-32 and
zstd's decode (C code that releases the GIL), and a pure-Python loop (holds it), on
512 chunks of 1 MiB from a thread pool of 1 to 16 threads; GB/s, best of three.

What it showed on the H100 box (``benchmarks/results/cpu-scaling-h100.json``): zstd
decode scales with cores (0.60 GB/s on one, 9.3 on 16), copies stop at about 24 GB/s
on 8 threads, and Python code does not scale at all; so the host codec's decode must
spend its time in few, long GIL-free calls.

Usage: ``python benchmarks/cpu_scaling.py benchmarks/results/cpu-scaling-h100.json``
"""

import json
import os
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import zstandard

rows = []


def emit(**kw):
    rows.append(kw)
    print(json.dumps(kw), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(rows, indent=1))


MiB = 1 << 20
n_chunks = 512
src = np.random.default_rng(0).integers(0, 256, n_chunks * MiB, dtype=np.uint8)
dst = np.empty_like(src)
small = np.random.default_rng(1).normal(0, 1, n_chunks * MiB // 4).astype(np.float32).view(np.uint8)
frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(small[:MiB])
dctx = [zstandard.ZstdDecompressor() for _ in range(64)]


def memcpy(i):
    np.copyto(dst[i * MiB : (i + 1) * MiB], src[i * MiB : (i + 1) * MiB])


def crc(i):
    zlib.crc32(src[i * MiB : (i + 1) * MiB])


def zd(i):
    dctx[i % 64].decompress(frame, max_output_size=MiB)


def spin(i):
    x = 0
    for k in range(20000):
        x += k


for name, f in (("memcpy", memcpy), ("crc32", crc), ("zstd_decompress", zd), ("python_loop", spin)):
    for t in (1, 2, 4, 8, 16):
        with ThreadPoolExecutor(t) as pool:
            list(pool.map(f, range(n_chunks)))
            best = 9
            for _ in range(3):
                t0 = time.perf_counter()
                list(pool.map(f, range(n_chunks)))
                best = min(best, time.perf_counter() - t0)
        emit(what=name, threads=t, gbps=n_chunks * MiB / best / 1e9, seconds=best)
emit(what="loadavg", value=os.getloadavg(), affinity=len(os.sched_getaffinity(0)))
