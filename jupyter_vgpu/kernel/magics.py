"""The ``%vgpu`` line magic: ``status``, ``offload [names…]``, ``restore [names…]``."""

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
        choices=["status", "offload", "restore"],
        help="status (default): the slice and this kernel's usage; "
        "offload: move tensors to compressed host memory; restore: bring them back to the GPU.",
    )
    @argument("names", nargs="*", help="variables to offload or restore (default: every tensor).")
    @line_magic
    def vgpu(self, line: str = ""):
        """Show this kernel's vGPU slice, or offload / restore its tensors."""
        args = parse_argstring(self.vgpu, line)
        if args.action == "status":
            if args.names:
                print("%vgpu status takes no names")
                return
            print(format_status(self.hook))
            return
        engine = self.hook.engine
        if engine is None:
            if self.hook.torch is None:
                print("Nothing to do: torch is not imported in this kernel.")
            else:
                print("Nothing to do: PyTorch has no CUDA here, so there is no GPU memory to offload.")
            return
        names = args.names or None
        if args.action == "offload":
            print(engine.offload(self.shell.user_ns, names))
        else:
            print(engine.restore(self.shell.user_ns, names))
