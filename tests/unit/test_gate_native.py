"""The gate of the pausable allocator (native/gate.c) over a driver stand-in on host
memory (tests/native): while the kernel is away, no thread's GPU call reaches memory that
is not there; each waits, asks for the kernel to come back, and goes on once it is back.

"Device" memory is host memory here and a kernel is a host function run by the launch,
so a launch that reached a paused segment would fault the process (its pages are
unmapped), as a GPU's illegal address kills a CUDA context."""

import pytest

from ..native import build, run


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return build(tmp_path_factory.mktemp("native"))


HELD = """
start()
import select, threading, time
vmm = _vmm.load()
lib.vgpu_gate_mine(1)  # this thread brings the memory back; the others are the user's
ptr = alloc(2 * 2**20)
fp, status = vp(), ctypes.c_int()

def proc(name):
    cuda.cuGetProcAddress_v2(name, ctypes.byref(fp), 12000, u64(0), ctypes.byref(status))
    return fp.value

KERNEL = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p))
LAUNCH_ARGS = [vp] + [ctypes.c_uint] * 7 + [vp, ctypes.POINTER(ctypes.c_void_p), vp]

def launcher(keeps_gil):
    kind = ctypes.PYFUNCTYPE if keeps_gil else ctypes.CFUNCTYPE
    return kind(ctypes.c_int, *LAUNCH_ARGS)(proc(b"cuLaunchKernel"))

def write(value):
    return KERNEL(lambda params: ctypes.memset(params[0], value, 16))

def in_thread(fn):
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("rc", fn()))
    t.start()
    return t, out
"""


@pytest.mark.parametrize("keeps_gil", [False, True], ids=["gil-released", "gil-held"])
def test_a_launch_while_paused_waits_for_the_memory_and_asks_for_it(native, keeps_gil):
    """A launch into a paused segment (from a thread that releases the GIL, and from one
    that keeps it, as a C extension's call may) waits instead of faulting, asks for the
    kernel to come back (the eventfd), and writes once the memory is back."""
    got = run(
        native,
        HELD
        + f"""
launch = launcher({keeps_gil})
fd = vmm.wanted_fd()
vmm.gate_close(_vmm.PAUSED)
assert lib.vgpu_unmap(u64(ptr)) == 0  # released: touching it now would fault
kernel, params = write(7), (ctypes.c_void_p * 1)(ptr)
t, out = in_thread(lambda: launch(kernel, 1, 1, 1, 1, 1, 1, 0, None, params, None))
asked = bool(select.select([fd], [], [], 20)[0])  # runs only if the held thread let go of the GIL
os.read(fd, 8)
time.sleep(0.2)
waited, figures = t.is_alive(), vmm.gate()
assert lib.vgpu_map(u64(ptr)) == 0
vmm.gate_open()
t.join(20)
print(json.dumps({{"asked": asked, "waited": waited, "waiting": figures.waiting, "rc": out.get("rc"),
                  "byte": ctypes.c_uint8.from_address(ptr).value}}))
""",
    )
    assert got == {"asked": True, "waited": True, "waiting": 1, "rc": 0, "byte": 7}


def test_every_other_driver_call_waits_only_while_suspended(native):
    """A driver entry point with no form of the library's own (here cuDeviceGetCount) is
    handed out as a stub: it goes straight through while the kernel is paused (its
    context is there), and waits while the kernel is suspended (the driver's lock would
    block it, with the thread's GIL perhaps held)."""
    got = run(
        native,
        HELD
        + """
count = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(proc(b"cuDeviceGetCount"))
lib.vgpu_real_dlsym.restype, lib.vgpu_real_dlsym.argtypes = vp, [vp, ctypes.c_char_p]
stubbed = fp.value != lib.vgpu_real_dlsym(cuda._handle, b"cuDeviceGetCount")  # not the driver's own
n = ctypes.c_int()
vmm.gate_close(_vmm.PAUSED)
t, out = in_thread(lambda: count(ctypes.byref(n)))
t.join(10)
through_while_paused = not t.is_alive() and out.get("rc") == 0
vmm.gate_close(_vmm.SUSPENDED)
t, out = in_thread(lambda: count(ctypes.byref(n)))
time.sleep(0.3)
waited = t.is_alive()
vmm.gate_set(_vmm.PAUSED)  # the driver restored the process
t.join(10)
vmm.gate_open()
print(json.dumps({"stubbed": stubbed, "paused": through_while_paused, "suspended": waited,
                  "rc": out.get("rc"), "n": n.value, "every call": vmm.holds_every_call}))
""",
    )
    assert got == {"stubbed": True, "paused": True, "suspended": True, "rc": 0, "n": 1, "every call": True}


