"""Growth granted on demand (``ArbiterApp.grant_on_demand``) on the real card and driver: a
cell is granted what its kernel holds plus a margin, and an allocation past what the card
has free asks the arbiter for room from inside the pausable allocator, before the driver's
out-of-memory answer reaches PyTorch; the arbiter pauses an idle kernel for it, and the
allocation is made again.

A process outside every server holds all of the card but about 20 GiB (a ballast: other
users' memory, out of every kernel's reach). Ada's kernel holds 8 GiB of random bytes and
stays idle. Bob's cell then allocates 12 GiB, more than the card has free beside Ada's:
it gets them, no OutOfMemoryError, Ada is paused for it (a ``grown`` decision names bob),
and Ada's bytes come back bit-exact. Meanwhile a thread of Bob's kernel reads PyTorch's
allocator figures without a pause: the allocator's ask goes over its own grow channel in C,
so it needs no lock of Python's while it holds PyTorch's."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import card_holder
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30
LEFT = 20 * GiB  # what the ballast leaves of the card

HOLD = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed(1)\n"
    "data = torch.randint(0, 256, (8 * 2**30,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "digest = hashlib.sha256(data.cpu().numpy()).hexdigest()\n"
    "print('held')"
)
CHECK = "print(hashlib.sha256(data.cpu().numpy()).hexdigest() == digest)"
GROW = (  # a thread reads PyTorch's allocator figures all along, as the kernel's report does
    "import threading, torch\n"
    "stop = threading.Event()\n"
    "def look():\n"
    "    while not stop.is_set():\n"
    "        torch.cuda.memory_allocated()\n"
    "looker = threading.Thread(target=look)\n"
    "looker.start()\n"
    "x = torch.empty(12 * 2**30, dtype=torch.uint8, device='cuda')\n"
    "x.fill_(7)\n"
    "torch.cuda.synchronize()\n"
    "stop.set()\n"
    "looker.join()\n"
    "print('grew', int(x[-1]))"
)
FIGURES = "from jupyter_vgpu.kernel.pause import vmm\nprint('asks', *vmm.load().grow_figures())"


def test_an_allocation_past_the_free_memory_gets_room_made_by_pausing_an_idle_kernel(tmp_path):
    gpu = nvml.list_gpus()[0]
    ballast = card_holder.hold(nvml.free_memory(gpu.uuid) - LEFT)
    arbiter = kernels = None
    try:
        slice_ = Slice.on_card(gpu, 16 * GiB, 100, overcommit_ratio=2.0)
        arbiter = ArbiterProcess(
            tmp_path,
            "--ArbiterApp.grant_on_demand=True",
            "--ArbiterApp.suspend_after=3600",
            "--ArbiterApp.unowned_policy=report",
        ).start()
        ada = arbiter.start_kernel(tmp_path, "ada", slice_)
        bob = arbiter.start_kernel(tmp_path, "bob", slice_)
        kernels = [ada, bob]
        assert "held" in ada.run(HOLD, timeout=300)
        out = bob.run(GROW, timeout=300)
        assert "grew 7" in out, out
        assert "OutOfMemoryError" not in out, out
        decisions = arbiter.books()["decisions"]
        grown = [d for d in decisions if d["what"] == "grown"]
        assert grown, decisions[-20:]
        assert {d["server"] for d in grown} == {"bob/"}, grown
        paused = [d for d in decisions if d["what"] == "pause" and d.get("pid") == ada.pid]
        assert paused, decisions[-20:]
        assert "bob/" in paused[0]["reason"], paused
        words = bob.run(FIGURES).split()
        asked, granted = (int(w) for w in words[words.index("asks") + 1 :][:2])
        assert asked >= 1, words
        assert granted >= 1, words
        assert "freed" in bob.run("del x\ntorch.cuda.empty_cache()\nprint('freed')")
        wait_for(lambda: (arbiter.kernel(bob.pid) or {}).get("state") != "active", 60, "bob's cell ended")
        assert ada.run(CHECK, timeout=300).strip().splitlines()[-1] == "True"
    finally:
        for k in kernels or []:
            k.shutdown()
        if arbiter is not None:
            arbiter.stop()
        ballast.stdin.close()
        ballast.wait(30)
