"""Code that runs between cells, in a real kernel that leaves the GPU after every cell: the
scenarios of ``tests/gpu/test_between_cells.py`` and ``benchmarks/liveness.py``.

Each pattern starts code in a cell that keeps touching a CUDA tensor after the cell has
ended (twenty steps, each noted with its time in a file the test reads without sending
the kernel a message); the kernel is paused or suspended after the cell (chaos mode),
so the steps meet it away. :func:`run_pattern` returns a :class:`Row`: whether the kernel
left the card or was kept (and why), whether every step ran and the kernel's data came
back bit-exact, the longest a step waited, and the seconds from a message sent to the
kernel while it was away to its answer.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from .kernel_runner import Kernel
from .preloaded import environment
from .waiting import wait_for

#: Seconds between two steps: twenty of them span the kernel's time away after the cell
#: (a pause takes a fraction of a second, a suspend about one), so that several meet it away.
INTERVAL = 0.2

#: The kernel's data: a tensor the steps add to, and one whose sum is checked bit for bit.
SETUP = (
    "import torch, time, json\n"
    f"INTERVAL = {INTERVAL}\n"
    "acc = torch.zeros(1, device='cuda')\n"
    "w = torch.randn(1 << 24, device='cuda')\n"
    "ref = w.double().sum().item()\n"
    "def step():\n"
    "    t0 = time.monotonic()\n"
    "    acc.add_(1)  # held, the first time after the kernel left, until it is back\n"
    "    with open(LOG, 'a') as f: f.write(f'{t0} {time.monotonic()}\\n')\n"
)

#: Each pattern's cell: twenty steps after the cell has ended.
PATTERNS = {
    "asyncio task": (
        "import asyncio\n"
        "async def job():\n"
        "    for _ in range(20):\n"
        "        step(); await asyncio.sleep(INTERVAL)\n"
        "task = asyncio.ensure_future(job())\n"
    ),
    "tornado PeriodicCallback": (
        "from tornado.ioloop import PeriodicCallback\n"
        "n = [0]\n"
        "def tick():\n"
        "    step(); n[0] += 1\n"
        "    if n[0] >= 20: pc.stop()\n"
        "pc = PeriodicCallback(tick, INTERVAL * 1000); pc.start()\n"
    ),
    "IOLoop call_later": (
        "from tornado.ioloop import IOLoop\n"
        "def tick(k):\n"
        "    step()\n"
        "    if k < 19: IOLoop.current().call_later(INTERVAL, tick, k + 1)\n"
        "IOLoop.current().call_later(INTERVAL, tick, 0)\n"
    ),
    "threading.Timer": (
        "import threading\n"
        "def tick(k):\n"
        "    step()\n"
        "    if k < 19: later(k + 1)\n"
        "def later(k):\n"
        "    t = threading.Timer(INTERVAL, tick, (k,)); t.daemon = True; t.start()\n"
        "later(0)\n"
    ),
    "thread": (
        "import threading\n"
        "def work():\n"
        "    for _ in range(20):\n"
        "        step(); time.sleep(INTERVAL)\n"
        "threading.Thread(target=work, daemon=True).start()\n"
    ),
    "thread in a CUDA call": (
        "import threading\n"
        "def work():\n"
        "    for _ in range(20):\n"
        "        (acc * 2).sum().item(); torch.cuda.synchronize(); step(); time.sleep(INTERVAL)\n"
        "threading.Thread(target=work, daemon=True).start()\n"
    ),
    "thread holding the GIL in C": (
        # a C extension's call into the driver made without letting go of the GIL
        "import ctypes, threading\n"
        "drv = ctypes.PyDLL('libcuda.so.1')\n"
        "gil_held_memset = drv.cuMemsetD32_v2\n"
        "gil_held_memset.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]\n"
        "twice = torch.zeros(1, dtype=torch.int32, device='cuda')\n"
        "def work():\n"
        "    acc.add_(0)  # a call of the runtime's makes the thread's CUDA context current\n"
        "    for k in range(20):\n"
        "        assert gil_held_memset(twice.data_ptr(), 2 * (k + 1), 1) == 0\n"
        "        step(); time.sleep(INTERVAL)\n"
        "threading.Thread(target=work, daemon=True).start()\n"
    ),
}
#: How many GPU calls of the kernel's threads waited for it at the allocator's gate so far.
HELD = "from jupyter_vgpu.kernel.pause import vmm as _vmm\nprint(_vmm.load().gate().held_total)"
#: What the kernel answers once every step ran: the steps counted, its data bit-exact.
CHECK = "print(json.dumps({'acc': acc.item(), 'exact': w.double().sum().item() == ref}))"


@dataclasses.dataclass
class Row:
    """One pattern in one mode (``benchmarks/results/liveness-<card>.json``'s rows).

    Attributes:
        pattern, mode: the pattern's name and the chaos mode (``pause``, ``suspend``).
        left: how the kernel stood after the pattern's cell: ``paused``, ``suspended``, or
            ``kept`` (stayed on the GPU).
        why: why it was kept, in the kernel's words, or None.
        steps: steps that ran (20 when none was lost).
        exact: the kernel's data came back bit-exact and every step counted.
        longest_call: the longest a step's GPU call took, seconds: the first call after
            the kernel left waits there for its way back (a held call brings the kernel
            back, and it stays), the others take microseconds.
        message_seconds: seconds from a cell sent while the kernel was away to its answer.
    """

    pattern: str
    mode: str
    left: str
    why: str | None
    steps: int
    exact: bool
    longest_call: float
    message_seconds: float


def _report(channel: Path, kernel: Kernel) -> dict:
    try:
        return json.loads((channel / f"kernel-{kernel.id}.json").read_text()).get("pause") or {}
    except (OSError, ValueError):
        return {}


def _away(channel: Path, kernel: Kernel) -> bool:
    return _report(channel, kernel).get("state") in ("paused", "suspended")


def run_pattern(tmp: Path, pattern: str, mode: str, extra_env: dict | None = None) -> Row:
    """Run ``pattern`` in a kernel of chaos mode ``mode`` (``pause`` or ``suspend``);
    the returned :class:`Row` says what came of it.

    Raises:
        AssertionError: the kernel did not start, or the steps did not all run within
            two minutes (a freeze).
    """
    channel = tmp / "channel"
    channel.mkdir()
    log = tmp / "steps"
    env = environment(JUPYTER_VGPU_CHAOS=mode, JUPYTER_VGPU_CHANNEL=str(channel), **(extra_env or {}))
    kernel = Kernel(tmp, env, load_extension=True, log=tmp / "kernel.log")
    try:
        kernel.run(f"LOG = {str(log)!r}\n" + SETUP)
        wait_for(lambda: _away(channel, kernel), 60, "the kernel to leave the GPU after its first cell")
        kernel.run(PATTERNS[pattern])  # the kernel leaves again as the cell ends; the steps go on
        wait_for(lambda: log.exists() and log.read_text().count("\n") >= 20, 180, f"the {pattern}'s steps")
        calls = [tuple(map(float, line.split())) for line in log.read_text().splitlines()]
        held = json.loads(kernel.run(HELD).strip().splitlines()[-1])  # the kernel leaves again after it
        wait_for(
            lambda: _away(channel, kernel) or _report(channel, kernel).get("refused"), 60, "the pause after"
        )
        kept = _report(channel, kernel).get("refused") if held == 0 else None
        left = "kept" if held == 0 else {"pause": "paused", "suspend": "suspended"}[mode]
        if left != "kept":
            wait_for(lambda: _away(channel, kernel), 60, "the kernel away before the timed message")
        t0 = time.monotonic()
        out = kernel.run(CHECK)
        seconds = time.monotonic() - t0
        got = json.loads(out.strip().splitlines()[-1])
        longest = max(done - began for began, done in calls)
        exact = got["exact"] and got["acc"] == len(calls)
        return Row(pattern, mode, left, kept, len(calls), exact, longest, seconds)
    finally:
        kernel.shutdown()
