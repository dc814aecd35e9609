"""The pausable allocator's interposition, in real processes over a CUDA driver and runtime
on host memory (``tests/native``): every way a program reaches the driver gets the
allocator, every allocation path lands in a unit a pause releases, and what works
without the allocator (CUDA IPC between processes, dlsym's own rules, fork) works with it.
The same paths on the H100 are in ``tests/gpu/test_coverage.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ..native import build, environment, run

MiB = 1 << 20


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return build(tmp_path_factory.mktemp("native"))


def test_every_way_to_the_driver_gets_the_allocator(native):
    got = run(
        native,
        """
        start()
        ours = address(lib.cuMemAlloc_v2)
        found = {"dlsym": address(cuda.cuMemAlloc_v2) == ours}
        fp, status = vp(), ctypes.c_int()
        cuda.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fp), 13000, u64(0), ctypes.byref(status))
        found["cuGetProcAddress_v2"] = fp.value == ours
        cuda.cuGetProcAddress(b"cuMemCreate", ctypes.byref(fp), 11030, u64(0))
        found["cuGetProcAddress"] = fp.value == address(lib.cuMemCreate)
        cuda.cuGetProcAddress_v2(b"cuMemAllocAsync", ctypes.byref(fp), 13000, u64(2), ctypes.byref(status))
        found["per-thread stream variant"] = fp.value == address(lib.cuMemAllocAsync_ptsz)
        cuda.cuGetProcAddress_v2(b"cuGetProcAddress", ctypes.byref(fp), 13000, u64(0), ctypes.byref(status))
        found["cuGetProcAddress itself"] = fp.value == address(lib.cuGetProcAddress_v2)
        cuda.cuGetProcAddress_v2(b"cuMemAlloc", ctypes.byref(fp), 3000, u64(0), ctypes.byref(status))
        found["an older ABI is left alone"] = fp.value == address(cuda.cuMemAlloc)
        rt = ctypes.CDLL("libcudart.so.13")
        st = ctypes.byref(status)
        rt.cudaGetDriverEntryPointByVersion(b"cuMemMap", ctypes.byref(fp), 12000, u64(0), st)
        found["cudaGetDriverEntryPointByVersion"] = fp.value == address(lib.cuMemMap)
        cuda.cuGetProcAddress_v2(b"cuCtxSynchronize", ctypes.byref(fp), 13000, u64(0), ctypes.byref(status))
        found["what is not wrapped is the driver's"] = fp.value == address(cuda.cuCtxSynchronize)
        print(json.dumps(found))
        """,
    )
    assert len(got) == 8
    assert got == dict.fromkeys(got, True), got


def test_every_allocation_path_lands_in_units_a_pause_releases(native):
    got = run(
        native,
        """
        import numpy as np, torch
        from jupyter_vgpu.kernel.pause.engine import PauseEngine
        start()
        rt = ctypes.CDLL("libcudart.so.13")
        blocks = {}
        blocks["cuMemAlloc"] = alloc(24 * 2**20)
        blocks["cuMemAlloc, small"] = alloc(3000)
        p = vp()
        assert rt.cudaMalloc(ctypes.byref(p), size_t(6 * 2**20)) == 0
        blocks["the runtime's cudaMalloc"] = p.value
        assert rt.cudaMallocAsync(ctypes.byref(p), size_t(10 * 2**20), None) == 0
        blocks["cudaMallocAsync"] = p.value
        assert rt.cudaMallocAsync(ctypes.byref(p), size_t(1000), None) == 0
        blocks["cudaMallocAsync, small"] = p.value
        q, pool = u64(), vp()
        cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
        assert cuda.cuMemAllocFromPoolAsync(ctypes.byref(q), size_t(4 * 2**20), pool, None) == 0
        blocks["cuMemAllocFromPoolAsync"] = q.value
        # cuMemCreate pages in one reserved range, as PyTorch's expandable segments map them
        base = u64()
        r = cuda.cuMemAddressReserve(ctypes.byref(base), size_t(64 * 2**20), size_t(0), u64(0), u64(0))
        assert r == 0
        prop = (ctypes.c_int * 8)(1, 1, 1, 0, 0, 0, 0, 0)  # pinned, fd handles, on device 0
        access = (ctypes.c_int * 3)(1, 0, 3)
        for i in range(3):
            h = u64()
            assert cuda.cuMemCreate(ctypes.byref(h), size_t(2 * 2**20), prop, u64(0)) == 0
            assert h.value >> 48 == 0x7647, "the caller holds a handle of ours"
            page = u64(base.value + i * 2 * 2**20)
            assert cuda.cuMemMap(page, size_t(2 * 2**20), size_t(0), h, u64(0)) == 0
            assert cuda.cuMemRelease(h) == 0  # the mapping keeps it alive
        assert cuda.cuMemSetAccess(base, size_t(6 * 2**20), access, size_t(1)) == 0
        blocks["cuMemCreate pages"] = base.value
        sizes = {"cuMemAlloc, small": 3000, "cudaMallocAsync, small": 1000, "cuMemCreate pages": 6 * 2**20}
        rng = np.random.default_rng(0)
        data = {}
        for name, ptr in blocks.items():
            n = sizes.get(name, 2**20)
            data[name] = rng.integers(0, 256, n, dtype=np.uint8)
            ctypes.memmove(ptr, data[name].ctypes.data, n)
        before = used()
        kinds = sorted({k for _, _, k, _, _ in units()})
        engine = PauseEngine(torch, _vmm.load(), None, threads=2)
        engine.pause()
        away = used()
        engine.resume()
        same = {
            name: bool(np.array_equal(np.ctypeslib.as_array(
                (ctypes.c_uint8 * data[name].size).from_address(ptr)), data[name]))
            for name, ptr in blocks.items()
        }
        print(json.dumps({"before": before, "away": away, "back": used(), "same": same, "kinds": kinds,
                          "figures": _vmm.load().figures().__dict__}))
        """,
    )
    assert got["kinds"] == ["async", "others", "own", "small"], got["kinds"]
    assert got["before"] >= 54 * MiB  # 24 + 6 + 10 + 4 + 6 and two chunks of small ones
    assert got["away"] == 0, f"{got['away']} bytes stayed on the device through the pause"
    assert got["back"] > 0
    assert got["same"] == dict.fromkeys(got["same"], True), got["same"]
    assert got["figures"]["unmappable"] == 0
    assert got["figures"]["let_through"] == 0


def test_cumemcreate_memory_keeps_the_drivers_rules_under_handles_of_ours(native):
    got = run(
        native,
        """
        start()
        base = u64()
        cuda.cuMemAddressReserve(ctypes.byref(base), size_t(8 * 2**20), size_t(0), u64(0), u64(0))
        prop = (ctypes.c_int * 8)(1, 1, 1, 0, 0, 0, 0, 0)
        h = u64()
        assert cuda.cuMemCreate(ctypes.byref(h), size_t(4 * 2**20), prop, u64(0)) == 0
        # one allocation mapped twice: the engine pauses it through the mapping that covers it
        assert cuda.cuMemMap(base, size_t(4 * 2**20), size_t(0), h, u64(0)) == 0
        alias = base.value + 4 * 2**20
        assert cuda.cuMemMap(u64(alias), size_t(2 * 2**20), size_t(2 * 2**20), h, u64(0)) == 0
        access = (ctypes.c_int * 3)(1, 0, 3)
        cuda.cuMemSetAccess(base, size_t(8 * 2**20), access, size_t(1))
        ctypes.memset(base.value + 2 * 2**20, 9, 16)
        seen_through_alias = ctypes.c_uint8.from_address(alias).value
        out = {"alias": seen_through_alias, "units": len(units())}
        r = u64()
        retained = cuda.cuMemRetainAllocationHandle(ctypes.byref(r), vp(alias + 5))
        out["retain"] = retained == 0 and r.value == h.value
        cuda.cuMemRelease(r)
        got_prop = (ctypes.c_int * 8)()
        cuda.cuMemGetAllocationPropertiesFromHandle(got_prop, h)
        out["properties"] = list(got_prop)[:4] == [1, 1, 1, 0]
        cuda.cuMemRelease(h)
        assert lib.vgpu_unmap(u64(base.value)) == 0
        out["paused"] = used()
        assert lib.vgpu_map(u64(base.value)) == 0
        out["alias after resume"] = ctypes.c_uint8.from_address(alias).value  # new memory, same addresses
        ctypes.memset(base.value + 2 * 2**20, 5, 16)
        out["alias sees the new memory"] = ctypes.c_uint8.from_address(alias).value
        cuda.cuMemUnmap(base, size_t(8 * 2**20))  # both mappings: the allocation is gone
        out["after unmap"] = used()
        out["units after unmap"] = len(units())
        out["a stale handle"] = cuda.cuMemRelease(h)
        print(json.dumps(out))
        """,
    )
    assert got["alias"] == 9
    assert got["units"] == 1
    assert got["retain"]
    assert got["properties"]
    assert got["paused"] == 0
    assert got["alias after resume"] == 0
    assert got["alias sees the new memory"] == 5
    assert got["after unmap"] == 0
    assert got["units after unmap"] == 0
    assert got["a stale handle"] != 0


def test_units_come_back_all_or_none_with_one_access_call_per_run(native):
    """A resume maps every paused unit again or none: with room for only some, each stays
    paused and the device holds nothing more; adjacent pages (PyTorch's expandable
    segments) get their access in one driver call."""
    got = run(
        native,
        """
        start()
        cuda.fake_cuda_set_access_calls.restype = u64
        base = u64()
        cuda.cuMemAddressReserve(ctypes.byref(base), size_t(32 * 2**20), size_t(0), u64(0), u64(0))
        prop = (ctypes.c_int * 8)(1, 1, 1, 0, 0, 0, 0, 0)
        access = (ctypes.c_int * 3)(1, 0, 3)
        for i in range(8):
            h = u64()
            cuda.cuMemCreate(ctypes.byref(h), size_t(2 * 2**20), prop, u64(0))
            cuda.cuMemMap(u64(base.value + i * 2 * 2**20), size_t(2 * 2**20), size_t(0), h, u64(0))
            cuda.cuMemRelease(h)
        cuda.cuMemSetAccess(base, size_t(16 * 2**20), access, size_t(1))
        ctypes.memset(base.value, 3, 16 * 2**20)
        own = alloc(8 * 2**20)
        A = _vmm.load()
        ptrs = sorted(s.ptr for s in A.segments() if s.mapped)
        for p in ptrs:
            A.unmap(p)
        out = {"paused": used()}
        cuda.fake_cuda_limit(u64(10 * 2**20))  # room for the segment of ours and one page
        try:
            A.map_many(ptrs)
            out["error"] = None
        except _vmm.DeviceFull as e:
            out["error"] = type(e).__name__
        out["after refusal"] = used()
        out["still paused"] = all(not s.mapped for s in A.segments())
        cuda.fake_cuda_limit(u64(0))
        calls = cuda.fake_cuda_set_access_calls()
        A.map_many(ptrs)
        out["access calls"] = cuda.fake_cuda_set_access_calls() - calls
        out["mapped"] = all(s.mapped for s in A.segments())
        ctypes.memset(base.value, 4, 16 * 2**20)  # writable again, at the same addresses
        ctypes.memset(own, 4, 8 * 2**20)
        print(json.dumps(out))
        """,
    )
    assert got["paused"] == 0
    assert got["error"] == "DeviceFull"
    assert got["after refusal"] == 0
    assert got["still paused"]
    assert got["access calls"] == 2  # one for the eight pages side by side, one for the segment
    assert got["mapped"]


def test_an_error_reads_as_the_drivers_name_and_words_with_the_librarys_own(native):
    """A failed call names its error as the driver does (cuGetErrorName, cuGetErrorString,
    through the driver the library loaded), and says what the library was doing."""
    got = run(
        native,
        """
        start()
        A = _vmm.load()
        A.init(_vmm.CUDA)
        out = {}
        cuda.fake_cuda_limit(u64(2**20))  # no room for a segment
        try:
            A.malloc(4 * 2**20)
        except _vmm.DeviceFull as e:
            out["full"] = [str(e), e.code, e.name, e.text, e.detail]
        cuda.fake_cuda_limit(u64(0))
        try:
            A.unmap(0x1000)
        except _vmm.VMMError as e:
            out["own"] = str(e)
        out["only the driver knows"] = A.describe(101)
        out["nobody knows"] = A.describe(12345)
        out["raised by the engine"] = str(_vmm.DeviceFull(2, "resuming needs 8 free bytes"))
        print(json.dumps(out))
        """,
    )
    assert got["full"] == [
        "allocating 4194304 bytes: CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        " (a segment of 4194304 bytes on device 0)",
        2,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
        "a segment of 4194304 bytes on device 0",
    ]
    assert got["own"] == (
        "pausing the segment at 0x1000: VGPU_ERROR_UNKNOWN_POINTER: no segment starts at that address"
        " (releasing the unit at 0x1000)"
    )
    assert got["only the driver knows"] == ["CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"]
    assert got["nobody knows"] == ["error 12345", ""]
    engine = got["raised by the engine"]
    assert engine == "resuming needs 8 free bytes: CUDA_ERROR_OUT_OF_MEMORY: out of memory"


def test_two_threads_read_their_own_last_errors(native):
    """Two threads fail at once, differently; each then reads its own error, not the one
    the other made last, and a third thread's stays as it was."""
    got = run(
        native,
        """
        import threading
        start()
        A = _vmm.load()
        A.init(_vmm.CUDA)
        ptr = A.malloc(2 * 2**20)
        both_failed = threading.Barrier(2, timeout=10)
        seen = {}

        def fail(name, call):
            try:
                call()
            except _vmm.VMMError as e:
                raised = [e.code, e.name, e.detail]
            both_failed.wait()
            seen[name] = [*raised, A.last_error, A.last_message]

        threads = [threading.Thread(target=fail, args=("unknown", lambda: A.unmap(0x1000))),
                   threading.Thread(target=fail, args=("mapped", lambda: A.map(ptr)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        print(json.dumps({**seen, "ptr": ptr, "mine": [A.last_error, A.last_message]}))
        """,
    )
    unknown, mapped = "releasing the unit at 0x1000", f"mapping the unit at {got['ptr']:#x}: mapped already"
    assert got["unknown"] == [901, "VGPU_ERROR_UNKNOWN_POINTER", unknown, 901, unknown]
    assert got["mapped"] == [902, "VGPU_ERROR_BAD_STATE", mapped, 902, mapped]
    assert got["mine"] == [0, ""]


