"""The pausable allocator's library (``native/*.c``), loaded with ctypes.

The library is built once, beside this module as ``libjupyter_vgpu_vmm.so`` by the
admin (``python -m jupyter_vgpu.kernel.pause.vmm build``), or else on first use into the
user's cache directory with the system ``cc``; where neither works, :func:`load` raises
:class:`VMMUnavailable` with the reason, and kernels run without pause (``%vgpu status``
says why). ``native/vmm.c`` describes what the library does.

Torch-free: the engine hands unit addresses to the codec itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from ..cache import cache_dir

NATIVE = Path(__file__).with_name("native")
#: The library's C sources, compiled together (``vmm.h`` is their internal header,
#: ``driver.h`` the driver's types and the table of its entry points).
SOURCES = tuple(
    NATIVE / name
    for name in (
        "vmm.c",
        "handles.c",
        "arena.c",
        "ipc.c",
        "interpose.c",
        "held.c",
        "gate.c",
        "grow.c",
        "stubs.S",
    )
)
HEADERS = tuple(NATIVE / name for name in ("vmm.h", "driver.h", "stubs.h"))
LIBRARY_NAME = "libjupyter_vgpu_vmm.so"
#: How the library is compiled, wherever it is built (install, first use, tests): every
#: warning is an error, so a prototype out of step with its definition, a function
#: another file declares by hand, or an unused parameter stops the build.
CFLAGS = ("-O2", "-Wall", "-Wextra", "-Wmissing-prototypes", "-Werror", "-shared", "-fPIC")
LIBS = ("-ldl", "-lpthread")

#: Backends of :meth:`VMM.init`.
CUDA, HOST = 1, 2
#: ``vgpu_map`` found no room on the device (``CUDA_ERROR_OUT_OF_MEMORY``).
OUT_OF_MEMORY = 2


class VMMUnavailable(RuntimeError):
    """The library is missing and cannot be built here; the message says why."""


class VMMError(RuntimeError):
    """A call of the library failed. Its message reads ``what: NAME: words (the library's
    words)``, e.g. ``resuming the segment at 0x7f3a00000000: CUDA_ERROR_OUT_OF_MEMORY: out
    of memory (mapping the unit at 0x7f3a00000000)``.

    Args:
        code: see the attribute.
        what: what the caller was doing.
        name, text: the error's name and words; by default the loaded library's
            (:meth:`VMM.describe`), which asks the driver.
        detail: the library's own words for this failure (``vgpu_last_message``).

    Attributes:
        code: the CUDA driver error (``CUresult``) or one of the library's own (900-904).
        name: ``CUDA_ERROR_OUT_OF_MEMORY`` (``cuGetErrorName``), or the library's own
            ``VGPU_ERROR_...``; ``error <code>`` where nothing knows the code.
        text: ``out of memory`` (``cuGetErrorString``), or the library's own words; ""
            where nothing knows them.
        detail: the library's words, or "".
    """

    def __init__(
        self, code: int, what: str, name: str | None = None, text: str | None = None, detail: str = ""
    ):
        if name is None or text is None:
            known_name, known_text = describe(code)
            name = known_name if name is None else name
            text = known_text if text is None else text
        self.code, self.what, self.name, self.text, self.detail = code, what, name, text, detail
        message = f"{what}: {name}: {text}" if text else f"{what}: {name}"
        super().__init__(f"{message} ({detail})" if detail else message)


class DeviceFull(VMMError):
    """The device has no room for the segment's physical memory; nothing changed."""


class GateBusy(RuntimeError):
    """The gate could not close: a GPU call already in the driver did not return in time
    (a long synchronous copy of another thread); the message says how long was waited."""


#: Flags of a unit (``native/vmm.h``, ``UNIT_*``).
UNIT_MAPPED, UNIT_OTHERS, UNIT_PAUSABLE, UNIT_CHUNK, UNIT_EXPORTED, UNIT_ASYNC = 1, 2, 4, 8, 16, 32


