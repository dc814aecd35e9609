"""The GPU codec path: device ranges compressed on the GPU before they cross the bus.

Layout of what it writes (the "device" layout; the host layout is ``codec.zstd``):

- A range is cut into **pieces** of ``piece_bytes`` (the last may be shorter). A piece
  whose length is a multiple of 4 is first transposed into 4 **byte planes** (plane *k*
  holds byte *k* of every 4-byte word), as a whole: exponents and signs of floats land
  together, apart from the noisy low mantissa bytes. Four planes suit bf16/fp16 (two
  values per word) as well as fp32; measured with nvCOMP ANS on the H100 box
  (``benchmarks/results/probe-h100.jsonl``): bf16 N(0, 0.02) weights 1.28 unsplit ->
  1.50, fp32 Adam second moment 1.09 -> 1.20, bf16 ReLU activations 2.06 -> 2.35
  (nvCOMP's own FLOAT16 mode, without the split: bf16 weights 1.33).
- The planar bytes are cut into **chunks** of ``chunk_bytes``. Each chunk is stored as
  one of three kinds, decided on the GPU (``vgpu_uniform`` and ``vgpu_settle`` in
  :mod:`.kernels`), so that the host never waits on the GPU to choose:

  - :data:`FILL`: every byte is the same; nothing is stored but the byte (zeros, padding,
    masks). ANS would still write about 2 KiB per 128 KiB chunk of zeros.
  - :data:`ANS`: nvCOMP ANS, while that makes the chunk at most 1/64 larger (the noisy
    mantissa planes of bf16 weights come out 0.5% larger and stay ANS: one decoder
    call per piece; half the chunks of an fp32 Adam state grow more).
  - :data:`RAW`: the planar bytes themselves, copied over the chunk's compressor output
    slot (also for a chunk nvCOMP reports it could not compress).

  Stored chunks of a piece lie back to back in pinned host memory, each at an offset
  rounded up to 16 bytes (nvCOMP's alignment). On pause the GPU gathers them out of the
  compressor's output slots into that layout (``vgpu_gather``), so the piece crosses the
  bus in one copy either way: the host issues one ``cuMemcpyAsync`` per piece, where a
  batched copy of its 64 chunks (``cuMemcpyBatchAsync``) cost 52 µs of host time per
  piece on the H100 box, half of what the bus needs to move the piece.
- What a piece stores is a function of its bytes alone: the compressor's output slots
  are zeroed before each piece, since nvCOMP's ANS leaves a few bytes of a chunk's
  output unwritten. Equal pieces of two kernels thus store equal bytes under equal keys,
  which piece sharing relies on (``kernel.pause.sharing``).
- Every stored chunk carries its CRC-32 (zlib's polynomial, so ``zlib.crc32`` checks
  it too), computed by nvCOMP on the GPU from the stored bytes before the copy out.
  Resume recomputes it on the GPU after the copy in and refuses a piece whose checksum,
  nvCOMP status or decoded size disagrees; the host copy is untouched.

Everything runs in one scratch area of device memory the caller owns (``scratch`` of
:meth:`DeviceCodec.scratch_bytes` bytes, about 53 MiB with the defaults): the byte planes
of one piece, and ``slots`` slots (four) for compressed bytes, so that the copies of some
pieces over the bus overlap the coding of others.

**Few calls per piece.** A whole piece's work on the GPU is captured once per slot into
CUDA graphs; the addresses that change from piece to piece travel in the slot's
metadata, which the graph moves to the device first. A pause launches two graphs per
piece: the coding (metadata in, split, uniform check, ANS, settle, gather) on the compute
stream, then the CRC-32s and the results out on a side stream, beside the next piece's
coding. A resume launches one, keyed by the piece's count of ANS and stored chunks:
metadata in, CRC-32s on a side branch beside the ANS decoding, raw and uniform chunks
put in place, the join, results out. Issued one by one from Python these calls cost
150-200 µs per 8 MiB piece, more than the bus needs to move it (pause 33 GB/s, resume
46 GB/s on the H100 against 55 GB/s of raw copy). The metadata moves by kernels
(``vgpu_move``), not copy engines: on a copy engine the small move queued behind the
other stream's piece copies, which serialized coding and copying (pause 43 GB/s). Pieces
shorter than ``piece_bytes`` run the same steps as direct calls; so does everything when
the driver refuses to capture (:attr:`DeviceCodec.graph_reason`).

Nothing is allocated through PyTorch on the way: the pause path must run on a card with
almost no free memory and must never be handed a block of memory it is releasing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from . import kernels, nvcomp
from .cuda_driver import Driver
from .pinned_arena import PinnedArena, round_up

MiB = 1 << 20
#: Chunk kinds (:attr:`Piece.kinds`).
RAW, FILL, ANS = 0, 1, 3
#: A chunk stays ANS while ANS makes it at most 1/SLACK larger: random mantissa bytes
#: come out 0.5% larger, and keeping them ANS keeps one decoder call and no host work
#: per piece.
SLACK = 64
_ALIGN = nvcomp.ALIGNMENT
#: Bit set in a chunk's uniform flag (:func:`.kernels.Kernels.uniform_async`).
_UNIFORM = 0x100


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
        kinds: per chunk, :data:`ANS`, :data:`RAW` or :data:`FILL` (uint8 array).
        sizes: per chunk, stored bytes (int64 array; 0 for FILL).
        crcs: per chunk, CRC-32 of the stored bytes (uint32 array; 0 for FILL).
        fills: per chunk, the byte a FILL chunk repeats (uint8 array; 0 for the others).
        slab: index of the pinned slab holding the stored chunks (-1 when none is stored).
        start: offset in that slab of the first chunk, bytes.
        offsets: per chunk, its offset from ``start``, 16-byte aligned (int64 array).
        span: bytes the piece takes in its slab.
        stored_bytes: the sum of ``sizes``.
        whole: the piece is ``piece_bytes`` long (its work runs as the slot's CUDA graphs).

    (numpy arrays, not tuples: building and reading them per 8 MiB piece is part of
    the codec's Python cost per piece.)
    """

    offset: int
    length: int
    planes: int
    kinds: np.ndarray
    sizes: np.ndarray
    crcs: np.ndarray
    fills: np.ndarray
    slab: int
    start: int
    offsets: np.ndarray
    span: int
    stored_bytes: int
    whole: bool


