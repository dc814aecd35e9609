"""Byte ranges of one file read into memory by several ``preadv`` calls at once.

A resume from the disk tier (:func:`.spill.unpack`) reads the spill file a window at a
time into pinned buffers. One synchronous read keeps one request in flight, and a drive
(an NVMe one above all) reaches its bandwidth only with several. :class:`Reader` splits
each window into tasks of at most :data:`TASK_BYTES` and runs them on a small thread
pool of its own, made once per resume (``os.preadv`` lets go of the GIL while it
waits), the way KvikIO splits a read into tasks for its thread pool (its "Runtime
Settings" page, ``KVIKIO_TASK_SIZE`` and ``KVIKIO_NTHREADS``,
docs.rapids.ai/api/kvikio/stable/runtime_settings/).

Why plain ``preadv`` on threads: KvikIO ships as CUDA-specific wheels that the GPU
machines do not have and cannot fetch (they reach no network), and without GPUDirect
Storage it runs POSIX reads on a thread pool anyway (its compatibility mode, same
page). io_uring has no binding in Python's standard library; the ones on PyPI build
against liburing. Threads over ``preadv`` need nothing and put as many requests in
flight.

Reads bypass the page cache (``O_DIRECT``, ``open(2)``) where the file system and the
buffer's address allow it: the bytes go from the disk into the buffer once, and nothing
stays in the cache (a resume never reads them again). Elsewhere (tmpfs before Linux 6.6
refuses ``O_DIRECT`` at open; a buffer not aligned to :data:`DIRECT_ALIGN`) they come
through the page cache, to the same place.
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import threading
import time
from pathlib import Path

import numpy as np

from ..codec.zstd import CodecError

#: Alignment of a read that bypasses the page cache (``O_DIRECT``): of the file offset,
#: the length and the buffer's address; 4096 bytes serves disks of 512- and 4096-byte
#: logical blocks alike.
DIRECT_ALIGN = 4096
#: Most bytes one task reads (one ``preadv``, or a few where the system returns less):
#: KvikIO's default task size, 4 MiB (``KVIKIO_TASK_SIZE``, its "Runtime Settings").
TASK_BYTES = 4 << 20
#: Threads of a reader, so reads in flight at once. KvikIO's default is 1
#: (``KVIKIO_NTHREADS``), one request in flight, the very case this module is for;
#: 8 puts 32 MiB in flight (half a 64 MiB window of :mod:`.spill`) with half the
#: 16 cores of the H100 machines. A starting point, not a measured optimum: the
#: figures of a resume from disk (``read_bytes_per_s``) say what the drive gave.
READ_THREADS = 8


def aligned(first: int, end: int) -> tuple[int, int]:
    """``[first, end)`` widened to :data:`DIRECT_ALIGN` boundaries."""
    return first - first % DIRECT_ALIGN, -(-end // DIRECT_ALIGN) * DIRECT_ALIGN


class ShortFile(CodecError):
    """The file ends before the bytes a read needs.

    Attributes:
        path: the file.
        at: its end, as the read found it (byte offset).
        end: the byte offset the read needed to reach.
    """

    def __init__(self, path: Path, at: int, end: int):
        super().__init__(f"the file {path} ends at byte {at}; {end} were expected")
        self.path, self.at, self.end = path, at, end


class Window:
    """One range being read (from :meth:`Reader.start`); :meth:`wait` for it."""

    def __init__(self, reader: Reader, tasks: list[concurrent.futures.Future], pad: int):
        self._reader, self._tasks, self.pad = reader, tasks, pad

    def wait(self) -> int:
        """Wait for every task of the window; returns where its first byte landed in the
        buffer (see :meth:`Reader.start`).

        Raises:
            ShortFile: the file ends before the range does.
            OSError: a read failed.
        """
        concurrent.futures.wait(self._tasks)
        direct = True
        for task in self._tasks:  # the first failure in file order, once none still runs
            direct = task.result() and direct
        self._reader.direct = direct
        return self.pad


class Reader:
    """Reads ranges of the file ``path`` into buffers, each range split into tasks of at
    most ``task_bytes`` run at once on ``threads`` threads of the reader's own pool.
    Close it (or use it as a context manager): that waits for the reads it started.

    ``direct=False`` reads through the page cache even where ``O_DIRECT`` is taken (a
    comparison, ``benchmarks/disk_reads.py``).

    Attributes:
        direct: whether every read of the last range waited for bypassed the page cache
            (None before one).
        bytes_read: bytes read so far, in whole :data:`DIRECT_ALIGN` blocks.
        read_s: seconds during which at least one read was in flight.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(
        self, path: str | Path, threads: int = READ_THREADS, task_bytes: int = TASK_BYTES, direct: bool = True
    ):
        if task_bytes <= 0 or task_bytes % DIRECT_ALIGN:
            raise ValueError(f"a task of {task_bytes} bytes is not a multiple of {DIRECT_ALIGN}")
        self.path = Path(path)
        self.threads, self.task_bytes = threads, task_bytes
        self.direct: bool | None = None
        self.bytes_read = 0
        self.read_s = 0.0
        self._lock = threading.Lock()
        self._in_flight = 0
        self._busy_since = 0.0
        self._refused = False  # the file system refused an O_DIRECT read: none tried again
        self._plain = os.open(self.path, os.O_RDONLY)
        self._direct: int | None = None
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self._direct = os.open(self.path, os.O_RDONLY | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:  # EINVAL: the file system takes no O_DIRECT
                    os.close(self._plain)
                    raise
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="jupyter-vgpu-disk")

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, first: int, end: int, buffer: np.ndarray) -> Window:
        """Start reading the file's bytes ``[first, end)`` into ``buffer`` (uint8, at
        least :func:`window_bytes` long), with the bytes around them that make the read
        aligned to :data:`DIRECT_ALIGN`: once :meth:`Window.wait` returns ``pad``, the
        bytes are ``buffer[pad : pad + end - first]``. ``buffer`` must stay untouched
        until then.

        Raises:
            ValueError: ``buffer`` is too small.
        """
        lo, hi = aligned(first, end)
        view = memoryview(buffer).cast("B")
        if len(view) < hi - lo:
            raise ValueError(f"a buffer of {len(view)} bytes holds no window of {hi - lo}")
        direct = self._direct is not None and buffer.ctypes.data % DIRECT_ALIGN == 0
        tasks = []
        for at in range(lo, hi, self.task_bytes):
            stop = min(at + self.task_bytes, hi)
            part = view[at - lo : stop - lo]
            tasks.append(self._pool.submit(self._task, part, at, min(stop, end) - at, direct, end))
        return Window(self, tasks, first - lo)

    def read(self, first: int, end: int, buffer: np.ndarray) -> int:
        """:meth:`start`, then :meth:`Window.wait`: returns ``pad``.

        Raises:
            ShortFile: the file ends before ``end``.
            OSError: it cannot be read.
            ValueError: ``buffer`` is too small.
        """
        return self.start(first, end, buffer).wait()

    def close(self) -> None:
        """Cancel the reads not started, wait for those running, close the file."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in (self._plain, self._direct):
            if fd is not None:
                os.close(fd)
        self._plain = self._direct = None

    def _task(self, view: memoryview, offset: int, need: int, direct: bool, end: int) -> bool:
        """Fill ``view`` from file byte ``offset`` with at least ``need`` bytes of the range
        that ends at byte ``end``; returns whether it bypassed the page cache."""
        with self._lock:
            if self._in_flight == 0:
                self._busy_since = time.perf_counter()
            self._in_flight += 1
        try:
            if direct and not self._refused:
                if self._pread(self._direct, view, offset, need, end, direct=True):
                    return True
                self._refused = True
            self._pread(self._plain, view, offset, need, end, direct=False)
            return False
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self.read_s += time.perf_counter() - self._busy_since

    def _pread(self, fd: int, view: memoryview, offset: int, need: int, end: int, direct: bool) -> bool:
        """False when the file system refuses an ``O_DIRECT`` read (nothing read)."""
        got = 0
        while got < need:
            try:  # a direct read asks for whole blocks: the view's end is aligned
                n = os.preadv(fd, [view[got:] if direct else view[got:need]], offset + got)
            except OSError as e:
                if direct and e.errno == errno.EINVAL and got == 0:
                    return False
                raise
            got += n
            with self._lock:
                self.bytes_read += n
            if n == 0 or (direct and n % DIRECT_ALIGN and got < need):  # the end of the file
                raise ShortFile(self.path, min(offset + got, os.fstat(fd).st_size), end)
        return True


def window_bytes(first: int, end: int) -> int:
    """Bytes of a buffer that :meth:`Reader.start` fills for ``[first, end)``."""
    lo, hi = aligned(first, end)
    return hi - lo
