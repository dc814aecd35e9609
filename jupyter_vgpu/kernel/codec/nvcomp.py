"""NVIDIA nvCOMP's batched ANS codec on raw device pointers, through its C API (ctypes).

The low-level ("batched") C API takes every buffer from the caller, so compression
runs inside the pipeline's fixed GPU scratch and allocates nothing: the pause path must
work on a card with almost no free memory. nvCOMP ships on PyPI as
``nvidia-libnvcomp-cu12`` / ``-cu13`` (``jupyter-vgpu[gpu]``); without it the host
codec (zstandard) runs instead.

Signatures are those of nvCOMP 5 and 6 (``nvcomp/ans.h``): options are 64-byte structs
passed by value whose unused bytes must be zero; compression and decompression report
a status per chunk in device memory. Measured on the H100 box (shared measurements,
``codec-h100.jsonl``): bf16 weights split into byte planes compress 1.44x at 140 GB/s
and decode at 387 GB/s.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

#: ``nvcompType_t`` values (``nvcomp.h``).
CHAR, UCHAR, FLOAT16, BITS = 0, 1, 9, 0xFF
#: nvCOMP's largest ANS chunk (``nvcompANSCompressionMaxAllowedChunkSize``), bytes.
MAX_CHUNK_BYTES = 1 << 24
#: Alignment nvCOMP requires of every ANS input, output and temporary buffer, bytes.
ALIGNMENT = 16

_STATUS = {
    10: "invalid value",
    11: "not supported",
    12: "cannot decompress",
    13: "bad checksum",
    15: "output buffer too small",
    17: "alignment",
    18: "chunk size too large",
    1000: "CUDA error",
    10000: "internal error",
}


class NvcompUnavailable(RuntimeError):
    """nvCOMP's library is not installed or lacks the ANS entry points this code calls."""


class NvcompError(RuntimeError):
    """An nvCOMP call failed; ``status`` is its ``nvcompStatus_t``."""

    def __init__(self, status: int, what: str):
        super().__init__(f"nvCOMP {what} failed: {_STATUS.get(status, 'status')} ({status})")
        self.status = status


class _Opts(ctypes.Structure):
    """``nvcompBatchedANSCompressOpts_t`` / ``...DecompressOpts_t``: two enums, then zeros."""

    _fields_ = (("first", ctypes.c_int), ("data_type", ctypes.c_int), ("reserved", ctypes.c_char * 56))


class _CRC32Spec(ctypes.Structure):
    """``nvcompCRC32Spec_t`` (``nvcomp/crc32.h``)."""

    _fields_ = (
        ("poly", ctypes.c_uint32),
        ("init", ctypes.c_uint32),
        ("ref_in", ctypes.c_bool),
        ("ref_out", ctypes.c_bool),
        ("xorout", ctypes.c_uint32),
        ("reserved", ctypes.c_char * 16),
    )


class _CRC32Conf(ctypes.Structure):
    """``nvcompCRC32KernelConf_t``."""

    _fields_ = (
        ("kernel_kind", ctypes.c_int),
        ("bytes_per_read", ctypes.c_int32),
        ("blocks_per_msg", ctypes.c_int32),
        ("reserved", ctypes.c_char * 20),
    )


class _CRC32Opts(ctypes.Structure):
    """``nvcompBatchedCRC32Opts_t``: the model, the kernel configuration, zeros."""

    _fields_ = (("spec", _CRC32Spec), ("conf", _CRC32Conf), ("reserved", ctypes.c_char * 64))


#: CRC-32 as zlib computes it (``nvcompCRC32``: CRC-32/PKZIP), so either side can check.
_PKZIP = (0x04C11DB7, 0xFFFFFFFF, True, True, 0xFFFFFFFF)


def _find_library() -> str:
    try:
        import nvidia.libnvcomp as pkg  # the PyPI wheel nvidia-libnvcomp-cu*
    except ImportError:
        pkg = None
    if pkg is not None:
        for sub in ("lib64", "lib"):
            candidate = Path(pkg.__file__).parent / sub / "libnvcomp.so.6"
            if candidate.exists():
                return str(candidate)
    return os.environ.get("JUPYTER_VGPU_NVCOMP", "libnvcomp.so.6")


