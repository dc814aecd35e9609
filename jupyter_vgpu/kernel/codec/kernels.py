"""The GPU codec path's own small CUDA kernels, compiled at run time with NVRTC.

Nine kernels move a piece between its layout in device memory and the byte-plane layout
nvCOMP compresses (``codec.device``), and decide and restore each chunk's kind:

- ``vgpu_move``: a small copy by the SMs, for the per-piece metadata.
- ``vgpu_split4``: the 4-byte words of a piece into 4 byte planes (plane *k* holds byte
  *k* of every word). Each thread transposes 4 words (16 bytes) with ``__byte_perm``.
- ``vgpu_join4``: the planes back into words (the same 4x4 byte transpose: it is its own
  inverse).
- ``vgpu_uniform``: per chunk of the planar bytes, whether every byte equals the first;
  writes ``0x100 | byte`` or 0 to an int32 per chunk (one thread block per chunk).
- ``vgpu_settle``: after compression, copies each chunk that did not compress (or grew)
  over its output slot, so that everything stored leaves from one place and the host
  never waits on the GPU to choose.
- ``vgpu_gather`` and ``vgpu_copy_span``: after the settle, the stored chunks of a piece
  gathered back to back (through the free planes, then into the slot), so that the
  piece leaves for the host in one copy of one span.
- ``vgpu_place``: before the join, fills uniform chunks and copies raw ones into place.
- ``vgpu_interleave``: the host path's join (``codec.host``): chunks decoded on the CPU
  as byte planes of 2, 4 or 8 are interleaved on the GPU after the copy, so that the
  CPU threads only run zstd, which scales with them (``benchmarks/results/cpu-scaling-h100.json``).

The split reads the piece's address, and the join the destination's, from a word of
device memory rather than from a kernel argument, so that one captured CUDA graph per
scratch slot serves every piece (``codec.device``): the per-piece work is then one or two
graph launches instead of a dozen calls from Python, each of several microseconds.

Through PyTorch a split or join of an 8 MiB piece cost 25 µs of Python per call and
23 µs on the GPU (``benchmarks/results/codec-stages-h100.jsonl``); these read and write
each byte once: on the H100 (profiler traces of a pause and a resume of 2 GiB) the split
took 6 µs per 8 MiB piece, the join 5-6, the uniform check 2 and the settle 1.6.

NVRTC comes with PyTorch's CUDA wheels (``nvidia-cuda-nvrtc``) and cuda-bindings loads
it; a built cubin is cached per source and architecture in ``~/.cache/jupyter-vgpu``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import tempfile
import threading

from ..cache import cache_dir

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

// The 4x4 byte transpose: (a, b, c, d) -> (p0, p1, p2, p3) with byte j of p_k = byte k of
// word j. Applied twice it gives the words back.
__device__ __forceinline__ void transpose4(u32 a, u32 b, u32 c, u32 d,
                                           u32 &p0, u32 &p1, u32 &p2, u32 &p3) {
  u32 t0 = __byte_perm(a, b, 0x5140), t1 = __byte_perm(a, b, 0x7362);
  u32 t2 = __byte_perm(c, d, 0x5140), t3 = __byte_perm(c, d, 0x7362);
  p0 = __byte_perm(t0, t2, 0x5410); p1 = __byte_perm(t0, t2, 0x7632);
  p2 = __byte_perm(t1, t3, 0x5410); p3 = __byte_perm(t1, t3, 0x7632);
}

// words: 4-byte words in the piece; planar: 4 * words bytes, plane k at k * words.
extern "C" __global__ void vgpu_split4(const u64 *where, unsigned char *planar, u64 words) {
  const unsigned char *src = (const unsigned char *)where[0];
  u64 stride = (u64)gridDim.x * blockDim.x, i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if ((words & 3) == 0 && ((u64)src & 15) == 0) {
    u64 groups = words >> 2;
    u32 *p = (u32 *)planar;
    for (u64 g = i; g < groups; g += stride) {
      uint4 v = ((const uint4 *)src)[g];
      u32 p0, p1, p2, p3;
      transpose4(v.x, v.y, v.z, v.w, p0, p1, p2, p3);
      p[g] = p0; p[groups + g] = p1; p[2 * groups + g] = p2; p[3 * groups + g] = p3;
    }
  } else {
    for (u64 w = i; w < words; w += stride) {
      planar[w] = src[4 * w]; planar[words + w] = src[4 * w + 1];
      planar[2 * words + w] = src[4 * w + 2]; planar[3 * words + w] = src[4 * w + 3];
    }
  }
}

extern "C" __global__ void vgpu_join4(const unsigned char *planar, const u64 *where, u64 words) {
  unsigned char *dst = (unsigned char *)where[0];
  u64 stride = (u64)gridDim.x * blockDim.x, i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if ((words & 3) == 0 && ((u64)dst & 15) == 0) {
    u64 groups = words >> 2;
    const u32 *p = (const u32 *)planar;
    for (u64 g = i; g < groups; g += stride) {
      uint4 v;
      transpose4(p[g], p[groups + g], p[2 * groups + g], p[3 * groups + g], v.x, v.y, v.z, v.w);
      ((uint4 *)dst)[g] = v;
    }
  } else {
    for (u64 w = i; w < words; w += stride) {
      dst[4 * w] = planar[w]; dst[4 * w + 1] = planar[words + w];
      dst[4 * w + 2] = planar[2 * words + w]; dst[4 * w + 3] = planar[3 * words + w];
    }
  }
}

// One block per chunk of `chunk` bytes (a multiple of 16; planar 16-byte aligned); the
// last chunk ends at `length`.
extern "C" __global__ void vgpu_uniform(const unsigned char *planar, u64 chunk, u64 length, int *flags) {
  u64 start = (u64)blockIdx.x * chunk, end = min(start + chunk, length);
  unsigned char v = planar[start];
  u32 v4 = 0x01010101u * v;
  u64 vend = start + ((end - start) & ~(u64)15);
  int same = 1;
  for (u64 j = start + 16 * (u64)threadIdx.x; same && j < vend; j += 16 * (u64)blockDim.x) {
    uint4 x = *(const uint4 *)(planar + j);
    same = x.x == v4 && x.y == v4 && x.z == v4 && x.w == v4;
  }
  for (u64 j = vend + threadIdx.x; j < end; j += blockDim.x) same &= planar[j] == v;
  same = __syncthreads_and(same);
  if (threadIdx.x == 0) flags[blockIdx.x] = same ? (0x100 | v) : 0;
}

// A small copy by the SMs (metadata between pinned host and device memory, read or written
// over the bus): a copy engine would queue it behind the piece copies of the other stream.
extern "C" __global__ void vgpu_move(u64 *dst, const u64 *src, u64 words) {
  for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < words; j += (u64)gridDim.x * blockDim.x)
    dst[j] = src[j];
}

// The host path's join, after the copy to the device: chunk c of `table` (int64 offset,
// length, planes; blockIdx.y) holds planes planes of length / planes bytes each at src +
// offset (planes 1: bytes as they are); its words go to dst + offset.
extern "C" __global__ void vgpu_interleave(const unsigned char *src, unsigned char *dst,
                                           const long long *table) {
  const long long *c = table + 3 * blockIdx.y;
  u64 off = c[0], len = c[1], p = c[2];
  const unsigned char *s = src + off;
  unsigned char *d = dst + off;
  u64 stride = (u64)gridDim.x * blockDim.x, i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (p <= 1) {
    for (u64 j = i; j < len; j += stride) d[j] = s[j];
    return;
  }
  u64 words = len / p;
  bool aligned = ((u64)d & (p - 1)) == 0;
  for (u64 w = i; w < words; w += stride) {
    u64 v = 0;
    for (u64 k = 0; k < p; k++) v |= (u64)s[k * words + w] << (8 * k);
    if (aligned && p == 2) *(unsigned short *)(d + 2 * w) = (unsigned short)v;
    else if (aligned && p == 4) *(u32 *)(d + 4 * w) = (u32)v;
    else if (aligned && p == 8) *(u64 *)(d + 8 * w) = v;
    else for (u64 k = 0; k < p; k++) d[p * w + k] = (unsigned char)(v >> (8 * k));
  }
}

// After compression, per chunk (one block each): a chunk nvCOMP could not compress
// (status != 0) or that came out more than len / slack larger is stored raw: its planar
// bytes are copied over its output slot (room for max_compressed_bytes >= len), its size
// set to its length and its flag to 0x200. Uniform chunks (flag 0x100) are left alone.
extern "C" __global__ void vgpu_settle(const unsigned char *planar, u64 chunk, u64 length,
                                       const u64 *out_ptrs, u64 *out_sizes, const int *statuses,
                                       int *flags, u64 slack) {
  u64 k = blockIdx.x, start = k * chunk, len = min(start + chunk, length) - start;
  if (flags[k] & 0x100) return;
  if (statuses[k] == 0 && out_sizes[k] <= len + len / slack) return;
  unsigned char *dst = (unsigned char *)out_ptrs[k];
  const unsigned char *src = planar + start;
  u64 vlen = len & ~(u64)15;
  for (u64 j = 16 * (u64)threadIdx.x; j < vlen; j += 16 * (u64)blockDim.x)
    *(uint4 *)(dst + j) = *(const uint4 *)(src + j);
  for (u64 j = vlen + threadIdx.x; j < len; j += blockDim.x) dst[j] = src[j];
  __syncthreads();  // every thread has read out_sizes[k] before it changes
  if (threadIdx.x == 0) { out_sizes[k] = len; flags[k] = 0x200; }
}

// After the settle, per chunk (one block each): what the piece stores, gathered back to back
// into dst. Chunk k's stored bytes (none for a uniform chunk, flag 0x100; else out_sizes[k]
// from out_ptrs[k]) go to offset o_k, the sum of the earlier chunks' stored sizes each
// rounded up to 16 (the offsets the host computes, codec.device); its final address
// (final + o_k) and stored size go to addrs[k] and sizes[k] for the checksums, and the
// last block writes the total to *span. Output slots are 16-byte aligned and at least
// the rounded size long, so whole 16-byte words are copied.
extern "C" __global__ void vgpu_gather(const u64 *out_ptrs, const u64 *out_sizes, const int *flags,
                                       u64 n, unsigned char *dst, u64 final, u64 *addrs, u64 *sizes,
                                       u64 *span) {
  __shared__ u64 offset;
  u64 k = blockIdx.x;
  if (threadIdx.x == 0) {
    u64 o = 0;
    for (u64 j = 0; j < k; j++) o += (flags[j] & 0x100) ? 0 : (out_sizes[j] + 15) & ~(u64)15;
    offset = o;
  }
  __syncthreads();
  u64 size = (flags[k] & 0x100) ? 0 : out_sizes[k], words = (size + 15) >> 4;
  const uint4 *s = (const uint4 *)out_ptrs[k];
  uint4 *d = (uint4 *)(dst + offset);
  for (u64 j = threadIdx.x; j < words; j += blockDim.x) d[j] = s[j];
  if (threadIdx.x == 0) {
    addrs[k] = final + offset;
    sizes[k] = size;
    if (k == n - 1) *span = offset + 16 * words;
  }
}

// Copy *span bytes (a multiple of 16; both sides 16-byte aligned) from src to dst: the
// gathered piece back into its slot, one graph node whatever its size.
extern "C" __global__ void vgpu_copy_span(uint4 *dst, const uint4 *src, const u64 *span) {
  u64 words = *span >> 4;
  for (u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x; j < words; j += (u64)gridDim.x * blockDim.x)
    dst[j] = src[j];
}

// Before the join, per chunk (one block each): a chunk flagged 0x100 | byte is filled with
// the byte; one flagged 0x200 (stored raw) is copied from sources[k] into its planes.
extern "C" __global__ void vgpu_place(unsigned char *planar, u64 chunk, u64 length, const int *flags,
                                      const u64 *sources) {
  int f = flags[blockIdx.x];
  if (!(f & 0x300)) return;
  u64 start = (u64)blockIdx.x * chunk, len = min(start + chunk, length) - start;
  unsigned char *dst = planar + start;
  u64 vlen = len & ~(u64)15;
  if (f & 0x100) {
    u32 v4 = 0x01010101u * (u32)(f & 0xff);
    uint4 q = make_uint4(v4, v4, v4, v4);
    for (u64 j = 16 * (u64)threadIdx.x; j < vlen; j += 16 * (u64)blockDim.x) *(uint4 *)(dst + j) = q;
    for (u64 j = vlen + threadIdx.x; j < len; j += blockDim.x) dst[j] = (unsigned char)f;
  } else {
    const unsigned char *src = (const unsigned char *)sources[blockIdx.x];
    for (u64 j = 16 * (u64)threadIdx.x; j < vlen; j += 16 * (u64)blockDim.x)
      *(uint4 *)(dst + j) = *(const uint4 *)(src + j);
    for (u64 j = vlen + threadIdx.x; j < len; j += blockDim.x) dst[j] = src[j];
  }
}
"""

