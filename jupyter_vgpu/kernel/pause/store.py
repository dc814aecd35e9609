"""Where the host path keeps paused memory: compressed host memory, then a disk directory.

Host memory is capped (default: half of what the host has available when the store
is made, read from ``/proc/meminfo``'s ``MemAvailable``; elsewhere from
``os.sysconf``'s free physical pages), so pausing can never push the server into
the kernel's OOM killer. Past the cap, packed data spills to files (tier 3) in a
private directory made under ``spill_dir``; with no spill directory the pause is
refused with :class:`HostMemoryFull` and the tensor stays on the GPU.

A spill file holds the chunk payloads of one :class:`~.codec.Packed`, back to back in
chunk order, in the codec layout (standard zstd frames, raw bytes, constant values),
then a trailer with every payload's size and CRC-32 (u64 and u32 each, little-endian),
their count and ``b"VGPH"``; the chunk records stay in memory with their payloads set
to None, and the sizes and CRC-32s too: both are checked when the file is read back.
Files are written to a temporary name, flushed and renamed, then dropped from the page
cache.

Besides its own cap, the store moves everything it holds in memory to a directory when
asked (:meth:`HostStore.spill`): the node arbiter's disk tier, when the node's host
memory for paused kernels runs short.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import shutil
import struct
import tempfile
import threading
import zlib
from pathlib import Path

from jupyter_vgpu import failpoints
from jupyter_vgpu.host.meminfo import meminfo

from ..codec.zstd import CodecError, Packed
from .spill import drop_cache

_TRAILER = b"VGPH"

DEFAULT_HOST_FRACTION = 0.5


class HostMemoryFull(RuntimeError):
    """Offloading this much would pass the host memory cap and there is no spill directory."""


def available_host_memory() -> int:
    """Bytes of host memory available for new allocations (Linux ``MemAvailable`` from
    ``/proc/meminfo``; elsewhere the free physical pages from ``os.sysconf``)."""
    available = meminfo().get("MemAvailable")
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class _Entry:
    packed: Packed  # payloads are None while spilled
    path: Path | None = None  # the spill file, while spilled
    sizes: tuple[int, ...] = ()  # each chunk's payload size in the spill file, bytes
    crcs: tuple[int, ...] = ()  # each chunk's payload CRC-32


class HostStore:
    """Holds :class:`~.codec.Packed` data in host memory up to a cap, spilling to disk past it.

    Thread-safe. Keys are positive integers, never reused by one store.

    Args:
        cap_bytes: host bytes to hold at most (default: half of ``MemAvailable``).
        spill_dir: directory under which a private spill directory is made on the
            first spill (so stores of several kernels can share it), or None to refuse
            past the cap.

    Raises:
        ValueError: ``cap_bytes`` is negative.
    """

    def __init__(self, cap_bytes: int | None = None, spill_dir: str | Path | None = None):
        if cap_bytes is None:
            cap_bytes = int(available_host_memory() * DEFAULT_HOST_FRACTION)
        if cap_bytes < 0:
            raise ValueError(f"cap_bytes must not be negative, got {cap_bytes}")
        self.cap_bytes = int(cap_bytes)
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self._private: Path | None = None
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.host_bytes = 0
        self.disk_bytes = 0

    def room(self) -> int:
        """Bytes that can still be put in host memory before the cap."""
        with self._lock:
            return max(0, self.cap_bytes - self.host_bytes)

    def put(self, packed: Packed) -> int:
        """Keep ``packed`` (in memory under the cap, else on disk); returns its key.

        Raises:
            HostMemoryFull: over the cap with no spill directory; nothing is kept.
            OSError: spilling failed (disk full); nothing is kept, no file is left.
        """
        with self._lock:
            key = next(self._ids)
            size = packed.stored_bytes
            if self.host_bytes + size <= self.cap_bytes:
                self._entries[key] = _Entry(packed)
                self.host_bytes += size
                return key
            if self.spill_dir is None:
                raise HostMemoryFull(
                    f"pausing {size} more bytes would pass the host memory cap: "
                    f"{self.host_bytes} of {self.cap_bytes} bytes held, and no spill directory is set"
                )
            if self._private is None:
                self.spill_dir.mkdir(parents=True, exist_ok=True)
                self._private = Path(tempfile.mkdtemp(prefix="vgpu-spill-", dir=self.spill_dir))
            self._entries[key] = self._spill(self._private, key, packed)
            self.disk_bytes += size
            return key

    def _spill(self, directory: Path, key: int, packed: Packed) -> _Entry:
        path = directory / f"{key}.chunks"
        tmp = path.with_suffix(".tmp")
        sizes = tuple(len(c.payload) for c in packed.chunks)
        crcs = tuple(zlib.crc32(c.payload) for c in packed.chunks)
        trailer = struct.pack(f"<{len(sizes)}Q{len(crcs)}II4s", *sizes, *crcs, len(sizes), _TRAILER)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with open(fd, "wb") as f:
                for chunk in packed.chunks:
                    f.write(chunk.payload)
                f.write(trailer)
                f.flush()
                os.fdatasync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        drop_cache(path)  # spilling must free host memory
        chunks = tuple(dataclasses.replace(c, payload=None) for c in packed.chunks)
        return _Entry(dataclasses.replace(packed, chunks=chunks), path, sizes, crcs)

    def spill(self, directory: str | Path) -> int:
        """Move every entry held in host memory to files in ``directory`` (made, mode
        0700); returns the stored bytes moved. Entries already on disk stay where they are.

        Raises:
            OSError: a file could not be written (a full or failing disk): the entries
                moved before it stay on disk, the others in memory, none is lost.
        """
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        moved = 0
        with self._lock:
            keys = [k for k, e in self._entries.items() if e.path is None and e.packed.stored_bytes]
        for key in keys:
            with self._lock:
                entry = self._entries.get(key)
            if entry is None or entry.path is not None:
                continue
            new = self._spill(directory, key, entry.packed)
            if not moved:
                failpoints.hit("kernel.spill.written")
            with self._lock:
                if self._entries.get(key) is not entry:  # dropped meanwhile (a resume)
                    new.path.unlink(missing_ok=True)
                    continue
                self._entries[key] = new
                size = entry.packed.stored_bytes
                self.host_bytes -= size
                self.disk_bytes += size
                moved += size
            if moved == size and key != keys[-1]:
                failpoints.hit("kernel.spill.write")
        return moved

    def get(self, key: int) -> Packed:
        """The packed data under ``key``, read back from disk if it was spilled (it stays
        spilled: the store's figures do not change; the payloads are read-only views of
        one buffer read from the file).

        Raises:
            KeyError: unknown key.
            OSError: the spill file cannot be read.
            CodecError: the spill file is shorter or longer than written, or a chunk's
                payload fails its CRC-32 (the error names the chunk and the file).
        """
        with self._lock:
            entry = self._entries[key]
        if entry.path is None:
            return entry.packed
        raw = entry.path.read_bytes()
        trailer = struct.calcsize(f"<{len(entry.sizes)}Q{len(entry.crcs)}II4s")
        written = sum(entry.sizes) + trailer
        if len(raw) != written:
            raise CodecError(f"spill file {entry.path} holds {len(raw)} bytes; {written} were written")
        data = raw[: written - trailer]
        kept = struct.pack(
            f"<{len(entry.sizes)}Q{len(entry.crcs)}II4s",
            *entry.sizes,
            *entry.crcs,
            len(entry.sizes),
            _TRAILER,
        )
        if raw[written - trailer :] != kept:
            raise CodecError(f"spill file {entry.path}: its table of chunk sizes and CRC-32s is damaged")
        chunks, pos = [], 0
        view = memoryview(data)
        for i, (c, size, crc) in enumerate(zip(entry.packed.chunks, entry.sizes, entry.crcs, strict=True)):
            payload = view[pos : pos + size]
            if zlib.crc32(payload) != crc:
                where = f"chunk at byte {c.offset} (number {i}) in spill file {entry.path}"
                raise CodecError(f"{where}: checksum mismatch")
            chunks.append(dataclasses.replace(c, payload=payload))
            pos += size
        return dataclasses.replace(entry.packed, chunks=tuple(chunks))

    def drop(self, key: int) -> None:
        """Forget ``key`` and free its memory or spill file (no error when absent)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            if entry.path is None:
                self.host_bytes -= entry.packed.stored_bytes
            else:
                self.disk_bytes -= entry.packed.stored_bytes
                entry.path.unlink(missing_ok=True)

    def in_memory(self) -> int:
        """Stored bytes held in host memory (the others are on disk)."""
        with self._lock:
            return self.host_bytes

    def close(self) -> None:
        """Drop everything and remove the private spill directory."""
        for key in list(self._entries):
            self.drop(key)
        with self._lock:
            if self._private is not None:
                shutil.rmtree(self._private, ignore_errors=True)
                self._private = None

    def __enter__(self) -> HostStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """``host_bytes`` and ``disk_bytes`` held (stored, compressed bytes), ``entries``
        (keys held) and ``cap_bytes`` (the host memory cap, bytes)."""
        with self._lock:
            return {
                "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes,
                "entries": len(self._entries),
                "cap_bytes": self.cap_bytes,
            }
