"""Pausing in real kernels, on a simulated GPU (the stand-in: states, gate and reports
run for real, no memory moves): the kernel comes back before any of its code runs,
messages that run no code leave it paused, and code of the user's that may run while
the kernel is idle is named, not a reason to keep it on the card; and a paused kernel
gives the host back what its own process holds and needs for nothing until its next cell
(``VGPUKernel.trim_when_paused``), measured from outside in the process's resident
anonymous memory (``RssAnon``)."""

import pytest

from jupyter_vgpu import channel
from jupyter_vgpu.host import procs
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.waiting import wait_for

GiB, MiB = 2**30, 2**20
SLICE = Slice("GPU-sim-0", 0, "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, 8 * GiB, 50, simulated=True)


@pytest.fixture
def channel_dir(tmp_path):
    d = tmp_path / "channel"
    d.mkdir()
    channel.write_json(channel.server_path(d), {"slice": SLICE.to_dict()})
    return d


def start(tmp_path, channel_dir, args: tuple[str, ...] = (), **env) -> Kernel:
    env = {"JUPYTER_VGPU_CHANNEL": str(channel_dir), "JUPYTER_VGPU_SLICE": "", **env}
    return Kernel(tmp_path, env, args=args)


def state(kernel: Kernel, channel_dir) -> str | None:
    report = channel.read_json(channel.kernel_path(channel_dir, kernel.id)) or {}
    return (report.get("pause") or {}).get("state")


def test_chaos_pauses_after_every_cell_and_resumes_before_the_next(tmp_path, channel_dir):
    k = start(tmp_path, channel_dir, JUPYTER_VGPU_CHAOS="1")
    try:
        k.run("import torch\nx = torch.arange(10.0)")
        wait_for(lambda: state(k, channel_dir) == "paused", what="the kernel paused after the cell")
        k.client.kernel_info(reply=True, timeout=30)  # runs no code: the kernel stays paused
        assert state(k, channel_dir) == "paused"
        assert k.run("print(x.sum().item())").strip() == "45.0"
        wait_for(lambda: state(k, channel_dir) == "paused", what="paused again after the second cell")
        status = k.run("%vgpu status")
        assert "active" in status
        assert "stand-in" in status
    finally:
        k.shutdown()


def test_pause_magic_pauses_once_the_cell_ends(tmp_path, channel_dir):
    k = start(tmp_path, channel_dir)
    try:
        assert "paused as soon as the cell ends" in k.run("%vgpu pause")
        wait_for(lambda: state(k, channel_dir) == "paused", what="the kernel paused after %vgpu pause")
        k.run("1 + 1")
        wait_for(lambda: state(k, channel_dir) == "idle", what="the kernel idle, not paused, after a cell")
    finally:
        k.shutdown()


def test_completion_and_comm_messages_resume_the_kernel_first(tmp_path, channel_dir):
    k = start(tmp_path, channel_dir, JUPYTER_VGPU_CHAOS="1")
    try:
        k.run("import torch\nweights = torch.ones(3)")
        wait_for(lambda: state(k, channel_dir) == "paused", what="paused after the cell")
        reply = k.client.complete("weig", 4, reply=True, timeout=30)
        assert "weights" in reply["content"]["matches"]
        wait_for(lambda: state(k, channel_dir) == "idle", what="idle after the completion ran")
    finally:
        k.shutdown()


def test_a_user_thread_does_not_keep_the_kernel_from_a_pause_and_is_named(tmp_path, channel_dir):
    """A thread that may use the GPU while the kernel is idle is no reason to keep the
    kernel on the card: its GPU calls wait while the kernel is away and bring it back
    (the allocator's gate). The kernel is paused after its cell, ``%vgpu status`` names
    the thread as code that runs between cells, and the thread's work goes on."""
    k = start(tmp_path, channel_dir, JUPYTER_VGPU_CHAOS="1")
    try:
        k.run(
            "import threading, torch\nacc = torch.zeros(1)\nstop = threading.Event()\n"
            "def work():\n    while not stop.is_set():\n        acc.add_(1); stop.wait(0.01)\n"
            "t = threading.Thread(target=work, name='adder'); t.start()"
        )
        wait_for(lambda: state(k, channel_dir) == "paused", what="paused after the cell, the thread running")
        out = k.run("%vgpu status")
        line = next(x for x in out.splitlines() if x.strip().startswith("between cells"))
        assert "thread 'adder'" in line
        assert "bring it back" in line
        pausable = next(x for x in out.splitlines() if x.strip().startswith("pausable"))
        assert "yes" in pausable
        assert float(k.run("stop.set(); t.join(); print(acc.item())").strip()) > 0
    finally:
        k.shutdown()


# -- the paused kernel's own memory: the cell builds about 400 MB of 4 kB buffers in the C
# heap and drops 63 of every 64; the freed pages sit between live ones, where ``free``
# keeps them, until ``malloc_trim``
FRAGMENT = "blocks = [bytearray(4000) for _ in range(100_000)]\nkept = blocks[::64]\ndel blocks"


def _fragmented(k) -> int:
    base = procs.private_bytes(k.pid)
    k.run(FRAGMENT)
    held = procs.private_bytes(k.pid)
    assert held - base >= 300 * MiB, (base, held)  # the freed buffers are still resident
    return held


def test_a_paused_kernel_gives_back_the_free_pages_of_its_heap(tmp_path, channel_dir):
    k = start(tmp_path, channel_dir)
    try:
        held = _fragmented(k)
        k.run("%vgpu pause")
        wait_for(lambda: state(k, channel_dir) == "paused", what="the kernel paused after %vgpu pause")
        wait_for(
            lambda: procs.private_bytes(k.pid) < held - 250 * MiB,
            30,
            "the paused kernel's process to give back the free pages of its heap",
        )
        row = next(x for x in k.run("%vgpu status").splitlines() if x.strip().startswith("own memory"))
        assert "given back when last paused" in row, row
        assert k.run("print(len(kept), bytes(kept[-1][:3]))").strip() == "1563 b'\\x00\\x00\\x00'"  # intact
    finally:
        k.shutdown()


def test_with_trim_when_paused_off_the_heap_keeps_its_free_pages(tmp_path, channel_dir):
    k = start(tmp_path, channel_dir, args=("--VGPUKernel.trim_when_paused=False",))
    try:
        held = _fragmented(k)
        k.run("%vgpu pause")
        wait_for(lambda: state(k, channel_dir) == "paused", what="the kernel paused after %vgpu pause")
        assert procs.private_bytes(k.pid) >= held - 100 * MiB  # nothing trims it: the pages stay
        row = next(x for x in k.run("%vgpu status").splitlines() if x.strip().startswith("own memory"))
        assert "given back" not in row, row
    finally:
        k.shutdown()


def test_a_kernel_about_to_be_suspended_gives_back_the_free_pages_of_its_heap(tmp_path, channel_dir):
    """Chaos mode ``suspend``: after each cell the kernel is suspended (a stand-in on a
    simulated GPU: no device memory moves, the process's own memory is real)."""
    k = start(tmp_path, channel_dir, JUPYTER_VGPU_CHAOS="suspend")
    try:
        rss_anon = "print(next(l for l in open('/proc/self/status') if l.startswith('RssAnon')).split()[1])"
        held = int(k.run(FRAGMENT + "\n" + rss_anon).strip().splitlines()[-1]) * 1024  # as the cell ended
        wait_for(lambda: state(k, channel_dir) == "suspended", what="the kernel suspended after its cell")
        wait_for(
            lambda: procs.private_bytes(k.pid) < held - 250 * MiB,
            30,
            "the suspended kernel's process to give back the free pages of its heap",
        )
        assert k.run("print(len(kept))").strip() == "1563"
    finally:
        k.shutdown()


def test_what_a_pause_would_store_is_the_pausable_bytes_less_pytorchs_cached_blocks():
    """``pausable_bytes`` (what the kernel tells the arbiter its pause would store): the
    allocator's pausable mapped bytes less PyTorch's free blocks on every device, those
    beside live tensors included (a pause stores live ranges only), where ``cached_bytes``
    (what a release gives back) leaves those out; unknown without the allocator on CUDA,
    and where a figure cannot be read. The figures here are stood in for: on a GPU,
    ``tests/gpu/test_pinned_ahead.py`` reads real ones."""
    from types import SimpleNamespace

    from jupyter_vgpu.kernel.memory_path import MemoryPath

    reserved, allocated = {0: 10 * GiB, 1: 4 * GiB}, {0: 3 * GiB, 1: 4 * GiB}
    split = {0: GiB, 1: 0}  # free bytes beside live tensors: empty_cache cannot free them
    cuda = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        device_count=lambda: 2,
        memory_reserved=reserved.__getitem__,
        memory_allocated=allocated.__getitem__,
        memory_stats=lambda d: {
            "reserved_bytes.all.current": reserved[d],
            "active_bytes.all.current": allocated[d],
            "inactive_split_bytes.all.current": split[d],
        },
    )

    class Path(MemoryPath):
        backend = 1  # vmm.CUDA

        def _allocator(self):
            return SimpleNamespace(backend=self.backend, figures=self.figures)

        def figures(self):
            return SimpleNamespace(own=12 * GiB, others=GiB)

        def _torch(self):
            return SimpleNamespace(cuda=cuda)

    path = Path()
    assert path.pausable_bytes() == 13 * GiB - 7 * GiB  # every free byte left out, the split one too
    assert path.cached_bytes() == 6 * GiB  # a release cannot give the split one back
    path.backend = 2  # the allocator's host backend: no card
    assert path.pausable_bytes() is None
    path.backend = 1
    path.figures = lambda: 1 / 0
    assert path.pausable_bytes() is None
