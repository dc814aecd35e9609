"""What the fault-injection tests stand on: kernels holding real bytes, cells timed message
by message, processes stopped at a named step and killed there, and the invariants.

On a machine without a GPU the kernels' slices are simulated, and the bytes that move
are real all the same: each kernel makes a segment of the pausable allocator's host
backend (``vmm.HOST``) and fills it with a pattern both the kernel and the test can
make; a pause stores those bytes through the zstandard path (host memory, the disk
tier) and releases the segment's pages, a resume writes them back. Data are checked
bit for bit against the test's own copy of the pattern (SHA-256).

A failpoint (``jupyter_vgpu.failpoints``) stops the process at its step (SIGSTOP); the
test waits until the process is stopped, then kills it with SIGKILL, or SIGTERM (and
SIGCONT so it can act on it).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.output_text import output_text
from jupyter_vgpu.testing.waiting import wait_for

MiB, GiB = 2**20, 2**30
#: A 1 GiB simulated card: two kernels holding 700 MiB of it cannot both be resident.
SLICE = Slice("GPU-sim-faults", 0, "Simulated card", GiB, 800 * MiB, 50, simulated=True, idle_seconds=3600)
#: What a cell may go without a word in its output, by the issue: the waiting line is
#: updated every second. ``benchmarks/faults.py`` measures every fault against it.
SILENCE_GOAL = 2.0
#: What the tests allow: the issue's bound with room for a loaded 2-core machine, where a
#: line due every second can come late. A wait that says nothing still fails it.
SILENCE = 5.0

#: The pattern of bytes a kernel holds: half bf16-like weights (they compress), half
#: random bytes (they do not). Run in the kernel and in the test alike.
PATTERN = """
import numpy as _np
def pattern(seed, n):
    rng = _np.random.default_rng(seed)
    half = n // 2 // 4 * 4
    w = (rng.standard_normal(half // 2, dtype=_np.float32) * 0.02).view(_np.uint32) >> 16
    noise = rng.integers(0, 256, n - half, dtype=_np.uint8)
    return _np.concatenate([w.astype(_np.uint16).view(_np.uint8), noise])
"""


def pattern(seed: int, n: int):
    ns: dict = {}
    exec(PATTERN, ns)
    return ns["pattern"](seed, n)


def digest(seed: int, n: int) -> str:
    """SHA-256 of the pattern a kernel holds."""
    return hashlib.sha256(pattern(seed, n).tobytes()).hexdigest()


def hold_code(seed: int, nbytes: int, simulated_mib: int = 0) -> str:
    """A cell that makes ``nbytes`` of real bytes in two host-backend segments stored
    apart (so that a pause, a spill or a resume has a step between the two), and, for the
    simulated card's books, a tensor of ``simulated_mib`` MiB. ``held`` is the list of the
    two arrays.

    The second segment is made for device 1 of the host backend: a pause joins the live
    bytes of segments side by side on one device into one span, and where mmap places two
    segments depends on the holes in the kernel's address space."""
    half = nbytes // 2
    code = PATTERN + (
        "import ctypes, hashlib\n"
        "from jupyter_vgpu.kernel.pause import vmm as _vmm\n"
        "_lib = _vmm.load()\n"
        "if _lib.backend == 0:\n    _lib.init(_vmm.HOST)\n"
        f"_data = pattern({seed}, {nbytes})\n"
        "held = []\n"
        f"for _device, _n in enumerate(({half}, {nbytes - half})):\n"
        "    _at = _lib.malloc(_n, _device)\n"
        "    _a = _np.ctypeslib.as_array((ctypes.c_uint8 * _n).from_address(_at))\n"
        "    _a[:] = _data[sum(h.size for h in held):][:_n]\n"
        "    held.append(_a)\n"
        "del _data\n"
    )
    if simulated_mib:
        code += f"import torch\nx = torch.zeros({simulated_mib} * 2**20 // 4)\n"
    return code


#: A cell's first line, printed as soon as its code runs: the wait before it is what a
#: silence is timed over (:meth:`Timed.silence_until`), not the code's own time (hashing
#: GiBs on the CPU takes seconds).
BACK = "print('back', flush=True)\n"

#: A cell printing the SHA-256 of what the kernel holds (after it came back).
DIGEST = "_h = hashlib.sha256()\nfor _a in held:\n    _h.update(_a)\nprint(_h.hexdigest())"


@dataclass
class Timed:
    """A cell's outcome: its text and when each of its messages arrived."""

    text: str = ""
    sent: float = 0.0
    times: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    ended: float | None = None
    error: BaseException | None = None

    @property
    def longest_silence(self) -> float:
        """The longest stretch, seconds, from the request through its output to its reply
        without a message in the cell's output."""
        marks = [self.sent, *self.times, self.ended if self.ended is not None else time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(marks))

    def silence_until(self, text: str) -> float:
        """The longest stretch without a message, seconds, from the request to the first
        message holding ``text`` (a line the cell's code prints first): the wait before
        the code runs, without the code's own time. Raises AssertionError when no
        message holds it."""
        first = next((i for i, t in enumerate(self.texts) if text in t), None)
        assert first is not None, f"no message holds {text!r}: {self.text!r}"
        marks = [self.sent, *self.times[: first + 1]]
        return max(b - a for a, b in itertools.pairwise(marks))


def run(kernel: Kernel, code: str, timeout: float = 120, out: Timed | None = None) -> Timed:
    """Run ``code`` in ``kernel``, timing every message of its output (into ``out``, which
    another thread may watch as it fills)."""
    out = out if out is not None else Timed()
    parts: list[str] = []

    def hook(msg):
        text = output_text(msg["header"]["msg_type"], msg["content"])
        if text is None:
            return
        parts.append(text)
        out.texts.append(text)
        out.times.append(time.monotonic())

    out.sent = time.monotonic()
    try:
        kernel.client.execute_interactive(code, output_hook=hook, timeout=timeout)
    except Exception as e:  # a kernel killed under its cell; a test's own timeout goes on up
        out.error = e
    out.ended = time.monotonic()
    out.text = "".join(parts)
    return out


class Background:
    """A cell run in a thread of the test, while the test does something else.

    Attributes:
        partial: the cell's outcome as it fills (``times`` grows with each message).
    """

    def __init__(self, kernel: Kernel, code: str, timeout: float = 120):
        self.result: Timed | None = None
        self.partial = Timed()
        self._thread = threading.Thread(target=self._go, args=(kernel, code, timeout), daemon=True)
        self._thread.start()

    def _go(self, kernel, code, timeout):
        self.result = run(kernel, code, timeout, out=self.partial)

    def said(self, n: int, timeout: float = 30) -> None:
        """Wait until the cell has shown ``n`` messages: it has waited that many seconds,
        saying so."""
        wait_for(lambda: len(self.partial.times) >= n, timeout, f"the waiting cell's message number {n}")

    def join(self, timeout: float = 120) -> Timed:
        self._thread.join(timeout)
        assert self.result is not None, f"the cell did not end within {timeout} s"
        return self.result


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``T`` stopped, ``Z``), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def stopped_at_failpoint(pid: int, what: str, timeout: float = 60) -> None:
    wait_for(
        lambda: process_state(pid) == "t" or process_state(pid) == "T", timeout, f"{what} to stop at its step"
    )


def stopped_below(pid: int, what: str, timeout: float = 120) -> int:
    """Wait until a descendant of ``pid`` is stopped at its failpoint (the arbiter's
    checkpoint workers reach the ``checkpoint.*`` steps); its PID."""
    import psutil

    def stopped() -> int | None:
        try:
            below = psutil.Process(pid).children(recursive=True)
        except psutil.Error:
            return None
        return next((c.pid for c in below if process_state(c.pid) in ("t", "T")), None)

    return wait_for(stopped, timeout, f"{what} to stop at its step")


def kill(pid: int, how: str) -> None:
    """End a process: ``kill`` (SIGKILL) or ``term`` (SIGTERM, then SIGCONT so that a
    stopped process acts on it)."""
    if how == "kill":
        os.kill(pid, signal.SIGKILL)
    else:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)


