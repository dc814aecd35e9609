"""The offload codec: bytes of a tensor's storage <-> compressed chunks (zstandard).

Layout of a :class:`Packed` (the project's host format):

- The input (``nbytes`` bytes, any length) is cut into chunks of ``chunk_bytes``
  (rounded down to a multiple of the item size), each encoded on its own so chunks
  encode and decode in parallel on a thread pool (zstandard releases the GIL) and a
  chunk decodes straight into its own slice of the output.
- For 2-, 4- and 8-byte floating values a chunk is first split into **byte planes**:
  plane *k* holds byte *k* of every value. Exponent bytes of weights are nearly
  constant and compress well once apart from the noisy mantissa bytes (measured on the
  H100 box: bf16 weights 1.28 → 1.46 with zstd level 1; see the shared measurements).
  Each plane is its own zstd frame (``parts`` holds their sizes): a noisy mantissa
  plane then becomes raw zstd blocks, which decode at memory speed, instead of
  slowing the entropy decoder of the whole chunk (measured here: 1.10 → 0.66 ms per
  MiB of bf16 weights on one core).
- Each chunk is one of ``ZSTD`` (a standard zstd frame with its content checksum, so
  any host tool can read it and corruption is caught on decode), ``RAW`` (the chunk
  did not shrink by ``min_saving``: stored as is, with a CRC-32), or ``CONST`` (every
  item equal: the item itself, with a CRC-32 of it).

Torch-free (numpy, zstandard, zlib): the engine hands us pinned host memory as numpy.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import zstandard

MiB = 1 << 20
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class CodecError(RuntimeError):
    """A chunk failed its checksum or could not be decoded; the packed data is untouched."""


class Kind(enum.IntEnum):
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
        payload: the encoded bytes (None while spilled to disk by the host store).
        checksum: CRC-32 of the raw bytes (RAW) or of the repeated item (CONST); 0 for
            ZSTD, whose frame carries its own content checksum.
        parts: with byte planes, the size of each plane's zstd frame in ``payload``.
    """

    offset: int
    length: int
    kind: Kind
    planes: int
    payload: bytes | None
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
        """Original over stored size (inf when nothing needs storing)."""
        return self.nbytes / self.stored_bytes if self.stored_bytes else float("inf")


