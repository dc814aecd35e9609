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
  alignment): on pause they leave the compressor's output slots in one batched copy
  (:meth:`.cuda_driver.Driver.copies`), on resume the piece crosses the bus in one copy.
- Every stored chunk carries its CRC-32 (zlib's polynomial, so ``zlib.crc32`` checks
  it too), computed by nvCOMP on the GPU before the copy out (for a chunk stored raw,
  only once the piece's sizes say it is one). Resume recomputes it on the GPU after
  the copy in and refuses a piece whose checksum, nvCOMP status or decoded size
  disagrees; the host copy is untouched.

Everything runs in one scratch area of device memory the caller owns (``scratch`` of
:meth:`DeviceCodec.scratch_bytes` bytes, 58 MiB with the defaults): ``slots`` slots
(three), so that the coding of two pieces overlaps the copy of a third over two CUDA
streams. Where the time goes, per 8 MiB piece of bf16 weights on the H100 (GPU µs /
Python µs to enqueue, ``benchmarks/results/codec-stages-h100.jsonl``): split 25/26,
ANS compress 50/16, CRC of the compressed chunks 45/24, copy out 105/7; copy in
107/7, ANS decompress 35/14, join 23/25.
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


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """One piece of a range, stored in the device layout.

    Attributes:
        offset: where the piece starts in its range, bytes.
        length: its original length, bytes.
        planes: 4 (transposed into byte planes) or 1.
        kinds: per chunk, :data:`ANS` or :data:`RAW` (uint8 array).
        sizes: per chunk, stored bytes (int64 array).
        crcs: per chunk, CRC-32 of the stored bytes (uint32 array).
        slab: index of the pinned slab holding the stored chunks.
        start: offset in that slab of the first chunk, bytes.
        offsets: per chunk, its offset from ``start``, 16-byte aligned (int64 array).
        span: bytes the piece takes in its slab.
        stored_bytes: the sum of ``sizes``.

    (numpy arrays, not tuples: building and reading them per 8 MiB piece is part of
    the codec's Python cost per piece.)
    """

    offset: int
    length: int
    planes: int
    kinds: np.ndarray
    sizes: np.ndarray
    crcs: np.ndarray
    slab: int
    start: int
    offsets: np.ndarray
    span: int
    stored_bytes: int


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
        self._bases: list[int] = []  # each slab's address

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """``(slab index, offset)`` of ``nbytes`` fresh bytes, 16-byte aligned."""
        if not self.slabs or self._used + nbytes > self._last_size:
            size = max(self.slab_bytes, _round(nbytes))
            self.slabs.append(self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True))
            self._bases.append(self.slabs[-1].data_ptr())
            self.held_bytes += size
            self._last_size = size
            self._used = 0
        start = self._used
        self._used = _round(start + nbytes)
        return len(self.slabs) - 1, start

    def address(self, slab: int, start: int) -> int:
        """The address of byte ``start`` of slab ``slab``."""
        return self._bases[slab] + start

    def clear(self) -> None:
        """Give every slab back to PyTorch's pinned-memory cache."""
        self.slabs.clear()
        self._bases.clear()
        self.held_bytes = self._last_size = self._used = 0


# Rows of a slot's meta area: ``ROWS`` rows of ``max_chunks`` 8-byte words, on the device
# and mirrored in pinned host memory. Pause uploads IN_PTRS (planar chunks), IN_SIZES
# and OUT_PTRS (compressed outputs), and downloads OUT_SIZES and STATUS_CRC (int32
# statuses, then uint32 CRCs of the compressed chunks); for a piece with chunks stored
# raw it then uploads their CRC_PTRS, CRC_SIZES and downloads their CRCs (written to
# CAPACITY, which pause does not use). Resume uploads
# IN_PTRS, IN_SIZES, CAPACITY and OUT_PTRS of the ANS chunks, and CRC_PTRS, CRC_SIZES of
# every chunk; it downloads OUT_SIZES and STATUS_CRC.
IN_PTRS, IN_SIZES, CAPACITY, OUT_PTRS, OUT_SIZES, STATUS_CRC, CRC_PTRS, CRC_SIZES = range(8)
ROWS = 8