NAMES = (
    "vgpu_move",
    "vgpu_split4",
    "vgpu_join4",
    "vgpu_uniform",
    "vgpu_settle",
    "vgpu_place",
    "vgpu_interleave",
    "vgpu_gather",
    "vgpu_copy_span",
)
#: Threads per block of every kernel.
THREADS = 256
#: The most blocks of the split and the join (they loop over the rest): 8 per
#: multiprocessor of an H100 (132).
MAX_BLOCKS = 1056

_LAUNCH = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUfunction
    *(ctypes.c_uint,) * 7,  # grid x, y, z; block x, y, z; shared memory bytes
    ctypes.c_void_p,  # CUstream
    ctypes.c_void_p,  # void **kernelParams
    ctypes.c_void_p,  # void **extra
)


class KernelsUnavailable(RuntimeError):
    """NVRTC or the driver could not build or load the codec's kernels."""


def compile_cubin(arch: str) -> bytes:
    """The kernels compiled by NVRTC for ``arch`` (e.g. ``"sm_90"``), as a cubin.

    Raises:
        KernelsUnavailable: cuda-bindings' NVRTC cannot be loaded, or compilation failed
            (the message holds NVRTC's log).
    """
    try:
        from cuda.bindings import nvrtc
    except ImportError as e:
        raise KernelsUnavailable(f"cuda-bindings is not installed ({e})") from None
    try:
        err, prog = nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"vgpu_codec.cu", 0, [], [])
    except Exception as e:  # the library itself could not be found or loaded
        raise KernelsUnavailable(f"NVRTC is not available ({e}); install nvidia-cuda-nvrtc") from None
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise KernelsUnavailable(f"nvrtcCreateProgram failed: {err}")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-default-device"]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            _, size = nvrtc.nvrtcGetProgramLogSize(prog)
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise KernelsUnavailable(
                f"NVRTC could not compile the codec kernels for {arch}: {log.decode()[:800]}"
            )
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or not size:
            raise KernelsUnavailable(f"NVRTC made no cubin for {arch}: {err}")
        cubin = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelsUnavailable(f"nvrtcGetCUBIN failed: {err}")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cubin(arch: str) -> bytes:
    """:func:`compile_cubin`, cached on disk per source and architecture."""
    digest = hashlib.sha256(SOURCE.encode()).hexdigest()[:16]
    path = cache_dir() / f"codec-kernels-{digest}-{arch}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    data = compile_cubin(arch)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".cubin", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a concurrent kernel never reads half a file
    except OSError:
        pass  # a read-only home: compile again next time
    return data