def test_small_allocations_share_chunks_and_keep_their_own_ranges(native):
    got = run(
        native,
        """
        start()
        ptrs = [alloc(4000) for _ in range(1000)]
        out = {"distinct": len(set(ptrs)), "aligned": all(p % 512 == 0 for p in ptrs), "used": used()}
        base, size = u64(), size_t()
        cuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), u64(ptrs[10] + 100))
        out["range"] = [base.value == ptrs[10], size.value]
        start_attr = u64()
        cuda.cuPointerGetAttribute(ctypes.byref(start_attr), 11, u64(ptrs[10] + 5))
        out["range start attribute"] = start_attr.value == ptrs[10]
        pitched, pitch = u64(), size_t()
        pitch_of = lambda elem: cuda.cuMemAllocPitch_v2(
            ctypes.byref(pitched), ctypes.byref(pitch), size_t(100), size_t(10), elem)
        out["pitch"] = [pitch_of(4), pitch.value]
        out["bad element size"] = pitch_of(3)
        out["interior free"] = cuda.cuMemFree_v2(u64(ptrs[0] + 512))
        for p in ptrs:
            assert cuda.cuMemFree_v2(u64(p)) == 0
        out["double free"] = cuda.cuMemFree_v2(u64(ptrs[0]))
        out["after free"] = used()
        print(json.dumps(out))
        """,
    )
    assert got["distinct"] == 1000
    assert got["aligned"]
    assert got["used"] <= 8 * MiB, "1000 small allocations took a segment each"
    assert got["range"] == [True, 4096]
    assert got["range start attribute"]
    assert got["pitch"] == [0, 128]
    assert got["bad element size"] == 1
    assert got["interior free"] != 0
    assert got["double free"] != 0
    assert got["after free"] <= 4 * MiB  # a chunk of each size stays for the next


