"""How the disk tier's reader should read this machine's disk: a file read the way a
resume from the disk tier reads its spill file, at several request sizes and depths,
beside one plain read of it (issue 42, item 3).

A resume reads the file in windows of ``window`` bytes, in file order, each into one
of ``buffers`` buffers, up to ``buffers - 1`` windows ahead of the GPU
(:func:`jupyter_vgpu.kernel.pause.spill.unpack`), each window split into reads of at
most ``task`` bytes on ``threads`` threads (:class:`jupyter_vgpu.kernel.pause.parallel_read.Reader`,
``O_DIRECT`` where the file system takes it). Here the GPU's part is left out (a window
is handed back as soon as it is read): what is measured is what the reads alone can
draw from the disk, the ceiling of a resume from it. The plain read is one thread
reading the file front to back through the page cache, 64 MiB at a time
(``benchmarks/faults.py``'s ``plain_read``), which the kernel's readahead serves.

Each setting reads the same file of random bytes (incompressible), with the file's
pages dropped from the page cache before each read (``POSIX_FADV_DONTNEED``). Figures:
``seconds`` (median of ``--repeats``, NumPy's ``numpy.median``), ``bytes_per_s``,
``vs_plain`` (the plain read's seconds over the setting's: above 1, faster), ``direct``
(whether every read bypassed the page cache; with ``--page-cache`` each setting is read
through it too, as a comparison); ``default`` marks the reader's settings
as shipped (:data:`~jupyter_vgpu.kernel.pause.parallel_read.READ_THREADS`,
:data:`~jupyter_vgpu.kernel.pause.parallel_read.TASK_BYTES`,
:data:`~jupyter_vgpu.kernel.pause.spill.WINDOW`,
:data:`~jupyter_vgpu.kernel.pause.spill.BUFFERS`).

Runs on any Linux machine (no GPU needed: the buffers are page-aligned host memory, as
the pinned ones are)::

    python benchmarks/disk_reads.py --dir /tmp --gib 4 --out benchmarks/results/disk-reads-h100.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import provenance  # noqa: E402

from jupyter_vgpu.kernel.pause import parallel_read, spill  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def write_file(path: Path, nbytes: int) -> int:
    """A file of ``nbytes`` random bytes at ``path``, synced; returns its CRC-32."""
    crc = 0
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            chunk = rng.integers(0, 256, min(left, 64 * MiB), dtype=np.uint8).tobytes()
            f.write(chunk)
            crc = zlib.crc32(chunk, crc)
            left -= len(chunk)
        f.flush()
        os.fsync(f.fileno())
    return crc


def drop_cache(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (``posix_fadvise(2)``, DONTNEED)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(path: Path) -> float:
    """Seconds for one thread to read ``path`` front to back, 64 MiB at a time, from a
    cold page cache."""
    drop_cache(path)
    view = memoryview(bytearray(64 * MiB))
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    return time.perf_counter() - t0


def buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-aligned host memory (an anonymous mapping), uint8."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def windowed_read(
    path: Path, threads: int, task: int, window: int, buffers: int, check: bool = False, direct: bool = True
):
    """Read ``path`` as a resume reads its spill file (the module's doc), from a cold page
    cache. Returns ``(seconds, direct, crc)``: ``crc`` the CRC-32 of the bytes read, in
    file order, when ``check`` (computed after the clock stops), else None.

    Raises:
        ShortFile: the file is shorter than it was.
        OSError: a read failed.
    """
    size = path.stat().st_size
    ranges = [(at, min(at + window, size)) for at in range(0, size, window)]
    bufs = [buffer(window + parallel_read.DIRECT_ALIGN) for _ in range(buffers)]
    crc, bypassed = 0, True
    drop_cache(path)
    t0 = time.perf_counter()
    with parallel_read.Reader(path, threads=threads, task_bytes=task, direct=direct) as reader:
        ahead = [reader.start(*ranges[i], bufs[i % buffers]) for i in range(min(buffers - 1, len(ranges)))]
        for i, (first, end) in enumerate(ranges):
            pad = ahead.pop(0).wait()
            bypassed = bypassed and bool(reader.direct)
            if check:  # for tests: inside the clock, so never in a sweep
                crc = zlib.crc32(bufs[i % buffers][pad : pad + end - first], crc)
            nxt = i + buffers - 1
            if nxt < len(ranges):
                ahead.append(reader.start(*ranges[nxt], bufs[nxt % buffers]))
    return time.perf_counter() - t0, bypassed, (crc if check else None)


def sweep(path: Path, threads, tasks, windows, buffers: int, repeats: int, directs=(True,)) -> dict:
    """Every setting of ``threads`` x ``tasks`` x ``windows`` (bytes) x ``directs``
    (``O_DIRECT`` asked for, or reads through the page cache) read ``repeats`` times,
    beside the plain read (the module's doc for the figures)."""
    size = path.stat().st_size
    plain = float(np.median([plain_read(path) for _ in range(repeats)]))
    rows = []
    for n, task, window, asked in itertools.product(threads, tasks, windows, directs):
        runs = [windowed_read(path, n, task, window, buffers, direct=asked) for _ in range(repeats)]
        seconds = float(np.median([r[0] for r in runs]))
        rows.append({
            "threads": n, "task_bytes": task, "window_bytes": window, "buffers": buffers,
            "seconds": round(seconds, 4), "bytes_per_s": round(size / seconds),
            "vs_plain": round(plain / seconds, 3), "direct": all(r[1] for r in runs),
            "default": asked and (n, task, window, buffers) == (
                parallel_read.READ_THREADS, parallel_read.TASK_BYTES, spill.WINDOW, spill.BUFFERS),
        })  # fmt: skip
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    best = max(rows, key=lambda r: r["bytes_per_s"])
    return {
        "file_bytes": size,
        "plain_read_s": round(plain, 4),
        "plain_read_bytes_per_s": round(size / plain),
        "settings": rows,
        "best": best,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where the file goes")
    ap.add_argument("--gib", type=float, default=4.0, help="the file's size, GiB")
    ap.add_argument("--threads", default="1,4,8,16,32")
    ap.add_argument("--tasks-mib", default="1,4,16")
    ap.add_argument("--windows-mib", default="64,256")
    ap.add_argument("--buffers", type=int, default=spill.BUFFERS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--page-cache", action="store_true", help="also each setting through the page cache (no O_DIRECT)"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    result = {**provenance.record(), "percentile_rule": "numpy.median", "directory": str(args.dir)}
    path = Path(tempfile.mkdtemp(prefix="vgpu-disk-reads-", dir=args.dir)) / "file.bin"
    try:
        write_file(path, int(args.gib * GiB))
        result.update(
            sweep(
                path,
                [int(v) for v in args.threads.split(",")],
                [int(v) * MiB for v in args.tasks_mib.split(",")],
                [int(v) * MiB for v in args.windows_mib.split(",")],
                args.buffers,
                args.repeats,
                (True, False) if args.page_cache else (True,),
            )
        )
    finally:
        path.unlink(missing_ok=True)
        path.parent.rmdir()
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