class _Library:
    def __init__(self):
        try:
            lib = ctypes.CDLL(_find_library(), ctypes.RTLD_LOCAL)
        except OSError as e:
            raise NvcompUnavailable(f"nvCOMP is not installed ({e}); install jupyter-vgpu[gpu]") from None
        size_t, vp, st = ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int
        psize = ctypes.POINTER(size_t)
        try:
            self.compress_temp = lib.nvcompBatchedANSCompressGetTempSize
            self.decompress_temp = lib.nvcompBatchedANSDecompressGetTempSize
            self.max_output = lib.nvcompBatchedANSCompressGetMaxOutputChunkSize
            self.compress = lib.nvcompBatchedANSCompressAsync
            self.decompress = lib.nvcompBatchedANSDecompressAsync
            self.crc32 = lib.nvcompBatchedCRC32Async
            self.crc32_conf = lib.nvcompBatchedCRC32GetHeuristicConf
            self.crc32_search = lib.nvcompBatchedCRC32SearchConf
        except AttributeError as e:
            raise NvcompUnavailable(f"this nvCOMP lacks the ANS and CRC32 API of nvCOMP 6 ({e})") from None
        for fn in (self.compress_temp, self.decompress_temp):
            fn.argtypes, fn.restype = [size_t, size_t, _Opts, psize, size_t, vp], st
        self.max_output.argtypes, self.max_output.restype = [size_t, _Opts, psize], st
        self.compress.argtypes = [vp, vp, size_t, size_t, vp, size_t, vp, vp, _Opts, vp, vp]
        self.compress.restype = st
        self.decompress.argtypes = [vp, vp, vp, vp, size_t, vp, size_t, vp, _Opts, vp, vp]
        self.decompress.restype = st
        self.crc32.argtypes, self.crc32.restype = [vp, vp, size_t, vp, _CRC32Opts, ctypes.c_int, vp, vp], st
        self.crc32_conf.argtypes = [vp, size_t, ctypes.POINTER(_CRC32Conf), size_t, vp]
        self.crc32_conf.restype = st
        self.crc32_search.argtypes = [vp, vp, size_t, vp, _CRC32Spec, ctypes.POINTER(_CRC32Conf), vp]
        self.crc32_search.restype = st
        self.version = "unknown"
        props = (ctypes.c_uint32 * 2)()
        if hasattr(lib, "nvcompGetProperties") and lib.nvcompGetProperties(props) == 0:
            v = props[0]
            self.version = f"{v // 1000}.{v // 10 % 100}.{v % 10}" if v > 1000 else str(v)


_library: _Library | None = None
_lock = threading.Lock()


def library() -> _Library:
    """The loaded nvCOMP library. Raises :class:`NvcompUnavailable`."""
    global _library
    with _lock:
        if _library is None:
            _library = _Library()
        return _library


def _check(status: int, what: str) -> None:
    if status != 0:
        raise NvcompError(status, what)


