"""Code that runs between cells, in a real kernel paused after every cell (chaos mode
``pause``), on the driver stand-in (tests/native): an asyncio task, a tornado
``PeriodicCallback``, a ``threading.Timer`` and a plain thread each launch GPU work
twenty times after their cell has ended. Each launch made while the kernel is away waits
at the allocator's gate, brings the kernel back with no message from anyone, and then
runs: every launch succeeds and lands, and the kernel answers its next cell.

(On the GPU, tests/gpu/test_between_cells.py runs the same patterns with PyTorch, in
both chaos modes and through the node arbiter.)"""

import json

import pytest

from jupyter_vgpu import channel
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.waiting import wait_for

from ..native import build, environment

GiB = 2**30
SLICE = Slice("GPU-sim-0", 0, "a simulated card", 80 * GiB, 8 * GiB, 50, simulated=True)

SETUP = """
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
ctx = ctypes.c_void_p()
assert cuda.cuInit(0) == 0 and cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
assert cuda.cuCtxSetCurrent(ctx) == 0
counter = ctypes.c_uint64()
assert cuda.cuMemAlloc_v2(ctypes.byref(counter), ctypes.c_size_t(2 * 2**20)) == 0
cuda.cuMemsetD8_v2(counter, 0, ctypes.c_size_t(8))
KERNEL = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_void_p))

@KERNEL
def add_one(params):  # a kernel of the stand-in: it runs on the launching thread
    cell = ctypes.c_uint64.from_address(params[0])
    cell.value += 1

params = (ctypes.c_void_p * 1)(counter.value)
cuda.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
codes = []
log = open(LOG, "a")

def launch():  # one launch, its code noted where the test reads it without a message
    codes.append(cuda.cuLaunchKernel(ctypes.cast(add_one, ctypes.c_void_p), 1, 1, 1, 1, 1, 1, 0, None,
                                     params, None))
    log.write(f"{codes[-1]}\\n"); log.flush()
"""

PATTERNS = {
    "asyncio task": (
        "import asyncio\n"
        "async def task():\n"
        "    for _ in range(20):\n"
        "        launch(); await asyncio.sleep(0.05)\n"
        "job = asyncio.ensure_future(task())\n"
    ),
    "tornado PeriodicCallback": (
        "from tornado.ioloop import PeriodicCallback\n"
        "def tick():\n"
        "    launch()\n"
        "    if len(codes) >= 20: pc.stop()\n"
        "pc = PeriodicCallback(tick, 50); pc.start()\n"
    ),
    "threading.Timer": (
        "import threading\n"
        "def tick():\n"
        "    launch()\n"
        "    if len(codes) < 20: start()\n"
        "def start():\n"
        "    t = threading.Timer(0.05, tick); t.daemon = True; t.start()\n"
        "start()\n"
    ),
    "thread": (
        "import threading, time\n"
        "def work():\n"
        "    for _ in range(20):\n"
        "        launch(); time.sleep(0.05)\n"
        "threading.Thread(target=work, name='launcher', daemon=True).start()\n"
    ),
}


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    return build(tmp_path_factory.mktemp("native"))


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_gpu_calls_between_cells_bring_a_paused_kernel_back(native, tmp_path, pattern):
    chan = tmp_path / "channel"
    chan.mkdir()
    channel.write_json(channel.server_path(chan), {"slice": SLICE.to_dict()})
    env = environment(
        native, JUPYTER_VGPU_CHANNEL=str(chan), JUPYTER_VGPU_SLICE="", JUPYTER_VGPU_CHAOS="pause"
    )
    launches = tmp_path / "launches"
    k = Kernel(tmp_path, env)
    try:
        assert k.run(f"LOG = {str(launches)!r}\n" + SETUP).strip() == ""
        k.run(PATTERNS[pattern])  # paused as the cell ends; the pattern's launches go on
        # no message reaches the kernel meanwhile: the launches alone must bring it back
        wait_for(lambda: launches.read_text().count("\n") >= 20, 120, f"the {pattern}'s twenty launches")
        out = k.run(
            "from jupyter_vgpu.kernel.pause import vmm\n"
            "print(json.dumps({'codes': codes, 'count': ctypes.c_uint64.from_address(counter.value).value,"
            " 'held': vmm.load().gate().held_total}))"
        )
        got = json.loads(out.strip().splitlines()[-1])
        assert got["codes"] == [0] * 20
        assert got["count"] == 20
        assert got["held"] >= 1  # at least one launch met the kernel away, and waited
    finally:
        k.shutdown()