class Codec:
    """Encodes and decodes :class:`Packed` data on a thread pool.

    Args:
        level: zstd compression level (1: fastest; the ratio barely improves above it
            on weights, see the shared measurements).
        chunk_bytes: bytes per chunk (default 1 MiB).
        threads: worker threads (default ``os.cpu_count()``).
        min_saving: a chunk is stored raw unless compression saves this fraction.
    """

    def __init__(
        self,
        level: int = 1,
        chunk_bytes: int = 1 * MiB,
        threads: int | None = None,
        min_saving: float = 0.03,
    ):
        if chunk_bytes < 64:
            raise ValueError("chunk_bytes must be at least 64")
        self.level = level
        self.chunk_bytes = chunk_bytes
        self.threads = threads or os.cpu_count() or 1
        self.min_saving = min_saving
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="vgpu-codec")
        self._local = threading.local()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- per-thread zstd contexts (zstandard objects are not thread-safe) ----------

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, write_checksum=True, write_content_size=True
            )
        return cctx

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
            itemsize: bytes per value; chunks never split a value.
            floating: values are floating point: split them into byte planes.

        Raises:
            ValueError: ``data`` is not a 1-D C-contiguous uint8 array.
        """
        _check_buffer(data)
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
            source, size = split_planes(view, use_planes), length // use_planes
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

    def decode(self, packed: Packed, out: np.ndarray) -> None:
        """Write the original bytes of ``packed`` into ``out``.

        Args:
            packed: what :meth:`encode` returned (its payloads must be in memory).
            out: uint8, 1-D, C-contiguous, writable, exactly ``packed.nbytes`` long.

        Raises:
            ValueError: ``out`` has the wrong type or size.
            CodecError: a chunk is corrupt, truncated or missing; ``packed`` is not
                modified, so decoding can be retried from an intact copy.
        """
        _check_buffer(out)
        if out.size != packed.nbytes:
            raise ValueError(f"out holds {out.size} bytes; the packed data is {packed.nbytes}")
        errors = [e for e in self._pool.map(lambda c: self._decode_chunk(c, out), packed.chunks) if e]
        if errors:
            raise CodecError(f"{len(errors)} of {len(packed.chunks)} chunk(s) failed to decode: {errors[0]}")

    def decode_bytes(self, packed: Packed) -> bytes:
        """The original bytes of ``packed``. Raises CodecError like :meth:`decode`."""
        out = np.empty(packed.nbytes, dtype=np.uint8)
        self.decode(packed, out)
        return out.tobytes()

    def _decode_chunk(self, chunk: Chunk, out: np.ndarray) -> str | None:
        target = out[chunk.offset : chunk.offset + chunk.length]
        where = f"chunk at byte {chunk.offset} ({chunk.kind.name}, {chunk.length} bytes)"
        if chunk.payload is None:
            return f"{where}: payload missing"
        try:
            if chunk.kind == Kind.RAW:
                if len(chunk.payload) != chunk.length or zlib.crc32(chunk.payload) != chunk.checksum:
                    return f"{where}: checksum mismatch"
                target[:] = np.frombuffer(chunk.payload, dtype=np.uint8)
            elif chunk.kind == Kind.CONST:
                item = chunk.payload
                if zlib.crc32(item) != chunk.checksum or chunk.length % len(item):
                    return f"{where}: checksum mismatch"
                dtype = _UINT[len(item)]
                target.view(dtype).fill(np.frombuffer(item, dtype=dtype)[0])
            elif chunk.planes > 1:
                size = chunk.length // chunk.planes
                if len(chunk.parts) != chunk.planes or sum(chunk.parts) != len(chunk.payload):
                    return f"{where}: payload size does not match its planes"
                rows, start, payload = [], 0, memoryview(chunk.payload)
                for part in chunk.parts:
                    raw = self._dctx().decompress(payload[start : start + part], max_output_size=size)
                    if len(raw) != size:
                        return f"{where}: a plane decoded to {len(raw)} bytes"
                    rows.append(np.frombuffer(raw, dtype=np.uint8))
                    start += part
                join_planes(rows, target)
            else:
                raw = self._dctx().decompress(chunk.payload, max_output_size=chunk.length)
                if len(raw) != chunk.length:
                    return f"{where}: decoded {len(raw)} bytes"
                target[:] = np.frombuffer(raw, dtype=np.uint8)
        except zstandard.ZstdError as e:
            return f"{where}: {e}"
        return None


def split_planes(view: np.ndarray, planes: int) -> np.ndarray:
    """Byte planes of ``view`` (uint8, length a multiple of ``planes``): plane k, the k-th
    byte of every item, then plane k+1. Shifts on whole words, not strided byte copies."""
    words = view.view(_UINT[planes])
    out = np.empty(view.size, dtype=np.uint8).reshape(planes, -1)
    for k in range(planes):
        np.right_shift(words, 8 * k, out=out[k], casting="unsafe")
    return out.reshape(-1)


def join_planes(rows, target: np.ndarray) -> None:
    """Inverse of :func:`split_planes`: interleave the planes ``rows`` (a sequence of
    equal-length uint8 arrays, or one 2-D array) into ``target``."""
    planes = len(rows)
    dtype = _UINT[planes]
    words = target.view(dtype)
    np.copyto(words, rows[0], casting="unsafe")
    tmp = np.empty_like(words)
    for k in range(1, planes):
        np.left_shift(rows[k], 8 * k, out=tmp, dtype=dtype, casting="unsafe")
        np.bitwise_or(words, tmp, out=words)


def _check_buffer(a: np.ndarray) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.uint8 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError("expected a 1-D C-contiguous numpy uint8 array")
