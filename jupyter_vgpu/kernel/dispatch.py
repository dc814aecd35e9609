"""Hooking ipykernel's message dispatch, so that the kernel resumes before any of its code runs.

IPython's ``pre_run_cell`` event is too late: completion, inspection, comm (widget)
messages and the debugger run code without a cell. ipykernel keeps one handler per
message type in ``kernel.shell_handlers`` and ``kernel.control_handlers``; each is
wrapped so that :meth:`~.gate.Gate.enter` runs first and :meth:`~.gate.Gate.leave`
after (after the coroutine, for handlers that return one). Messages that run no user
code pass straight through, so a paused kernel still answers ``kernel_info_request``
(JupyterLab sends one on every connect) without coming back to the GPU.

If the kernel cannot come back (no room before the timeout, or the user interrupts the
wait), the handler does not run: an ``execute_request`` gets an error reply that says
why, as a failed cell would, and other requests an error reply of their type.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable

from .gate import Gate

log = logging.getLogger("jupyter_vgpu")

#: Shell messages that run no user code: answered without resuming the kernel.
PASS_THROUGH = frozenset(
    {
        "kernel_info_request",
        "is_complete_request",
        "history_request",
        "connect_request",
        "comm_info_request",
        "shutdown_request",
        "interrupt_request",
        "create_subshell_request",
        "delete_subshell_request",
        "list_subshell_request",
    }
)
#: Control messages that may run user code.
CONTROL = frozenset({"debug_request"})

_WRAPPED = "_jupyter_vgpu_original"


def _reply_type(msg_type: str) -> str:
    return msg_type[: -len("_request")] + "_reply" if msg_type.endswith("_request") else ""


def refuse(kernel, stream, idents, msg, reason: BaseException) -> None:
    """Answer ``msg`` with an error naming ``reason`` instead of running it."""
    msg_type = msg["header"]["msg_type"]
    ename = type(reason).__name__
    evalue = str(reason) or ename
    content = {"status": "error", "ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]}
    if msg_type == "execute_request":
        shell = kernel.shell
        if not msg["content"].get("silent", False) and msg["content"].get("store_history", True):
            shell.execution_count += 1
        content["execution_count"] = shell.execution_count
        kernel.session.send(kernel.iopub_socket, "error", content, parent=msg, ident=kernel._topic("error"))
        content.update(user_expressions={}, payload=[])
    reply = _reply_type(msg_type)
    if reply and stream is not None:
        kernel.session.send(stream, reply, content, parent=msg, ident=idents)


def _wrap(kernel, gate: Gate, handler: Callable, msg_type: str, after: Callable[[str], None] | None):
    def wrapper(stream, idents, msg):
        try:
            gate.enter(cell=msg_type == "execute_request" and not msg["content"].get("silent", False))
        except (Exception, KeyboardInterrupt) as e:
            log.info("jupyter-vgpu: %s not run: %s", msg_type, e)  # the reply says why, in words
            refuse(kernel, stream, idents, msg, e)
            return None
        try:
            result = handler(stream, idents, msg)
        except BaseException:
            gate.leave()
            raise
        if not inspect.isawaitable(result):
            gate.leave()
            if after is not None:
                after(msg_type)
            return result

        async def finish():
            try:
                return await result
            finally:
                gate.leave()
                if after is not None:
                    after(msg_type)

        return finish()

    setattr(wrapper, _WRAPPED, handler)
    return wrapper


def install(kernel, gate: Gate, after: Callable[[str], None] | None = None) -> int:
    """Wrap ``kernel``'s handlers (idempotent); ``after(msg_type)`` runs once a wrapped
    handler is done (chaos mode pauses there). Returns how many were wrapped."""
    count = 0
    for table, names in ((kernel.shell_handlers, None), (kernel.control_handlers, CONTROL)):
        for msg_type, handler in list(table.items()):
            if hasattr(handler, _WRAPPED) or msg_type in PASS_THROUGH:
                continue
            if names is not None and msg_type not in names:
                continue
            table[msg_type] = _wrap(kernel, gate, handler, msg_type, after)
            count += 1
    return count


def uninstall(kernel) -> None:
    """Put ``kernel``'s original handlers back."""
    for table in (kernel.shell_handlers, kernel.control_handlers):
        for msg_type, handler in list(table.items()):
            original = getattr(handler, _WRAPPED, None)
            if original is not None:
                table[msg_type] = original
