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

so the file keeps every chunk's CRC-32 beside its bytes. Resume (:func:`unpack`) streams
the file back to the GPU: a reader thread reads the next window of records into one of
two pinned buffers (with ``O_DIRECT`` where the file system takes it: from the disk
straight into the pinned buffer, no copy through the page cache, :meth:`SpillFile.read_window`)
while the codec writes the window before it back to the device; each
record's header is checked against the piece the kernel holds in memory (number, sizes,
CRC-32s), and the GPU checks every chunk's CRC-32 again after the copy, as it does for
pieces in host memory. A damaged or short file fails the resume with
:class:`~..codec.zstd.CodecError`, naming the record; the kernel stays paused and the
file stays.

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
import errno
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from jupyter_vgpu import failpoints

from ..codec.zstd import CodecError

#: :attr:`Piece.slab` of a piece whose stored bytes are in the spill file.
DISK = -2
MAGIC = b"VGPR"
_HEADER = struct.Struct("<4sHHIIQII")
#: Bytes read into each of the two pinned buffers of a resume from disk.
WINDOW = 64 << 20
#: Alignment of a read that bypasses the page cache (``O_DIRECT``): of the file offset,
#: the length and the buffer's address; 4096 bytes serves disks of 512- and 4096-byte
#: logical blocks alike.
DIRECT_ALIGN = 4096


def _aligned(first: int, end: int) -> tuple[int, int]:
    """``[first, end)`` widened to :data:`DIRECT_ALIGN` boundaries."""
    return first - first % DIRECT_ALIGN, -(-end // DIRECT_ALIGN) * DIRECT_ALIGN


def window_bytes(first: int, end: int) -> int:
    """Bytes of a buffer that :meth:`SpillFile.read_window` fills for ``[first, end)``."""
    lo, hi = _aligned(first, end)
    return hi - lo


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

    def read_window(self, first: int, end: int, buffer: np.ndarray) -> int:
        """Read the file's bytes ``[first, end)`` into ``buffer`` (uint8, at least
        :func:`window_bytes` long), with the bytes around them that make the read aligned
        to :data:`DIRECT_ALIGN`; returns where byte ``first`` landed: the bytes are
        ``buffer[pad : pad + end - first]``.

        Read with ``O_DIRECT`` where the file system and ``buffer``'s address allow it:
        the bytes go from the disk to ``buffer`` once, with no copy through the page
        cache and nothing left in it (a resume never reads them again; ``open(2)``,
        O_DIRECT). Elsewhere (tmpfs, an unaligned buffer) through the page cache, to the
        same place. :attr:`direct` says which the last read took.

        Raises:
            CodecError: the file ends before ``end``.
            OSError: it cannot be read.
        """
        lo, hi = _aligned(first, end)
        view = memoryview(buffer).cast("B")
        if len(view) < hi - lo:
            raise ValueError(f"a buffer of {len(view)} bytes holds no window of {hi - lo}")
        view = view[: hi - lo]
        direct = hasattr(os, "O_DIRECT") and buffer.ctypes.data % DIRECT_ALIGN == 0
        self.direct = direct and self._read_at(view, lo, end - lo, direct=True)
        if not self.direct:
            self._read_at(view, lo, end - lo, direct=False)
        return first - lo

    def _read_at(self, view: memoryview, offset: int, need: int, direct: bool) -> bool:
        """Fill ``view`` from file byte ``offset`` with at least ``need`` bytes; False
        when the file system refuses ``O_DIRECT`` (nothing read)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError as e:
            if direct and e.errno == errno.EINVAL:
                return False
            raise
        try:
            got = 0
            while got < need:
                try:  # direct reads ask for whole blocks: the view's end is aligned
                    n = os.preadv(fd, [view[got:] if direct else view[got:need]], offset + got)
                except OSError as e:
                    if direct and e.errno == errno.EINVAL and got == 0:
                        return False
                    raise
                got += n
                if n == 0 or (direct and n % DIRECT_ALIGN and got < need):  # the end of the file
                    raise CodecError(
                        f"the disk tier's file {self.path} ends at byte {offset + got}; "
                        f"{offset + need} were written"
                    )
        finally:
            os.close(fd)
        return True

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


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
    """An arena for :meth:`DeviceCodec.unpack` over one pinned buffer of file bytes."""

    def __init__(self, base: int):
        self.base = base

    def address(self, slab: int, start: int) -> int:
        return self.base + start


def unpack(
    codec,
    items: Sequence[tuple[object, Sequence]],
    spill: SpillFile,
    pinned: Callable[[int], object],
    window: int = WINDOW,
) -> None:
    """Write every range back from the spill file, streaming: ``(device uint8 tensor of
    the range, its pieces)`` pairs, pieces as :meth:`SpillFile.write` left them (``slab``
    :data:`DISK`, ``start`` the payload's offset in the file; pieces that stored nothing
    need no bytes).

    Args:
        codec: the :class:`~..codec.device.DeviceCodec`.
        spill: the file.
        pinned: returns a pinned uint8 CPU tensor of at least the given bytes.
        window: bytes read at once into each of two pinned buffers.

    Raises:
        CodecError: a record's header does not match its piece, or the file is short.
        DeviceCodecError: a chunk fails its CRC-32 on the GPU (see ``DeviceCodec.unpack``).
        OSError: the file cannot be read.
    """
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
    buffers = [None, None]
    results: dict[int, tuple] = {}
    ready = [threading.Event() for _ in batches]

    def read(k: int) -> None:
        try:
            disk = [p for _, p in batches[k] if p.slab == DISK]
            if not disk:
                results[k] = (None, 0, 0)
                return
            first = disk[0].start - header_bytes(len(disk[0].crcs))
            end = disk[-1].start + disk[-1].span
            b = k % 2
            if buffers[b] is None or buffers[b].numel() < window_bytes(first, end):
                buffers[b] = pinned(max(window + 2 * DIRECT_ALIGN, window_bytes(first, end)))
            pad = spill.read_window(first, end, buffers[b].numpy())
            data = buffers[b].numpy()[pad : pad + end - first]
            for p in disk:
                if p.start not in spill.records:
                    raise CodecError(f"the disk tier's file {spill.path} has no record at byte {p.start}")
                at = p.start - header_bytes(len(p.crcs)) - first
                check(data, at, spill.records[p.start], p, spill.path)
            results[k] = (buffers[b], first, pad)
        except BaseException as e:
            results[k] = e
        finally:
            ready[k].set()

    reader: threading.Thread | None = None

    def start(k: int) -> threading.Thread:
        t = threading.Thread(target=read, args=(k,), name="jupyter-vgpu-disk", daemon=True)
        t.start()
        return t

    try:
        if batches:
            reader = start(0)
        for k, batch in enumerate(batches):
            ready[k].wait()
            got = results.pop(k)
            if isinstance(got, BaseException):
                raise got
            if k + 1 < len(batches):
                reader = start(k + 1)  # into the other buffer, while this one goes to the GPU
            buffer, first, pad = got
            grouped: dict[int, list] = {}
            for r, p in batch:
                if p.slab == DISK:
                    p = _at(p, p.start - first)
                grouped.setdefault(r, []).append(p)
            arena = _Window(buffer.data_ptr() + pad if buffer is not None else 0)
            codec.unpack([(items[r][0], pieces) for r, pieces in grouped.items()], arena)
            failpoints.hit("kernel.resume.copy")
    finally:
        if reader is not None:
            reader.join()


def _at(piece, start: int):
    """``piece`` read from a window at ``start`` (slab 0 of :class:`_Window`)."""
    return dataclasses.replace(piece, slab=0, start=start)
