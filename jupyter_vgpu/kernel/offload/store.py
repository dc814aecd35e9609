"""Where offloaded data lives: compressed host memory, then a disk directory.

Host memory is capped (default: half of what the host has available when the kernel
starts, read from ``/proc/meminfo``'s ``MemAvailable``), so offloading can never push
the server into the kernel's OOM killer. Past the cap, packed data spills to files in
``spill_dir`` (tier 3); with no spill directory the offload is refused with
:class:`HostMemoryFull` and the tensor stays on the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading
from pathlib import Path

from .codec import Packed

DEFAULT_HOST_FRACTION = 0.5


class HostMemoryFull(RuntimeError):
    """Offloading this much would pass the host memory cap and there is no spill directory."""


def available_host_memory() -> int:
    """Bytes of host memory available for new allocations (Linux ``MemAvailable``;
    elsewhere the free physical pages from ``sysconf``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class _Entry:
    packed: Packed  # payloads are None while spilled
    path: Path | None = None  # the spill file, while spilled
    sizes: tuple[int, ...] = ()  # each chunk's payload size in the spill file


class HostStore:
    """Holds :class:`Packed` data in host memory up to a cap, spilling to disk past it.

    Args:
        cap_bytes: host bytes to hold at most (default: half of ``MemAvailable``).
        spill_dir: directory for spilled data (created on first spill), or None to
            refuse past the cap.
    """

    def __init__(self, cap_bytes: int | None = None, spill_dir: str | Path | None = None):
        self.cap_bytes = int(
            cap_bytes if cap_bytes is not None else available_host_memory() * DEFAULT_HOST_FRACTION
        )
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.host_bytes = 0
        self.disk_bytes = 0

    def put(self, packed: Packed) -> int:
        """Keep ``packed``; returns its key.

        Raises:
            HostMemoryFull: over the cap with no spill directory; nothing is kept.
            OSError: spilling failed (disk full); nothing is kept.
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
                    f"offloading {size} more bytes would pass the host memory cap "
                    f"({self.host_bytes} of {self.cap_bytes} bytes held) and no spill directory is set"
                )
            self._entries[key] = self._spill(key, packed)
            self.disk_bytes += size
            return key

    def _spill(self, key: int, packed: Packed) -> _Entry:
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        path = self.spill_dir / f"{key}.chunks"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                for chunk in packed.chunks:
                    f.write(chunk.payload)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        chunks = tuple(dataclasses.replace(c, payload=None) for c in packed.chunks)
        sizes = tuple(c.stored_bytes for c in packed.chunks)
        return _Entry(dataclasses.replace(packed, chunks=chunks), path, sizes)

    def get(self, key: int) -> Packed:
        """The packed data under ``key``, read back from disk if it was spilled.

        Raises:
            KeyError: unknown key.
            OSError: the spill file cannot be read.
        """
        with self._lock:
            entry = self._entries[key]
        if entry.path is None:
            return entry.packed
        data = entry.path.read_bytes()
        chunks, pos = [], 0
        for c, size in zip(entry.packed.chunks, entry.sizes, strict=True):
            chunks.append(dataclasses.replace(c, payload=data[pos : pos + size]))
            pos += size
        return dataclasses.replace(entry.packed, chunks=tuple(chunks))

    def drop(self, key: int) -> None:
        """Forget ``key`` and free its memory or file (no error when absent)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return
            if entry.path is None:
                self.host_bytes -= entry.packed.stored_bytes
            else:
                self.disk_bytes -= entry.packed.stored_bytes
                entry.path.unlink(missing_ok=True)

    def close(self) -> None:
        for key in list(self._entries):
            self.drop(key)

    def stats(self) -> dict[str, int]:
        """``host_bytes``, ``disk_bytes``, ``entries``, ``cap_bytes``."""
        with self._lock:
            return {
                "host_bytes": self.host_bytes,
                "disk_bytes": self.disk_bytes,
                "entries": len(self._entries),
                "cap_bytes": self.cap_bytes,
            }
