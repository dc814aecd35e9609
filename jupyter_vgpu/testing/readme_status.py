"""The README's ``%vgpu status`` sample, as a real kernel prints it.

A kernel of the demo on a machine without a GPU: the demo's default slice (8 GiB of the
first simulated 80 GiB card, a 50% share, binpack, overcommit 1.5), 4 MiB of tensors in
its namespace, a node arbiter that may hold 64 GiB of host memory for paused kernels.
:func:`render` starts that arbiter and kernel and returns what ``%vgpu status`` prints;
``python -m jupyter_vgpu.testing.readme_status`` writes it into the README, and
``tests/unit/test_readme.py`` fails when the README's sample is not what the code prints.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

from .arbiter_process import ArbiterProcess
from .kernel_runner import Kernel
from .simulated_slice import simulated_slice
from .waiting import wait_for

GiB = 2**30
README = Path(__file__).resolve().parents[2] / "README.md"
#: The demo's default slice on its first simulated GPU (hub_spawner.demo.settings, GPUInventory).
SLICE = simulated_slice(
    gpu_uuid="GPU-sim-00000000-0000-4000-8000-000000000000",
    memory_request=8 * GiB,
    priority=50,
    isolation="time-slicing",
    placement="binpack",
    overcommit_ratio=1.5,
)
#: The cell of the sample (the README shows its last line).
CELL = "import torch\nx = torch.zeros(1024, 1024)  # 4 MiB of tensors\n%vgpu status"
#: The node arbiter's host memory limit in the sample (by default half of the host's RAM).
HOST_MEMORY_LIMIT = "64G"
#: The README's line just before the sample's code block.
MARK = "<!-- %vgpu status sample: written by python -m jupyter_vgpu.testing.readme_status -->"


def render(directory: Path) -> str:
    """What ``%vgpu status`` prints in the sample's kernel (started in ``directory``)."""
    arbiter = ArbiterProcess(directory, f"--ArbiterApp.host_memory_limit={HOST_MEMORY_LIMIT}").start()
    kernel = None
    try:
        kernel = Kernel(
            directory,
            {
                "JUPYTER_VGPU_SLICE": SLICE.to_json(),
                "JUPYTER_VGPU_ARBITER": str(arbiter.socket),
                "JUPYTER_VGPU_CHANNEL": "",
                "CUDA_VISIBLE_DEVICES": "",  # a GPU machine prints it as one without
            },
        )
        with arbiter.control() as c:
            c.register(kernel.pid, "ada", "", SLICE)
        wait_for(lambda: arbiter.kernel(kernel.pid), 30, "the sample's kernel to join the arbiter")
        return kernel.run(CELL).rstrip("\n")
    finally:
        if kernel is not None:
            kernel.shutdown()
        arbiter.stop()


def sample() -> str:
    """The README's sample as it should read: the cell's last line, then its output."""
    with tempfile.TemporaryDirectory(prefix="vgpu-readme-") as directory:
        return CELL.splitlines()[-1] + "\n" + render(Path(directory))


#: The figure of the sample that depends on the machine that printed it: the kernel
#: process's own memory (its libraries' heaps, the interpreter's). :func:`steady` masks it.
_MACHINE_FIGURE = re.compile(r"^(  own memory +)[\d.]+ [KMGT]?i?B", re.M)


def steady(sample_text: str) -> str:
    """``sample_text`` with its machine-dependent figure masked, for comparing two samples
    printed on different machines (the README's, and the one a test prints now)."""
    return _MACHINE_FIGURE.sub(r"\1…", sample_text)


def _block(text: str) -> re.Match:
    found = re.search(re.escape(MARK) + r"\n```\n(?P<body>.*?)\n```", text, re.S)
    if found is None:
        raise ValueError(f"the README has no sample after {MARK!r} in a ``` block")
    return found


def in_readme(path: Path = README) -> str:
    """The sample as the README shows it."""
    return _block(path.read_text(encoding="utf-8"))["body"]


def write(path: Path = README) -> None:
    """Write :func:`sample` into the README."""
    text = path.read_text(encoding="utf-8")
    found = _block(text)
    path.write_text(text[: found.start("body")] + sample() + text[found.end("body") :], encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else README)
