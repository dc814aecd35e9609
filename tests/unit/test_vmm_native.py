"""The pausable allocator's interposition, in real processes over a CUDA driver and runtime
on host memory (``tests/native``): every way a program reaches the driver gets the
allocator, every allocation path lands in a unit a pause releases, and what works
without the allocator (CUDA IPC between processes, dlsym's own rules, fork) works with it.
The same paths on the H100 are in ``tests/gpu/test_coverage.py``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

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

#: The library's first line on the grow channel.
CHANNEL_LINE = b'{"type":"channel","version":4,"for":"grow"}\n'


class FakeArbiter:
    """The node arbiter's end of the allocator's grow channel, in the test's process: a
    Unix socket server on threads of its own, one per connection.

    Each connection's first line must be :data:`CHANNEL_LINE`; ``channel(index)`` (index:
    0, 1, ... the connections in order) says how it is answered: ``"ok"`` (every one,
    where ``channel`` is None), ``"error"`` (an error line, then the connection closed)
    or ``"close"`` (closed without a word). Each
    room line is handed to ``on_room(arbiter, send, msg)``, which answers with ``send``
    (a dict as a JSON line; bytes as they are) and may make room first
    (:meth:`make_room`). The fake device's capacity is a file its driver reads at every
    allocation (``FAKE_CUDA_MEMORY_FILE``, :meth:`env`), :data:`CAPACITY` at first: the
    arbiter makes room by raising it, as pausing another kernel frees the card.

    Attributes:
        lines: per connection, the lines received (bytes, newline and all).
        rooms: ``(time.monotonic(), msg)`` of every room line, in order.
        problems: what the library said that the protocol does not allow.
        most_outstanding: the most room requests unanswered at once.
    """

    def __init__(self, directory: Path, on_room, channel=None):
        self.path = str(directory / "grow.sock")
        self.capacity_file = directory / "capacity"
        self.capacity = CAPACITY
        self._lock = threading.Lock()
        self.make_room(0)
        self.on_room, self.channel = on_room, channel or (lambda index: "ok")
        self.lines: list[list[bytes]] = []
        self.rooms: list[tuple[float, dict]] = []
        self.problems: list[str] = []
        self.most_outstanding = 0
        self._outstanding: set[int] = set()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(self.path)
        self._server.listen(8)
        self._server.settimeout(0.05)

    def env(self) -> dict[str, str]:
        return {"FAKE_CUDA_MEMORY_FILE": str(self.capacity_file)}

    def make_room(self, nbytes: int) -> None:
        """``nbytes`` more of the fake device's capacity (the file replaced whole)."""
        with self._lock:
            self.capacity += nbytes
            spare = self.capacity_file.with_suffix(".new")
            spare.write_text(str(self.capacity))
            os.replace(spare, self.capacity_file)

    def __enter__(self) -> FakeArbiter:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        for t in list(self._threads):
            t.join(10)
        self._server.close()

    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            with self._lock:
                self._conns.append(conn)
                self.lines.append([])
                index = len(self.lines) - 1
            self._spawn(self._serve, conn, index)

    def _serve(self, conn: socket.socket, index: int) -> None:
        lines = self.lines[index]

        def send(msg) -> None:
            conn.sendall(msg if isinstance(msg, bytes) else json.dumps(msg).encode() + b"\n")

        # the library may close with a line of ours unread (past 64 KiB, say): a reset
        with conn, conn.makefile("rb") as f, contextlib.suppress(ConnectionError):
            first = f.readline()
            lines.append(first)
            if first != CHANNEL_LINE:
                self.problems.append(f"the first line is {first!r}")
                return
            how = self.channel(index)
            if how != "ok":
                if how == "error":
                    send({"type": "error", "message": "channel refused: no kernel of this process"})
                return
            send({"type": "ok"})
            while line := f.readline():
                lines.append(line)
                msg = json.loads(line)
                if set(msg) != {"type", "id", "for", "bytes"} or (msg["type"], msg["for"]) != (
                    "room",
                    "grow",
                ):
                    self.problems.append(f"not a room line for growth: {line!r}")
                    continue
                with self._lock:
                    self.rooms.append((time.monotonic(), msg))
                    self._outstanding.add(msg["id"])
                    self.most_outstanding = max(self.most_outstanding, len(self._outstanding))
                try:
                    self.on_room(self, send, msg)
                finally:
                    with self._lock:
                        self._outstanding.discard(msg["id"])

    def ids(self) -> list[int]:
        return [msg["id"] for _, msg in self.rooms]

    def asked(self) -> list[int]:
        """The bytes of every room line, in order."""
        return [msg["bytes"] for _, msg in self.rooms]


