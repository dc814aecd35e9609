"""Cells of the GPU tests whose kernels pause and keep only their CUDA contexts on the
card, for another kernel's room: each holds 256 MiB of random bytes (uint8, seeded) and
remembers their SHA-256, so that a resume or a restore is checked bit for bit; the
kernel that needs the room grows by 2 GiB."""

from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for

#: Hold 256 MiB of random bytes on the card and keep their digest; prints ``held``.
HOLD = (
    "import hashlib, torch\n"
    "g = torch.Generator(device='cuda').manual_seed({seed})\n"
    "data = torch.randint(0, 256, (256 * 2**20,), dtype=torch.uint8, device='cuda', generator=g)\n"
    "digest = hashlib.sha256(data.cpu().numpy()).hexdigest()\n"
    "print('held')"
)
#: Prints ``True`` when the bytes are what they were.
CHECK = "print(hashlib.sha256(data.cpu().numpy()).hexdigest() == digest)"
#: 2 GiB more on the card; prints ``grew``.
GROW = (
    "import torch\n"
    "x = torch.ones(2 * 2**30, dtype=torch.uint8, device='cuda')\n"
    "print('grew', int(x[::4096].sum()))"
)


def start_holders(arbiter: ArbiterProcess, directory, slice_, kernels: list, n: int = 4) -> list:
    """``n`` kernels (``user0``...) on ``slice_``, each holding :data:`HOLD`'s bytes; each
    is added to ``kernels`` as ``(kernel, user, slice)`` as it starts (the caller shuts
    them down) and returned."""
    holders = []
    for i in range(n):
        k = arbiter.start_kernel(directory, f"user{i}", slice_)
        kernels.append((k, f"user{i}", slice_))
        holders.append(k)
        assert "held" in k.run(HOLD.format(seed=i), timeout=300)
    return holders


def pause_all(arbiter: ArbiterProcess, kernels: list) -> None:
    """``%vgpu pause`` in each of ``kernels``, then wait until the arbiter has each in host memory."""
    for k in kernels:
        assert "paused as soon as the cell ends" in k.run("%vgpu pause")
    for k in kernels:
        wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("tier") == "host", 120, f"{k.pid} paused")


def restart(directory, kernels: list, paused: list, *settings: str) -> ArbiterProcess:
    """A new arbiter in ``directory`` with ``settings``, every one of ``kernels`` registered
    with it again (standalone, the harness registers), once each has joined it and it knows
    ``paused`` paused (a kernel not joined yet runs its next cell without an arbiter)."""
    arbiter = ArbiterProcess(directory, *settings).start()
    try:
        with arbiter.control() as c:
            for k, user, slice_ in kernels:
                c.register(k.pid, user, "", slice_)
        for k, _, _ in kernels:
            wait_for(lambda k=k: arbiter.kernel(k.pid), 60, f"{k.pid} joined")
        for k in paused:
            wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("state") == "paused", 60, f"{k.pid} known")
    except BaseException:
        arbiter.stop()  # the caller stops only the arbiter it was given back
        raise
    return arbiter


def assert_made_together(suspends: list[dict], label: str) -> None:
    """The suspends' decisions overlap in time (each ends after the last one began), and
    their seconds are printed after ``label``."""
    spans = [(d["time"] - d["seconds"], d["time"]) for d in suspends]
    assert max(a for a, _ in spans) < min(b for _, b in spans), f"one after another: {spans}"
    print(
        label,
        [round(b - a, 3) for a, b in spans],
        "wall",
        round(max(b for _, b in spans) - min(a for a, _ in spans), 3),
    )
