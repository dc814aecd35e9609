"""The ``%vgpu`` line magic: ``status``, ``pause``, ``help``, and ``offload`` / ``restore``,
the old names of ``pause`` and ``resume``.

``%vgpu help`` and ``%vgpu?`` print the magic's usage (:func:`usage`). IPython sends what
``?`` shows to a pager, which a Jupyter kernel turns into a ``page`` payload of its reply:
frontends that show no pager (notebooks run by nbclient, REST clients) then show
nothing. So ``%vgpu?`` prints its usage as output instead (:func:`show_in_pager`, a
``show_in_pager`` hook that lets every other ``?`` through).
"""

from __future__ import annotations

import re

from IPython.core.error import TryNext
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
        choices=["status", "pause", "resume", "help", "offload", "restore"],
        metavar="status|pause|resume|help",
        help="what to do (default: status)",
    )
    @line_magic
    def vgpu(self, line: str = ""):
        """Show this kernel's vGPU slice and usage, or pause the kernel after this cell.

        actions:
          status   (the default) the slice, this kernel's memory, its state (active, idle,
                   paused, suspended), whether it can be paused (and if not, why and what
                   happens instead), where its memory is, and its last pause and resume
          pause    pause this kernel as soon as the cell ends: its GPU memory moves to
                   compressed host memory and the card gets it back; where a pause is not
                   safe, the kernel is suspended instead (the driver's checkpoint); it comes
                   back by itself before any of its code runs (old name: offload)
          resume   nothing to do: a paused or suspended kernel comes back by itself before
                   its next code runs (old name: restore)
          help     this text (also %vgpu?)
        """
        args = parse_argstring(self.vgpu, line)
        if args.action == "status":
            print(format_status(self.hook))
        elif args.action == "help":
            print(usage())
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


def usage() -> str:
    """What ``%vgpu help`` and ``%vgpu?`` print: the usage line, the summary, every action
    (the magic's argument parser's help, as IPython shows it, without its reST ``::``)."""
    text = VGPUMagics.vgpu.parser.format_help()
    return re.sub(r"\A::\n\n", "", text).rstrip() + "\n"


#: The first line of the magic's help, by which its ``?`` is told from any other.
SUMMARY = "Show this kernel's vGPU slice and usage, or pause the kernel after this cell."


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def show_in_pager(shell, data, start=0, screen_lines=0, pager_cmd=None):
    """IPython's ``show_in_pager`` hook: ``%vgpu?`` prints :func:`usage`; anything else
    goes on to the next pager (``TryNext``)."""
    text = data.get("text/plain", "") if isinstance(data, dict) else str(data)
    if SUMMARY in _ANSI.sub("", text):
        print(usage())
        return
    raise TryNext