def test_stream_ordered_frees_wait_for_their_stream(native):
    got = run(
        native,
        """
        start()
        rt = ctypes.CDLL("libcudart.so.13")
        pool = vp()
        cuda.cuDeviceGetDefaultMemPool(ctypes.byref(pool), 0)
        def attr(a):
            v = u64()
            cuda.cuMemPoolGetAttribute(pool, a, ctypes.byref(v))
            return v.value
        p, q = vp(), vp()
        rt.cudaMallocAsync(ctypes.byref(p), size_t(8 * 2**20), None)
        out = {"used in pool": attr(7), "reserved in pool": attr(5)}
        cuda.fake_cuda_hold_events(1)  # the stream has not reached the free yet
        rt.cudaFreeAsync(p, None)
        rt.cudaMallocAsync(ctypes.byref(q), size_t(8 * 2**20), None)
        out["reused before the stream got there"] = q.value == p.value
        rt.cudaFreeAsync(q, None)
        cuda.fake_cuda_hold_events(0)
        r = vp()
        rt.cudaMallocAsync(ctypes.byref(r), size_t(8 * 2**20), None)
        out["reused once it did"] = r.value in (p.value, q.value)
        out["high-water mark"] = attr(6) >= 16 * 2**20
        rt.cudaFreeAsync(r, None)
        cuda.fake_cuda_capture(1)  # inside a graph capture the driver allocates
        c = vp()
        rt.cudaMallocAsync(ctypes.byref(c), size_t(4 * 2**20), None)
        out["let through"] = _vmm.load().figures().let_through
        rt.cudaFreeAsync(c, None)
        cuda.fake_cuda_capture(0)
        out["let through after its free"] = _vmm.load().figures().let_through
        lib.vgpu_collect()
        out["after collect"] = used()
        out["reserved after collect"] = attr(5)
        print(json.dumps(out))
        """,
    )
    assert got["used in pool"] == 8 * MiB
    assert got["reserved in pool"] == 8 * MiB
    assert not got["reused before the stream got there"]
    assert got["reused once it did"]
    assert got["high-water mark"]
    assert got["let through"] == 4 * MiB
    assert got["let through after its free"] == 0
    assert got["after collect"] == 0
    assert got["reserved after collect"] == 0