def grants(arbiter: FakeArbiter, send, msg: dict) -> None:
    """Room made for what was asked, then granted."""
    arbiter.make_room(msg["bytes"])
    send({"type": "grant", "id": msg["id"]})


def denies(arbiter: FakeArbiter, send, msg: dict) -> None:
    send({"type": "deny", "id": msg["id"], "message": "the card is full of running cells"})


def claims(arbiter: FakeArbiter, send, msg: dict) -> None:
    """Granted, though no room was made."""
    send({"type": "grant", "id": msg["id"]})


@pytest.fixture
def short_dir():
    """A folder of a short path: a Unix socket's path holds 107 bytes at most."""
    path = Path(tempfile.mkdtemp(prefix="vgpu-grow-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


#: The fake device's capacity in the tests of growth, at first.
CAPACITY = 16 * MiB

GROW = f"""
import threading, time
start()
A = _vmm.load()
rt = ctypes.CDLL("libcudart.so.13")
SOCKET = os.environ["GROW_SOCKET"]
FULL = alloc({CAPACITY})  # the device is full from here on

def attempt():
    p, q = u64(), vp()
    r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
    seen = [r, *A.describe(r), A.last_message, rt.cudaMalloc(ctypes.byref(q), size_t(32 * 2**20))]
    try:
        A.malloc(32 * 2**20)
    except _vmm.DeviceFull as e:
        seen.append(str(e))
    return seen
"""

#: What :data:`GROW`'s ``attempt()`` sees without an arbiter's room.
OUT_OF_MEMORY = [
    2,
    "CUDA_ERROR_OUT_OF_MEMORY",
    "out of memory",
    "33554432 bytes on device 0",
    2,
    "allocating 33554432 bytes: CUDA_ERROR_OUT_OF_MEMORY: out of memory"
    " (a segment of 33554432 bytes on device 0)",
]


#: Two allocations of 4 MiB past the room, each asking once: their codes and the figures.
TWO_ASKS = """
A.set_grow_channel(SOCKET)
p = u64()
out = {"codes": [cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(4 * 2**20)) for _ in range(2)]}
out["figures"] = A.grow_figures()
print(json.dumps(out))
"""


def run_grow(
    native, directory: Path, on_room, body: str, channel=None, timeout: float = 30, **extra: str
) -> tuple[dict, FakeArbiter]:
    """:data:`GROW`, then ``body`` (dedented), in a preloaded process over the stand-ins,
    beside a :class:`FakeArbiter` in ``directory`` answering with ``on_room`` (and
    ``channel``, where given); returns what the program printed and that arbiter, ended,
    its lines kept."""
    with FakeArbiter(directory, on_room, channel) as arbiter:
        got = run(
            native,
            GROW + textwrap.dedent(body),
            timeout=timeout,
            GROW_SOCKET=arbiter.path,
            **arbiter.env(),
            **extra,
        )
    return got, arbiter


def test_an_allocation_past_the_room_asks_the_arbiter_and_gets_it(native, short_dir):
    """cuMemAlloc, cudaMalloc and the pluggable allocator's malloc past the device's room
    ask the arbiter over the grow channel (connected at the first ask), each for the size
    of the physical allocation refused, before the caller sees an error; room made, the
    allocation succeeds."""
    got, arbiter = run_grow(
        native,
        short_dir,
        grants,
        """
        A.set_grow_channel(SOCKET)
        out = {}
        p = u64()
        out["cuMemAlloc"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(5 * 2**20 + 1))  # 6 MiB of memory
        ctypes.memset(p.value, 1, 5 * 2**20 + 1)
        q = vp()
        out["cudaMalloc"] = rt.cudaMalloc(ctypes.byref(q), size_t(3 * 2**20))  # 4 MiB
        ctypes.memset(q.value, 2, 3 * 2**20)
        out["malloc"] = A.malloc(2 * 2**20) > 0
        out["figures"] = A.grow_figures()
        out["used"] = used()
        print(json.dumps(out))
        """,
    )
    assert got == {"cuMemAlloc": 0, "cudaMalloc": 0, "malloc": True, "figures": [3, 3], "used": 28 * MiB}
    assert arbiter.lines == [
        [
            CHANNEL_LINE,
            b'{"type":"room","id":1,"for":"grow","bytes":6291456}\n',
            b'{"type":"room","id":2,"for":"grow","bytes":4194304}\n',
            b'{"type":"room","id":3,"for":"grow","bytes":2097152}\n',
        ]
    ]
    assert arbiter.problems == []


def test_cumemcreate_and_stream_ordered_allocations_ask_too(native, short_dir):
    """Other libraries' cuMemCreate and stream-ordered allocations (large, and small ones
    in a 2 MiB chunk) past the room ask for it before they fail."""
    got, arbiter = run_grow(
        native,
        short_dir,
        grants,
        """
        A.set_grow_channel(SOCKET)
        out = {}
        prop = (ctypes.c_int * 8)(1, 1, 1, 0, 0, 0, 0, 0)  # pinned, fd handles, on device 0
        h = u64()
        out["cuMemCreate"] = cuda.cuMemCreate(ctypes.byref(h), size_t(4 * 2**20), prop, u64(0))
        p = u64()
        out["cuMemAllocAsync"] = cuda.cuMemAllocAsync(ctypes.byref(p), size_t(8 * 2**20), None)
        q = vp()
        out["cudaMallocAsync, small"] = rt.cudaMallocAsync(ctypes.byref(q), size_t(1000), None)
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
    )
    assert got == {"cuMemCreate": 0, "cuMemAllocAsync": 0, "cudaMallocAsync, small": 0, "figures": [3, 3]}
    assert arbiter.asked() == [4 * MiB, 8 * MiB, 2 * MiB]
    assert arbiter.ids() == [1, 2, 3]
    assert arbiter.problems == []


def test_an_ask_not_granted_leaves_the_out_of_memory_as_it_was(native, short_dir):
    """With no channel, an arbiter that denies, a path where nothing listens, and the
    channel turned off again, an allocation past the room fails the same way (code, name,
    the library's words); the arbiter is asked once per allocation, and never once off. A
    path too long for a Unix socket is refused, the channel left as it was."""
    got, arbiter = run_grow(
        native,
        short_dir,
        denies,
        """
        out = {"none": attempt()}
        tries = {"denied": SOCKET, "unreachable": SOCKET + ".nobody", "off": None}
        for name, path in tries.items():
            A.set_grow_channel(path)
            out[name] = attempt()
            out["asks " + name] = A.grow_figures()[0]
        A.set_grow_channel(SOCKET)
        try:
            A.set_grow_channel("/" + "x" * 107)
        except ValueError as e:
            out["too long"] = str(e)
        A.set_grow_channel("/" + "x" * 106)  # 107 bytes: taken
        A.set_grow_channel(None)
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
    )
    assert got["none"] == OUT_OF_MEMORY
    assert got["denied"] == got["unreachable"] == got["off"] == got["none"]
    assert [got["asks denied"], got["asks unreachable"], got["asks off"]] == [3, 6, 6]
    assert got["figures"] == [6, 0]
    assert "107 at most" in got["too long"]
    assert arbiter.asked() == [32 * MiB] * 3
    assert len(arbiter.lines) == 1, "a denial keeps the channel open"
    assert arbiter.problems == []


def test_a_channel_refused_or_ended_answers_no_room_and_the_next_ask_connects_again(native, short_dir):
    """An error answered to the channel line, or the connection ended without a word: that
    ask is answered no room (the allocation fails as it would have), and the next ask
    connects again."""
    answers = ["error", "close", "ok"]
    got, arbiter = run_grow(
        native,
        short_dir,
        grants,
        """
        A.set_grow_channel(SOCKET)
        p = u64()
        out = {"codes": [cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(4 * 2**20)) for _ in range(3)]}
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
        channel=lambda index: answers[index],
    )
    assert got == {"codes": [2, 2, 0], "figures": [3, 1]}
    assert arbiter.lines == [
        [CHANNEL_LINE],
        [CHANNEL_LINE],
        [CHANNEL_LINE, b'{"type":"room","id":1,"for":"grow","bytes":4194304}\n'],
    ]
    assert arbiter.problems == []


def test_wait_lines_and_lines_of_other_ids_are_read_past_to_the_answer(native, short_dir):
    """Wait lines, lines of another id, lines that are no JSON object and a long line
    (under 64 KiB) come before the grant; fields in any order, spaces around the colons,
    "type" and "id" inside strings and nested objects: the grant is found all the same."""

    def waits_then_grants(arbiter, send, msg):
        rid = msg["id"]
        send({"type": "wait", "id": rid, "message": "pausing kernel k1 for you"})
        quoted = b'"{\\"type\\":\\"grant\\",\\"id\\":%d}"' % rid  # a grant's line, as a string
        send(b'{ "message" : %s, "id" : %d , "type" : "wait" }\n' % (quoted, rid))
        send({"type": "grant", "id": rid + 1000})  # another ask's
        send({"type": "grant", "extra": {"type": "grant", "id": rid}, "list": [1, {"id": rid}], "id": -rid})
        send(b"this is no JSON object\n")
        send(b'{"type":"grant","id":1e3}\n')
        send({"type": "wait", "id": rid, "message": "x" * 60000})
        arbiter.make_room(msg["bytes"])
        send(b'{"id":%d,"type": "grant"}\n' % rid)

    got, arbiter = run_grow(
        native,
        short_dir,
        waits_then_grants,
        TWO_ASKS,
    )
    assert got == {"codes": [0, 0], "figures": [2, 2]}
    assert arbiter.ids() == [1, 2]
    assert len(arbiter.lines) == 1
    assert arbiter.problems == []


def test_a_line_past_64_kib_closes_the_channel(native, short_dir):
    """A line longer than 64 KiB: the channel is closed, the ask answered no room; the
    next ask connects again."""

    def rambles_once(arbiter, send, msg):
        if msg["id"] == 1:
            send({"type": "wait", "id": 1, "message": "x" * 70000})
        else:
            grants(arbiter, send, msg)

    got, arbiter = run_grow(
        native,
        short_dir,
        rambles_once,
        TWO_ASKS,
    )
    assert got == {"codes": [2, 0], "figures": [2, 1]}
    assert [len(lines) for lines in arbiter.lines] == [2, 2]
    assert arbiter.ids() == [1, 2]


def test_a_silent_arbiter_is_given_up_after_the_silence(native, short_dir):
    """No line for JUPYTER_VGPU_GROW_SILENCE_S seconds (1 here; 60 unless set): the ask is
    answered no room and the channel closed; the next ask connects again. A wait line
    starts the silence again: waits 0.6 s apart keep an ask of 1.8 s alive."""

    def silent_then_slow(arbiter, send, msg):
        if msg["id"] == 1:
            return  # never a word
        for _ in range(3):
            time.sleep(0.6)
            send({"type": "wait", "id": msg["id"], "message": "suspending kernel k2"})
        grants(arbiter, send, msg)

    got, arbiter = run_grow(
        native,
        short_dir,
        silent_then_slow,
        """
        A.set_grow_channel(SOCKET)
        p = u64()
        out = {"codes": [], "seconds": []}
        for _ in range(2):
            t0 = time.monotonic()
            out["codes"].append(cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(4 * 2**20)))
            out["seconds"].append(time.monotonic() - t0)
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
        JUPYTER_VGPU_GROW_SILENCE_S="1",
    )
    assert got["codes"] == [2, 0]
    assert 0.9 < got["seconds"][0] < 5
    assert 1.7 < got["seconds"][1] < 6
    assert got["figures"] == [2, 1]
    assert [len(lines) for lines in arbiter.lines] == [2, 2]


def test_an_allocation_asks_four_times_at_most(native, short_dir):
    """An arbiter that grants when no room was made: the allocation is tried again after
    each of four asks, then fails as it would have."""
    got, arbiter = run_grow(
        native,
        short_dir,
        claims,
        """
        A.set_grow_channel(SOCKET)
        p = u64()
        r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
        print(json.dumps({"r": r, "message": A.last_message, "figures": A.grow_figures()}))
        """,
    )
    assert got == {"r": 2, "message": "33554432 bytes on device 0", "figures": [4, 0]}
    assert arbiter.ids() == [1, 2, 3, 4]
    assert arbiter.asked() == [32 * MiB] * 4


def test_two_threads_asking_at_once_ask_one_after_the_other(native, short_dir):
    """Two threads refused at once: one ask at a time on the channel (the second waits for
    the first's answer, then asks itself), and both allocations succeed."""

    def slowly_grants(arbiter, send, msg):
        time.sleep(0.3)
        grants(arbiter, send, msg)

    got, arbiter = run_grow(
        native,
        short_dir,
        slowly_grants,
        """
        A.set_grow_channel(SOCKET)
        barrier = threading.Barrier(2)
        codes = []
        def allocate():
            start()
            p = u64()
            barrier.wait()
            codes.append(cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(4 * 2**20)))
        threads = [threading.Thread(target=allocate) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(json.dumps({"codes": codes, "figures": A.grow_figures()}))
        """,
        JUPYTER_VGPU_GROW_SILENCE_S="5",  # an answer taken by the other thread: given up
    )
    assert got["codes"] == [0, 0]
    assert got["figures"][1] == 2
    assert arbiter.most_outstanding == 1
    assert arbiter.ids() == list(range(1, len(arbiter.rooms) + 1))
    assert len(arbiter.rooms) >= 2
    assert len(arbiter.lines) == 1


def test_the_pause_engines_threads_and_a_child_of_fork_never_ask(native, short_dir):
    """The machinery's allocations (the pause engine's work areas, marked threads) and a
    child of fork()'s get the error at once, the child saying nothing on the channel it
    inherited; the kernel's own still ask, on the same channel."""
    got, arbiter = run_grow(
        native,
        short_dir,
        denies,
        """
        A.set_grow_channel(SOCKET)
        p = u64()
        out = {"kernel": cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))}  # connects
        with A.machinery():
            out["machinery"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
            try:
                A.malloc(32 * 2**20)
            except _vmm.DeviceFull:
                out["machinery malloc"] = "DeviceFull"
        out["asks by the machinery"] = A.grow_figures()[0] - 1
        child = os.fork()
        if child == 0:
            r = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
            os._exit(0 if r == 2 and A.grow_figures() == (0, 0) else 1)
        out["child"] = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
        out["kernel again"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(32 * 2**20))
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
    )
    assert got == {
        "kernel": 2,
        "machinery": 2,
        "machinery malloc": "DeviceFull",
        "asks by the machinery": 0,
        "child": 0,
        "kernel again": 2,
        "figures": [2, 0],
    }
    assert len(arbiter.lines) == 1, "the child neither connected nor closed the kernel's channel"
    assert arbiter.ids() == [1, 2]
    assert arbiter.problems == []


def test_the_ask_needs_no_lock_of_pythons(native, short_dir):
    """The allocating thread asks and reads the answers while another thread holds
    Python's lock (a ctypes.PyDLL call): the ask never enters Python, so it cannot wait
    for the lock of a thread that waits for the allocating thread (PyTorch's allocator
    mutex, held across the allocation, against torch.cuda.memory_allocated)."""

    def first_slowly(arbiter, send, msg):
        if msg["id"] == 1:
            time.sleep(1)  # the other thread takes Python's lock meanwhile
        claims(arbiter, send, msg)

    got, arbiter = run_grow(
        native,
        short_dir,
        first_slowly,
        """
        libc = ctypes.PyDLL("libc.so.6")  # its calls keep Python's lock
        A.set_grow_channel(SOCKET)
        out = {}
        def allocate():
            start()
            p = u64()
            out["r"] = cuda.cuMemAlloc_v2(ctypes.byref(p), size_t(4 * 2**20))
        t = threading.Thread(target=allocate)
        t.start()
        time.sleep(0.3)  # the allocation is in the library, its first ask sent
        out["held from"] = time.monotonic()
        libc.sleep(3)
        out["held until"] = time.monotonic()
        t.join()
        out["figures"] = A.grow_figures()
        print(json.dumps(out))
        """,
    )
    assert got["r"] == 2
    assert got["figures"] == [4, 0]
    times = [t for t, _ in arbiter.rooms]
    assert len(times) == 4
    assert all(got["held from"] < t < got["held until"] for t in times[1:]), (times, got)
