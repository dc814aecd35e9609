"""The GPU codec path: device ranges compressed on the GPU before they cross the bus.

Layout of what it writes (the "device" layout; the host layout is ``codec.zstd``):

- A range is cut into **pieces** of ``piece_bytes`` (the last may be shorter). A piece
  whose length is a multiple of 4 is first transposed into 4 **byte planes** (plane *k*
  holds byte *k* of every 4-byte word), as a whole: exponents and signs of floats land
  together, apart from the noisy low mantissa bytes. Four planes suit bf16/fp16 (two
  values per word) as well as fp32; measured with nvCOMP ANS on the H100 box
  (``benchmarks/results/probe-h100.jsonl``): bf16 N(0, 0.02) weights 1.28 unsplit ->
  1.50, fp32 Adam second moment 1.09 -> 1.20, bf16 ReLU activations 2.06 -> 2.35.
- The planar bytes are cut into **chunks** of ``chunk_bytes``. Each chunk is stored as
  nvCOMP ANS (kind :data:`ANS`) or, when ANS makes it more than 1/64 larger, as the
  planar bytes themselves (:data:`RAW`; random mantissa bytes come out of ANS only
  0.5% larger, so they stay ANS: one decoder call per piece). Stored chunks of a piece lie back to
  back in pinned host memory, each at an offset rounded up to 16 bytes (nvCOMP's
  alignment): a piece is gathered on the GPU and crosses the bus in one copy each way.
- Every stored chunk carries its CRC-32 (zlib's polynomial, so ``zlib.crc32`` checks
  it too), computed by nvCOMP on the GPU before the copy out. Resume recomputes it on
  the GPU after the copy in and refuses a piece whose checksum, nvCOMP status or
  decoded size disagrees; the host copy is untouched.

Everything runs in one scratch area of device memory the caller owns (``scratch`` of
:meth:`DeviceCodec.scratch_bytes` bytes, 54 MiB with the defaults): two slots, so that
compression of one piece overlaps the copy of the other over two CUDA streams.
Nothing is allocated through PyTorch on the way: the pause path must run on a card with
almost no free memory and must never be handed a block of memory it is releasing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from . import nvcomp
from .cuda_driver import Driver

MiB = 1 << 20
ANS, RAW = 3, 0
#: A chunk stays ANS while ANS makes it at most 1/SLACK larger: random mantissa bytes
#: come out 0.5% larger, and keeping them ANS keeps one decoder call and no host work
#: per piece.
SLACK = 64
_ALIGN = nvcomp.ALIGNMENT


def _round(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


class DeviceCodecError(RuntimeError):
    """A stored piece failed its checksum, nvCOMP status or decoded size; nothing the
    host holds was changed. The message names the range, piece and chunk."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece of a range, stored in the device layout.

    Attributes:
        offset: where the piece starts in its range, bytes.
        length: its original length, bytes.
        planes: 4 (transposed into byte planes) or 1.
        kinds: per chunk, :data:`ANS` or :data:`RAW`.
        sizes: per chunk, stored bytes.
        crcs: per chunk, CRC-32 of the stored bytes.
        slab: index of the pinned slab holding the stored chunks.
        start: offset in that slab of the first chunk, bytes.
        offsets: per chunk, its offset from ``start`` (16-byte aligned), bytes.
        span: bytes the piece takes in its slab.
    """

    offset: int
    length: int
    planes: int
    kinds: tuple[int, ...]
    sizes: tuple[int, ...]
    crcs: tuple[int, ...]
    slab: int
    start: int
    offsets: tuple[int, ...]
    span: int

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes)


class PinnedArena:
    """Pinned host memory for stored pieces: slabs handed out front to back.

    Slabs come from PyTorch's pinned-memory cache, so after the first pause they are
    reused without pinning again (pinning 1 GiB took 0.40 s on the H100 box; taking it
    from the cache 40 µs). :meth:`clear` gives every slab back to that cache.

    Args:
        torch: the torch module.
        slab_bytes: bytes per slab (a piece never spans two slabs).
    """

    def __init__(self, torch, slab_bytes: int = 256 * MiB):
        self.torch = torch
        self.slab_bytes = slab_bytes
        self.slabs: list = []
        self.held_bytes = 0  # pinned bytes held by the slabs (an int: reading it runs no torch call)
        self._used = 0  # bytes handed out of the last slab
        self._last_size = 0  # bytes of the last slab

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """``(slab index, offset)`` of ``nbytes`` fresh bytes, 16-byte aligned."""
        if not self.slabs or self._used + nbytes > self._last_size:
            size = max(self.slab_bytes, _round(nbytes))
            self.slabs.append(self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True))
            self.held_bytes += size
            self._last_size = size
            self._used = 0
        start = self._used
        self._used = _round(start + nbytes)
        return len(self.slabs) - 1, start

    def view(self, slab: int, start: int, nbytes: int):
        """The pinned bytes ``[start, start + nbytes)`` of slab ``slab`` (a tensor)."""
        return self.slabs[slab][start : start + nbytes]

    def clear(self) -> None:
        """Give every slab back to PyTorch's pinned-memory cache."""
        self.slabs.clear()
        self.held_bytes = self._last_size = self._used = 0


