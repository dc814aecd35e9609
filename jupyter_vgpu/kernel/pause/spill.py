"""The disk tier of the GPU codec path: stored pieces moved from pinned slabs to a file.

A paused kernel's GPU-path pieces (:class:`~..codec.device.Piece`) live in pinned host
slabs (:class:`~..codec.pinned_arena.PinnedArena`). When the node arbiter asks (its host
budget is near), :meth:`SpillFile.write` puts every piece's stored bytes into one file
of the kernel's disk tier directory, then the slabs go back. The file holds one record
per piece, back to back::

    header  32 bytes: b"VGPR", version (u16) 1, 0 (u16), piece number (u32),
            chunk count (u32), stored span (u64), CRC-32 of the chunk CRC-32s (u32), 0 (u32)
    CRC-32  one u32 per chunk (the piece's own, as the GPU computed them at pause), padded
            to 16 bytes
    stored  the piece's span, as it lay in its slab (its chunks at their 16-byte offsets)

so the file keeps every chunk's CRC-32 beside its bytes. Pieces other kernels read too
from the node's shared copies are not written: they stay mapped, and a resume reads
them from there (:func:`unpack`'s ``arena``). Resume (:func:`unpack`) streams
the file back to the GPU in windows of :data:`WINDOW` bytes, each read into one of
:data:`BUFFERS` pinned buffers while the codec writes an earlier window back to the
device: reads run up to ``BUFFERS - 1`` windows ahead of the GPU, and each window is read
by several ``preadv`` calls at once on a small thread pool made for the resume
(:mod:`.parallel_read`), with ``O_DIRECT`` where the file system takes it: from the disk
straight into the pinned buffer, no copy through the page cache. Each record's header is
checked against the piece the kernel holds in memory (number, sizes, CRC-32s), and the
GPU checks every chunk's CRC-32 again after the copy, as it does for pieces in host
memory. A damaged or short file fails the resume with
:class:`~..codec.zstd.CodecError`, naming the record; the kernel stays paused and the
file stays. :class:`DiskResume` says where the time went: waiting for reads (the GPU
idle), in the GPU's unpack, and the bandwidth the reads found.

Writing goes to ``<name>.tmp`` first, is flushed (``fsync``) and renamed: a kernel that
dies mid-spill leaves a temporary file (the node arbiter removes its directory), never a
file that looks whole. Until the rename, nothing in the kernel changes: a full or
failing disk leaves the pieces in host memory and raises :class:`SpillError`. The
file's pages are dropped from the page cache once written (``POSIX_FADV_DONTNEED``), or
the spill would only move the bytes from one part of RAM to another.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jupyter_vgpu import failpoints

from ..codec.zstd import CodecError
from .parallel_read import DIRECT_ALIGN, READ_THREADS, TASK_BYTES, Reader, ShortFile, window_bytes

#: :attr:`Piece.slab` of a piece whose stored bytes are in the spill file.
DISK = -2
#: :attr:`Piece.slab` of a piece read from a window of the file during :func:`unpack`.
IN_WINDOW = -3
MAGIC = b"VGPR"
_HEADER = struct.Struct("<4sHHIIQII")
#: Bytes of a window: what one pinned buffer of a resume from disk holds. Large enough
#: that a window's reads (:data:`~.parallel_read.TASK_BYTES` each) keep every thread of
#: the reader busy, small enough that the buffers stay a small part of host memory.
WINDOW = 64 << 20
#: Pinned buffers of a resume from disk: while the GPU writes one window back, the
#: others are being read, so reads never wait for the GPU unless it is the slower of the
#: two. 3 buffers keep two windows of reads (128 MiB) in flight past the one on the GPU;
#: host memory held: ``BUFFERS * WINDOW`` (192 MiB), whatever the file's size.
BUFFERS = 3


class SpillError(OSError):
    """Writing the spill file failed (a full or failing disk); nothing moved: the data is
    still in host memory. The message names the file and the system's error."""


