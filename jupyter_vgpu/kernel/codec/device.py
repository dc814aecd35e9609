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
  nvCOMP ANS (kind :data:`ANS`) or, when that does not save ``min_saving`` of it, as
  the planar bytes themselves (:data:`RAW`). Stored chunks of a piece lie back to back
  in pinned host memory, each at an offset rounded up to 16 bytes (nvCOMP's
  alignment), so a piece moves to the device in one copy.
- Every stored chunk carries its CRC-32 (zlib's polynomial; nvCOMP computes it on the
  GPU). Resume recomputes it on the GPU after the copy and refuses to use a piece
  whose checksum, nvCOMP status or decoded size disagrees; the host copy is untouched.

Everything runs in one scratch area of device memory the caller owns (``scratch`` of
:meth:`DeviceCodec.scratch_bytes` bytes): two slots, so that compression of one piece
overlaps the copy of the other over two CUDA streams. Nothing is allocated through
PyTorch on the way: the pause path must run on a card with almost no free memory and
must never be handed a block of memory it is releasing.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from . import nvcomp

MiB = 1 << 20
ANS, RAW = 3, 0
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
    """

    offset: int
    length: int
    planes: int
    kinds: tuple[int, ...]
    sizes: tuple[int, ...]
    crcs: tuple[int, ...]
    slab: int
    start: int

    @property
    def stored_bytes(self) -> int:
        return sum(self.sizes)

    @property
    def span(self) -> int:
        """Bytes the piece takes in its slab (chunks at 16-byte offsets)."""
        return sum(_round(s) for s in self.sizes)

    def chunk_offsets(self) -> list[int]:
        """Offset of each stored chunk from :attr:`start`, bytes."""
        out, pos = [], 0
        for s in self.sizes:
            out.append(pos)
            pos += _round(s)
        return out


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
        self._used = 0  # bytes handed out of the last slab

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """``(slab index, offset)`` of ``nbytes`` fresh bytes, 16-byte aligned."""
        if not self.slabs or self._used + nbytes > self.slabs[-1].numel():
            size = max(self.slab_bytes, _round(nbytes))
            self.slabs.append(self.torch.empty(size, dtype=self.torch.uint8, pin_memory=True))
            self._used = 0
        start = self._used
        self._used = _round(start + nbytes)
        return len(self.slabs) - 1, start

    def view(self, slab: int, start: int, nbytes: int):
        """The pinned bytes ``[start, start + nbytes)`` of slab ``slab`` (a tensor)."""
        return self.slabs[slab][start : start + nbytes]

    @property
    def held_bytes(self) -> int:
        """Pinned bytes held by the slabs."""
        return sum(s.numel() for s in self.slabs)

    def clear(self) -> None:
        """Give every slab back to PyTorch's pinned-memory cache."""
        self.slabs.clear()
        self._used = 0


# Rows of a slot's meta area: ``ROWS`` rows of ``max_chunks`` 8-byte words, on the
# device and mirrored in pinned host memory. Pause uses IN_PTRS..OUT_PTRS (uploaded),
# OUT_SIZES and STATUS_CRC (downloaded: int32 statuses, then uint32 CRCs); resume uses
# IN_PTRS..OUT_PTRS and CRC_PTRS, CRC_SIZES (uploaded; the ANS chunks' rows compacted,
# the CRC rows for every chunk), OUT_SIZES and STATUS_CRC (downloaded).
IN_PTRS, IN_SIZES, CAPACITY, OUT_PTRS, OUT_SIZES, STATUS_CRC, CRC_PTRS, CRC_SIZES = range(8)
ROWS = 8


@dataclasses.dataclass
class _Slot:
    planar: object  # device, piece_bytes: the piece as byte planes
    comp: object  # device: compressed chunks at max_compressed_bytes strides (pause) or packed (resume)
    meta: object  # device int64 (ROWS, max_chunks)
    host_meta: object  # pinned int64 (ROWS, max_chunks)
    ready: object  # event: the slot's compute work is done (pause: compressed; resume: uploaded)
    done: object  # event: the slot may be reused