# Rows of a slot's meta area: ``ROWS`` rows of ``max_chunks`` 8-byte words, on the device
# and mirrored in pinned host memory. Pause uploads IN_PTRS (planar chunks), IN_SIZES
# and OUT_PTRS (compressed outputs), and downloads OUT_SIZES, STATUS_CRC (int32
# statuses, then uint32 CRCs of the compressed chunks) and RAW_CRC. Resume uploads IN_PTRS,
# IN_SIZES, CAPACITY and OUT_PTRS of the ANS chunks, and CRC_PTRS, CRC_SIZES of every
# chunk; it downloads OUT_SIZES and STATUS_CRC.
IN_PTRS, IN_SIZES, CAPACITY, OUT_PTRS, OUT_SIZES, STATUS_CRC, CRC_PTRS, CRC_SIZES = range(8)
RAW_CRC = CRC_PTRS  # pause: uint32 CRCs of the planar chunks, for those stored raw
ROWS = 8


@dataclasses.dataclass
class _Slot:
    planar: object  # device, piece_bytes: the piece as byte planes
    comp: object  # device, max_chunks * max_compressed_bytes: compressed chunks at fixed strides
    packed: object  # device: a piece's stored chunks back to back, as they cross the bus
    meta: object  # device int64 (ROWS, max_chunks)
    host_meta: object  # pinned int64 (ROWS, max_chunks)
    ready: object  # driver event: pause: compressed; resume: uploaded
    done: object  # driver event: the slot may be reused
    shape: tuple = ()  # the chunk lengths whose pause pointers are uploaded


