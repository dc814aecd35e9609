"""The ``%vgpu`` line magic: ``status``, ``pause``, and ``offload`` / ``restore``, their old names."""

from __future__ import annotations

from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .status import format_status


@magics_class
class VGPUMagics(Magics):
    def __init__(self, shell, *, hook):
        super().__init__(shell)
        self.hook = hook

    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        default="status",
        choices=["status", "pause", "resume", "offload", "restore"],
        help="status (default): the slice, this kernel's usage and its pause state; "
        "pause (or offload): move this kernel's GPU memory to compressed host memory as soon "
        "as the cell ends, releasing it to the card (or, where a pause is not safe, suspend "
        "the kernel: the driver's checkpoint); resume (or restore): nothing to do, a paused "
        "or suspended kernel comes back by itself before any of its code runs.",
    )
    @line_magic
    def vgpu(self, line: str = ""):
        """Show this kernel's vGPU slice and usage, or pause the kernel after this cell."""
        args = parse_argstring(self.vgpu, line)
        if args.action == "status":
            print(format_status(self.hook))
        elif args.action in ("pause", "offload"):
            pausing = self.hook.pausing
            reasons = pausing.blockers()
            if not reasons:
                pausing.pause_after_cell()
                print(
                    "This kernel will be paused as soon as the cell ends; "
                    "it resumes before its next code runs."
                )
                return
            if pausing.pauses_partly(reasons):
                pausing.pause_after_cell()
                print(
                    f"This kernel will be paused as soon as the cell ends, all but what must stay on "
                    f"the GPU: {'; '.join(reasons)}; {pausing.consequence(reasons)}. It resumes "
                    "before its next code runs."
                )
                return
            why = pausing.suspend_unavailable()
            if why:
                print(f"This kernel will not be paused: {'; '.join(reasons)}; nor suspended: {why}")
                return
            pausing.pause_after_cell()
            print(
                f"This kernel cannot be paused safely ({'; '.join(reasons)}): it will be suspended "
                "as soon as the cell ends instead, and restored before its next code runs."
            )
        else:
            print("Nothing to do: this kernel is running, so its memory is on the GPU.")