@dataclasses.dataclass(frozen=True)
class Segment:
    """One unit the engine pauses: a reserved address range of the allocator's own, or an
    allocation another library made with ``cuMemCreate``, at the address of a mapping
    that covers it whole.

    Attributes:
        ptr: first address.
        size: bytes (a multiple of the allocation granularity, 2 MiB on current GPUs).
        device: CUDA ordinal.
        mapped: physical memory is behind it (False: paused).
        flags: ``UNIT_*`` bits (0 where the caller did not give them).
    """

    ptr: int
    size: int
    device: int
    mapped: bool
    flags: int = UNIT_PAUSABLE

    @property
    def pausable(self) -> bool:
        """False for memory shared with another process through CUDA IPC: a peer maps it."""
        return bool(self.flags & UNIT_PAUSABLE)

    @property
    def kind(self) -> str:
        """``own`` (cudaMalloc, cuMemAlloc), ``small`` (a chunk of small allocations),
        ``async`` (stream-ordered) or ``others`` (made with cuMemCreate by a library)."""
        if self.flags & UNIT_OTHERS:
            return "others"
        if self.flags & UNIT_CHUNK:
            return "small"
        return "async" if self.flags & UNIT_ASYNC else "own"


@dataclasses.dataclass(frozen=True)
class Figures:
    """What the allocator holds, bytes (``vgpu_figures``); each byte is in one of the
    first nine.

    Attributes:
        own: its own segments, mapped and pausable (cudaMalloc, cuMemAlloc,
            stream-ordered allocations, chunks of small ones).
        own_paused: its own segments, paused.
        others: ``cuMemCreate`` memory of other libraries (PyTorch's expandable
            segments, XLA), mapped and pausable.
        others_paused: the same, paused.
        exported: memory shared with other processes through CUDA IPC (never paused:
            a peer maps it).
        imported: other processes' memory mapped here (theirs to pause).
        managed: managed (unified) memory, which the driver migrates itself.
        let_through: stream-ordered memory the driver allocated itself (inside a CUDA
            graph capture, or from a pool the caller made).
        unmappable: ``cuMemCreate`` memory that no single mapping covers.
        async_live: stream-ordered allocations in use (a part of ``own``).
        async_cached: stream-ordered segments freed and kept for reuse (they hold nothing).
        small_chunks: chunks holding allocations under 1 MiB (a part of ``own``).
    """

    own: int
    own_paused: int
    others: int
    others_paused: int
    exported: int
    imported: int
    managed: int
    let_through: int
    unmappable: int
    async_live: int
    async_cached: int
    small_chunks: int

    @property
    def pausable(self) -> int:
        """Device bytes a pause releases."""
        return self.own + self.others

    @property
    def unpausable(self) -> int:
        """Device bytes of this process the allocator knows and a pause cannot release."""
        return self.exported + self.managed + self.let_through + self.unmappable

    @property
    def device(self) -> int:
        """Device bytes the allocator knows of (pausable or not; the CUDA context and the
        driver's own memory are not among them)."""
        return self.pausable + self.unpausable + self.async_cached


def compile_command(compiler: str, target: str, sources: tuple[Path, ...] = SOURCES) -> list[str]:
    """The command that compiles ``sources`` into the shared library ``target``
    (:data:`CFLAGS`)."""
    return [compiler, *CFLAGS, "-o", target, *map(str, sources), *LIBS]


