"""Paused pieces held once across kernels, on the real card (issue 42): two kernels holding
the same weights pause, offer their pieces in the background, and the node holds those
pieces once; a third kernel with other weights shares nothing; every kernel comes back
bit-exact from the shared pieces, and once back, the references go. Beside the weights,
each kernel holds blocks of odd sizes with gaps between them, so that spans start and end
off the grid the pieces are laid out on. A kernel whose
pieces are shared is moved to the disk tier and comes back from disk bit-exact; two
kernels that shared their weights before their move write only their own bytes to disk,
the weights staying once in the node's copies, and come back bit-exact from both."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
MiB, GiB = 2**20, 2**30

HOLD = (
    "import hashlib, torch\n"
    "def weights(seed, n):\n"
    "    g = torch.Generator(device='cuda').manual_seed(seed)\n"
    "    return torch.randint(0, 4, (n,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "base = weights({base}, 2**30)\n"  # the class's checkpoint: allocated first, as from_pretrained does
    "own = weights({own}, 64 * 2**20)\n"
    # blocks of odd sizes, every other one freed: live bytes that start and end off the
    # 8 MiB grid of their units, in a layout of each kernel's own
    "bits = [weights({own} + i, (1 + ({own} * 7 + i * 5) % 19) * 2**20 + 2**19) for i in range(16)]\n"
    "bits = bits[::2]\n"
    "def digest():\n"
    "    return [hashlib.sha256(t.cpu().numpy()).hexdigest() for t in (base, own, *bits)]\n"
    "sums = digest()\n"
    "print('held')"
)
CHECK = "print(digest() == sums)"


def paused(arbiter, kernel) -> bool:
    return (arbiter.kernel(kernel.pid) or {}).get("state") == "paused"


def test_two_kernels_with_the_same_weights_hold_them_once_and_come_back_exact(tmp_path):
    slice_ = Slice.on_card(nvml.list_gpus()[0], 8 * GiB, 100, overcommit_ratio=2.0)
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.share_pieces=all", "--ArbiterApp.suspend_after=3600")
    arbiter.start()
    kernels = []
    try:
        for user, base, own in (("ada", 0, 10), ("bob", 0, 11), ("eve", 1, 12)):
            k = arbiter.start_kernel(tmp_path, user, slice_)
            kernels.append(k)
            assert "held" in k.run(HOLD.format(base=base, own=own))
        for k in kernels:
            assert "paused as soon as the cell ends" in k.run("%vgpu pause")
        for k in kernels:
            wait_for(lambda k=k: paused(arbiter, k), 120, f"kernel {k.pid} paused")

        def shared() -> dict:
            return arbiter.books()["shared_pieces"]

        # ada's and bob's 1 GiB of weights are the same pieces: held once. Everything else
        # (their own 64 MiB and 71-92 MiB of blocks, eve's other weights) is held by one
        # kernel each. All are random bytes of one entropy, stored compressed alike, so
        # sharing saves about 1 GiB of the 3.4 GiB the three reference: 0.29 of it
        def saved_share() -> float:
            figures = shared()
            return 1 - figures["held_bytes"] / max(1, figures["referenced_bytes"])

        wait_for(
            lambda: len(shared()["by_pid"]) == 3 and saved_share() > 0.25,
            180,
            "ada's and bob's weights held once",
        )
        figures = shared()
        saved = figures["referenced_bytes"] - figures["held_bytes"]
        print("shared pieces:", figures["pieces"], "held", figures["held_bytes"], "saved", saved)
        for k in kernels:  # back from the shared pieces (and the slabs left), bit-exact
            out = k.run(CHECK)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
        # once back, each kernel lets its mappings go and drops its references
        wait_for(lambda: shared()["pieces"] == 0, 60, "every shared piece let go")
    finally:
        for k in kernels:
            k.shutdown()
        arbiter.stop()


def spilling_arbiter(tmp_path, limit: str, fraction: float) -> ArbiterProcess:
    """An arbiter sharing pieces across users and suspending nobody, its host budget
    ``limit`` and its spill mark at ``fraction`` of it."""
    return ArbiterProcess(
        tmp_path, "--ArbiterApp.share_pieces=all", "--ArbiterApp.suspend_after=3600",
        f"--ArbiterApp.host_memory_limit={limit}", f"--ArbiterApp.host_spill_fraction={fraction}",
    ).start()  # fmt: skip


def pause_two(tmp_path, arbiter, slice_, kernels: list) -> None:
    """ada and bob, each holding the class's weights and bits of their own, paused (each
    added to ``kernels`` as it starts, for the caller to shut down)."""
    for user, own in (("ada", 10), ("bob", 11)):
        k = arbiter.start_kernel(tmp_path, user, slice_)
        kernels.append(k)
        assert "held" in k.run(HOLD.format(base=0, own=own))
        assert "paused as soon as the cell ends" in k.run("%vgpu pause")


def test_a_kernel_whose_pieces_are_shared_moves_to_disk_and_comes_back_exact(tmp_path):
    slice_ = Slice.on_card(nvml.list_gpus()[0], 8 * GiB, 100, overcommit_ratio=2.0)
    arbiter = spilling_arbiter(tmp_path, "64G", 0.0001)
    kernels = []
    try:
        pause_two(tmp_path, arbiter, slice_, kernels)
        for k in kernels:  # past the spill mark: both go to disk, whether or not they shared first
            wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("tier") == "disk", 300, f"{k.pid} on disk")
        for k in kernels:
            out = k.run(CHECK)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
        wait_for(lambda: arbiter.books()["shared_pieces"]["pieces"] == 0, 60, "every shared piece let go")
    finally:
        for k in kernels:
            k.shutdown()
        arbiter.stop()


#: Bytes of random uint8 that do not compress: the kernel whose pause passes the spill mark.
BULK = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed(3)\n"
    "bulk = torch.randint(0, 256, (6 * 2**30,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "def digest():\n"
    "    return [hashlib.sha256(bulk.cpu().numpy()).hexdigest()]\n"
    "sums = digest()\n"
    "print('held')"
)


def test_kernels_that_shared_their_weights_write_only_their_own_bytes_to_disk(tmp_path):
    # the mark (4 GB) sits above what ada and bob hold, their pinned-ahead slabs included
    # (about 2.5 GB), and below what eve's 6 GiB of random bytes hold once paused
    slice_ = Slice.on_card(nvml.list_gpus()[0], 8 * GiB, 100, overcommit_ratio=2.0)
    arbiter = spilling_arbiter(tmp_path, "8G", 0.5)
    kernels = []
    try:
        pause_two(tmp_path, arbiter, slice_, kernels)
        ada, bob = kernels

        def shared() -> dict:
            return arbiter.books()["shared_pieces"]

        def weights_held_once() -> bool:
            figures = shared()
            saved = figures["referenced_bytes"] - figures["held_bytes"]
            return len(figures["by_pid"]) == 2 and saved > 128 * MiB

        wait_for(weights_held_once, 180, "ada's and bob's weights held once")
        eve = arbiter.start_kernel(tmp_path, "eve", slice_)
        kernels.append(eve)
        assert "held" in eve.run(BULK)
        assert "paused as soon as the cell ends" in eve.run("%vgpu pause")
        for k in kernels:  # past the mark: each goes to disk, coldest first
            wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("tier") == "disk", 300, f"{k.pid} on disk")
        figures = shared()
        written = {k.pid: arbiter.kernel(k.pid)["disk_bytes"] for k in (ada, bob)}
        print("shared held", figures["held_bytes"], "for", figures["referenced_bytes"], "; on disk", written)
        # the weights stay once in the node's copies, both still reading them: neither
        # kernel wrote them to its own file
        assert figures["referenced_bytes"] - figures["held_bytes"] > 128 * MiB, figures
        assert sum(written.values()) < figures["held_bytes"], (written, figures)
        for k in kernels:  # back from disk and from the node's copies, bit-exact
            out = k.run(CHECK)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
        wait_for(lambda: shared()["pieces"] == 0, 60, "every shared piece let go")
    finally:
        for k in kernels:
            k.shutdown()
        arbiter.stop()