IPC_EXPORT = """
start()
rt = ctypes.CDLL("libcudart.so.13")
p = vp()
assert rt.cudaMalloc(ctypes.byref(p), size_t(4 * 2**20)) == 0
ctypes.memset(p.value + 1000, 42, 64)
handle = ctypes.create_string_buffer(64)
r = rt.cudaIpcGetMemHandle(handle, vp(p.value + 1000))
"""

IPC_OPEN = """
start()
class Handle(ctypes.Structure):  # passed by value, as cuda.h's CUipcMemHandle
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
handle = Handle.from_buffer_copy(bytes.fromhex(sys.argv[1]))
cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), Handle, ctypes.c_uint]
d = u64()
r = cuda.cuIpcOpenMemHandle_v2(ctypes.byref(d), handle, 1)
assert r == 0, r
again = u64()
cuda.cuIpcOpenMemHandle_v2(ctypes.byref(again), handle, 1)
seen = ctypes.c_uint8.from_address(d.value).value
ctypes.memset(d.value, 7, 64)
cuda.cuIpcCloseMemHandle(again)
cuda.cuIpcCloseMemHandle(d)
print(json.dumps({"seen": seen, "same mapping": again.value == d.value}))
"""


def test_cuda_ipc_between_two_preloaded_processes(native, tmp_path):
    """The parent shares memory of the allocator's with a child (torch.multiprocessing's
    path: cudaIpcGetMemHandle, then cudaIpcOpenMemHandle in the child): the child sees the
    parent's bytes and the parent sees the child's writes; the shared segment is never
    paused."""
    script = tmp_path / "open.py"
    from ..native import PRELUDE

    script.write_text(PRELUDE + IPC_OPEN)
    got = run(
        native,
        IPC_EXPORT
        + f"""
import subprocess
assert r == 0, r
child = subprocess.run([sys.executable, {str(script)!r}, handle.raw.hex()], capture_output=True, text=True)
assert child.returncode == 0, child.stderr
seen = json.loads(child.stdout.strip().splitlines()[-1])
shared = [u for u in units() if u[0] == p.value]
print(json.dumps({{**seen, "parent sees": ctypes.c_uint8.from_address(p.value + 1000).value,
                  "pausable": shared[0][3], "unmap": lib.vgpu_unmap(u64(p.value)),
                  "exported": _vmm.load().figures().exported}}))
""",
    )
    assert got == {
        "seen": 42,
        "same mapping": True,
        "parent sees": 7,
        "pausable": False,
        "unmap": 902,
        "exported": 4 * MiB,
    }, got


