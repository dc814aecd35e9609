"""The host codec: bytes <-> compressed chunks (zstandard), on CPU threads.

Codec layout (the host layout: paused memory on machines without nvCOMP, and spilled data):

- A :class:`Packed` describes ``nbytes`` original bytes (any length, 0 included) of
  values ``itemsize`` bytes wide, as a tuple of :class:`Chunk` records in order. Chunk
  *i* covers bytes ``[offset, offset + length)``; the chunks tile ``[0, nbytes)``
  without gaps. Every chunk but the last is ``chunk_bytes`` long, rounded down to a
  multiple of ``itemsize`` so no value straddles two chunks; the last holds the rest
  (it may end in a partial value). Chunks encode and decode independently, on a
  thread pool (zstandard releases the GIL), and a chunk decodes straight into its own
  slice of the output.
- A chunk is one of three kinds:

  ``CONST``
      every value in the chunk is the same ``itemsize``-byte pattern (zeros, or a
      constant float such as 1.0): ``payload`` is that one value, ``checksum`` its
      CRC-32. No codec runs; a zero chunk of 1 MiB costs 2-8 bytes.
  ``ZSTD``
      ``payload`` is one standard zstd frame per byte plane, concatenated; ``parts``
      gives each frame's size (empty when ``planes == 1``: one frame). Every frame is
      written with its content size and content checksum, so ``zstd -d`` reads it
      and corruption or truncation is caught on decode. ``checksum`` is 0.
  ``RAW``
      compression did not save ``min_saving`` of the chunk: ``payload`` is the chunk
      as is, ``checksum`` its CRC-32 (``zlib.crc32``).

- **Byte planes.** For floating values of 2, 4 or 8 bytes (fp16/bf16, fp32, fp64) a
  chunk is split before compression into ``planes == itemsize`` planes: plane *k*
  holds byte *k* (little-endian) of every value, i.e. plane 0 is the low mantissa
  bytes and the last plane holds sign and exponent. Exponents of weights are nearly
  constant and compress well once apart from the noisy mantissa bytes (H100 box,
  shared measurements: bf16 N(0, 0.02) weights 1.28 -> 1.46 with zstd level 1). Each
  plane is its own frame: a noisy mantissa plane becomes raw zstd blocks that decode
  at memory speed instead of slowing the entropy decoder for the whole chunk
  (measured on this project's 2-core CI box: 1.10 -> 0.66 ms per MiB of bf16 weights,
  one thread). A chunk whose length is not a multiple of ``itemsize`` (a tail) is
  compressed whole (``planes == 1``).
- Defaults, measured on this project's 2-core CI box (``benchmarks/codec.py``, results
  in ``benchmarks/results/codec-*.json``): zstd level 1 with longer minimum matches
  and a small hash table (:data:`FAST_PARAMETERS`; bf16 weights 1.49, and faster
  both ways than zstd's own level 1; levels -5..-1 lose 0.25 of ratio on bf16
  weights, levels 2 and 3 lose ratio on byte planes and encode 1.5-2x slower);
  1 MiB chunks (4 MiB gave the same ratio and speed; smaller chunks lose ratio,
  larger ones leave threads idle on small tensors).

Torch-free (numpy, zstandard, zlib): the host path (``codec.host``) hands it pinned host memory as numpy.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import zlib
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import zstandard

try:  # zstd's C API through zstandard's cffi backend: decodes into place, the GIL released
    from zstandard import backend_cffi as _cffi
except ImportError:  # no cffi: decode through zstandard's bytes API and copy into place
    _cffi = None

MiB = 1 << 20
#: Changes to zstd's level 1 parameters (see :class:`Codec`); frames stay standard zstd.
FAST_PARAMETERS = {
    "strategy": zstandard.STRATEGY_FAST,
    "window_log": 20,
    "hash_log": 8,
    "min_match": 7,
    "target_length": 0,
    "write_checksum": 1,
    "write_content_size": 1,
}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CodecError(RuntimeError):
    """A chunk failed its checksum or could not be decoded; the packed data is untouched."""


class Kind(enum.IntEnum):
    """How a chunk's payload encodes it (see the module docstring)."""

    RAW = 0
    ZSTD = 1
    CONST = 2


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One encoded chunk.

    Attributes:
        offset: where the chunk starts in the original bytes.
        length: its length in the original bytes.
        kind: how ``payload`` encodes it.
        planes: byte planes it was split into before compression (1: none).
        payload: the encoded bytes (bytes, or a read-only memoryview when read back
            from a spill file; None while spilled to disk by the host store).
        checksum: CRC-32 of the raw bytes (RAW) or of the repeated item (CONST); 0 for
            ZSTD, whose frame carries its own content checksum.
        parts: with byte planes, the size of each plane's zstd frame in ``payload``.
    """

    offset: int
    length: int
    kind: Kind
    planes: int
    payload: bytes | memoryview | None
    checksum: int
    parts: tuple[int, ...] = ()

    @property
    def stored_bytes(self) -> int:
        return len(self.payload) if self.payload is not None else 0


@dataclasses.dataclass(frozen=True)
class Packed:
    """A whole storage, encoded.

    Attributes:
        nbytes: original size, bytes.
        itemsize: bytes per value (1 for raw bytes).
        chunks: the chunks, in order, covering ``[0, nbytes)``.
        stored_bytes: sum of the payloads, bytes (what host memory holds).
    """

    nbytes: int
    itemsize: int
    chunks: tuple[Chunk, ...]
    stored_bytes: int

    @property
    def ratio(self) -> float:
        """Original over stored size (inf when nothing needs storing; 1.0 when empty)."""
        if self.stored_bytes:
            return self.nbytes / self.stored_bytes
        return float("inf") if self.nbytes else 1.0


class Codec:
    """Encodes and decodes :class:`Packed` data on a thread pool.

    Args:
        level: zstd compression level. Level 1 (the default) uses zstd's level-1
            "fast" strategy with matches of at least 7 bytes and a 2^8-entry hash
            table (:data:`FAST_PARAMETERS`): on byte planes of weights, optimizer
            state and activations, short matches in noise cost ratio and time, and
            this encodes 1.3-2.4x faster, decodes 1.1-1.5x faster and compresses
            2-6% better than zstd's own level 1 (``benchmarks/codec.py``). Other
            levels are zstd's standard ones (3 and up lose ratio on byte planes).
        chunk_bytes: bytes per chunk (default 1 MiB, at least 64).
        threads: worker threads (default ``os.cpu_count()``).
        min_saving: a chunk is stored raw unless compression saves this fraction
            (0 to 1, default 0.03).

    Raises:
        ValueError: a setting is out of range.
    """

    def __init__(
        self,
        level: int = 1,
        chunk_bytes: int = 1 * MiB,
        threads: int | None = None,
        min_saving: float = 0.03,
    ):
        if chunk_bytes < 64:
            raise ValueError(f"chunk_bytes must be at least 64, got {chunk_bytes}")
        if not 0 <= min_saving < 1:
            raise ValueError(f"min_saving must be a fraction in [0, 1), got {min_saving}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.level = level
        self.chunk_bytes = chunk_bytes
        self.threads = threads or os.cpu_count() or 1
        self.min_saving = min_saving
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="vgpu-codec")
        self._local = threading.local()

    def close(self) -> None:
        """Stop the worker threads (after running work finishes)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Codec:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- per-thread zstd contexts (zstandard objects are not thread-safe) ----------

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            if self.level == 1:
                params = zstandard.ZstdCompressionParameters.from_level(1, **FAST_PARAMETERS)
            else:
                params = zstandard.ZstdCompressionParameters.from_level(
                    self.level, write_checksum=1, write_content_size=1
                )
            cctx = self._local.cctx = zstandard.ZstdCompressor(compression_params=params)
        return cctx

    def _scratch(self, nbytes: int) -> np.ndarray:
        """This thread's scratch bytes (at least ``nbytes``), kept between chunks: a fresh
        chunk-sized array per chunk would be allocated and faulted in again each time."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.size < nbytes:
            buf = self._local.scratch = np.empty(max(nbytes, self.chunk_bytes), dtype=np.uint8)
        return buf[:nbytes]

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    # -- encode ------------------------------------------------------------------

    def encode(self, data: np.ndarray, *, itemsize: int = 1, floating: bool = False) -> Packed:
        """Encode ``data`` (uint8, 1-D, C-contiguous).

        Args:
            data: the bytes; not modified, and not referenced once this returns.
            itemsize: bytes per value (1 for plain bytes); chunks never split a value.
            floating: values are floating point: with ``itemsize`` 2, 4 or 8, split
                them into byte planes.

        Returns:
            The :class:`Packed` data; it shares no memory with ``data``.

        Raises:
            ValueError: ``data`` is not a 1-D C-contiguous uint8 array, or ``itemsize``
                is not a positive integer.
        """
        _check_buffer(data)
        if not isinstance(itemsize, int) or itemsize < 1:
            raise ValueError(f"itemsize must be a positive integer, got {itemsize!r}")
        n = data.size
        step = max(itemsize, self.chunk_bytes - self.chunk_bytes % itemsize)
        planes = itemsize if floating and itemsize in (2, 4, 8) else 1
        spans = [(start, min(step, n - start)) for start in range(0, n, step)]
        work = [(data, start, length, itemsize, planes) for start, length in spans]
        chunks = tuple(self._pool.map(lambda args: self._encode_chunk(*args), work))
        return Packed(n, itemsize, chunks, sum(c.stored_bytes for c in chunks))

    def _encode_chunk(self, data: np.ndarray, offset: int, length: int, itemsize: int, planes: int) -> Chunk:
        view = data[offset : offset + length]
        if itemsize in _UINT and length % itemsize == 0 and length >= itemsize:
            items = view.view(_UINT[itemsize])
            first = items[0]
            # sample before the full pass: most chunks differ at once
            if items[-1] == first and items[len(items) // 2] == first and (items == first).all():
                item = view[:itemsize].tobytes()
                return Chunk(offset, length, Kind.CONST, 1, item, zlib.crc32(item))
        use_planes = planes if length % planes == 0 else 1
        cctx = self._cctx()
        if use_planes > 1:
            source, size = split_planes(view, use_planes, self._scratch(length)), length // use_planes
            frames = [cctx.compress(source[k * size : (k + 1) * size]) for k in range(use_planes)]
            if sum(map(len, frames)) <= length * (1 - self.min_saving):
                parts = tuple(map(len, frames))
                return Chunk(offset, length, Kind.ZSTD, use_planes, b"".join(frames), 0, parts)
        else:
            frame = cctx.compress(view)
            if len(frame) <= length * (1 - self.min_saving):
                return Chunk(offset, length, Kind.ZSTD, 1, frame, 0)
        raw = view.tobytes()
        return Chunk(offset, length, Kind.RAW, 1, raw, zlib.crc32(raw))

    # -- decode ------------------------------------------------------------------

    def decode(self, packed: Packed, out: np.ndarray, *, planar: bool = False) -> None:
        """Write the original bytes of ``packed`` into ``out``.

        Args:
            packed: what :meth:`encode` returned (its payloads must be in memory).
            out: uint8, 1-D, C-contiguous, writable, exactly ``packed.nbytes`` long.
            planar: leave the chunks split into byte planes as planes (plane *k* of a
                chunk of length *L* at ``[k * L / planes, (k + 1) * L / planes)`` of its
                slice): the caller joins them (on the GPU, :func:`plane_table`). Every
                checksum is still verified.

        Raises:
            ValueError: ``out`` has the wrong type or size.
            CodecError: a chunk is corrupt, truncated or missing; ``packed`` is not
                modified, so decoding can be retried from an intact copy.
        """
        self.decode_finish(packed, self.decode_start(packed, out, planar=planar))

    def decode_start(self, packed: Packed, out: np.ndarray, *, planar: bool = False) -> list[Future]:
        """Queue the chunks of ``packed`` for decoding into ``out`` and return at once, so
        that the next piece's chunks can queue behind them and no thread waits for the
        last chunk of a piece. Arguments as :meth:`decode`; pass the result to
        :meth:`decode_finish`, which must be called before ``out`` is read or reused.

        Raises:
            ValueError: ``out`` has the wrong type or size.
            CodecError: the chunks do not tile the data.
        """
        _check_buffer(out)
        if out.size != packed.nbytes:
            raise ValueError(f"out holds {out.size} bytes; the packed data is {packed.nbytes}")
        _check_layout(packed)
        return [self._pool.submit(self._decode_chunk, i, c, out, planar) for i, c in enumerate(packed.chunks)]

    def decode_finish(self, packed: Packed, futures: list[Future]) -> None:
        """Wait for every chunk :meth:`decode_start` queued.

        Raises:
            CodecError: a chunk is corrupt, truncated or missing.
        """
        errors = [e for e in (f.result() for f in futures) if e]
        if errors:
            raise CodecError(f"{len(errors)} of {len(packed.chunks)} chunk(s) failed to decode: {errors[0]}")

    def decode_bytes(self, packed: Packed) -> bytes:
        """The original bytes of ``packed``. Raises CodecError like :meth:`decode`."""
        out = np.empty(packed.nbytes, dtype=np.uint8)
        self.decode(packed, out)
        return out.tobytes()

    def _decode_chunk(self, index: int, chunk: Chunk, out: np.ndarray, planar: bool = False) -> str | None:
        error = self._decode_into(chunk, out, planar)
        if error:
            where = f"chunk at byte {chunk.offset} (number {index}, {chunk.kind.name}, {chunk.length} bytes)"
            return f"{where}: {error}"
        return None

    def _decode_into(self, chunk: Chunk, out: np.ndarray, planar: bool) -> str | None:
        """Decode one chunk into its slice of ``out``; what went wrong in words, or None.
        (Runs per chunk on many threads: what it does in Python holds the GIL.)"""
        if chunk.payload is None:
            return "payload missing"
        target = out[chunk.offset : chunk.offset + chunk.length]
        try:
            if chunk.kind == Kind.RAW:
                if len(chunk.payload) != chunk.length or zlib.crc32(chunk.payload) != chunk.checksum:
                    return "checksum mismatch"
                target[:] = np.frombuffer(chunk.payload, dtype=np.uint8)
            elif chunk.kind == Kind.CONST:
                item = chunk.payload
                if len(item) not in _UINT or chunk.length % len(item) or zlib.crc32(item) != chunk.checksum:
                    return "checksum mismatch"
                dtype = _UINT[len(item)]
                target.view(dtype).fill(np.frombuffer(item, dtype=dtype)[0])
            elif chunk.planes > 1:
                if chunk.planes not in _UINT or chunk.length % chunk.planes:
                    return f"{chunk.planes} byte planes do not fit its length"
                if len(chunk.parts) != chunk.planes or sum(chunk.parts) != len(chunk.payload):
                    return "payload size does not match its planes"
                planes = target if planar else self._scratch(chunk.length)
                error = self._decode_frames(chunk.payload, chunk.parts, planes)
                if error:
                    return error
                if not planar:
                    join_planes(planes.reshape(chunk.planes, -1), target)
            else:
                return self._decode_frames(chunk.payload, (len(chunk.payload),), target)
        except (zstandard.ZstdError, ValueError) as e:
            return str(e)
        return None

    def _decode_frames(self, payload: bytes, parts, out: np.ndarray) -> str | None:
        """Decode the zstd frames of ``payload`` (sizes ``parts``), one per equal slice of
        ``out``, so that together they fill ``out`` exactly; an error in words, or None.

        Through zstd's C API the frames decode in one call: zstd decodes concatenated
        frames one after another into consecutive output (``ZSTD_decompressDCtx``, zstd.h),
        which is where the planes go. Every frame still carries its content size and
        checksum, so a damaged frame fails, and the call must fill ``out`` exactly. One
        call per chunk rather than per plane: each call gives the GIL up and takes it back,
        and among 16 decoding threads taking it back costs more than the decoding saves
        (H100 box, 16 cores, 1 GiB of bf16 weights: per-plane calls 7.0 GB/s, per-chunk
        11.9, ``benchmarks/results/zstd-calls-h100.json``;
        10.6 and 14.2 on another machine of the same kind)."""
        if _cffi is not None:
            lib, ffi = _cffi.lib, _cffi.ffi
            dctx = getattr(self._local, "raw_dctx", None)
            if dctx is None:
                dctx = self._local.raw_dctx = ffi.gc(lib.ZSTD_createDCtx(), lib.ZSTD_freeDCtx)
            dst, src = ffi.from_buffer(out), ffi.from_buffer(payload)
            got = lib.ZSTD_decompressDCtx(dctx, dst, out.size, src, len(payload))
            if lib.ZSTD_isError(got):
                return ffi.string(lib.ZSTD_getErrorName(got)).decode()
            if got != out.size:
                return f"the frames decoded to {got} bytes, not {out.size}"
            return None
        payload, start, size = memoryview(payload), 0, out.size // len(parts)
        for k, part in enumerate(parts):
            raw = self._dctx().decompress(payload[start : start + part], max_output_size=size)
            if len(raw) != size:
                return f"a frame decoded to {len(raw)} bytes, not {size}"
            out[k * size : (k + 1) * size] = np.frombuffer(raw, dtype=np.uint8)
            start += part
        return None


def plane_table(packed: Packed) -> np.ndarray:
    """Per chunk of ``packed``, ``(offset, length, planes)`` (int64, shape (chunks, 3)):
    how :meth:`Codec.decode` with ``planar=True`` leaves it (planes 1: as it was)."""
    table = np.ones((len(packed.chunks), 3), dtype=np.int64)
    for i, chunk in enumerate(packed.chunks):
        table[i, 0], table[i, 1] = chunk.offset, chunk.length
        if chunk.kind == Kind.ZSTD and chunk.planes > 1:
            table[i, 2] = chunk.planes
    return table


def split_planes(view: np.ndarray, planes: int, out: np.ndarray | None = None) -> np.ndarray:
    """Byte planes of ``view`` (uint8, length a multiple of ``planes``): plane k, the k-th
    byte of every item, then plane k+1. Shifts on whole words, not strided byte copies.
    ``out``: a uint8 array of ``view.size`` bytes to write them to (default: a new one)."""
    words = view.view(_UINT[planes])
    out = (np.empty(view.size, dtype=np.uint8) if out is None else out).reshape(planes, -1)
    for k in range(planes):
        np.right_shift(words, 8 * k, out=out[k], casting="unsafe")
    return out.reshape(-1)


def join_planes(rows, target: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: interleave the planes ``rows`` (a sequence of
    equal-length uint8 arrays, or one 2-D array) into ``target``.

    One strided copy (``np.stack``) rather than shifts on whole words (a widening copy,
    then a shift and an OR per further plane): one call per chunk instead of seven, each
    of which takes the GIL back from the other decoding threads. On the H100 box's 16
    cores, joining the planes of 1 GiB of bf16 weights on 16 threads ran at 7.9 GB/s
    this way against 4.6 GB/s with shifts (``benchmarks/results/zstd-decode-parts-h100.json``);
    on the 2-core CI box a whole decode went from 2.47 to 2.77 GB/s.
    """
    np.stack(rows, axis=1, out=target.reshape(-1, len(rows)))


def _check_layout(packed: Packed) -> None:
    """Chunks must tile ``[0, nbytes)`` in order, so no decode writes outside its slice."""
    pos = 0
    for i, c in enumerate(packed.chunks):
        if c.offset != pos or c.length <= 0:
            where = f"chunk at byte {c.offset} (number {i}, {c.length} bytes)"
            raise CodecError(f"{where} does not follow byte {pos}")
        pos += c.length
    if pos != packed.nbytes:
        raise CodecError(f"the chunks cover {pos} bytes; the packed data is {packed.nbytes}")


def _check_buffer(a: np.ndarray) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError("expected a 1-D C-contiguous numpy uint8 array")
