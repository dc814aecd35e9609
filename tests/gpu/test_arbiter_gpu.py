"""The node arbiter on the real card: three kernels with 40 GiB budgets on one 80 GB
H100 take turns filling their budget and going idle; every allocation succeeds (the
arbiter pauses whoever is idle) and every kernel's data is bit-exact when it runs again.
A larger card is kept to the H100's memory by ``card_reserve``, as the benchmarks keep
it: on an H200 (143 GB) the three fit side by side and nobody was paused."""

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess

pytestmark = pytest.mark.gpu
GiB = 2**30
#: The H100 80GB's memory, bytes, as NVML reports it (``benchmarks/results/``, ``machine``).
H100_BYTES = 85_520_809_984

FILL = (
    "import torch\ng = torch.Generator(device='cuda').manual_seed({seed})\n"
    "data = [torch.randint(0, 4, (2**30,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "        for _ in range({gib})]\n"
    "check = [int(d[:: 2**16].sum()) for d in data]\nprint('filled', {gib})"
)
CHECK = (
    "same = all(int(d[:: 2**16].sum()) == c for d, c in zip(data, check))\n"
    "print(same, torch.cuda.memory_allocated() >> 30)"
)


def test_three_40_gib_kernels_take_turns_on_one_card(tmp_path):
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 40 * GiB, 100, overcommit_ratio=2.0)
    reserve = gpu.memory_total - H100_BYTES
    kept = [f"--ArbiterApp.card_reserve={reserve}"] if reserve > 0 else []
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.suspend_after=0", *kept).start()
    kernels = []
    try:
        for i in range(3):
            kernels.append(arbiter.start_kernel(tmp_path, f"user{i}", slice_))
        for i, kernel in enumerate(kernels):  # each fills 36 GiB of its 40 GiB budget in turn
            out = kernel.run(FILL.format(seed=i, gib=36))
            assert "filled 36" in out, out
        for kernel in kernels:  # everyone runs again: the others are paused to make room
            out = kernel.run(CHECK)  # after the lines of its wait for room, when it waited over 1 s
            assert out.strip().splitlines()[-1].split() == ["True", "36"], out[-2000:]
        decisions = arbiter.books()["decisions"]
        assert sum(d["what"] == "pause" for d in decisions) >= 3
        assert not any(d["what"] == "denied" for d in decisions)
        # every kernel paused twice or more: each pause's paused bytes within what was measured
        assert not [d for d in decisions if d["what"] == "figure capped"], decisions
    finally:
        for kernel in kernels:
            kernel.shutdown()
        arbiter.stop()