def test_an_export_goes_to_processes_of_its_own_user_only(native):
    """The exporter hands its descriptor to callers of its own user: another user's
    process naming a live token gets nothing."""
    got = run(
        native,
        IPC_EXPORT
        + """
assert r == 0, r
import socket  # before the child drops to an account that may not read this Python
token, nonce = handle.raw[16:24], int.from_bytes(handle.raw[40:48], "little")
pid = os.getpid()
child = os.fork()
if child == 0:
    try:
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(5)
        try:  # refused at once (the connection closed before the token) or after it
            s.connect(b"\\0jupyter-vgpu-ipc-%d-%016x" % (pid, nonce))
            s.sendall(token)
            anc = s.recvmsg(1, socket.CMSG_SPACE(4))[1]
        except OSError:
            anc = []
        os._exit(3 if anc else 0)
    except BaseException:
        os._exit(4)
_, status = os.waitpid(child, 0)
print(json.dumps({"status": os.waitstatus_to_exitcode(status)}))
""",
    )
    assert got["status"] == 0, "another user's process was given the exporter's memory"


def test_an_importer_takes_memory_from_the_exporter_alone(native):
    """The exporter ended, and another user's process took its socket's name (read from
    /proc/net/unix: abstract names are visible to all) to answer for it: the importer
    checks the peer before it sends the token, and refuses what it is offered."""
    got = run(
        native,
        """
start()
import socket, time
rt = ctypes.CDLL("libcudart.so.13")
read_end, write_end = os.pipe()
exporter = os.fork()
if exporter == 0:  # shares memory, tells its handle, ends
    p = vp()
    assert rt.cudaMalloc(ctypes.byref(p), size_t(4 * 2**20)) == 0
    handle = ctypes.create_string_buffer(64)
    assert rt.cudaIpcGetMemHandle(handle, p) == 0
    os.write(write_end, handle.raw)
    os._exit(0)
raw = os.read(read_end, 64)
os.waitpid(exporter, 0)
pid, nonce = int.from_bytes(raw[8:12], "little"), int.from_bytes(raw[40:48], "little")
told_r, told_w = os.pipe()
impostor = os.fork()
if impostor == 0:  # another user, on the name the exporter left
    try:
        os.setgid(65534)
        os.setuid(65534)
        s = socket.socket(socket.AF_UNIX)
        s.bind(b"\\0jupyter-vgpu-ipc-%d-%016x" % (pid, nonce))
        s.listen(1)
        os.write(told_w, b"r")
        s.settimeout(10)
        c, _ = s.accept()
        c.settimeout(2)
        try:
            got = c.recv(8)
        except OSError:
            got = b""
        fd = os.open("/dev/null", os.O_RDONLY)
        try:
            c.sendmsg([b"x"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd.to_bytes(4, "little"))])
        except OSError:
            pass
        os._exit(2 if got else 0)
    except BaseException:
        os._exit(4)
assert os.read(told_r, 1) == b"r"
class Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]
cuda.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), Handle, ctypes.c_uint]
d = u64()
r = cuda.cuIpcOpenMemHandle_v2(ctypes.byref(d), Handle.from_buffer_copy(raw), 1)
_, status = os.waitpid(impostor, 0)
print(json.dumps({"opened": r == 0, "impostor": os.waitstatus_to_exitcode(status)}))
""",
    )
    assert got == {"opened": False, "impostor": 0}, got  # 2: the impostor was sent the token