# Rows of a slot's meta area: ``ROWS`` rows of ``max_chunks`` 8-byte words, on the device
# and mirrored in pinned host memory; every piece uploads the whole area first. Both moves
# run as kernels (:meth:`.kernels.Kernels.move_async`), never on a copy engine.
# Pause: IN_PTRS (planar chunks), IN_SIZES, OUT_PTRS (compressed outputs) and WHERE (the
# piece's address) in; OUT_SIZES, STATUS_CRC (int32 statuses, then uint32 CRCs of what
# is stored) and FLAGS (int32: 0x100 | byte uniform, 0x200 stored raw) out. CRC_PTRS,
# CRC_SIZES (each chunk's gathered bytes) and WHERE[1] (the gathered span) stay on the device.
# Resume: IN_PTRS, IN_SIZES, CAPACITY, OUT_PTRS of the ANS chunks, CRC_PTRS, CRC_SIZES
# of the stored chunks, FLAGS and PLACE (each chunk's stored bytes) of every chunk and
# WHERE (the destination) in; OUT_SIZES and STATUS_CRC out.
IN_PTRS, IN_SIZES, CAPACITY, OUT_PTRS, OUT_SIZES, STATUS_CRC, FLAGS, CRC_PTRS, CRC_SIZES, PLACE, WHERE = (
    range(11)
)
ROWS = 11
#: The most CUDA graphs a codec keeps (a resume graph is captured per slot and per count
#: of ANS and stored chunks in a piece; pieces of other counts run as direct calls).
MAX_GRAPHS = 64