class DeviceCodec:
    """Stores device ranges as :class:`Piece` lists in a :class:`PinnedArena`, and back.

    Args:
        torch: the torch module.
        device: CUDA ordinal.
        chunk_bytes: planar bytes per chunk (default 1 MiB: bf16 weights 1.50 at 454 GB/s
            encode, 810 GB/s decode on the H100; 256 KiB gave 1.48 with four times the
            per-chunk copies).
        piece_bytes: bytes per piece (a multiple of ``chunk_bytes``; default 8 MiB).
        min_saving: a chunk is stored raw unless ANS saves this fraction of it.

    Raises:
        nvcomp.NvcompUnavailable: nvCOMP cannot be loaded.
        ValueError: ``piece_bytes`` is not a multiple of ``chunk_bytes``.
    """

    def __init__(
        self,
        torch,
        device: int,
        *,
        chunk_bytes: int = 1 * MiB,
        piece_bytes: int = 8 * MiB,
        min_saving: float = 0.03,
    ):
        if piece_bytes % chunk_bytes or piece_bytes <= 0:
            raise ValueError(f"piece_bytes ({piece_bytes}) must be a multiple of chunk_bytes ({chunk_bytes})")
        self.torch, self.device = torch, device
        self.chunk_bytes, self.piece_bytes, self.min_saving = chunk_bytes, piece_bytes, min_saving
        self.max_chunks = piece_bytes // chunk_bytes
        self.ans = nvcomp.ANS(chunk_bytes, self.max_chunks)
        self.crc = nvcomp.CRC32(self.max_chunks, max(chunk_bytes, self.ans.max_compressed_bytes))
        self._slots: list[_Slot] = []
        self._streams = None

    @property
    def name(self) -> str:
        return f"nvCOMP {self.ans.lib.version} ANS (GPU)"

    def _parts(self) -> tuple[int, int, int]:
        comp = self.max_chunks * self.ans.max_compressed_bytes
        return _round(self.piece_bytes, 256), _round(comp, 256), _round(ROWS * 8 * self.max_chunks, 256)

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
        planar, comp, meta = self._parts()
        self._slots, pos = [], 0
        for _ in range(2):
            n = self.max_chunks
            self._slots.append(
                _Slot(
                    scratch[pos : pos + planar],
                    scratch[pos + planar : pos + planar + comp],
                    scratch[pos + planar + comp : pos + planar + comp + ROWS * 8 * n]
                    .view(torch.int64)
                    .view(ROWS, n),
                    torch.empty((ROWS, n), dtype=torch.int64, pin_memory=True),
                    torch.cuda.Event(),
                    torch.cuda.Event(),
                )
            )
            pos += planar + comp + meta

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

    def _lengths(self, length: int) -> list[int]:
        c = self.chunk_bytes
        return [min(c, length - start) for start in range(0, length, c)]

    def _row_ptr(self, slot: _Slot, row: int) -> int:
        return slot.meta.data_ptr() + row * 8 * self.max_chunks

    def _statuses_crcs(self, host_meta, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``n`` statuses (int32) and ``m`` CRCs (uint32) in a STATUS_CRC row."""
        words = host_meta.numpy()[STATUS_CRC].view(np.int32)
        half = self.max_chunks
        return words[:n], words[half : half + m].view(np.uint32)

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
            return self._pack(ranges, arena, on_range, out)
        except BaseException as e:
            e.partial = out
            raise

    def _pack(self, ranges, arena, on_range, out) -> list[list[Piece]]:
        torch = self.torch
        compute, copier = self._streams
        todo = [
            (r, off, min(self.piece_bytes, length - off))
            for r, (_, length) in enumerate(ranges)
            for off in range(0, length, self.piece_bytes)
        ]
        left = [0] * len(ranges)
        for r, _, _ in todo:
            left[r] += 1
        raw: list[tuple[int, int, int]] = []  # (range, piece, chunk) stored raw: checksummed on the host
        finished: list[int] = []  # ranges whose last piece is being copied out

        def flush_finished() -> None:
            if finished and on_range is not None:
                copier.synchronize()
                self._checksum_raw(out, raw, arena)
                for r in finished:
                    on_range(r, out[r])
            finished.clear()

        pending = None
        mc = self.ans.max_compressed_bytes
        for i, (r, off, length) in enumerate(todo):
            slot = self._slots[i % 2]
            slot.done.synchronize()
            lengths = self._lengths(length)
            n = len(lengths)
            host = slot.host_meta.numpy()
            host[IN_PTRS, :n] = [slot.planar.data_ptr() + k * self.chunk_bytes for k in range(n)]
            host[IN_SIZES, :n] = lengths
            host[CAPACITY, :n] = [slot.comp.data_ptr() + k * mc for k in range(n)]  # output pointers
            with torch.cuda.stream(compute):
                slot.meta[:3].copy_(slot.host_meta[:3], non_blocking=True)
                planes = self._split(slot.planar, ranges[r][0][off : off + length], length)
                s = compute.cuda_stream
                ptr = self._row_ptr
                self.ans.compress(
                    n,
                    ptr(slot, IN_PTRS),
                    ptr(slot, IN_SIZES),
                    ptr(slot, CAPACITY),
                    ptr(slot, OUT_SIZES),
                    ptr(slot, STATUS_CRC),
                    0,
                    s,
                )
                crc_out = ptr(slot, STATUS_CRC) + 4 * self.max_chunks
                self.crc.compute(n, ptr(slot, CAPACITY), ptr(slot, OUT_SIZES), crc_out, s)
                slot.host_meta[OUT_SIZES:CRC_PTRS].copy_(slot.meta[OUT_SIZES:CRC_PTRS], non_blocking=True)
                slot.ready.record(compute)
            if pending is not None:
                self._store(pending, arena, out, raw)
                left[pending[1]] -= 1
                if left[pending[1]] == 0:
                    finished.append(pending[1])
            flush_finished()
            pending = (slot, r, off, length, lengths, planes)
        if pending is not None:
            self._store(pending, arena, out, raw)
            finished.append(pending[1])
        copier.synchronize()
        self._checksum_raw(out, raw, arena)
        flush_finished()
        return out

    def _store(self, pending, arena: PinnedArena, out, raw) -> None:
        torch = self.torch
        slot, r, off, length, lengths, planes = pending
        slot.ready.synchronize()
        n = len(lengths)
        sizes = slot.host_meta.numpy()[OUT_SIZES, :n]
        statuses, crcs = self._statuses_crcs(slot.host_meta, n, n)
        if statuses.any():
            k = int(np.flatnonzero(statuses)[0])
            raise DeviceCodecError(
                f"nvCOMP could not compress chunk {k} of the piece at byte {off} of range {r} "
                f"(status {int(statuses[k])})"
            )
        kinds, stored = [], []
        for k, size in enumerate(sizes.tolist()):
            ans = size <= lengths[k] * (1 - self.min_saving)
            kinds.append(ANS if ans else RAW)
            stored.append(size if ans else lengths[k])
        span = sum(_round(s) for s in stored)
        slab, start = arena.reserve(span)
        _, copier = self._streams
        mc = self.ans.max_compressed_bytes
        with torch.cuda.stream(copier):
            copier.wait_event(slot.ready)
            pos = start
            for k, kind in enumerate(kinds):
                src = slot.comp[k * mc :] if kind == ANS else slot.planar[k * self.chunk_bytes :]
                arena.view(slab, pos, stored[k]).copy_(src[: stored[k]], non_blocking=True)
                pos += _round(stored[k])
            slot.done.record(copier)
        raw.extend((r, len(out[r]), k) for k, kind in enumerate(kinds) if kind == RAW)
        piece = Piece(off, length, planes, tuple(kinds), tuple(stored), tuple(crcs.tolist()), slab, start)
        out[r].append(piece)

    def _checksum_raw(self, out, raw, arena: PinnedArena) -> None:
        """CRC-32 of chunks stored raw (the GPU checksummed the compressed form only)."""
        for r, p, k in raw:
            piece = out[r][p]
            where = piece.start + piece.chunk_offsets()[k]
            crcs = list(piece.crcs)
            crcs[k] = zlib.crc32(arena.view(piece.slab, where, piece.sizes[k]).numpy())
            out[r][p] = dataclasses.replace(piece, crcs=tuple(crcs))
        raw.clear()

    # -- resume direction ----------------------------------------------------------------

    def unpack(self, items: Sequence[tuple[object, Sequence[Piece]]], arena: PinnedArena) -> None:
        """Write every stored range back: ``(device uint8 tensor, its pieces)`` pairs.

        Raises:
            DeviceCodecError: a stored chunk failed its checksum, its nvCOMP status or its
                decoded size; the message names it. The arena is not modified; the device
                ranges hold garbage and must not be used.
        """
        torch = self.torch
        compute, copier = self._streams
        work = [(r, dst, piece) for r, (dst, pieces) in enumerate(items) for piece in pieces]
        results = torch.empty((max(1, len(work)), 2, self.max_chunks), dtype=torch.int64, pin_memory=True)
        for i, (_, dst, piece) in enumerate(work):
            slot = self._slots[i % 2]
            slot.done.synchronize()
            n = len(piece.sizes)
            lengths = self._lengths(piece.length)
            offsets = piece.chunk_offsets()
            ans = [k for k in range(n) if piece.kinds[k] == ANS]
            comp, planar = slot.comp.data_ptr(), slot.planar.data_ptr()
            host = slot.host_meta.numpy()
            host[IN_PTRS, : len(ans)] = [comp + offsets[k] for k in ans]
            host[IN_SIZES, : len(ans)] = [piece.sizes[k] for k in ans]
            host[CAPACITY, : len(ans)] = [lengths[k] for k in ans]
            host[OUT_PTRS, : len(ans)] = [planar + k * self.chunk_bytes for k in ans]
            host[CRC_PTRS, :n] = [comp + o for o in offsets]
            host[CRC_SIZES, :n] = piece.sizes
            span = piece.span
            with torch.cuda.stream(copier):
                copier.wait_event(slot.done)
                slot.meta.copy_(slot.host_meta, non_blocking=True)
                slot.comp[:span].copy_(arena.view(piece.slab, piece.start, span), non_blocking=True)
                slot.ready.record(copier)
            with torch.cuda.stream(compute):
                compute.wait_event(slot.ready)
                s = compute.cuda_stream
                ptr = self._row_ptr
                self.crc.compute(
                    n,
                    ptr(slot, CRC_PTRS),
                    ptr(slot, CRC_SIZES),
                    ptr(slot, STATUS_CRC) + 4 * self.max_chunks,
                    s,
                )
                if ans:
                    self.ans.decompress(
                        len(ans),
                        ptr(slot, IN_PTRS),
                        ptr(slot, IN_SIZES),
                        ptr(slot, CAPACITY),
                        ptr(slot, OUT_SIZES),
                        ptr(slot, OUT_PTRS),
                        ptr(slot, STATUS_CRC),
                        0,
                        s,
                    )
                for k in range(n):
                    if piece.kinds[k] == RAW:
                        c = k * self.chunk_bytes
                        slot.planar[c : c + lengths[k]].copy_(slot.comp[offsets[k] : offsets[k] + lengths[k]])
                results[i].copy_(slot.meta[OUT_SIZES:CRC_PTRS], non_blocking=True)
                self._join(
                    dst[piece.offset : piece.offset + piece.length], slot.planar, piece.length, piece.planes
                )
                slot.done.record(compute)
        compute.synchronize()
        for i, (r, _, piece) in enumerate(work):
            self._verify(r, piece, results[i].numpy())

    def _verify(self, r: int, piece: Piece, row: np.ndarray) -> None:
        n = len(piece.sizes)
        lengths = self._lengths(piece.length)
        ans = [k for k in range(n) if piece.kinds[k] == ANS]
        words = row[1].view(np.int32)
        statuses, crcs = words[: len(ans)], words[self.max_chunks : self.max_chunks + n].view(np.uint32)
        where = f"the piece at byte {piece.offset} of range {r}"
        for k in range(n):
            if int(crcs[k]) != piece.crcs[k]:
                raise DeviceCodecError(f"chunk {k} of {where} fails its CRC-32: the stored copy is damaged")
        for j, k in enumerate(ans):
            if statuses[j] != 0:
                raise DeviceCodecError(
                    f"nvCOMP could not decode chunk {k} of {where} (status {int(statuses[j])})"
                )
            if int(row[0, j]) != lengths[k]:
                raise DeviceCodecError(
                    f"chunk {k} of {where} decoded to {int(row[0, j])} bytes, not {lengths[k]}"
                )