class ANS:
    """Batched rANS (de)compression of equal-sized chunks.

    Args:
        chunk_bytes: uncompressed bytes per chunk (a multiple of 16, at most
            :data:`MAX_CHUNK_BYTES`).
        max_chunks: the most chunks one call compresses.
        data_type: :data:`CHAR` (bytes; byte planes are split beforehand) or
            :data:`FLOAT16` (nvCOMP's own 2-byte float mode).

    Raises:
        NvcompUnavailable: nvCOMP cannot be loaded.
        ValueError: a setting is out of range.
    """

    def __init__(self, chunk_bytes: int, max_chunks: int, data_type: int = CHAR):
        if chunk_bytes % ALIGNMENT or not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be a multiple of 16 up to 16 MiB, got {chunk_bytes}")
        if max_chunks < 1:
            raise ValueError(f"max_chunks must be at least 1, got {max_chunks}")
        self.lib = library()
        self.chunk_bytes, self.max_chunks = chunk_bytes, max_chunks
        self.copts = _Opts(0, data_type)
        self.dopts = _Opts(0, BITS)  # decode whatever type the stream was written with
        out = ctypes.c_size_t()
        _check(self.lib.max_output(chunk_bytes, self.copts, ctypes.byref(out)), "max output size")
        #: bytes to reserve for each compressed chunk (rounded up to the alignment).
        self.max_compressed_bytes = -(-out.value // ALIGNMENT) * ALIGNMENT
        total = chunk_bytes * max_chunks
        t = ctypes.c_size_t()
        _check(
            self.lib.compress_temp(max_chunks, chunk_bytes, self.copts, ctypes.byref(t), total, None), "temp"
        )
        self.compress_temp_bytes = t.value
        _check(
            self.lib.decompress_temp(max_chunks, chunk_bytes, self.dopts, ctypes.byref(t), total, None),
            "temp",
        )
        self.decompress_temp_bytes = t.value

    @property
    def temp_bytes(self) -> int:
        """Device scratch both directions need, bytes."""
        return max(self.compress_temp_bytes, self.decompress_temp_bytes)

    def compress(
        self,
        n: int,
        in_ptrs: int,
        in_bytes: int,
        out_ptrs: int,
        out_bytes: int,
        statuses: int,
        temp: int,
        stream: int,
    ) -> None:
        """Enqueue compression of ``n`` chunks on ``stream``.

        Every argument but ``n`` is a device address: arrays of ``n`` input pointers
        (uint64), input sizes (uint64, each ≤ ``chunk_bytes``), output pointers (each to
        ``max_compressed_bytes`` of room), output sizes (uint64, written), statuses
        (int32, written; 0 is success), and ``temp_bytes`` of scratch.

        Raises:
            NvcompError: the launch was refused.
        """
        _check(
            self.lib.compress(
                in_ptrs,
                in_bytes,
                self.chunk_bytes,
                n,
                temp or None,
                self.compress_temp_bytes,
                out_ptrs,
                out_bytes,
                self.copts,
                statuses,
                stream or None,
            ),
            "ANS compression",
        )

    def decompress(
        self,
        n: int,
        in_ptrs: int,
        in_bytes: int,
        out_capacity: int,
        out_bytes: int,
        out_ptrs: int,
        statuses: int,
        temp: int,
        stream: int,
    ) -> None:
        """Enqueue decompression of ``n`` chunks on ``stream``.

        Device arrays of ``n``: compressed pointers and sizes (uint64), each output's
        capacity (uint64), the decoded sizes (uint64, written), output pointers,
        statuses (int32, written).

        Raises:
            NvcompError: the launch was refused.
        """
        _check(
            self.lib.decompress(
                in_ptrs,
                in_bytes,
                out_capacity,
                out_bytes,
                n,
                temp or None,
                self.decompress_temp_bytes,
                out_ptrs,
                self.dopts,
                statuses,
                stream or None,
            ),
            "ANS decompression",
        )


class CRC32:
    """Batched CRC-32 (zlib's: ``zlib.crc32`` gives the same values) of device chunks.

    Args:
        max_chunks: the most chunks one call checksums.
        max_chunk_bytes: the largest chunk, bytes.

    Raises:
        NvcompUnavailable: nvCOMP cannot be loaded.
    """

    def __init__(self, max_chunks: int, max_chunk_bytes: int):
        self.lib = library()
        self.opts = _CRC32Opts()
        spec = self.opts.spec
        spec.poly, spec.init, spec.ref_in, spec.ref_out, spec.xorout = _PKZIP
        _check(
            self.lib.crc32_conf(None, max_chunks, ctypes.byref(self.opts.conf), max_chunk_bytes, None),
            "CRC32 configuration",
        )
        self._key = (max_chunks, max_chunk_bytes)
        found = CRC32._found.get(self._key)
        if found is not None:
            self.opts.conf = found
        #: whether the configuration is the searched one (see :meth:`tune`)
        self.tuned = found is not None

    # searched configurations by (max_chunks, max_chunk_bytes): one search per process
    _found: dict[tuple[int, int], _CRC32Conf] = {}

    def tune(self, n: int, ptrs: int, sizes: int, out: int, stream: int) -> None:
        """Replace the heuristic kernel configuration with the fastest nvCOMP finds by
        running on ``n`` sample chunks (device arrays as in :meth:`compute`; synchronous).
        The heuristic's choice checksummed one 8 MiB piece of 128 KiB chunks far slower
        than the bus moves it; the search runs once per process."""
        conf = _CRC32Conf()
        status = self.lib.crc32_search(
            ptrs, sizes, n, out, self.opts.spec, ctypes.byref(conf), stream or None
        )
        if status == 0:
            self.opts.conf = conf
        CRC32._found[self._key] = self.opts.conf
        self.tuned = True

    def compute(self, n: int, ptrs: int, sizes: int, out: int, stream: int) -> None:
        """Enqueue the CRC-32 of ``n`` chunks on ``stream``: device arrays of pointers
        and sizes (uint64) in, one uint32 per chunk written to ``out``.

        Raises:
            NvcompError: the launch was refused.
        """
        _check(self.lib.crc32(ptrs, sizes, n, out, self.opts, 0, None, stream or None), "CRC32")