@dataclasses.dataclass
class _Slot:
    planar: object  # device, piece_bytes: the piece as byte planes
    comp: object  # device, max_chunks * max_compressed_bytes: pause: compressed chunks at
    #               fixed strides; resume: the stored piece as it crossed the bus
    meta: object  # device int64 (ROWS, max_chunks)
    host_meta: object  # pinned int64 (ROWS, max_chunks)
    ready: object  # driver event: pause: compressed; resume: uploaded
    done: object  # driver event: the slot may be reused
    planes: object  # planar as (4, piece_bytes / 4): a whole piece's byte planes
    words: object  # planar as (piece_bytes / 4, 4), transposed view of ``planes``
    shape: tuple = ()  # the chunk lengths whose pause pointers are uploaded
    host: np.ndarray | None = None  # host_meta as a numpy array (made once: .numpy() costs µs)


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
        slots: pieces in flight at once (at least 2; default 3): with two, the host waits
            for the copy of one piece before it may enqueue the coding of the next.

    Raises:
        nvcomp.NvcompUnavailable: nvCOMP cannot be loaded.
        DriverUnavailable: cuda-bindings cannot be imported.
        ValueError: ``piece_bytes`` is not a multiple of ``chunk_bytes``, or ``slots`` < 2.
    """

    def __init__(
        self, torch, device: int, *, chunk_bytes: int = 128 << 10, piece_bytes: int = 8 * MiB, slots: int = 3
    ):
        if piece_bytes % chunk_bytes or piece_bytes <= 0:
            raise ValueError(f"piece_bytes ({piece_bytes}) must be a multiple of chunk_bytes ({chunk_bytes})")
        if slots < 2:
            raise ValueError(f"slots must be at least 2, got {slots}")
        self.slot_count = slots
        # the chunk lengths of a whole piece (shared: never written)
        self._full = np.full(piece_bytes // chunk_bytes, chunk_bytes, dtype=np.int64)
        self.torch, self.device = torch, device
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.max_chunks = piece_bytes // chunk_bytes
        self.ans = nvcomp.ANS(chunk_bytes, self.max_chunks)
        self.crc = nvcomp.CRC32(self.max_chunks, max(chunk_bytes, self.ans.max_compressed_bytes))
        # on resume a stored piece lands in ``comp``: ANS chunks at most 1/SLACK larger
        assert (
            self.max_chunks * self.ans.max_compressed_bytes
            >= piece_bytes + piece_bytes // SLACK + _ALIGN * self.max_chunks
        )
        self.cu = Driver()
        self._slots: list[_Slot] = []
        self._streams = None

    @property
    def name(self) -> str:
        return f"nvCOMP {self.ans.lib.version} ANS (GPU)"

    def _parts(self) -> tuple[int, int, int]:
        n = self.max_chunks
        return (
            _round(self.piece_bytes, 256),
            _round(n * self.ans.max_compressed_bytes, 256),
            _round(ROWS * 8 * n, 256),
        )

    def scratch_bytes(self) -> int:
        """Device scratch :meth:`bind` needs, bytes (``slots`` slots)."""
        return self.slot_count * sum(self._parts())

    def bind(self, scratch) -> None:
        """Carve the slots out of ``scratch``, a device uint8 tensor of at least
        :meth:`scratch_bytes` that stays valid while the codec runs."""
        torch = self.torch
        if self._streams is None:
            dev = torch.device("cuda", self.device)
            self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev))
            self._cu_streams = tuple(self.cu.stream(s.cuda_stream) for s in self._streams)
            self._events = [(self.cu.event(), self.cu.event()) for _ in range(self.slot_count)]
        planar, comp, meta = self._parts()
        n, words = self.max_chunks, self.piece_bytes // 4
        self._slots, pos = [], 0
        for i in range(self.slot_count):
            views = []
            for size in (planar, comp, meta):
                views.append(scratch[pos : pos + size])
                pos += size
            planes = views[0][: self.piece_bytes].view(4, words)
            self._slots.append(
                _Slot(
                    views[0],
                    views[1],
                    views[2][: ROWS * 8 * n].view(torch.int64).view(ROWS, n),
                    torch.empty((ROWS, n), dtype=torch.int64, pin_memory=True),
                    *self._events[i],
                    planes,
                    planes.t(),
                )
            )
            self._slots[-1].host = self._slots[-1].host_meta.numpy()
        # (waiting on an event never recorded returns at once: a fresh slot is free)
        if not self.crc.tuned:
            slot = self._slots[0]
            host = slot.host
            k = np.arange(n, dtype=np.int64)
            host[CRC_PTRS] = slot.planar.data_ptr() + k * self.chunk_bytes
            # searched on chunks the size compressed ones mostly are (bf16 weights: 1/1.47)
            host[CRC_SIZES] = _round(self.chunk_bytes * 2 // 3)
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

    def _split(self, slot: _Slot, src, length: int) -> int:
        if length % 4:
            slot.planar[:length].copy_(src)
            return 1
        if length == self.piece_bytes:
            slot.planes.copy_(src.view(length // 4, 4).t())
        else:
            slot.planar[:length].view(4, length // 4).copy_(src.view(length // 4, 4).t())
        return 4

    def _join(self, dst, slot: _Slot, length: int, planes: int) -> None:
        if planes == 1:
            dst.copy_(slot.planar[:length])
        elif length == self.piece_bytes:
            dst.view(length // 4, 4).copy_(slot.words)
        else:
            dst.view(length // 4, 4).copy_(slot.planar[:length].view(4, length // 4).t())

    def _lengths(self, length: int) -> np.ndarray:
        if length == self.piece_bytes:
            return self._full
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
        return slot.host[row].view(np.int32)

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
        pending: list[tuple] = []
        half = 4 * self.max_chunks
        rows = (STATUS_CRC + 1 - OUT_SIZES) * 8 * self.max_chunks
        row = self._row

        def store_oldest() -> None:
            piece = pending.pop(0)
            self._store(piece, arena, out)
            left[piece[1]] -= 1
            if left[piece[1]] == 0:
                finished.append(piece[1])
            if finished and on_range is not None:
                cu.synchronize(piece[0].done)  # the range's last bytes are on the host
                for done in finished:
                    on_range(done, out[done])
                finished.clear()

        for i, (r, off, length) in enumerate(todo):
            slot = self._slots[i % self.slot_count]
            cu.synchronize(slot.done)
            lengths = self._lengths(length)
            n = len(lengths)
            shape = tuple(lengths)
            if slot.shape != shape:
                host = slot.host
                k = np.arange(n, dtype=np.int64)
                host[IN_PTRS, :n] = slot.planar.data_ptr() + k * self.chunk_bytes
                host[IN_SIZES, :n] = lengths
                host[OUT_PTRS, :n] = slot.comp.data_ptr() + k * self.ans.max_compressed_bytes
                cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), ROWS * 8 * self.max_chunks, compute)
                slot.shape = shape
            planes = self._split(slot, ranges[r][0][off : off + length], length)
            self.ans.compress(
                n, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, OUT_PTRS), row(slot, OUT_SIZES),
                row(slot, STATUS_CRC), 0, int(compute),
            )  # fmt: skip
            self.crc.compute(
                n, row(slot, OUT_PTRS), row(slot, OUT_SIZES), row(slot, STATUS_CRC) + half, int(compute)
            )
            cu.copy(self._host_row(slot, OUT_SIZES), row(slot, OUT_SIZES), rows, compute)
            cu.record(slot.ready, compute)
            pending.append((slot, r, off, length, lengths, planes))
            if len(pending) == self.slot_count - 1:
                store_oldest()
        while pending:
            store_oldest()
        self._streams[1].synchronize()  # every piece is on the host
        if on_range is not None:
            for done in finished:
                on_range(done, out[done])
        return out

    def _raw_crcs(self, slot: _Slot, raw: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """CRC-32 of the planar chunks ``raw`` of ``slot`` (those stored raw), waited for."""
        compute = self._cu_streams[0]
        m = len(raw)
        host = slot.host
        host[CRC_PTRS, :m] = slot.planar.data_ptr() + raw * self.chunk_bytes
        host[CRC_SIZES, :m] = lengths[raw]
        at = CRC_PTRS * 8 * self.max_chunks
        self.cu.copy(
            slot.meta.data_ptr() + at, slot.host_meta.data_ptr() + at, 2 * 8 * self.max_chunks, compute
        )
        # into CAPACITY: a row only resume uses
        self.crc.compute(
            m, self._row(slot, CRC_PTRS), self._row(slot, CRC_SIZES), self._row(slot, CAPACITY), int(compute)
        )
        self.cu.copy(self._host_row(slot, CAPACITY), self._row(slot, CAPACITY), 4 * m, compute)
        self._streams[0].synchronize()
        return host[CAPACITY].view(np.uint32)[:m].copy()

    def _store(self, pending, arena: PinnedArena, out) -> None:
        cu = self.cu
        copier = self._cu_streams[1]
        slot, r, off, length, lengths, planes = pending
        cu.synchronize(slot.ready)
        n = len(lengths)
        host = slot.host
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
        crcs = words[self.max_chunks : self.max_chunks + n].view(np.uint32).copy()
        k = np.arange(n, dtype=np.uint64)
        sources = slot.comp.data_ptr() + k * np.uint64(self.ans.max_compressed_bytes)
        if not ans.all():
            raw = np.flatnonzero(~ans)
            crcs[raw] = self._raw_crcs(slot, raw, lengths)
            sources[raw] = slot.planar.data_ptr() + raw.astype(np.uint64) * np.uint64(self.chunk_bytes)
        padded = (stored + _ALIGN - 1) // _ALIGN * _ALIGN
        offsets = np.concatenate(([0], np.cumsum(padded[:-1])))
        span = int(padded.sum())
        slab, start = arena.reserve(span)
        base = arena.address(slab, start)
        cu.copies((base + offsets).astype(np.uint64), sources, padded.astype(np.uint64), copier)
        cu.record(slot.done, copier)
        kinds = np.where(ans, ANS, RAW).astype(np.uint8)
        out[r].append(
            Piece(off, length, planes, kinds, stored.astype(np.int64), crcs, slab, start, offsets, span,
                  int(stored.sum()))
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
        results_at = results.data_ptr()
        row = self._row
        with self._on(self._streams[0]):
            for i, (_, dst, piece) in enumerate(work):
                slot = self._slots[i % self.slot_count]
                cu.synchronize(slot.done)
                n = len(piece.sizes)
                lengths = self._lengths(piece.length)
                offsets, sizes = piece.offsets, piece.sizes
                ans = piece.kinds == ANS
                m = int(np.count_nonzero(ans))
                stored, planar = slot.comp.data_ptr(), slot.planar.data_ptr()
                host = slot.host
                if m == n:
                    host[IN_PTRS, :n] = stored + offsets
                    host[IN_SIZES, :n] = sizes
                    host[CAPACITY, :n] = lengths
                    host[OUT_PTRS, :n] = planar + np.arange(n, dtype=np.int64) * c
                else:
                    host[IN_PTRS, :m] = stored + offsets[ans]
                    host[IN_SIZES, :m] = sizes[ans]
                    host[CAPACITY, :m] = lengths[ans]
                    host[OUT_PTRS, :m] = planar + np.flatnonzero(ans) * c
                host[CRC_PTRS, :n] = stored + offsets
                host[CRC_SIZES, :n] = sizes
                cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), meta_bytes, copier)
                cu.copy(stored, arena.address(piece.slab, piece.start), piece.span, copier)
                cu.record(slot.ready, copier)
                cu.wait(compute, slot.ready)
                self.crc.compute(
                    n, row(slot, CRC_PTRS), row(slot, CRC_SIZES), row(slot, STATUS_CRC) + half, int(compute)
                )
                if m:
                    self.ans.decompress(
                        m, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, CAPACITY), row(slot, OUT_SIZES),
                        row(slot, OUT_PTRS), row(slot, STATUS_CRC), 0, int(compute),
                    )  # fmt: skip
                if m < n:
                    raw = np.flatnonzero(~ans)
                    cu.copies(
                        (planar + raw * c).astype(np.uint64),
                        (stored + offsets[raw]).astype(np.uint64),
                        lengths[raw].astype(np.uint64),
                        compute,
                    )
                cu.copy(results_at + i * result_bytes, row(slot, OUT_SIZES), result_bytes, compute)
                self._join(dst[piece.offset : piece.offset + piece.length], slot, piece.length, piece.planes)
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