class DeviceCodec:
    """Stores device ranges as :class:`Piece` lists in a :class:`PinnedArena`, and back.

    Args:
        torch: the torch module.
        device: CUDA ordinal.
        chunk_bytes: planar bytes per chunk (default 128 KiB). nvCOMP decodes a chunk with
            one thread block, so a call needs many chunks to fill the GPU: on the H100 an
            8 MiB piece in 1 MiB chunks took 330 µs to decode, in 32 KiB chunks 16 µs;
            smaller chunks lose ratio (bf16 weights: 1.50 at 1 MiB, 1.485 at 256 KiB,
            1.38 at 32 KiB).
        piece_bytes: bytes per piece (a multiple of ``chunk_bytes``; default 8 MiB).

    Raises:
        nvcomp.NvcompUnavailable: nvCOMP cannot be loaded.
        DriverUnavailable: cuda-bindings cannot be imported.
        ValueError: ``piece_bytes`` is not a multiple of ``chunk_bytes``.
    """

    def __init__(self, torch, device: int, *, chunk_bytes: int = 128 << 10, piece_bytes: int = 8 * MiB):
        if piece_bytes % chunk_bytes or piece_bytes <= 0:
            raise ValueError(f"piece_bytes ({piece_bytes}) must be a multiple of chunk_bytes ({chunk_bytes})")
        self.torch, self.device = torch, device
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.max_chunks = piece_bytes // chunk_bytes
        self.ans = nvcomp.ANS(chunk_bytes, self.max_chunks)
        self.crc = nvcomp.CRC32(self.max_chunks, max(chunk_bytes, self.ans.max_compressed_bytes))
        self.cu = Driver()
        self._slots: list[_Slot] = []
        self._streams = None

    @property
    def name(self) -> str:
        return f"nvCOMP {self.ans.lib.version} ANS (GPU)"

    def _parts(self) -> tuple[int, int, int, int]:
        n = self.max_chunks
        return (
            _round(self.piece_bytes, 256),
            _round(n * self.ans.max_compressed_bytes, 256),
            _round(self.piece_bytes + self.piece_bytes // SLACK + _ALIGN * n, 256),
            _round(ROWS * 8 * n, 256),
        )

    def scratch_bytes(self) -> int:
        """Device scratch :meth:`bind` needs, bytes (two slots)."""
        return 2 * sum(self._parts())

    def bind(self, scratch) -> None:
        """Carve the two slots out of ``scratch``, a device uint8 tensor of at least
        :meth:`scratch_bytes` that stays valid while the codec runs."""
        torch = self.torch
        if self._streams is None:
            dev = torch.device("cuda", self.device)
            self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
            self._cu_streams = tuple(self.cu.stream(s.cuda_stream) for s in self._streams)
            self._events = [(self.cu.event(), self.cu.event()) for _ in range(2)]
        planar, comp, packed, meta = self._parts()
        n = self.max_chunks
        self._slots, pos = [], 0
        for i in range(2):
            views = []
            for size in (planar, comp, packed, meta):
                views.append(scratch[pos : pos + size])
                pos += size
            self._slots.append(
                _Slot(
                    views[0],
                    views[1],
                    views[2],
                    views[3][: ROWS * 8 * n].view(torch.int64).view(ROWS, n),
                    torch.empty((ROWS, n), dtype=torch.int64, pin_memory=True),
                    *self._events[i],
                )
            )
        # (waiting on an event never recorded returns at once: a fresh slot is free)
        if not self.crc.tuned:
            slot = self._slots[0]
            host = slot.host_meta.numpy()
            k = np.arange(n, dtype=np.int64)
            host[CRC_PTRS] = slot.planar.data_ptr() + k * self.chunk_bytes
            host[CRC_SIZES] = self.chunk_bytes
            stream = self._cu_streams[0]
            self.cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), ROWS * 8 * n, stream)
            self.crc.tune(
                n,
                self._row(slot, CRC_PTRS),
                self._row(slot, CRC_SIZES),
                self._row(slot, STATUS_CRC),
                int(stream),
            )
            self._streams[0].synchronize()

    def _split(self, planar, src, length: int) -> int:
        if length % 4:
            planar[:length].copy_(src)
            return 1
        planar[:length].view(4, length // 4).copy_(src.view(length // 4, 4).t())
        return 4

    def _join(self, dst, planar, length: int, planes: int) -> None:
        if planes == 1:
            dst.copy_(planar[:length])
        else:
            dst.view(length // 4, 4).copy_(planar[:length].view(4, length // 4).t())

    def _lengths(self, length: int) -> np.ndarray:
        c = self.chunk_bytes
        lengths = np.full(-(-length // c), c, dtype=np.int64)
        lengths[-1] = length - c * (len(lengths) - 1)
        return lengths

    def _row(self, slot: _Slot, row: int) -> int:
        return slot.meta.data_ptr() + row * 8 * self.max_chunks

    def _host_row(self, slot: _Slot, row: int) -> int:
        return slot.host_meta.data_ptr() + row * 8 * self.max_chunks

    def _halves(self, slot: _Slot, row: int) -> np.ndarray:
        """A host meta row as int32 words: the first ``max_chunks`` and the second."""
        return slot.host_meta.numpy()[row].view(np.int32)

    def _on(self, stream):
        """Make ``stream`` PyTorch's current stream (for the split, gather and join kernels)."""
        return self.torch.cuda.stream(stream)

    # -- pause direction ----------------------------------------------------------------

    def pack(
        self,
        ranges: Sequence[tuple[object, int]],
        arena: PinnedArena,
        on_range: Callable[[int, list[Piece]], None] | None = None,
    ) -> list[list[Piece]]:
        """Store every range; returns one list of :class:`Piece` per range.

        Args:
            ranges: ``(device uint8 tensor, its length in bytes)`` pairs. Nothing else
                may write them meanwhile (the engine pauses an idle kernel).
            arena: where the stored chunks go.
            on_range: called with ``(range index, pieces)`` once a range is wholly and
                durably on the host, so the caller may release its device memory.

        Raises:
            DeviceCodecError: nvCOMP reported a chunk it could not compress.
            Whatever is raised carries ``partial``: the pieces stored so far, one list
            per range (they live in ``arena``).
        """
        out: list[list[Piece]] = [[] for _ in ranges]
        try:
            with self._on(self._streams[0]):
                return self._pack(ranges, arena, on_range, out)
        except BaseException as e:
            e.partial = out
            raise

    def _pack(self, ranges, arena, on_range, out) -> list[list[Piece]]:
        cu = self.cu
        compute = self._cu_streams[0]
        todo = [
            (r, off, min(self.piece_bytes, length - off))
            for r, (_, length) in enumerate(ranges)
            for off in range(0, length, self.piece_bytes)
        ]
        left = [0] * len(ranges)
        for r, _, _ in todo:
            left[r] += 1
        finished: list[int] = []
        pending = None
        half = 4 * self.max_chunks
        rows = (RAW_CRC + 1 - OUT_SIZES) * 8 * self.max_chunks
        for i, (r, off, length) in enumerate(todo):
            slot = self._slots[i % 2]
            cu.synchronize(slot.done)
            lengths = self._lengths(length)
            n = len(lengths)
            shape = tuple(lengths)
            if slot.shape != shape:
                host = slot.host_meta.numpy()
                k = np.arange(n, dtype=np.int64)
                host[IN_PTRS, :n] = slot.planar.data_ptr() + k * self.chunk_bytes
                host[IN_SIZES, :n] = lengths
                host[OUT_PTRS, :n] = slot.comp.data_ptr() + k * self.ans.max_compressed_bytes
                cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), ROWS * 8 * self.max_chunks, compute)
                slot.shape = shape
            planes = self._split(slot.planar, ranges[r][0][off : off + length], length)
            row = self._row
            self.ans.compress(
                n, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, OUT_PTRS), row(slot, OUT_SIZES),
                row(slot, STATUS_CRC), 0, int(compute),
            )  # fmt: skip
            self.crc.compute(
                n, row(slot, OUT_PTRS), row(slot, OUT_SIZES), row(slot, STATUS_CRC) + half, int(compute)
            )
            self.crc.compute(n, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, RAW_CRC), int(compute))
            cu.copy(self._host_row(slot, OUT_SIZES), row(slot, OUT_SIZES), rows, compute)
            cu.record(slot.ready, compute)
            if pending is not None:
                self._store(pending, arena, out)
                left[pending[1]] -= 1
                if left[pending[1]] == 0:
                    finished.append(pending[1])
                if finished and on_range is not None:
                    cu.synchronize(pending[0].done)
                    for done in finished:
                        on_range(done, out[done])
                    finished.clear()
            pending = (slot, r, off, length, lengths, planes)
        if pending is not None:
            self._store(pending, arena, out)
            finished.append(pending[1])
        self._streams[1].synchronize()  # every piece is on the host
        if on_range is not None:
            for done in finished:
                on_range(done, out[done])
        return out

    def _store(self, pending, arena: PinnedArena, out) -> None:
        torch, cu = self.torch, self.cu
        compute, copier = self._cu_streams
        slot, r, off, length, lengths, planes = pending
        cu.synchronize(slot.ready)
        n = len(lengths)
        host = slot.host_meta.numpy()
        sizes = host[OUT_SIZES, :n]
        words = self._halves(slot, STATUS_CRC)
        statuses = words[:n]
        if statuses.any():
            k = int(np.flatnonzero(statuses)[0])
            raise DeviceCodecError(
                f"nvCOMP could not compress chunk {k} of the piece at byte {off} of range {r} "
                f"(status {int(statuses[k])})"
            )
        ans = sizes <= lengths + lengths // SLACK
        stored = np.where(ans, sizes, lengths)
        raw_crcs = self._halves(slot, RAW_CRC)[:n]
        crcs = np.where(ans, words[self.max_chunks : self.max_chunks + n], raw_crcs).view(np.uint32)
        padded = (stored + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets = np.concatenate(([0], np.cumsum(padded[:-1])))
        span = int(padded.sum())
        slab, start = arena.reserve(span)
        mc, c = self.ans.max_compressed_bytes, self.chunk_bytes
        parts = [
            slot.comp[k * mc : k * mc + int(padded[k])]
            if ans[k]
            else slot.planar[k * c : k * c + int(padded[k])]
            for k in range(n)
        ]
        torch.cat(parts, out=slot.packed[:span])  # gathered on the compute stream, after what follows it
        cu.record(slot.ready, compute)
        cu.wait(copier, slot.ready)
        cu.copy(arena.view(slab, start, span).data_ptr(), slot.packed.data_ptr(), span, copier)
        cu.record(slot.done, copier)
        kinds = tuple(ANS if a else RAW for a in ans.tolist())
        out[r].append(
            Piece(off, length, planes, kinds, tuple(stored.tolist()), tuple(crcs.tolist()),
                  slab, start, tuple(offsets.tolist()), span)
        )  # fmt: skip

    # -- resume direction ----------------------------------------------------------------

    def unpack(self, items: Sequence[tuple[object, Sequence[Piece]]], arena: PinnedArena) -> None:
        """Write every stored range back: ``(device uint8 tensor, its pieces)`` pairs.

        Raises:
            DeviceCodecError: a stored chunk failed its checksum, its nvCOMP status or its
                decoded size; the message names it. The arena is not modified; the device
                ranges hold garbage and must not be used.
        """
        torch, cu = self.torch, self.cu
        compute, copier = self._cu_streams
        work = [(r, dst, piece) for r, (dst, pieces) in enumerate(items) for piece in pieces]
        results = torch.empty((max(1, len(work)), 2, self.max_chunks), dtype=torch.int64, pin_memory=True)
        c = self.chunk_bytes
        half = 4 * self.max_chunks
        meta_bytes = ROWS * 8 * self.max_chunks
        result_bytes = 2 * 8 * self.max_chunks
        with self._on(self._streams[0]):
            for i, (_, dst, piece) in enumerate(work):
                slot = self._slots[i % 2]
                cu.synchronize(slot.done)
                n = len(piece.sizes)
                lengths = self._lengths(piece.length)
                offsets = np.asarray(piece.offsets, dtype=np.int64)
                sizes = np.asarray(piece.sizes, dtype=np.int64)
                ans = np.asarray(piece.kinds) == ANS
                m = int(ans.sum())
                packed, planar = slot.packed.data_ptr(), slot.planar.data_ptr()
                host = slot.host_meta.numpy()
                host[IN_PTRS, :m] = packed + offsets[ans]
                host[IN_SIZES, :m] = sizes[ans]
                host[CAPACITY, :m] = lengths[ans]
                host[OUT_PTRS, :m] = planar + np.flatnonzero(ans) * c
                host[CRC_PTRS, :n] = packed + offsets
                host[CRC_SIZES, :n] = sizes
                cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), meta_bytes, copier)
                cu.copy(
                    packed, arena.view(piece.slab, piece.start, piece.span).data_ptr(), piece.span, copier
                )
                cu.record(slot.ready, copier)
                cu.wait(compute, slot.ready)
                row = self._row
                self.crc.compute(
                    n, row(slot, CRC_PTRS), row(slot, CRC_SIZES), row(slot, STATUS_CRC) + half, int(compute)
                )
                if m:
                    self.ans.decompress(
                        m, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, CAPACITY), row(slot, OUT_SIZES),
                        row(slot, OUT_PTRS), row(slot, STATUS_CRC), 0, int(compute),
                    )  # fmt: skip
                for k in np.flatnonzero(~ans).tolist():
                    at, size = int(offsets[k]), int(lengths[k])
                    slot.planar[k * c : k * c + size].copy_(slot.packed[at : at + size])
                cu.copy(results[i].data_ptr(), row(slot, OUT_SIZES), result_bytes, compute)
                self._join(
                    dst[piece.offset : piece.offset + piece.length], slot.planar, piece.length, piece.planes
                )
                cu.record(slot.done, compute)
            self._streams[0].synchronize()
        for i, (r, _, piece) in enumerate(work):
            self._verify(r, piece, results[i].numpy())

    def _verify(self, r: int, piece: Piece, row: np.ndarray) -> None:
        n = len(piece.sizes)
        lengths = self._lengths(piece.length)
        ans = np.flatnonzero(np.asarray(piece.kinds) == ANS)
        words = row[1].view(np.int32)
        statuses = words[: len(ans)]
        crcs = words[self.max_chunks : self.max_chunks + n].view(np.uint32)
        where = f"the piece at byte {piece.offset} of range {r}"
        bad = np.flatnonzero(crcs != np.asarray(piece.crcs, dtype=np.uint32))
        if bad.size:
            raise DeviceCodecError(f"chunk {bad[0]} of {where} fails its CRC-32: the stored copy is damaged")
        bad = np.flatnonzero(statuses)
        if bad.size:
            k = ans[bad[0]]
            raise DeviceCodecError(
                f"nvCOMP could not decode chunk {k} of {where} (status {statuses[bad[0]]})"
            )
        bad = np.flatnonzero(row[0, : len(ans)] != lengths[ans])
        if bad.size:
            k, got = ans[bad[0]], int(row[0, bad[0]])
            raise DeviceCodecError(f"chunk {k} of {where} decoded to {got} bytes, not {lengths[k]}")
