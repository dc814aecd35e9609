"""A process outside every server that holds memory of the first visible GPU (plain
PyTorch, no pausable allocator), for the GPU tests: an unowned process for default deny,
or ballast that leaves the kernels of a test less of the card."""

from __future__ import annotations

import subprocess
import sys

HOLD = (
    "import sys, torch\n"
    "x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "print('holding', flush=True)\n"
    "sys.stdin.read()\n"
)


def hold(nbytes: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a process holding ``nbytes`` bytes of the card; returns once it does. It
    holds them until it is killed or its stdin is closed: the caller ends it. ``env`` is
    its environment (default: this process's); ``CUDA_VISIBLE_DEVICES`` there picks the
    card.

    Raises:
        AssertionError: the process could not take them (it is ended).
    """
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(nbytes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    if process.stdout.readline().strip() != "holding":
        process.kill()
        process.wait()
        raise AssertionError(f"a process could not take {nbytes} bytes of the card")
    return process