def _crcs_bytes(crcs: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(crcs, dtype="<u4").tobytes()
    return raw + b"\0" * (-len(raw) % 16)


def header_bytes(chunks: int) -> int:
    """Bytes of a record's header and CRC-32 table for a piece of ``chunks`` chunks."""
    return _HEADER.size + -(-4 * chunks // 16) * 16


def _header(index: int, crcs: np.ndarray, span: int) -> bytes:
    table = _crcs_bytes(crcs)
    head = _HEADER.pack(MAGIC, 1, 0, index, len(crcs), span, zlib.crc32(table), 0)
    return head + table


def _memory(address: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


class SpillFile:
    """One paused kernel's GPU-path pieces on disk.

    Attributes:
        path: the file.
        nbytes: its size, bytes.
        records: record number by payload offset (the ``start`` of a piece on disk).
        direct: whether the last :meth:`read_window` bypassed the page cache.
    """

    def __init__(self, path: Path, nbytes: int, offsets: Sequence[int] = ()):
        self.path, self.nbytes = path, nbytes
        self.records = {offset: i for i, offset in enumerate(offsets)}
        #: whether the last :meth:`read_window` bypassed the page cache (None before one)
        self.direct: bool | None = None

    @classmethod
    def write(
        cls, directory: str | Path, name: str, records: Sequence[tuple[int, int, np.ndarray]]
    ) -> tuple[SpillFile, list[int]]:
        """Write ``records`` (``(host address of the stored bytes, span in bytes, chunk
        CRC-32s)`` per piece, in order) to ``directory/name``; returns the file and each
        record's payload offset in it.

        Raises:
            SpillError: the directory cannot be made or the file cannot be written
                whole (no space, an I/O error); no file is left.
        """
        directory = Path(directory)
        path = directory / name
        tmp = path.with_name(name + ".tmp")
        offsets = []
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pos = 0
                for index, (address, span, crcs) in enumerate(records):
                    head = _header(index, crcs, span)
                    _write_all(fd, head)
                    pos += len(head)
                    offsets.append(pos)
                    if span:
                        _write_all(fd, _memory(address, span))
                    pos += span
                    if index == 0:
                        failpoints.hit("kernel.spill.write")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            reason = e.strerror or str(e)
            raise SpillError(e.errno, f"writing the disk tier's file {path} failed: {reason}") from e
        drop_cache(path)
        return cls(path, pos, offsets), offsets

    def reader(self, threads: int = READ_THREADS, task_bytes: int = TASK_BYTES) -> Reader:
        """A :class:`~.parallel_read.Reader` of the file (close it when done).

        Raises:
            OSError: the file cannot be opened.
        """
        return Reader(self.path, threads, task_bytes)

    def read_window(self, first: int, end: int, buffer: np.ndarray) -> int:
        """Read the file's bytes ``[first, end)`` into ``buffer`` (uint8, at least
        :func:`window_bytes` long), with the bytes around them that make the read aligned
        to :data:`DIRECT_ALIGN`; returns where byte ``first`` landed: the bytes are
        ``buffer[pad : pad + end - first]``. One read at a time, on a reader of its own
        (:func:`unpack` keeps one reader for every window).

        Read with ``O_DIRECT`` where the file system and ``buffer``'s address allow it
        (see :mod:`.parallel_read`), elsewhere through the page cache, to the same
        place. :attr:`direct` says which the read took.

        Raises:
            CodecError: the file ends before ``end`` (:class:`~.parallel_read.ShortFile`).
            OSError: it cannot be read.
        """
        with self.reader(threads=1) as reader:
            try:
                return reader.read(first, end, buffer)
            finally:
                self.direct = reader.direct

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)

    def remove_later(self) -> threading.Thread:
        """:meth:`remove` in a thread of its own: unlinking a file of gigabytes frees its
        blocks, which took long enough to matter to a resume that waited for it."""
        t = threading.Thread(target=self.remove, name="jupyter-vgpu-unlink", daemon=True)
        t.start()
        return t


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view[: 1 << 30])
        view = view[n:]


def drop_cache(path: Path) -> None:
    """Drop a file's pages from the page cache (the caller flushed them: ``fsync``), so
    that the host memory they held is free; nothing where that cannot be done."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)


def check(buffer: np.ndarray, at: int, index: int, piece, path) -> None:
    """Check the header of record ``index`` at ``buffer[at:]`` against ``piece``.

    Raises:
        CodecError: the header is not the piece's (damaged or misplaced bytes).
    """
    n = len(piece.crcs)
    where = f"record {index} of the disk tier's file {path}"
    raw = bytes(buffer[at : at + header_bytes(n)])
    magic, version, _, got_index, chunks, span, table_crc, _ = _HEADER.unpack_from(raw)
    table = raw[_HEADER.size :]
    if magic != MAGIC or version != 1 or got_index != index or chunks != n or span != piece.span:
        raise CodecError(f"{where}: its header does not match the paused piece (damaged file)")
    if zlib.crc32(table) != table_crc or table != _crcs_bytes(piece.crcs):
        raise CodecError(f"{where}: its chunk CRC-32s do not match the paused piece (damaged file)")


class _Window:
    """An arena for :meth:`DeviceCodec.unpack` over one pinned buffer of file bytes
    (pieces of slab :data:`IN_WINDOW`); the pieces a spill left in host memory are read
    where ``arena`` has them."""

    def __init__(self, base: int, arena=None):
        self.base, self.arena = base, arena

    def address(self, slab: int, start: int) -> int:
        if slab == IN_WINDOW:
            return self.base + start
        if self.arena is None:
            raise CodecError(f"a piece of slab {slab} is in host memory, and the resume was given no arena")
        return self.arena.address(slab, start)


@dataclasses.dataclass
class DiskResume:
    """Where the time of a resume from disk (:func:`unpack`) went, so that a run on a GPU
    can say whether the disk or the GPU held it up.

    Attributes:
        seconds: the whole of :func:`unpack`, seconds.
        read_wait_s: seconds the GPU waited for a window to be read (its idle time).
        unpack_s: seconds in the codec's unpack (GPU work, each window synchronized).
        read_s: seconds during which at least one read was in flight.
        bytes_read: bytes read from the file (whole 4096-byte blocks, so a little more
            than its size).
        read_bytes_per_s: ``bytes_read / read_s``, the disk's bandwidth as the reads found
            it (None before any read).
        windows: windows read.
        direct: whether every read bypassed the page cache (None: nothing was read).
        buffers: pinned buffers of the pipeline; ``window_bytes``: bytes of each window.
        threads: reads at once; ``task_bytes``: most bytes of one read.
        before_s: seconds of the resume before :func:`unpack` (the device memory mapped
            back, the codec's scratch taken), set by the engine.
    """

    seconds: float = 0.0
    read_wait_s: float = 0.0
    unpack_s: float = 0.0
    read_s: float = 0.0
    bytes_read: int = 0
    read_bytes_per_s: float | None = None
    windows: int = 0
    direct: bool | None = None
    buffers: int = BUFFERS
    window_bytes: int = WINDOW
    threads: int = READ_THREADS
    task_bytes: int = TASK_BYTES
    before_s: float = 0.0


def unpack(
    codec,
    items: Sequence[tuple[object, Sequence]],
    spill: SpillFile,
    pinned: Callable[[int], object],
    window: int = WINDOW,
    buffers: int = BUFFERS,
    threads: int = READ_THREADS,
    task_bytes: int = TASK_BYTES,
    figures: DiskResume | None = None,
    arena=None,
) -> DiskResume:
    """Write every range back from the spill file, streaming: ``(device uint8 tensor of
    the range, its pieces)`` pairs, pieces as :meth:`SpillFile.write` left them (``slab``
    :data:`DISK`, ``start`` the payload's offset in the file; pieces that stored nothing
    need no bytes; pieces the spill left in host memory, read from the node's shared
    copies, are read from ``arena`` where they are). Returns where the time went.

    The pieces go in windows of at most ``window`` bytes of records, in file order, each
    read into one of ``buffers`` pinned buffers by one reader (``threads`` reads of at
    most ``task_bytes`` at once, :mod:`.parallel_read`) up to ``buffers - 1`` windows
    ahead of the one on the GPU; a buffer is read into again only once the codec's
    unpack of the window it held has returned (``DeviceCodec.unpack`` synchronizes at
    its end). Host memory: ``buffers`` buffers of ``window`` bytes and a few KiB, made
    once per resume through ``pinned``.

    Args:
        codec: the :class:`~..codec.device.DeviceCodec`.
        spill: the file.
        pinned: returns a pinned uint8 CPU tensor of at least the given bytes.
        window: bytes of records read at once into each buffer (a record larger than
            that gets a window, and a buffer, of its own).
        buffers: pinned buffers, at least 2.
        threads: reads in flight at once.
        task_bytes: most bytes of one read, a multiple of :data:`DIRECT_ALIGN`.
        figures: filled as the resume goes (a failed one's figures stay in it).
        arena: the engine's :class:`~..codec.pinned_arena.PinnedArena`, for the pieces
            not in the file (None: every piece that stored bytes is in the file).

    Raises:
        CodecError: a record's header does not match its piece, or the file is short
            (the message names the record).
        DeviceCodecError: a chunk fails its CRC-32 on the GPU (see ``DeviceCodec.unpack``).
        OSError: the file cannot be read.
        ValueError: fewer than 2 buffers, or ``task_bytes`` not a multiple of
            :data:`DIRECT_ALIGN`.
    """
    if buffers < 2:
        raise ValueError(f"a resume from disk needs 2 buffers or more, not {buffers}")
    t0 = time.perf_counter()
    out = figures if figures is not None else DiskResume()
    out.buffers, out.window_bytes, out.threads, out.task_bytes = buffers, window, threads, task_bytes
    flat = [(r, p) for r, (_, pieces) in enumerate(items) for p in pieces]
    batches: list[list] = []
    size = 0
    for r, p in flat:
        need = header_bytes(len(p.crcs)) + p.span if p.slab == DISK else 0
        if not batches or (need and size + need > window and size):
            batches.append([])
            size = 0
        batches[-1].append((r, p))
        size += need
    held: list = [None] * buffers  # the pinned buffers, made as first needed
    pending: dict[int, tuple] = {}  # batch -> (its window being read, buffer, first byte)

    def start(k: int, reader: Reader) -> None:
        disk = [p for _, p in batches[k] if p.slab == DISK]
        if not disk:
            pending[k] = None
            return
        first = disk[0].start - header_bytes(len(disk[0].crcs))
        end = disk[-1].start + disk[-1].span
        b = k % buffers  # free: the batch that used it last went through the codec
        if held[b] is None or held[b].numel() < window_bytes(first, end):
            held[b] = pinned(max(window + 2 * DIRECT_ALIGN, window_bytes(first, end)))
        pending[k] = (reader.start(first, end, held[b].numpy()), held[b], first)

    reader = spill.reader(threads, task_bytes) if any(p.slab == DISK for _, p in flat) else None
    try:
        for k in range(min(buffers, len(batches))):
            start(k, reader)
        direct = True
        for k, batch in enumerate(batches):
            got = pending.pop(k)
            buffer, first, pad = None, 0, 0
            if got is not None:
                reading, buffer, first = got
                t = time.perf_counter()
                try:
                    pad = reading.wait()
                except ShortFile as e:
                    raise _short(e, batch, spill) from e
                finally:
                    out.read_wait_s += time.perf_counter() - t
                direct = direct and bool(reader.direct)
                out.windows += 1
                data = buffer.numpy()[pad:]
                for _, p in batch:
                    if p.slab != DISK:
                        continue
                    if p.start not in spill.records:
                        raise CodecError(f"the disk tier's file {spill.path} has no record at byte {p.start}")
                    at = p.start - header_bytes(len(p.crcs)) - first
                    check(data, at, spill.records[p.start], p, spill.path)
            grouped: dict[int, list] = {}
            for r, p in batch:
                if p.slab == DISK:
                    p = _at(p, p.start - first)
                grouped.setdefault(r, []).append(p)
            source = _Window(buffer.data_ptr() + pad if buffer is not None else 0, arena)
            t = time.perf_counter()
            codec.unpack([(items[r][0], pieces) for r, pieces in grouped.items()], source)
            out.unpack_s += time.perf_counter() - t
            failpoints.hit("kernel.resume.copy")
            if k + buffers < len(batches):
                start(k + buffers, reader)  # into the buffer the codec is done with
        if out.windows:
            out.direct = spill.direct = direct
    finally:
        if reader is not None:
            reader.close()  # no read outlives the resume, failed or not
            out.read_s, out.bytes_read = reader.read_s, reader.bytes_read
            out.read_bytes_per_s = reader.bytes_read / reader.read_s if reader.read_s else None
        out.seconds = time.perf_counter() - t0
    return out


def _short(e: ShortFile, batch: list, spill: SpillFile) -> CodecError:
    """The error of a file that ends at ``e.at``, naming the record it cuts."""
    for _, p in batch:
        if p.slab == DISK and p.start + p.span > e.at:
            index = spill.records.get(p.start, "?")
            return CodecError(
                f"record {index} of the disk tier's file {spill.path} is cut short: the file "
                f"ends at byte {e.at}, the record at byte {p.start + p.span} ({spill.nbytes} bytes "
                "were written)"
            )
    return CodecError(f"the disk tier's file {spill.path} ends at byte {e.at}; {e.end} were written")


def _at(piece, start: int):
    """``piece`` read from a window at ``start`` (slab :data:`IN_WINDOW` of :class:`_Window`)."""
    return dataclasses.replace(piece, slab=IN_WINDOW, start=start)