class Kernels:
    """The codec's kernels, loaded into ``device``'s primary context.

    Every ``*_async`` method enqueues one launch on ``stream`` (a ``CUstream`` handle as
    an int); addresses are device addresses (ints), sizes bytes.

    Args:
        device: CUDA ordinal.

    Raises:
        KernelsUnavailable: see :func:`compile_cubin`, or the driver refused the module.
    """

    def __init__(self, device: int):
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise KernelsUnavailable(f"cuda-bindings is not installed ({e})") from None
        ok = driver.CUresult.CUDA_SUCCESS

        def check(result, what):
            if result[0] != ok:
                raise KernelsUnavailable(f"{what} failed: {result[0]}")
            return result[1] if len(result) > 1 else None

        attr = driver.CUdevice_attribute
        dev = check(driver.cuDeviceGet(device), "cuDeviceGet")
        major = check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "sm"
        )
        minor = check(
            driver.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "sm"
        )
        self.arch = f"sm_{major}{minor}"
        image = cubin(self.arch)
        ctx = check(driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(driver.cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
        try:
            self._module = check(driver.cuModuleLoadData(image), "cuModuleLoadData")
            self._functions = {
                name: int(check(driver.cuModuleGetFunction(self._module, name.encode()), name))
                for name in NAMES
            }
        finally:
            driver.cuCtxPopCurrent()
        default = driver.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT
        address = check(driver.cuGetProcAddress(b"cuLaunchKernel", 4000, default), "cuGetProcAddress")
        self._launch = _LAUNCH(int(address))

    def _run(self, name: str, blocks: int, stream: int, *args: int, rows: int = 1) -> None:
        """Launch ``name`` on ``blocks`` x ``rows`` blocks of :data:`THREADS` threads, with
        ``args`` as its 8-byte arguments."""
        values = (ctypes.c_uint64 * len(args))(*args)
        base = ctypes.addressof(values)
        params = (ctypes.c_void_p * len(args))(*(base + 8 * k for k in range(len(args))))
        grid = (max(1, blocks), rows, 1)
        status = self._launch(
            self._functions[name], *grid, THREADS, 1, 1, 0, stream, ctypes.addressof(params), None
        )
        if status:
            raise RuntimeError(f"launching {name} failed: CUresult {status}")

    @staticmethod
    def _blocks(words: int) -> int:
        return min(MAX_BLOCKS, -(-words // (4 * THREADS)))

    def move_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` (a multiple of 8, both addresses 8-byte aligned) with the SMs.
        Either side may be pinned host memory mapped for the device: the codec moves its
        per-piece metadata this way, because a copy engine would run it only after the
        piece copies queued before it on the other stream (measured on the H100: pause
        43 GB/s and resume 65 GB/s with the metadata on copy engines)."""
        self._run("vgpu_move", -(-nbytes // (8 * THREADS)), stream, dst, src, nbytes // 8)

    def split4_async(self, where: int, planar: int, words: int, stream: int) -> None:
        """Transpose ``words`` 4-byte words, read from the address stored (uint64) at
        ``where``, into 4 byte planes at ``planar`` (``4 * words`` bytes)."""
        self._run("vgpu_split4", self._blocks(words), stream, where, planar, words)

    def join4_async(self, planar: int, where: int, words: int, stream: int) -> None:
        """The inverse of :meth:`split4_async`: planes at ``planar`` into words at the
        address stored (uint64) at ``where``."""
        self._run("vgpu_join4", self._blocks(words), stream, planar, where, words)

    def uniform_async(self, planar: int, chunk_bytes: int, length: int, flags: int, stream: int) -> None:
        """Per chunk of ``planar`` (``length`` bytes in chunks of ``chunk_bytes``, a
        multiple of 16, ``planar`` 16-byte aligned): int32 ``0x100 | byte`` at ``flags``
        when all its bytes are that byte, else 0."""
        self._run("vgpu_uniform", -(-length // chunk_bytes), stream, planar, chunk_bytes, length, flags)

    def interleave_async(self, src: int, dst: int, table: int, chunks: int, stream: int) -> None:
        """The host path's join of byte planes on the device: for each of ``chunks`` rows
        of ``table`` (int64 ``(offset, length, planes)``, device-readable, e.g. pinned
        host memory mapped for the device; :func:`.zstd.plane_table`), the chunk at
        ``src + offset`` (its planes one after another; planes 1: its bytes) becomes the
        words at ``dst + offset``."""
        if chunks:
            self._run("vgpu_interleave", 64, stream, src, dst, table, rows=chunks)

    def settle_async(
        self, planar: int, chunk_bytes: int, length: int, out_ptrs: int, out_sizes: int, statuses: int,
        flags: int, slack: int, stream: int,
    ) -> None:  # fmt: skip
        """After compression: store raw each chunk that failed (int32 status != 0) or grew
        by more than ``1/slack``: copy its planar bytes to its output (uint64 pointer per
        chunk at ``out_ptrs``), set its uint64 size to its length and its flag to 0x200.
        Uniform chunks (flag 0x100) are left as they are."""
        self._run(
            "vgpu_settle", -(-length // chunk_bytes), stream,
            planar, chunk_bytes, length, out_ptrs, out_sizes, statuses, flags, slack,
        )  # fmt: skip

    def place_async(
        self, planar: int, chunk_bytes: int, length: int, flags: int, sources: int, stream: int
    ) -> None:
        """Before the join: fill each chunk flagged 0x100 with its low byte, and copy each
        flagged 0x200 from its stored bytes (uint64 address per chunk at ``sources``)."""
        self._run(
            "vgpu_place", -(-length // chunk_bytes), stream, planar, chunk_bytes, length, flags, sources
        )

    def gather_async(
        self, out_ptrs: int, out_sizes: int, flags: int, n: int, dst: int, final: int, addrs: int,
        sizes: int, span: int, stream: int,
    ) -> None:  # fmt: skip
        """After the settle: gather the stored bytes of ``n`` chunks (uint64 address and
        size per chunk at ``out_ptrs`` and ``out_sizes``; int32 ``flags``, uniform chunks
        store nothing) back to back into ``dst``, each at a 16-byte aligned offset; write
        each chunk's address once the gathered bytes sit at ``final`` (uint64, to
        ``addrs``), its stored size (uint64, to ``sizes``) and the total bytes (uint64, to
        ``span``)."""
        self._run(
            "vgpu_gather", n, stream, out_ptrs, out_sizes, flags, n, dst, final, addrs, sizes, span
        )  # fmt: skip

    def copy_span_async(self, dst: int, src: int, span: int, max_bytes: int, stream: int) -> None:
        """Copy the number of bytes stored (uint64) at ``span`` (at most ``max_bytes``, a
        multiple of 16) from ``src`` to ``dst``, both 16-byte aligned."""
        self._run("vgpu_copy_span", min(MAX_BLOCKS, -(-max_bytes // (16 * THREADS))), stream, dst, src, span)


_loaded: dict[int, Kernels] = {}
_lock = threading.Lock()


def load(device: int) -> Kernels:
    """The kernels for ``device``, built and loaded once per process.

    Raises:
        KernelsUnavailable: see :class:`Kernels`.
    """
    with _lock:
        if device not in _loaded:
            _loaded[device] = Kernels(device)
        return _loaded[device]