def test_dlsym_keeps_glibcs_rules_for_its_callers(native, tmp_path):
    """glibc resolves RTLD_NEXT and RTLD_DEFAULT for the caller of dlsym: through the
    allocator's dlsym, a library still finds the next definition after itself, and a
    library loaded RTLD_LOCAL still finds its own dependency's symbols."""
    sources = {
        "libdep.c": "int dep_only(void) { return 7; }\nint shared_name(void) { return 2; }\n",
        "libfirst.c": (
            "#define _GNU_SOURCE\n#include <dlfcn.h>\nint shared_name(void) { return 1; }\n"
            'void *next_of(void) { return dlsym(RTLD_NEXT, "shared_name"); }\n'
            'void *default_of(void) { return dlsym(RTLD_DEFAULT, "dep_only"); }\n'
        ),
    }
    for name, text in sources.items():
        (tmp_path / name).write_text(text)
    # -O0: the test library's own calls to dlsym must not be sibling calls, or glibc
    # would see its caller's caller; --no-as-needed keeps libdep its dependency
    cc = ["cc", "-O0", "-shared", "-fPIC"]
    subprocess.run([*cc, "-o", str(tmp_path / "libdep.so"), str(tmp_path / "libdep.c")], check=True)
    subprocess.run(
        [
            *cc,
            "-o",
            str(tmp_path / "libfirst.so"),
            str(tmp_path / "libfirst.c"),
            f"-L{tmp_path}",
            "-Wl,--no-as-needed",
            "-ldep",
            "-ldl",
        ],
        check=True,
    )
    got = run(
        native,
        f"""
        first = ctypes.CDLL({str(tmp_path / "libfirst.so")!r}, mode=os.RTLD_LOCAL)
        dep = ctypes.CDLL({str(tmp_path / "libdep.so")!r})
        first.next_of.restype = first.default_of.restype = vp
        print(json.dumps({{
            "next": first.next_of() == address(dep.shared_name),
            "default finds the local dependency": first.default_of() == address(dep.dep_only),
        }}))
        """,
        LD_LIBRARY_PATH=f"{tmp_path}:{native}",
    )
    assert got == {"next": True, "default finds the local dependency": True}


def test_turned_off_every_entry_point_is_the_drivers(native):
    got = run(
        native,
        """
        start()
        p = alloc(4 * 2**20)
        print(json.dumps({"dlsym": address(cuda.cuMemAlloc_v2) == address(lib.cuMemAlloc_v2),
                          "units": len(units()), "used": used()}))
        """,
        JUPYTER_VGPU_PAUSABLE="0",
    )
    assert got == {"dlsym": False, "units": 0, "used": 4 * MiB}


def test_a_child_of_fork_allocates_without_waiting_on_the_parents_lock(native):
    got = run(
        native,
        """
        import threading
        start()
        stop = threading.Event()
        def churn():  # another thread in and out of the allocator while the parent forks
            start()
            while not stop.is_set():
                cuda.cuMemFree_v2(u64(alloc(3000)))
        t = threading.Thread(target=churn)
        t.start()
        codes = []
        for _ in range(20):
            child = os.fork()
            if child == 0:
                start()
                p = alloc(3 * 2**20)
                os._exit(0 if cuda.cuMemFree_v2(u64(p)) == 0 else 1)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
        stop.set()
        t.join()
        print(json.dumps({"codes": codes}))
        """,
        timeout=60,
    )
    assert got["codes"] == [0] * 20