def test_a_free_while_away_is_deferred_until_the_kernel_is_back(native):
    """Freeing memory of the allocator's while the kernel is away returns at once, and the
    memory stays until the kernel is back (the pause engine may be moving it)."""
    got = run(
        native,
        HELD
        + """
before = used()
vmm.gate_close(_vmm.PAUSED)
t, out = in_thread(lambda: cuda.cuMemFree_v2(u64(ptr)))
t.join(10)
returned, kept = not t.is_alive() and out.get("rc") == 0, used() == before
vmm.gate_open()
print(json.dumps({"returned": returned, "kept while away": kept, "freed once back": used() < before}))
""",
    )
    assert got == {"returned": True, "kept while away": True, "freed once back": True}


def test_a_way_back_that_failed_ends_the_wait_with_an_error(native):
    """When the kernel cannot come back (no room before the arbiter's timeout), the held
    call returns CUDA_ERROR_OUT_OF_MEMORY, and the library's last message in the thread
    that made it says why (in that thread only: each thread has its own last error)."""
    got = run(
        native,
        HELD
        + """
launch = launcher(False)
vmm.gate_close(_vmm.PAUSED)
params = (ctypes.c_void_p * 1)(ptr)

def held():
    rc = launch(write(7), 1, 1, 1, 1, 1, 1, 0, None, params, None)
    return rc, vmm.last_error, vmm.last_message

t, out = in_thread(held)
time.sleep(0.2)
vmm.gate_fail("no room on the GPU for 600 s")
t.join(10)
rc, code, message = out["rc"]
print(json.dumps({"rc": rc, "code": code, "message": message, "named": vmm.describe(rc),
                  "the closing thread's": [vmm.last_error, vmm.last_message]}))
""",
    )
    assert got["rc"] == got["code"] == 2
    assert got["message"] == "no room on the GPU for 600 s"
    assert got["named"] == ["CUDA_ERROR_OUT_OF_MEMORY", "out of memory"]  # the driver's words
    assert got["the closing thread's"] == [0, ""]


def test_closing_waits_for_the_calls_already_in_the_driver(native):
    """A pause closes the gate, then waits for launches already inside the driver to
    return, so that none slips in between its look at the memory and its copy; one that
    does not return in time makes the close fail and leaves the gate open."""
    got = run(
        native,
        HELD
        + """
launch = launcher(False)
inside, leave = threading.Event(), threading.Event()
finished = []

def slow(params):
    inside.set()
    leave.wait(30)
    finished.append(1)

kernel, params = KERNEL(slow), (ctypes.c_void_p * 1)(ptr)
t, out = in_thread(lambda: launch(kernel, 1, 1, 1, 1, 1, 1, 0, None, params, None))
inside.wait(10)
try:
    vmm.gate_close(_vmm.PAUSED, timeout=0.2)
    refused = None
except _vmm.GateBusy as e:
    refused = str(e)
open_again = vmm.gate().mode == _vmm.PRESENT
seen_at_close = []

def close():
    vmm.gate_close(_vmm.PAUSED, timeout=20)
    seen_at_close.append(len(finished))  # what had finished when the close returned

closer = threading.Thread(target=close)
closer.start()
time.sleep(0.2)
leave.set()
closer.join(20)
print(json.dumps({"refused": refused, "open again": open_again, "finished before close": seen_at_close == [1],
                  "mode": vmm.gate().mode}))
vmm.gate_open()
t.join(10)
""",
    )
    assert "did not return within 0.2 s" in got["refused"]
    assert got["open again"]
    assert got["finished before close"]
    assert got["mode"] == 1