def build(target: Path, sources: tuple[Path, ...] = SOURCES) -> Path:
    """Compile ``sources`` into the shared library ``target`` with the system C compiler,
    every warning an error (:data:`CFLAGS`).

    ``-O2`` matters beyond speed: the library's ``dlsym`` must end in a sibling call to
    glibc's, so that glibc resolves ``RTLD_NEXT`` and ``RTLD_DEFAULT`` for its caller.

    Raises:
        VMMUnavailable: no compiler (``$CC``, ``cc``, ``gcc``) or the build failed (the
            compiler's first complaint in the message).
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise VMMUnavailable("no C compiler (cc) to build the pausable allocator")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = compile_command(compiler, tmp, sources)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        os.unlink(tmp)
        raise VMMUnavailable(f"building the pausable allocator failed: {result.stderr.strip()[:500]}")
    # every user's kernels preload it: readable by all, whatever the umask or mkstemp's 0600
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)  # atomic: concurrent kernels never load a half-written file
    return target


def library_path() -> Path:
    """The built library: next to this module, else in the cache (built now if needed).

    Raises:
        VMMUnavailable: see :func:`build`.
    """
    packaged = Path(__file__).with_name(LIBRARY_NAME)
    newest = max(p.stat().st_mtime for p in (*SOURCES, *HEADERS))
    if packaged.exists() and packaged.stat().st_mtime >= newest:
        return packaged
    flags = " ".join((*CFLAGS, *LIBS)).encode()
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (*SOURCES, *HEADERS)) + flags).hexdigest()[:16]
    cached = cache_dir() / f"vmm-{digest}.so"
    return cached if cached.exists() else build(cached)


#: The gate's modes (native/stubs.h).
PRESENT, PAUSED, SUSPENDED = 0, 1, 2

#: The longest path of the grow channel's socket (:meth:`VMM.set_grow_channel`), bytes:
#: ``sun_path``'s room, less its NUL.
GROW_CHANNEL_PATH_MAX = 107


@dataclasses.dataclass(frozen=True)
class GateFigures:
    """The gate of native/gate.c now.

    Attributes:
        mode: :data:`PRESENT`, :data:`PAUSED` or :data:`SUSPENDED`.
        waiting: threads whose GPU call waits now.
        since: monotonic seconds (``time.monotonic``'s clock) the first of them began to
            wait, or None.
        held_total: calls held since the process started.
        wanted: a held call asked for the kernel to come back in this time away.
    """

    mode: int
    waiting: int
    since: float | None
    held_total: int
    wanted: bool


class VMM:
    """The process's pausable allocator (one per process: the C library keeps one table).

    Args:
        path: the shared library.
    """

    def __init__(self, path: Path):
        self.path = path
        lib = self._lib = ctypes.CDLL(str(path))
        u64, i32, sz = ctypes.c_uint64, ctypes.c_int, ctypes.c_size_t
        lib.vgpu_init.argtypes, lib.vgpu_init.restype = [i32], i32
        lib.vgpu_malloc.argtypes = [ctypes.c_ssize_t, i32, ctypes.c_void_p]
        lib.vgpu_malloc.restype = ctypes.c_void_p
        lib.vgpu_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, i32, ctypes.c_void_p]
        lib.vgpu_free.restype = None
        lib.vgpu_unmap.argtypes, lib.vgpu_unmap.restype = [u64], i32
        lib.vgpu_map.argtypes, lib.vgpu_map.restype = [u64], i32
        lib.vgpu_map_many.argtypes, lib.vgpu_map_many.restype = [ctypes.POINTER(u64), sz], i32
        lib.vgpu_units.argtypes = [
            ctypes.POINTER(u64),
            ctypes.POINTER(u64),
            ctypes.POINTER(i32),
            ctypes.POINTER(i32),
            sz,
        ]
        lib.vgpu_units.restype = sz
        lib.vgpu_figures.argtypes, lib.vgpu_figures.restype = [ctypes.POINTER(u64), sz], sz
        lib.vgpu_collect.argtypes, lib.vgpu_collect.restype = [], None
        lib.vgpu_mapped_bytes.argtypes, lib.vgpu_mapped_bytes.restype = [], u64
        lib.vgpu_backend.argtypes, lib.vgpu_backend.restype = [], i32
        lib.vgpu_preloaded.argtypes, lib.vgpu_preloaded.restype = [], i32
        lib.vgpu_last_error.argtypes, lib.vgpu_last_error.restype = [], i32
        lib.vgpu_last_message.argtypes, lib.vgpu_last_message.restype = [], ctypes.c_char_p
        lib.vgpu_error_name.argtypes, lib.vgpu_error_name.restype = [i32], ctypes.c_char_p
        lib.vgpu_error_string.argtypes, lib.vgpu_error_string.restype = [i32], ctypes.c_char_p
        lib.vgpu_gate_close.argtypes, lib.vgpu_gate_close.restype = [i32, i32], i32
        lib.vgpu_gate_set.argtypes, lib.vgpu_gate_set.restype = [i32], None
        lib.vgpu_gate_open.argtypes, lib.vgpu_gate_open.restype = [], None
        lib.vgpu_gate_mine.argtypes, lib.vgpu_gate_mine.restype = [i32], i32
        lib.vgpu_gate_wanted_fd.argtypes, lib.vgpu_gate_wanted_fd.restype = [], i32
        lib.vgpu_gate_fail.argtypes, lib.vgpu_gate_fail.restype = [i32, ctypes.c_char_p], None
        lib.vgpu_gate_figures.argtypes = [
            ctypes.POINTER(i32),
            ctypes.POINTER(ctypes.c_long),
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(u64),
            ctypes.POINTER(i32),
        ]
        lib.vgpu_gate_figures.restype = None
        lib.vgpu_stubs_available.argtypes, lib.vgpu_stubs_available.restype = [], i32
        lib.vgpu_set_grow_channel.argtypes, lib.vgpu_set_grow_channel.restype = [ctypes.c_char_p], i32
        lib.vgpu_grow_figures.argtypes, lib.vgpu_grow_figures.restype = [ctypes.POINTER(u64)], None

    # -- the gate (gate.c): no thread's GPU call reaches memory that is away -------------

    def gate_close(self, mode: int, timeout: float = 10.0) -> None:
        """Hold every GPU call of the process's threads from now on (``mode``:
        :data:`PAUSED`, or :data:`SUSPENDED`: every driver call), the machinery's marked
        threads aside, and wait up to ``timeout`` seconds for the calls already in the
        driver to return.

        Raises:
            GateBusy: a call did not return in time; the gate is open again.
        """
        if self._lib.vgpu_gate_close(mode, int(timeout * 1000)):
            raise GateBusy(f"a GPU call of another thread of this kernel did not return within {timeout:g} s")

    def gate_set(self, mode: int) -> None:
        """Change what the closed gate holds (a restored process: :data:`PAUSED`)."""
        self._lib.vgpu_gate_set(mode)

    def gate_open(self) -> None:
        """Let every held call go on (the kernel is back); frees deferred meanwhile happen now."""
        self._lib.vgpu_gate_open()

    def gate_fail(self, why: str, code: int = 2) -> None:
        """The way back failed: the calls held return ``code`` (CUDA's error number,
        ``CUDA_ERROR_OUT_OF_MEMORY`` by default) with ``why`` as the library's last
        message, and so does every call made before the gate opens."""
        self._lib.vgpu_gate_fail(code, why.encode(errors="replace")[:250])

    @contextlib.contextmanager
    def machinery(self):
        """While in this block, the calling thread's GPU calls are never held: it is the
        pause engine moving the memory (not the user's code)."""
        was = self._lib.vgpu_gate_mine(1)
        try:
            yield
        finally:
            self._lib.vgpu_gate_mine(was)

    def wanted_fd(self) -> int:
        """An eventfd that becomes readable when a held call asks for the kernel to come
        back (once per time away)."""
        return self._lib.vgpu_gate_wanted_fd()

    def gate(self) -> GateFigures:
        """The gate now (:class:`GateFigures`)."""
        mode, waiting, since, total, wanted = (
            ctypes.c_int(), ctypes.c_long(), ctypes.c_double(), ctypes.c_uint64(), ctypes.c_int()
        )  # fmt: skip
        self._lib.vgpu_gate_figures(
            ctypes.byref(mode),
            ctypes.byref(waiting),
            ctypes.byref(since),
            ctypes.byref(total),
            ctypes.byref(wanted),
        )
        return GateFigures(mode.value, waiting.value, since.value or None, total.value, bool(wanted.value))

    # -- growth on demand: room asked for before an allocation fails --------------------

    def set_grow_channel(self, path: str | None) -> None:
        """Ask the node arbiter listening at the Unix socket ``path`` for room whenever the
        driver refuses a physical allocation of this process for lack of memory, before the
        allocating code sees the error; None (or "") stops asking and closes the channel.

        The arbiter grants a running cell what it holds plus a margin and makes the rest of
        its room only when the cell grows (docs/design.md, "Growth on demand"). The ask is
        made by the C library itself, on the allocating thread, over a connection of its
        own to the arbiter (the grow channel), and never enters Python: the allocating
        thread may hold a lock of another library (PyTorch's caching allocator's) that a
        thread holding Python's lock waits for (``torch.cuda.memory_allocated``), so an ask
        that needed Python's lock there would deadlock the process; this one needs no lock
        of Python's. It asks for ``bytes``, the size of the physical allocation refused (a
        multiple of the allocation granularity; an allocation under 1 MiB asks for its
        2 MiB chunk), and waits for the answer with no lock of the library held: granted,
        the allocation is tried again (at most 4 asks for one allocation); anything else
        leaves the out-of-memory error to the caller, exactly as without a channel. One ask
        at a time: another thread's waits for it, then asks itself. Never asked: by the
        pause engine's threads (:meth:`machinery`), from inside an ask, nor in a child of
        ``fork()`` (the channel is closed there without a word).

        Covered: ``cudaMalloc``, ``cuMemAlloc``, ``cuMemAllocPitch``, stream-ordered
        allocations on the default pools, other libraries' ``cuMemCreate`` on a device,
        and :meth:`malloc` (PyTorch's pluggable allocator). Not covered: managed memory,
        and stream-ordered allocations the driver makes itself (graph captures, pools of
        the caller's).

        The channel, connected at the first ask (again at the next ask after it closed),
        one JSON object a line both ways::

            -> {"type":"channel","version":4,"for":"grow"}
            <- {"type":"ok"}  or  {"type":"error","message":"..."} (the arbiter closes)
            -> {"type":"room","id":N,"for":"grow","bytes":B}   (N = 1, 2, ... a process)
            <- {"type":"wait","id":N,"message":"..."}  (any number), then one of
            <- {"type":"grant","id":N}  {"type":"deny","id":N,...}  {"type":"failed","id":N,...}

        Lines of another id are skipped. No line for 60 s (``JUPYTER_VGPU_GROW_SILENCE_S``
        in the environment, seconds, overrides it), an error, the connection's end, or a
        line past 64 KiB close the channel and answer no room.

        Raises:
            ValueError: ``path`` is longer than :data:`GROW_CHANNEL_PATH_MAX` bytes (the
                channel is left as it was).
        """
        raw = os.fsencode(path) if path else b""
        if len(raw) > GROW_CHANNEL_PATH_MAX or b"\0" in raw:
            raise ValueError(
                f"the grow channel's socket path is {len(raw)} bytes; a Unix socket's path holds"
                f" {GROW_CHANNEL_PATH_MAX} at most, and no NUL"
            )
        if self._lib.vgpu_set_grow_channel(raw or None) != 0:
            raise ValueError(f"the grow channel's socket path {path!r} was refused")

    def grow_figures(self) -> tuple[int, int]:
        """``(asks, granted)``: how many times the arbiter was asked for room
        (:meth:`set_grow_channel`), and how many allocations succeeded after asking, since
        the library was loaded (in a child of ``fork()``, since the fork). Raises nothing."""
        out = (ctypes.c_uint64 * 2)()
        self._lib.vgpu_grow_figures(out)
        return out[0], out[1]

    @property
    def last_error(self) -> int:
        """The calling thread's last error in the library (``CUresult``, or 900-904); each
        thread has its own."""
        return self._lib.vgpu_last_error()

    @property
    def last_message(self) -> str:
        """The library's words for the calling thread's last error (what failed, and why)."""
        return (self._lib.vgpu_last_message() or b"").decode(errors="replace")

    def describe(self, code: int) -> tuple[str, str]:
        """The name and the words of an error ``code`` the library returned: the library's
        own (900-904), else the driver's (``cuGetErrorName``, ``cuGetErrorString``: the
        driver the library loaded, asked only while the process is not suspended), else
        the name the library knows; ``error <code>`` and "" where none knows it."""
        name, text = self._lib.vgpu_error_name(code), self._lib.vgpu_error_string(code)
        return (
            name.decode(errors="replace") if name else f"error {code}",
            text.decode(errors="replace") if text else "",
        )

    @property
    def holds_every_call(self) -> bool:
        """True where every driver entry point handed out is held while the kernel is
        suspended (x86-64); elsewhere only the library's own (launches, copies, sets,
        allocations), and a thread may wait in the driver's lock until the restore."""
        return bool(self._lib.vgpu_stubs_available())

    def init(self, backend: int) -> None:
        """Choose the backend once per process: :data:`CUDA` or :data:`HOST`.

        Raises:
            VMMError: no CUDA driver, or another backend was chosen before.
        """
        rc = self._lib.vgpu_init(backend)
        if rc:
            self._raise(rc, "choosing the allocator's backend")

    @property
    def preloaded(self) -> bool:
        """True when this library's ``cudaMalloc`` is the process's (it was loaded with
        LD_PRELOAD): only then is every allocation of the process pausable."""
        return bool(self._lib.vgpu_preloaded())

    @property
    def backend(self) -> int:
        """:data:`CUDA`, :data:`HOST`, or 0 before :meth:`init`."""
        return self._lib.vgpu_backend()

    def malloc(self, nbytes: int, device: int = 0) -> int:
        """A new mapped segment of at least ``nbytes``; its address.

        Raises:
            VMMError: the allocation failed (``DeviceFull`` when out of memory).
        """
        ptr = self._lib.vgpu_malloc(nbytes, device, None)
        if not ptr:
            self._raise(self._lib.vgpu_last_error(), f"allocating {nbytes} bytes")
        return ptr

    def free(self, ptr: int, device: int = 0) -> None:
        """Free the segment at ``ptr`` (mapped or paused)."""
        self._lib.vgpu_free(ptr, 0, device, None)

    def unmap(self, ptr: int) -> None:
        """Release the physical memory of the segment at ``ptr``; its addresses stay reserved.

        Raises:
            VMMError: unknown segment, already paused, or the driver refused.
        """
        rc = self._lib.vgpu_unmap(ptr)
        if rc:
            self._raise(rc, f"pausing the segment at {ptr:#x}")

    def map(self, ptr: int) -> None:
        """Put new physical memory behind the paused segment at ``ptr``, same addresses.

        Raises:
            DeviceFull: no room on the device; the segment stays paused.
            VMMError: unknown segment, not paused, or the driver refused.
        """
        rc = self._lib.vgpu_map(ptr)
        if rc:
            self._raise(rc, f"resuming the segment at {ptr:#x}")

    def map_many(self, ptrs: list[int]) -> None:
        """:meth:`map` for many paused units at once, all or none (the access of adjacent
        units is set in one driver call).

        Raises:
            DeviceFull: no room on the device for all of them; every one stays paused.
            VMMError: an unknown unit, one not paused, or the driver refused; every one
                stays paused.
        """
        if not ptrs:
            return
        array = (ctypes.c_uint64 * len(ptrs))(*ptrs)
        rc = self._lib.vgpu_map_many(array, len(ptrs))
        if rc:
            self._raise(rc, f"resuming {len(ptrs)} units")

    def segments(self) -> list[Segment]:
        """Every unit (segments of the allocator's own, and others' ``cuMemCreate``
        allocations), in no particular order; freed segments kept for reuse are left out."""
        while True:
            n = self._lib.vgpu_units(None, None, None, None, 0) + 16
            ptrs, sizes = (ctypes.c_uint64 * n)(), (ctypes.c_uint64 * n)()
            devices, flags = (ctypes.c_int * n)(), (ctypes.c_int * n)()
            count = self._lib.vgpu_units(ptrs, sizes, devices, flags, n)
            if count <= n:
                return [
                    Segment(ptrs[i], sizes[i], devices[i], bool(flags[i] & UNIT_MAPPED), flags[i])
                    for i in range(count)
                ]

    def figures(self) -> Figures:
        """What the allocator holds now (:class:`Figures`, bytes)."""
        out = (ctypes.c_uint64 * 12)()
        self._lib.vgpu_figures(out, 12)
        return Figures(*out)

    def collect(self) -> None:
        """Give back memory that holds nothing: stream-ordered allocations freed on work
        that has finished, freed segments kept for reuse, empty chunks of small
        allocations. The caller has synchronized the device (a pause does first)."""
        self._lib.vgpu_collect()

    @property
    def mapped_bytes(self) -> int:
        """Bytes with physical memory behind them."""
        return self._lib.vgpu_mapped_bytes()

    def _raise(self, code: int, what: str):
        """Raise the error of the library call this thread just made, which returned ``code``,
        with the driver's name and words for it and the library's own (its last message)."""
        name, text = self.describe(code)
        detail = self.last_message if self.last_error == code else ""
        raise (DeviceFull if code == OUT_OF_MEMORY else VMMError)(code, what, name, text, detail)


_instance: VMM | None = None
_lock = threading.Lock()


def describe(code: int) -> tuple[str, str]:
    """:meth:`VMM.describe` through the process's library where it is loaded; else
    ``error <code>`` and ""."""
    return _instance.describe(code) if _instance is not None else (f"error {code}", "")


def load() -> VMM:
    """The process's :class:`VMM` (loaded, and built if needed, on first call).

    Raises:
        VMMUnavailable: the library cannot be found or built here.
    """
    global _instance
    with _lock:
        if _instance is None:
            _instance = VMM(library_path())
        return _instance


def preload_environment(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` with the library first in ``LD_PRELOAD``, so that a process started
    with it routes every device allocation through the pausable allocator.

    Raises:
        VMMUnavailable: the library cannot be found or built here.
    """
    path = str(library_path())
    others = [p for p in environ.get("LD_PRELOAD", "").split(":") if p and p != path]
    return {**environ, "LD_PRELOAD": ":".join([path, *others])}


def main(argv: list[str] | None = None) -> None:
    """``python -m jupyter_vgpu.kernel.pause.vmm build``: build the library beside this
    module once (as the admin, at install time), so that users need no C compiler."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if args != ["build"]:
        sys.exit("usage: python -m jupyter_vgpu.kernel.pause.vmm build")
    print(build(Path(__file__).with_name(LIBRARY_NAME)))


if __name__ == "__main__":
    main()