def test_managed_memory_is_counted_as_unpausable(native):
    got = run(
        native,
        """
        start()
        rt = ctypes.CDLL("libcudart.so.13")
        p = vp()
        assert rt.cudaMallocManaged(ctypes.byref(p), size_t(3 * 2**20), 1) == 0
        f = _vmm.load().figures()
        out = {"managed": f.managed, "unpausable": f.unpausable}
        cuda.cuMemFree_v2(u64(p.value))
        out["after free"] = _vmm.load().figures().managed
        print(json.dumps(out))
        """,
    )
    assert got == {"managed": 3 * MiB, "unpausable": 3 * MiB, "after free": 0}


def test_processes_that_never_use_cuda_load_nothing(native):
    """Every process a kernel starts (pip, git, a shell) inherits LD_PRELOAD: the library
    stays out of their way and never loads the driver."""
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ctypes, json; print(json.dumps(ctypes.CDLL('libc.so.6').getpid() > 0))",
        ],
        env=environment(native),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(result.stdout) is True
    maps = subprocess.run(
        ["sh", "-c", "cat /proc/self/maps"],
        env=environment(native),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "libjupyter_vgpu_vmm" in maps or "vmm-" in maps
    assert "libcuda.so" not in maps


# -- growth on demand: an allocation the device has no room for asks the arbiter first --

#: The fake device's capacity in the tests of growth (``FAKE_CUDA_MEMORY_BYTES``).
CAPACITY = {"FAKE_CUDA_MEMORY_BYTES": str(16 * MiB)}

GROW = """
start()
A = _vmm.load()
rt = ctypes.CDLL("libcudart.so.13")
calls = []  # (device, bytes) of each ask
room = []  # allocations an ask frees, the last first

def frees_room(device, nbytes):
    calls.append([device, nbytes])
    if not room:
        return False
    # the library's lock is not held: the free takes it on this very thread
    assert cuda.cuMemFree_v2(u64(room.pop())) == 0
    return True

def refuses(device, nbytes):
    calls.append([device, nbytes])
    return False
"""


def grow(body: str) -> str:
    """:data:`GROW`, then ``body`` (dedented)."""
    return GROW + textwrap.dedent(body)


def test_an_allocation_past_the_room_asks_for_more_and_gets_it(native):
    """cuMemAlloc, cudaMalloc and the pluggable allocator's malloc past the device's room
    ask the callback once, with the device and the size of the physical allocation
    refused, before the caller sees an error; room made, the allocation succeeds."""
    got = run(
        native,
        grow(
            """
        A.set_grow(frees_room)
        out = {}
        room.append(alloc(12 * 2**20))
        p = u64()
        out["cuMemAlloc"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(5 * 2**20 + 1))  # 6 MiB of memory
        ctypes.memset(p.value, 1, 5 * 2**20 + 1)
        room.append(alloc(10 * 2**20))
        q = vp()
        out["cudaMalloc"] = rt.cudaMalloc(ctypes.byref(q), size_t(3 * 2**20))  # 4 MiB
        ctypes.memset(q.value, 2, 3 * 2**20)
        room.append(alloc(6 * 2**20))
        out["malloc"] = A.malloc(2 * 2**20) > 0
        out["calls"] = calls
        out["figures"] = A.grow_figures()
        out["used"] = used()
        print(json.dumps(out))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got["cuMemAlloc"] == 0
    assert got["cudaMalloc"] == 0
    assert got["malloc"]
    assert got["calls"] == [[0, 6 * MiB], [0, 4 * MiB], [0, 2 * MiB]]
    assert got["figures"] == [3, 3]
    assert got["used"] == 12 * MiB


def test_an_ask_refused_leaves_the_out_of_memory_as_it_was(native):
    """With no callback, one that refuses, one that raises, and one unset again, an
    allocation past the room fails the same way (code, name, the library's words); the
    callback is asked once per allocation, and never once unset."""
    got = run(
        native,
        grow(
            """
        import logging
        logged = []
        handler = logging.Handler()
        handler.emit = lambda record: logged.append(record.exc_info[0].__name__)
        logging.getLogger("jupyter_vgpu").addHandler(handler)

        def raises(device, nbytes):
            calls.append([device, nbytes])
            raise RuntimeError("the arbiter is gone")

        def attempt():
            p, q = u64(), vp()
            r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
            seen = [r, *A.describe(r), A.last_message, rt.cudaMalloc(ctypes.byref(q), size_t(32 * 2**20))]
            try:
                A.malloc(32 * 2**20)
            except _vmm.DeviceFull as e:
                seen.append(str(e))
            return seen

        out = {"none": attempt(), "calls none": len(calls)}
        for name, callback in (("refuses", refuses), ("raises", raises), ("unset", None)):
            A.set_grow(callback)
            out[name] = attempt()
            out["calls " + name] = len(calls)
        out["figures"] = A.grow_figures()
        out["logged"] = logged
        print(json.dumps(out))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got["none"] == [
        2,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
        "33554432 bytes on device 0",
        2,
        "allocating 33554432 bytes: CUDA_ERROR_OUT_OF_MEMORY: out of memory"
        " (a segment of 33554432 bytes on device 0)",
    ]
    assert got["refuses"] == got["raises"] == got["unset"] == got["none"]
    assert [got[f"calls {n}"] for n in ("none", "refuses", "raises", "unset")] == [0, 3, 6, 6]
    assert got["figures"] == [6, 0]
    assert got["logged"] == ["RuntimeError"] * 3, "the callback's exceptions are logged, never let into C"


def test_cumemcreate_and_stream_ordered_allocations_ask_too(native):
    """Other libraries' cuMemCreate and stream-ordered allocations (large, and small ones
    in a 2 MiB chunk) past the room ask for it before they fail."""
    got = run(
        native,
        grow(
            """
        A.set_grow(frees_room)
        out = {}
        room.append(alloc(14 * 2**20))
        prop = (ctypes.c_int * 8)(1, 1, 1, 0, 0, 0, 0, 0)  # pinned, fd handles, on device 0
        h = u64()
        out["cuMemCreate"] = cuda.cuMemCreate(ctypes.byref(h), size_t(4 * 2**20), prop, u64(0))
        room.append(alloc(12 * 2**20))
        p = u64()
        out["cuMemAllocAsync"] = cuda.cuMemAllocAsync(ctypes.byref(p), size_t(8 * 2**20), None)
        room.append(alloc(4 * 2**20))
        q = vp()
        out["cudaMallocAsync, small"] = rt.cudaMallocAsync(ctypes.byref(q), size_t(1000), None)
        out["calls"] = calls
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got["cuMemCreate"] == 0
    assert got["cuMemAllocAsync"] == 0
    assert got["cudaMallocAsync, small"] == 0
    assert got["calls"] == [[0, 4 * MiB], [0, 8 * MiB], [0, 2 * MiB]]
    assert got["figures"] == [3, 3]


def test_an_allocation_asks_four_times_at_most(native):
    """A callback that says room was made when none was: the allocation is tried again
    after each of four asks, then fails as it would have."""
    got = run(
        native,
        grow(
            """
        def claims(device, nbytes):
            calls.append([device, nbytes])
            return True

        A.set_grow(claims)
        p = u64()
        r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
        figures = A.grow_figures()
        print(json.dumps({"r": r, "message": A.last_message, "calls": len(calls), "figures": figures}))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got == {"r": 2, "message": "33554432 bytes on device 0", "calls": 4, "figures": [4, 0]}


def test_an_allocation_inside_the_callback_does_not_ask_again(native):
    """The callback's own allocation past the room gets the error at once, without a
    second ask from inside the first."""
    got = run(
        native,
        grow(
            """
        inner = []
        def allocates(device, nbytes):
            calls.append([device, nbytes])
            p = u64()
            inner.append(cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(24 * 2**20)))
            inner.append(len(calls))
            return False

        A.set_grow(allocates)
        p = u64()
        r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
        print(json.dumps({"r": r, "message": A.last_message, "calls": calls, "inner": inner}))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got == {"r": 2, "message": "33554432 bytes on device 0", "calls": [[0, 32 * MiB]], "inner": [2, 1]}


def test_the_pause_engines_threads_and_a_child_of_fork_never_ask(native):
    """The machinery's allocations (the pause engine's work areas, marked threads) and a
    child of fork()'s get the error at once; the kernel's own still ask."""
    got = run(
        native,
        grow(
            """
        A.set_grow(refuses)
        p = u64()
        out = {}
        with A.machinery():
            out["machinery"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
            try:
                A.malloc(32 * 2**20)
            except _vmm.DeviceFull:
                out["machinery malloc"] = "DeviceFull"
        out["calls by the machinery"] = len(calls)
        child = os.fork()
        if child == 0:
            r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
            os._exit(0 if r == 2 and not calls and A.grow_figures() == (0, 0) else 1)
        out["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        out["kernel"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
        out["calls"] = calls
        print(json.dumps(out))
        """
        ),
        timeout=30,
        **CAPACITY,
    )
    assert got == {
        "machinery": 2,
        "machinery malloc": "DeviceFull",
        "calls by the machinery": 0,
        "child": 0,
        "kernel": 2,
        "calls": [[0, 32 * MiB]],
    }