def start_kernel(
    tmp_path: Path,
    arbiter: ArbiterProcess,
    user: str,
    env: dict | None = None,
    args: tuple[str, ...] = (),
    slice_: Slice = SLICE,
) -> Kernel:
    """A kernel of ``user`` under ``arbiter`` (registered over the socket, as a standalone
    arbiter's harness does), its slice ``slice_`` (:data:`SLICE`); ``args``: the kernel's
    settings."""
    chan = tmp_path / f"channel-{user}-{time.monotonic_ns()}"
    chan.mkdir()
    kernel = Kernel(
        tmp_path,
        {
            "JUPYTER_VGPU_ARBITER": str(arbiter.socket),
            "JUPYTER_VGPU_CHANNEL": str(chan),
            "JUPYTER_VGPU_SLICE": "",
            **(env or {}),
        },
        load_extension=True,  # where the package's IPython config is not installed too
        args=args,
    )
    kernel.channel = chan
    kernel.user = user
    with arbiter.control() as c:
        c.register(kernel.pid, user, "", slice_)
    wait_for(lambda: arbiter.kernel(kernel.pid), 30, f"{user}'s kernel to join the arbiter")
    return kernel


def reap(kernel: Kernel) -> None:
    """Forget a kernel that was killed (its process reaped, its client closed)."""
    kernel.client.stop_channels()
    try:
        kernel.manager.shutdown_kernel(now=True)
    except Exception:
        pass


def books_consistent(arbiter: ArbiterProcess, alive: dict[int, str]) -> bool:
    """The arbiter's books hold exactly the kernels in ``alive`` (pid -> tier expected, or
    "" for any), each in the tier given."""
    kernels = {k["pid"]: k for k in arbiter.books()["kernels"]}
    if set(kernels) != set(alive):
        return False
    return all(not tier or kernels[pid]["tier"] == tier for pid, tier in alive.items())


def disk_dirs(root: Path) -> list[Path]:
    """The kernels' directories of the disk tier under ``root``."""
    return sorted(p for user in root.glob("*") if user.is_dir() for p in user.glob("kernel-*"))
