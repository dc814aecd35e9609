"""The host codec path: device ranges copied to pinned memory and compressed on CPU threads.

Used where nvCOMP or a GPU is absent (CPU-only kernels, the host stand-in of the
allocator), and on a card too full for the GPU path's scratch. It needs no device
memory at all: pieces of a range are copied into one of the pinned buffers while
another is encoded by :class:`~.zstd.Codec` (the host layout: byte planes, zstd frames,
raw and constant chunks, checksums), and the encoded pieces go to a
:class:`~jupyter_vgpu.kernel.pause.store.HostStore` (host memory under a cap, then
disk). Resume decodes pieces into two pinned buffers while a third is copied to the
device; the next piece's chunks queue on the codec's threads behind the current one's, so
no thread waits at the end of a piece. Given a piece of device scratch (``staging``),
resume leaves the chunks split into byte planes as planes and joins them on the GPU after
the copy (:meth:`.kernels.Kernels.interleave_async`): the CPU threads then run only zstd
(through its C API, the GIL released: ``codec.zstd``), which scales with them, where the
join on the CPU took the GIL back a few times per chunk.

On the host stand-in (``device=None``) the "device" range is host memory: pieces are
encoded from it and decoded into it directly.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import wait as futures_wait

from jupyter_vgpu import failpoints

from .zstd import Codec, plane_table

MiB = 1 << 20
#: Pinned buffers of ``piece_bytes``: a pause fills one while the codec encodes another;
#: a resume decodes into two while the third is copied to the device.
RING = 3
#: Rows of a piece's plane table (a piece holds piece_bytes / chunk_bytes chunks, +1).
TABLE_ROWS = 256


@dataclasses.dataclass(frozen=True)
class HostPiece:
    """One piece of a range, encoded in the host layout and kept by a HostStore.

    Attributes:
        offset: where the piece starts in its range, bytes.
        length: its original length, bytes.
        key: its key in the store.
        stored_bytes: what the store holds for it, bytes.
    """

    offset: int
    length: int
    key: int
    stored_bytes: int


class HostPath:
    """Stores device ranges through host memory and zstandard.

    Args:
        torch: the torch module.
        device: CUDA ordinal, or None for the host stand-in.
        codec: the zstd codec (its thread pool encodes and decodes).
        piece_bytes: bytes per piece (:data:`RING` pinned buffers of this size are kept).
    """

    name = "zstandard (CPU)"

    def __init__(self, torch, device: int | None, codec: Codec, piece_bytes: int = 32 * MiB):
        self.torch, self.device, self.codec, self.piece_bytes = torch, device, codec, piece_bytes
        self._buffers: list = []
        self._events: list = []
        self._stream = None
        self._kernels = None
        self._tables: list = []  # pinned int64 (TABLE_ROWS, 3), one per buffer
        self._table_addresses: list[int] = []  # their addresses on the device
        #: why resumes join byte planes on the CPU rather than the GPU, or None
        self.join_reason: str | None = None if device is not None else "no GPU"

    def gpu_join(self):
        """The GPU join's kernels and plane tables, made on first use; None (with
        :attr:`join_reason`) where NVRTC or cuda-bindings is missing."""
        if self._kernels is None and self.join_reason is None:
            try:
                from . import kernels
                from .cuda_driver import Driver

                self._kernels = kernels.load(self.device)
                torch = self.torch
                self._tables = [
                    torch.zeros((TABLE_ROWS, 3), dtype=torch.int64, pin_memory=True) for _ in range(RING)
                ]
                self._table_addresses = [Driver().device_pointer(t.data_ptr()) for t in self._tables]
            except Exception as e:  # joined on the CPU instead: slower, the same bytes
                self._kernels, self.join_reason = None, f"the GPU join is not available: {e}"
        return self._kernels

    def _ring(self) -> tuple[list, list, object]:
        torch = self.torch
        if not self._buffers:
            self._buffers = [
                torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(RING)
            ]
            self._events = [torch.cuda.Event() for _ in range(RING)]
            self._stream = torch.cuda.Stream(torch.device("cuda", self.device))
        return self._buffers, self._events, self._stream

    def release_buffers(self) -> int:
        """Give the pinned staging buffers back to PyTorch's cache of pinned memory (they
        are made again on next use); returns their bytes. The caller holds what keeps
        :meth:`pack` and :meth:`unpack` from running meanwhile (the engine's lock)."""
        released = sum(b.numel() for b in self._buffers)
        self._buffers, self._events = [], []
        return released

    def _pieces(self, length: int) -> list[tuple[int, int]]:
        return [(off, min(self.piece_bytes, length - off)) for off in range(0, length, self.piece_bytes)]

    def pack(
        self,
        ranges: Sequence[tuple[object, int]],
        store,
        on_range: Callable[[int, list[HostPiece]], None] | None = None,
        *,
        out: list[list[HostPiece]] | None = None,
    ) -> list[list[HostPiece]]:
        """Encode every range into ``store``; one list of :class:`HostPiece` per range.

        Args:
            ranges: ``(uint8 tensor viewing the range, its length)`` pairs.
            store: a :class:`~jupyter_vgpu.kernel.pause.store.HostStore`.
            on_range: called with ``(range index, pieces)`` once a range is encoded.
            out: one empty list per range, filled with the pieces as they are stored and
                returned: when this raises, it holds what was stored so far, for the
                caller to drop (default: new lists).

        Raises:
            HostMemoryFull: the store refused (over its cap, no spill directory).
            OSError: spilling to disk failed.
        """
        out = [[] for _ in ranges] if out is None else out
        return self._pack(ranges, store, on_range, out)

    def _pack(self, ranges, store, on_range, out) -> list[list[HostPiece]]:
        todo = [(r, off, n) for r, (_, length) in enumerate(ranges) for off, n in self._pieces(length)]
        if self.device is None:
            for r, off, n in todo:
                self._put(out, r, off, ranges[r][0][off : off + n].numpy(), store)
                if off + n == ranges[r][1] and on_range is not None:
                    on_range(r, out[r])
            return out
        torch = self.torch
        buffers, events, stream = self._ring()

        def issue(i: int) -> None:
            r, off, n = todo[i]
            with torch.cuda.stream(stream):
                buffers[i % 2][:n].copy_(ranges[r][0][off : off + n], non_blocking=True)
                events[i % 2].record(stream)

        if todo:
            issue(0)
        for i, (r, off, n) in enumerate(todo):
            if i + 1 < len(todo):
                issue(i + 1)  # the other buffer: it was encoded in the previous turn
            events[i % 2].synchronize()
            self._put(out, r, off, buffers[i % 2][:n].numpy(), store)
            if off + n == ranges[r][1] and on_range is not None:
                on_range(r, out[r])
        return out

    def _put(self, out, r: int, off: int, data, store) -> None:
        packed = self.codec.encode(data, itemsize=4, floating=True)
        key = store.put(packed)
        out[r].append(HostPiece(off, data.size, key, packed.stored_bytes))

    def unpack(self, items: Sequence[tuple[object, Sequence[HostPiece]]], store, staging=None) -> None:
        """Decode every range back: ``(uint8 tensor viewing the range, its pieces)`` pairs.

        Args:
            staging: a device uint8 tensor of at least ``piece_bytes`` to join byte planes
                on the GPU, or None to join them on the CPU threads.

        Raises:
            ValueError: ``staging`` is smaller than ``piece_bytes``.
            CodecError: a piece is damaged (the store keeps it intact).
            OSError: a spill file cannot be read.
        """
        if staging is not None and staging.numel() < self.piece_bytes:
            raise ValueError(f"staging holds {staging.numel()} bytes; a piece is {self.piece_bytes}")
        work = [(dst, p) for dst, pieces in items for p in pieces]
        if self.device is None:
            for dst, p in work:
                self.codec.decode(store.get(p.key), dst[p.offset : p.offset + p.length].numpy())
                failpoints.hit("kernel.resume.copy")
            return
        torch = self.torch
        buffers, events, stream = self._ring()
        kernels = self.gpu_join() if staging is not None else None
        ahead = len(buffers) - 1  # pieces queued on the codec's threads beyond the one awaited
        queued: collections.deque = collections.deque()

        def start(i: int) -> None:
            dst, p = work[i]
            b = i % len(buffers)
            events[b].synchronize()  # this buffer's previous copy to the device is done
            packed = store.get(p.key)
            planar = kernels is not None and len(packed.chunks) <= TABLE_ROWS
            buf = buffers[b][: p.length]
            queued.append(
                (dst, p, b, buf, packed, planar, self.codec.decode_start(packed, buf.numpy(), planar=planar))
            )

        try:
            for i in range(min(ahead, len(work))):
                start(i)
            for i in range(len(work)):
                if i + ahead < len(work):
                    start(i + ahead)
                dst, p, b, buf, packed, planar, futures = queued.popleft()
                self.codec.decode_finish(packed, futures)
                if planar:
                    table = plane_table(packed)
                    self._tables[b].numpy()[: len(table)] = table
                with torch.cuda.stream(stream):
                    if planar:
                        staging[: p.length].copy_(buf, non_blocking=True)
                        at = dst.data_ptr() + p.offset
                        table_at = self._table_addresses[b]
                        kernels.interleave_async(
                            staging.data_ptr(), at, table_at, len(table), stream.cuda_stream
                        )
                    else:
                        dst[p.offset : p.offset + p.length].copy_(buf, non_blocking=True)
                    events[b].record(stream)
                failpoints.hit("kernel.resume.copy")
        finally:  # no thread may still write a buffer once this returns
            futures_wait([f for *_, futures in queued for f in futures])
        stream.synchronize()
