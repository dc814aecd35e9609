"""Named steps where a test may stop a process of ours: the fault-injection hooks.

``JUPYTER_VGPU_FAILPOINTS`` lists ``step=action`` pairs, comma-separated, e.g.
``kernel.pause.copy=stop,arbiter.pause=kill``. When a process reaches a listed step
(:func:`hit`), it does the action to itself, once:

- ``kill``: SIGKILL, the process ends on the spot (no handler, no cleanup);
- ``term``: SIGTERM, the process ends the way its own handler for it says;
- ``stop``: SIGSTOP, the process freezes at that step (the thread that reached it before
  its next line: the signal is sent to that thread) until someone sends it SIGCONT,
  SIGKILL or SIGTERM (then SIGCONT). A test waits for the process to be stopped
  (``/proc/<pid>/stat`` state ``T``), then kills it the way it wants: the failure is at
  the named step, never a matter of sleeping and hoping;
- ``raise``: the thread that reached the step raises :class:`FailpointRaised` there, as a
  fault in the code at that step would: what is tested is how the process handles an
  error it did not foresee.

Steps are named ``<process>.<step>``: ``kernel.*`` in kernels, ``arbiter.*`` in the node
arbiter, ``checkpoint.*`` in the checkpoint helper (``python -m
jupyter_vgpu.host.checkpoint``). :data:`STEPS` lists them all; a name not there is
refused when the variable is read, so a misspelt step fails a test instead of passing it.

Why this cannot be abused: an action only ever signals the process that reached the
step (the thread that reached it), or raises in that thread; it never changes a figure,
skips a check or touches another process. A user may set the variable in their own
kernel (and in what it starts, such as the checkpoint helper of chaos mode), which can
end or fail only processes the user may end anyway (``os._exit``), and the node arbiter
survives any of its kernels dying at any step (``tests/faults/`` proves it). The arbiter
reads its own environment, which only the admin (or the Hub that runs it) sets. Without
the variable, :func:`hit` is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal
import threading

#: Environment variable listing the failpoints of a process.
ENV = "JUPYTER_VGPU_FAILPOINTS"

#: Every step a failpoint may name, with where it is.
STEPS = {
    "kernel.pause.start": "a pause begins: nothing has left the device yet",
    "kernel.pause.copy": "a pause has stored its first range; others are still to copy",
    "kernel.pause.release": "a segment's bytes are stored, before its memory is released",
    "kernel.pause.reply": "the pause is done, before the kernel tells the arbiter",
    "kernel.resume.mapped": "a resume has mapped the memory, before any byte is written back",
    "kernel.resume.copy": "a resume has written its first piece back; others are still to come",
    "kernel.spill.write": "a spill to disk has written its first part; others are still to write",
    "kernel.spill.written": "a spilled file is complete, before its host memory is let go",
    "kernel.suspend.prepared": "the kernel is ready to be checkpointed, before it tells the arbiter",
    "arbiter.room": "the arbiter begins to decide a kernel's request for room",
    "arbiter.pause": "the arbiter has asked a kernel to pause, before the answer",
    "arbiter.suspend": "the arbiter has the kernel's answer, before the driver's checkpoint",
    "arbiter.spill": "the arbiter has asked a kernel to spill to disk, before the answer",
    "arbiter.grant": "the arbiter has granted room, before anything else",
    "arbiter.restore": "the arbiter is about to restore a suspended kernel",
    "arbiter.hello": "the arbiter has read a kernel's hello, before it answers",
    "checkpoint.locked": "the checkpoint helper has locked the process, before the checkpoint",
    "checkpoint.held": "the checkpoint helper holds a suspended process",
    "checkpoint.restored": "the checkpoint helper has restored the process, before it unlocks it",
}
#: Each action's signal (``raise`` raises instead: :class:`FailpointRaised`).
ACTIONS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "stop": signal.SIGSTOP, "raise": None}

_lock = threading.Lock()
_armed: dict[str, str] | None = None


class FailpointRaised(RuntimeError):
    """What a step armed with ``raise`` raises."""


class FailpointError(ValueError):
    """``JUPYTER_VGPU_FAILPOINTS`` names an unknown step or action; the message says which."""


def parse(text: str) -> dict[str, str]:
    """``{step: action}`` of a ``JUPYTER_VGPU_FAILPOINTS`` value.

    Raises:
        FailpointError: an entry is not ``step=action`` with a step of :data:`STEPS` and
            an action of :data:`ACTIONS`.
    """
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        step, _, action = entry.partition("=")
        if step not in STEPS:
            raise FailpointError(f"{ENV}: unknown step {step!r}; steps: {', '.join(STEPS)}")
        if action not in ACTIONS:
            raise FailpointError(f"{ENV}: {step}: action must be one of {', '.join(ACTIONS)}, got {action!r}")
        out[step] = action
    return out


def hit(step: str) -> None:
    """Reaching ``step``: do its action to this process if one is armed (once)."""
    global _armed
    if _armed is None:
        with _lock:
            if _armed is None:
                _armed = parse(os.environ.get(ENV, ""))
    if not _armed:
        return
    with _lock:
        action = _armed.pop(step, None)
    if action == "raise":
        raise FailpointRaised(f"failpoint {step} (raise)")
    if action is not None:
        # directed at this thread: it stops (or ends) right here, before its next line; a
        # signal sent to the process would let this thread run on until its next system call
        signal.pthread_kill(threading.get_ident(), ACTIONS[action])
