"""Every setting of the kernel side, in one Configurable (``c.VGPUKernel.<trait>``).

Set them in an IPython kernel config file (the package ships
``etc/ipython/ipython_kernel_config.json``; a user's ``ipython_kernel_config.py`` may
add to it), e.g. ``c.VGPUKernel.scratch_bytes = "32M"``. None of them can raise a
limit: the budget comes from the slice, which the kernel only reads.
"""

from __future__ import annotations

import os

from traitlets import Bool, Enum, Float, Unicode, default
from traitlets.config import Configurable

from jupyter_vgpu.units import ByteSize

#: Environment variable that turns chaos mode on: ``1`` or ``pause``, or ``suspend``.
CHAOS_ENV = "JUPYTER_VGPU_CHAOS"


class VGPUKernel(Configurable):
    """jupyter-vgpu in an IPython kernel."""

    chaos = Enum(
        ["", "pause", "suspend"],
        help="""Pause (or pause, then suspend) the kernel after every cell and resume it
        before the next: proves a notebook gives the same results when its memory leaves
        the GPU between cells. Default from JUPYTER_VGPU_CHAOS (1 or pause, suspend).""",
    ).tag(config=True)

    @default("chaos")
    def _chaos_default(self):
        value = os.environ.get(CHAOS_ENV, "").strip().lower()
        return {"1": "pause", "pause": "pause", "suspend": "suspend"}.get(value, "")

    pause = Bool(
        True,
        help="""Let the kernel be paused (its GPU memory moved to host memory by the kernel
        itself) while idle. Turned off, the node arbiter suspends it whole instead when it
        needs the room (the driver's checkpoint, from outside): the setting is the user's
        to write, so it never keeps a kernel on the card.""",
    ).tag(config=True)

    use_nvcomp = Bool(
        True, help="Compress on the GPU with nvCOMP when it is installed (jupyter-vgpu[gpu])."
    ).tag(config=True)

    scratch_bytes = ByteSize(
        64 * 2**20,
        help="Device memory the pause path may use for the GPU codec, bytes or a size like '64M'.",
    ).tag(config=True)

    host_cap_bytes = ByteSize(
        None,
        allow_none=True,
        help="Host memory the CPU codec path may hold for a paused kernel before spilling "
        "(default: half of the host's available memory).",
    ).tag(config=True)

    spill_dir = Unicode("", help="Where the CPU codec path spills past its cap ('' refuses instead).").tag(
        config=True
    )

    share_pieces = Bool(
        True,
        help="""Once paused, offer the paused pieces to the node arbiter's store of pieces
        held once (a class's frozen base weights, the same in every kernel, then take host
        memory once): in the background, one piece at a time. Only under a node arbiter
        that shares pieces (its ``ArbiterApp.share_pieces``), and on the GPU path.""",
    ).tag(config=True)

    give_back_local_memory = Bool(
        False,
        help="""A pause gives back the CUDA context's local memory too (the threads' stacks,
        reserved for every thread the card holds: on an H100, 264 MiB of every context at
        the start's 1 KiB a thread, more once a kernel needed more), and a resume takes it
        back before any code runs, or stays paused where the card has no room for it.
        Measured on an H200 (benchmarks/results/context-parts-h200.json): 264 MiB of a
        0.79 GB context given back, taken back in 1.0 ms. Off: at 12x with release_first
        it lowered the memory path's share of p95 on seed 11 (31.5 to 17.8 points) and
        raised it on seeds 7 and 23 (-26.6 to 9.2, -41.6 to 22.2), one run each
        (docs/design.md, the sixteenth try).""",
    ).tag(config=True)

    prepare_pinned = Bool(
        True,
        help="""Once the kernel has been idle ``prepare_after`` seconds after a cell, pin in a
        thread of its own the host memory its next pause will store into (as much as it
        holds on the GPU), so that its first pause is as fast as the next ones instead of
        pinning on the way. Only under a node arbiter, which counts that memory in its
        host budget and asks for it back when the host needs it; it is only pinned while
        the node's kernels hold under half of that budget and the host keeps a quarter of
        its memory available.""",
    ).tag(config=True)

    trim_when_paused = Bool(
        True,
        help="""Once paused, give the host back what the kernel's process holds and needs for
        nothing until its next cell: pinned slabs kept warm past those holding its paused
        data, PyTorch's cache of pinned memory, and the free pages inside the C heap
        (glibc's ``malloc_trim``). Its next pause may pin again (or pins ahead once it is
        idle after a cell: ``prepare_pinned``). A kernel about to be suspended gives back
        the free pages of its heap the same way.""",
    ).tag(config=True)

    prepare_after = Float(
        2.0, help="Seconds of idleness after a cell before the kernel pins ahead (prepare_pinned)."
    ).tag(config=True)

    resume_timeout = Float(
        600.0,
        help="Seconds a cell waits for room on the GPU before it fails with a readable error.",
    ).tag(config=True)

    gate_timeout = Float(
        10.0,
        help="""Seconds a pause waits for the GPU calls other threads of the kernel have in the
        driver already (a launch, a long synchronous copy) to return before it takes the
        kernel off; past it, the pause is refused and the kernel stays.""",
    ).tag(config=True)

    poll_seconds = Float(0.5, help="Seconds between two looks at the server's channel.").tag(config=True)

    report_seconds = Float(1.0, help="Seconds between two usage reports to the server.").tag(config=True)