@dataclasses.dataclass
class _Slot:
    index: int
    comp: int  # device, max_chunks * max_compressed_bytes: pause: what is stored, at fixed
    #            strides; resume: the stored piece as it crossed the bus
    meta: int  # device int64 (ROWS, max_chunks)
    host_meta: object  # pinned int64 (ROWS, max_chunks), kept across binds (graphs read it)
    host_ptr: int  # its address
    host_dev: int  # its address on the device (the per-piece moves read and write it there)
    host: np.ndarray  # host_meta as a numpy array (made once: .numpy() costs µs)
    ready: object  # driver event: pause: compressed and checksummed; resume: uploaded
    done: object  # driver event: the slot may be reused
    coded: object  # driver event: pause: compressed (the checksums may start)
    rows: object = None  # what the host rows hold for every piece alike ("pack", "unpack", ...)
    check: tuple | None = None  # resume: the piece whose results the host rows will hold


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
        slots: pieces in flight at once (at least 2; default 4). Each has its own area
            for a piece's compressed bytes (about 11 MiB with the defaults: nvCOMP's bound on
            an ANS chunk is 1.38 times its length); the planes are shared, since only the
            compute stream touches them.
        graphs: capture each slot's per-piece work into CUDA graphs (default True).

    Raises:
        nvcomp.NvcompUnavailable: nvCOMP cannot be loaded.
        DriverUnavailable: cuda-bindings cannot be imported.
        kernels.KernelsUnavailable: NVRTC could not build the codec's kernels.
        ValueError: ``piece_bytes`` is not a multiple of ``chunk_bytes``, or ``slots`` < 2.
    """

    def __init__(
        self,
        torch,
        device: int,
        *,
        chunk_bytes: int = 128 << 10,
        piece_bytes: int = 8 * MiB,
        slots: int = 4,
        graphs: bool = True,
    ):
        if piece_bytes % chunk_bytes or piece_bytes <= 0:
            raise ValueError(f"piece_bytes ({piece_bytes}) must be a multiple of chunk_bytes ({chunk_bytes})")
        if slots < 2:
            raise ValueError(f"slots must be at least 2, got {slots}")
        self.slot_count = slots
        # the chunk lengths of a whole piece (shared: never written)
        self._full = np.full(piece_bytes // chunk_bytes, chunk_bytes, dtype=np.int64)
        self._every = np.arange(piece_bytes // chunk_bytes)
        self.torch, self.device = torch, device
        self.chunk_bytes, self.piece_bytes = chunk_bytes, piece_bytes
        self.max_chunks = piece_bytes // chunk_bytes
        #: the most a piece stores: each chunk at most 1/SLACK larger, rounded up to 16
        self.max_span = self.max_chunks * round_up(chunk_bytes + chunk_bytes // SLACK)
        self.ans = nvcomp.ANS(chunk_bytes, self.max_chunks)
        self.crc = nvcomp.CRC32(self.max_chunks, max(chunk_bytes, self.ans.max_compressed_bytes))
        # a chunk stored raw is copied over its output slot; on resume a stored piece
        # lands in ``comp``: chunks at most 1/SLACK larger than their length
        assert self.ans.max_compressed_bytes >= chunk_bytes
        assert self.max_chunks * self.ans.max_compressed_bytes >= self.max_span
        assert self.ans.max_compressed_bytes % _ALIGN == 0  # the gather moves 16-byte words
        self.cu = Driver()
        self.kernels = kernels.load(device)
        #: why whole pieces run as direct calls instead of CUDA graphs, or None
        self.graph_reason: str | None = None if graphs else "turned off"
        self._graphs: dict[tuple, object] = {}
        self._graph_base: int | None = None  # the scratch address the graphs were captured on
        self._slots: list[_Slot] = []
        self._planar = 0
        self._streams = None

    @property
    def name(self) -> str:
        return f"nvCOMP {self.ans.lib.version} ANS (GPU)"

    def _parts(self) -> tuple[int, int, int]:
        n = self.max_chunks
        return (
            round_up(self.max_span, 256),  # the planes, and then what the piece stores, gathered
            round_up(n * self.ans.max_compressed_bytes, 256),
            round_up(ROWS * 8 * n, 256),
        )

    def scratch_bytes(self) -> int:
        """Device scratch :meth:`bind` needs, bytes: the planes of one piece (or what it
        stores, gathered), and ``slots`` times a piece's compressed bytes and metadata."""
        planar, comp, meta = self._parts()
        return planar + self.slot_count * (comp + meta)

    def bind(self, scratch) -> None:
        """Carve the planes and the slots out of ``scratch``, a device uint8 tensor of at
        least :meth:`scratch_bytes` that stays valid while the codec runs.

        Raises:
            ValueError: ``scratch`` is smaller than :meth:`scratch_bytes`.
        """
        torch, n = self.torch, self.max_chunks
        if scratch.numel() < self.scratch_bytes():
            raise ValueError(f"scratch holds {scratch.numel()} bytes; the codec needs {self.scratch_bytes()}")
        if self._streams is None:
            dev = torch.device("cuda", self.device)
            # compute, copier, and a side stream for the checksums (beside the coding)
            self._streams = tuple(torch.cuda.Stream(dev) for _ in range(3))
            self._cu_streams = tuple(self.cu.stream(s.cuda_stream) for s in self._streams)
            self._stream_ints = tuple(int(s.cuda_stream) for s in self._streams)
            self._fork, self._joined = self.cu.event(), self.cu.event()
            self._events = [
                (self.cu.event(), self.cu.event(), self.cu.event()) for _ in range(self.slot_count)
            ]
            self._host_metas = [
                torch.zeros((ROWS, n), dtype=torch.int64, pin_memory=True) for _ in range(self.slot_count)
            ]
        base = scratch.data_ptr()
        if base != self._graph_base:  # the graphs hold the old slots' addresses
            self._drop_graphs()
            self._graph_base = base
        planar, comp, meta = self._parts()
        self._planar = base
        self._slots, pos = [], base + planar
        for i in range(self.slot_count):
            host_meta = self._host_metas[i]
            self._slots.append(
                _Slot(
                    i, pos, pos + comp, host_meta, host_meta.data_ptr(),
                    self.cu.device_pointer(host_meta.data_ptr()), host_meta.numpy(), *self._events[i],
                )
            )  # fmt: skip
            pos += comp + meta
        # (waiting on an event never recorded returns at once: a fresh slot is free)
        if not self.crc.tuned:
            slot = self._slots[0]
            host = slot.host
            host[CRC_PTRS] = self._planar + np.arange(n, dtype=np.int64) * self.chunk_bytes
            # searched on chunks the size compressed ones mostly are (bf16 weights: 1/1.47)
            host[CRC_SIZES] = round_up(self.chunk_bytes * 2 // 3)
            stream = self._cu_streams[0]
            self.cu.copy(slot.meta, slot.host_ptr, ROWS * 8 * n, stream)
            self.crc.tune(
                n,
                self._row(slot, CRC_PTRS),
                self._row(slot, CRC_SIZES),
                self._row(slot, STATUS_CRC),
                self._stream_ints[0],
            )
            self._streams[0].synchronize()

    def _drop_graphs(self) -> None:
        for graph in self._graphs.values():
            self.cu.destroy_graph(graph)
        self._graphs.clear()

    def _graph(self, slot: _Slot, key: tuple):
        """The slot's captured graph for a whole piece: ``("code",)`` (compute stream)
        and ``("check",)`` (side stream) of a pause, or ``("unpack", m, s)`` for resuming
        a piece of ``m`` ANS and ``s`` stored chunks. None when graphs are off, the driver
        refused to capture, or :data:`MAX_GRAPHS` are kept already."""
        graph = self._graphs.get((slot.index, *key))
        if graph is None and self.graph_reason is None and len(self._graphs) < MAX_GRAPHS:
            n, length = self.max_chunks, self.piece_bytes
            stream = self._cu_streams[2 if key[0] == "check" else 0]
            if key[0] == "code":

                def enqueue():
                    self._enqueue_code(slot, n, length, 4, 0)
            elif key[0] == "check":

                def enqueue():
                    self._enqueue_check(slot, n)
            else:

                def enqueue():
                    m, s = key[1:]
                    self._enqueue_unpack(slot, n, m, s, length, 4, m < n, 0)

            try:
                graph = self.cu.capture(stream, enqueue)
            except Exception as e:  # the pieces run as direct calls: slower, still right
                self.graph_reason = f"capturing the per-piece work failed: {e}"
                return None
            self._graphs[(slot.index, *key)] = graph
        return graph

    def _lengths(self, length: int) -> np.ndarray:
        if length == self.piece_bytes:
            return self._full
        c = self.chunk_bytes
        lengths = np.full(-(-length // c), c, dtype=np.int64)
        lengths[-1] = length - c * (len(lengths) - 1)
        return lengths

    def _row(self, slot: _Slot, row: int) -> int:
        return slot.meta + row * 8 * self.max_chunks

    def _host_row(self, slot: _Slot, row: int) -> int:
        """A row of the slot's pinned metadata, as the device addresses it."""
        return slot.host_dev + row * 8 * self.max_chunks

    def _halves(self, slot: _Slot, row: int) -> np.ndarray:
        """A host meta row as int32 words: the first ``max_chunks`` and the second."""
        return slot.host[row].view(np.int32)

    # -- pause direction ----------------------------------------------------------------

    def pack(
        self,
        ranges: Sequence[tuple[object, int]],
        arena: PinnedArena,
        on_range: Callable[[int, list[Piece]], None] | None = None,
        *,
        out: list[list[Piece]] | None = None,
    ) -> list[list[Piece]]:
        """Store every range; returns one list of :class:`Piece` per range.

        A chunk nvCOMP cannot compress is stored raw.

        Args:
            ranges: ``(device uint8 tensor, its length in bytes)`` pairs. Nothing else
                may write them meanwhile (the engine pauses an idle kernel).
            arena: where the stored chunks go.
            on_range: called with ``(range index, pieces)`` once a range is wholly and
                durably on the host, so the caller may release its device memory.
            out: one empty list per range, filled with the pieces as they are stored and
                returned: when this raises (a CUDA error, an interrupt), it holds what
                was stored so far, in ``arena`` (default: new lists).
        """
        out = [[] for _ in ranges] if out is None else out
        return self._pack(ranges, arena, on_range, out)

    def _enqueue_code(self, slot: _Slot, n: int, length: int, planes: int, src: int) -> None:
        """A piece's coding on the compute stream: upload the metadata, split (or copy,
        from ``src``) into planes, flag uniform chunks, compress, store raw what did not
        compress, gather what is stored into the free planes and back to the start of the
        slot. Captured as is for whole pieces."""
        cu, k, s = self.cu, self.kernels, self._stream_ints[0]
        row, c, planar = self._row, self.chunk_bytes, self._planar
        k.move_async(slot.meta, slot.host_dev, ROWS * 8 * self.max_chunks, s)
        if planes == 4:
            k.split4_async(row(slot, WHERE), planar, length // 4, s)
        else:
            cu.copy(planar, src, length, self._cu_streams[0])
        k.uniform_async(planar, c, length, row(slot, FLAGS), s)
        # nvCOMP's ANS leaves a few dozen bytes inside a chunk's output unwritten (43 of a
        # 128 KiB chunk of bf16 weights, on the H200); left as they were, they hold what
        # the slot held before, and equal pieces of two kernels, or of two pauses, would
        # store different bytes: CRC-32s and keys that never meet (piece sharing).
        cu.zero(slot.comp, n * self.ans.max_compressed_bytes, self._cu_streams[0])
        self.ans.compress(
            n, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, OUT_PTRS), row(slot, OUT_SIZES),
            row(slot, STATUS_CRC), 0, s,
        )  # fmt: skip
        k.settle_async(
            planar, c, length, row(slot, OUT_PTRS), row(slot, OUT_SIZES), row(slot, STATUS_CRC),
            row(slot, FLAGS), SLACK, s,
        )  # fmt: skip
        span = row(slot, WHERE) + 8
        k.gather_async(
            row(slot, OUT_PTRS), row(slot, OUT_SIZES), row(slot, FLAGS), n, planar, slot.comp,
            row(slot, CRC_PTRS), row(slot, CRC_SIZES), span, s,
        )  # fmt: skip
        k.copy_span_async(slot.comp, planar, span, self.max_span, s)

    def _enqueue_check(self, slot: _Slot, n: int) -> None:
        """A coded piece's checksums on the side stream, beside the next piece's coding:
        CRC-32 of what is stored (where it was gathered to; a uniform chunk's is of no
        bytes), then download sizes, statuses, CRCs and flags. Captured as is for whole
        pieces."""
        s, row = self._stream_ints[2], self._row
        self.crc.compute(
            n, row(slot, CRC_PTRS), row(slot, CRC_SIZES), row(slot, STATUS_CRC) + 4 * self.max_chunks, s
        )
        self.kernels.move_async(
            self._host_row(slot, OUT_SIZES), row(slot, OUT_SIZES), 3 * 8 * self.max_chunks, s
        )

    def _pack(self, ranges, arena, on_range, out) -> list[list[Piece]]:
        cu = self.cu
        compute, side = self._cu_streams[0], self._cu_streams[2]
        todo = [
            (r, off, min(self.piece_bytes, length - off))
            for r, (_, length) in enumerate(ranges)
            for off in range(0, length, self.piece_bytes)
        ]
        bases = [t.data_ptr() for t, _ in ranges]
        left = [0] * len(ranges)
        for r, _, _ in todo:
            left[r] += 1
        finished: list[int] = []
        pending: list[tuple] = []
        c = self.chunk_bytes
        k = np.arange(self.max_chunks, dtype=np.int64)

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
            host = slot.host
            whole = length == self.piece_bytes
            shape = "pack" if whole else ("pack", length)
            if slot.rows != shape:
                host[IN_PTRS, :n] = self._planar + k[:n] * c
                host[IN_SIZES, :n] = lengths
                host[OUT_PTRS, :n] = slot.comp + k[:n] * self.ans.max_compressed_bytes
                slot.rows = shape
            src = bases[r] + off
            host[WHERE, 0] = src
            planes = 1 if length % 4 else 4
            graph = self._graph(slot, ("code",)) if whole else None
            if graph is not None:
                cu.launch(graph, compute)
            else:
                self._enqueue_code(slot, n, length, planes, src)
            cu.record(slot.coded, compute)
            cu.wait(side, slot.coded)
            graph = self._graph(slot, ("check",)) if whole else None
            if graph is not None:
                cu.launch(graph, side)
            else:
                self._enqueue_check(slot, n)
            cu.record(slot.ready, side)
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

    def _store(self, pending, arena: PinnedArena, out) -> None:
        cu = self.cu
        copier = self._cu_streams[1]
        slot, r, off, length, lengths, planes = pending
        cu.synchronize(slot.ready)
        n = len(lengths)
        host = slot.host
        sizes = host[OUT_SIZES, :n]
        crcs = self._halves(slot, STATUS_CRC)[self.max_chunks : self.max_chunks + n].view(np.uint32).copy()
        flags = self._halves(slot, FLAGS)[:n]
        if flags.any():
            fill = (flags & _UNIFORM) != 0
            kinds = np.where(fill, FILL, np.where(flags, RAW, ANS)).astype(np.uint8)
            fills = np.where(fill, flags & 0xFF, 0).astype(np.uint8)
            stored = np.where(fill, 0, sizes)
            crcs[fill] = 0
        else:
            kinds = np.full(n, ANS, dtype=np.uint8)
            fills = np.zeros(n, dtype=np.uint8)
            stored = sizes.copy()
        # the offsets vgpu_gather gave the chunks at the start of the slot
        padded = (stored + (_ALIGN - 1)) & ~(_ALIGN - 1)
        offsets = np.zeros(n, dtype=np.int64)
        np.cumsum(padded[:-1], out=offsets[1:])
        span = int(offsets[-1] + padded[-1])
        slab, start = -1, 0
        if span:
            slab, start = arena.reserve(span)
            cu.copy(arena.address(slab, start), slot.comp, span, copier)
        cu.record(slot.done, copier)
        out[r].append(
            Piece(
                off, length, planes, kinds, stored, crcs, fills, slab, start, offsets, span,
                int(stored.sum()), length == self.piece_bytes,
            )
        )  # fmt: skip

    # -- resume direction ----------------------------------------------------------------

    def _enqueue_unpack(
        self, slot: _Slot, n: int, m: int, s: int, length: int, planes: int, place: bool, dst: int
    ):
        """A piece's work on the compute stream once its stored bytes are in ``comp``:
        upload the metadata, checksum the ``s`` stored chunks (on the side stream) while
        the ``m`` ANS chunks are decoded, put the others in place (``place``), join the
        planes into the destination (a 1-plane piece is copied to ``dst``), download
        sizes, statuses and CRCs. Captured as is for whole pieces."""
        cu, k, st = self.cu, self.kernels, self._stream_ints[0]
        compute, side = self._cu_streams[0], self._cu_streams[2]
        row, planar = self._row, self._planar
        k.move_async(slot.meta, slot.host_dev, ROWS * 8 * self.max_chunks, st)
        if s:  # on the side stream, beside the decoding: each fills half the SMs or less
            cu.record(self._fork, compute)
            cu.wait(side, self._fork)
            crcs = row(slot, STATUS_CRC) + 4 * self.max_chunks
            self.crc.compute(s, row(slot, CRC_PTRS), row(slot, CRC_SIZES), crcs, self._stream_ints[2])
            cu.record(self._joined, side)
        if m:
            self.ans.decompress(
                m, row(slot, IN_PTRS), row(slot, IN_SIZES), row(slot, CAPACITY), row(slot, OUT_SIZES),
                row(slot, OUT_PTRS), row(slot, STATUS_CRC), 0, st,
            )  # fmt: skip
        if place:
            k.place_async(planar, self.chunk_bytes, length, row(slot, FLAGS), row(slot, PLACE), st)
        if planes == 4:
            k.join4_async(planar, row(slot, WHERE), length // 4, st)
        else:
            cu.copy(dst, planar, length, compute)
        if s:
            cu.wait(compute, self._joined)
        k.move_async(self._host_row(slot, OUT_SIZES), row(slot, OUT_SIZES), 2 * 8 * self.max_chunks, st)

    def unpack(self, items: Sequence[tuple[object, Sequence[Piece]]], arena: PinnedArena) -> None:
        """Write every stored range back: ``(device uint8 tensor, its pieces)`` pairs.

        Raises:
            DeviceCodecError: a stored chunk failed its checksum, its nvCOMP status or its
                decoded size; the message names it. The arena is not modified; the device
                ranges hold garbage and must not be used.
        """
        cu = self.cu
        compute, copier = self._cu_streams[:2]
        for slot in self._slots:
            slot.check = None
        i = 0  # pieces so far, across ranges: piece i runs in slot i % slots
        try:
            for r, (dst, pieces) in enumerate(items):
                base = dst.data_ptr()
                for piece in pieces:
                    slot = self._slots[i % self.slot_count]
                    i += 1
                    cu.synchronize(slot.done)
                    if slot.check is not None:
                        self._verify(slot)
                    at = base + piece.offset
                    slot.host[WHERE, 0] = at
                    chosen = self._unpack_rows(slot, piece)
                    n, m, s = len(piece.sizes), len(chosen[0]), len(chosen[1])
                    if piece.span:
                        cu.copy(slot.comp, arena.address(piece.slab, piece.start), piece.span, copier)
                        cu.record(slot.ready, copier)
                        cu.wait(compute, slot.ready)
                    graph = self._graph(slot, ("unpack", m, s)) if piece.whole else None
                    if graph is not None:
                        cu.launch(graph, compute)
                    else:
                        self._enqueue_unpack(slot, n, m, s, piece.length, piece.planes, m < n, at)
                    cu.record(slot.done, compute)
                    slot.check = (r, piece, chosen)
            self._streams[0].synchronize()
            for slot in self._slots:
                if slot.check is not None:
                    self._verify(slot)
        finally:
            for slot in self._slots:
                slot.check = None

    def _unpack_rows(self, slot: _Slot, piece: Piece) -> tuple[np.ndarray, np.ndarray]:
        """Fill the host rows for resuming ``piece``; returns the indices of its ANS
        chunks and of its stored chunks (in the order their results come back)."""
        host, c = slot.host, self.chunk_bytes
        kinds, offsets = piece.kinds, piece.offsets
        n = len(kinds)
        all_ans = bool((kinds == ANS).all())
        if all_ans and piece.whole:
            if slot.rows != "unpack":
                host[CAPACITY] = self._full
                host[OUT_PTRS] = self._planar + np.arange(n, dtype=np.int64) * c
                slot.rows = "unpack"
            host[IN_PTRS] = slot.comp + offsets
            host[IN_SIZES] = piece.sizes
            host[CRC_PTRS] = host[IN_PTRS]
            host[CRC_SIZES] = piece.sizes
            every = self._every[:n]
            return every, every
        slot.rows = None
        lengths = self._lengths(piece.length)
        ans = np.flatnonzero(kinds == ANS)
        stored = np.flatnonzero(kinds != FILL)
        m, s = len(ans), len(stored)
        host[IN_PTRS, :m] = slot.comp + offsets[ans]
        host[IN_SIZES, :m] = piece.sizes[ans]
        host[CAPACITY, :m] = lengths[ans]
        host[OUT_PTRS, :m] = self._planar + ans * c
        host[CRC_PTRS, :s] = slot.comp + offsets[stored]
        host[CRC_SIZES, :s] = piece.sizes[stored]
        self._halves(slot, FLAGS)[:n] = np.where(
            kinds == FILL, _UNIFORM | piece.fills.astype(np.int32), np.where(kinds == RAW, 0x200, 0)
        )
        host[PLACE, :n] = slot.comp + offsets
        return ans, stored

    def _verify(self, slot: _Slot) -> None:
        r, piece, (ans, chosen) = slot.check
        slot.check = None
        host = slot.host
        words = self._halves(slot, STATUS_CRC)
        statuses = words[: len(ans)]
        crcs = words[self.max_chunks : self.max_chunks + len(chosen)].view(np.uint32)
        lengths = self._lengths(piece.length)
        sizes = host[OUT_SIZES, : len(ans)]
        if (
            np.array_equal(crcs, piece.crcs[chosen])
            and not statuses.any()
            and np.array_equal(sizes, lengths[ans])
        ):
            return
        where = f"the piece at byte {piece.offset} of range {r}"
        bad = np.flatnonzero(crcs != piece.crcs[chosen])
        if bad.size:
            raise DeviceCodecError(
                f"chunk {chosen[bad[0]]} of {where} fails its CRC-32: the stored copy is damaged"
            )
        bad = np.flatnonzero(statuses)
        if bad.size:
            raise DeviceCodecError(
                f"nvCOMP could not decode chunk {ans[bad[0]]} of {where} (status {statuses[bad[0]]})"
            )
        bad = np.flatnonzero(sizes != lengths[ans])
        k, got = ans[bad[0]], int(sizes[bad[0]])
        raise DeviceCodecError(f"chunk {k} of {where} decoded to {got} bytes, not {lengths[k]}")
