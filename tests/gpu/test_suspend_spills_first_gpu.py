"""A paused kernel's data goes to disk before its suspend when the node is past its host
mark (issue 42, ``tiers.strands``), on the real card and the driver's checkpoint: once
suspended, a kernel's CUDA calls, the release of its pinned slabs among them, wait for its
restore, so its paused data would be out of every spill's reach until it ran again.

Two kernels hold 2 GiB of random bytes each and pause. The arbiter is then started again
with a spill mark set from its books: above what the two paused kernels hold, below that
plus half a CUDA context (what a suspend adds: the checkpoint of what is left on the card).
It suspends both in the background: the first one's data goes to disk first; after that
the second one's suspend is under the mark, and it is suspended with its data in host
memory. Both come back bit-exact."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30

HOLD = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed({seed})\n"
    "data = torch.randint(0, 256, (2 * 2**30,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "digest = hashlib.sha256(data.cpu().numpy()).hexdigest()\n"
    "print('held')"
)
CHECK = "print(hashlib.sha256(data.cpu().numpy()).hexdigest() == digest)"


def test_a_paused_kernel_goes_to_disk_before_its_suspend_past_the_host_mark(tmp_path):
    slice_ = Slice.on_card(nvml.list_gpus()[0], 8 * GiB, 100, overcommit_ratio=2.0)
    disk = f"--ArbiterApp.disk_dir={tmp_path / 'disk'}"
    arbiter = ArbiterProcess(tmp_path, disk, "--ArbiterApp.suspend_after=3600").start()
    kernels = []
    try:
        for user, seed in (("ada", 1), ("bob", 2)):
            k = arbiter.start_kernel(tmp_path, user, slice_)
            kernels.append((k, user))
            assert "held" in k.run(HOLD.format(seed=seed), timeout=300)
        for k, _ in kernels:
            assert "paused as soon as the cell ends" in k.run("%vgpu pause")
        for k, _ in kernels:
            wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("tier") == "host", 120, f"{k.pid} paused")
        seen: list[int] = []

        def settled() -> bool:  # a paused kernel lets its warm slabs go in the background
            seen.append(arbiter.books()["node"]["host_used"])
            return len(seen) > 1 and seen[-1] == seen[-2]

        wait_for(settled, 60, "the paused kernels' host memory to stay the same for 2 s", interval=2.0)
        held = seen[-1]
        entries = [arbiter.kernel(k.pid) for k, _ in kernels]
        context = min(e["resident"] for e in entries)  # each one's CUDA context, left on the card
        assert context > 0, entries
        mark = held + context // 2
        arbiter.stop()
        arbiter = ArbiterProcess(
            tmp_path,
            disk,
            f"--ArbiterApp.host_memory_limit={2 * mark}",
            "--ArbiterApp.host_spill_fraction=0.5",
            "--ArbiterApp.suspend_after=2",
        ).start()
        with arbiter.control() as c:  # standalone, the harness registers again
            for k, user in kernels:
                c.register(k.pid, user, "", slice_)

        def steps(pid: int) -> list[str]:
            decisions = arbiter.books()["decisions"]
            return [d["what"] for d in decisions if d.get("pid") == pid and d["what"] in ("spill", "suspend")]

        # the decision is written once the move has settled; the books' state comes first
        def suspended() -> bool:
            return all("suspend" in steps(k.pid) for k, _ in kernels)

        wait_for(suspended, 120, "a suspend decision for both paused kernels")
        done = sorted(steps(k.pid) for k, _ in kernels)
        assert done == [["spill", "suspend"], ["suspend"]], arbiter.books()["decisions"]
        for k, _ in kernels:  # back, one from disk and one from host memory, bit-exact
            out = k.run(CHECK, timeout=300)
            assert out.strip().splitlines()[-1] == "True", out[-2000:]
    finally:
        for k, _ in kernels:
            k.shutdown()
        arbiter.stop()
