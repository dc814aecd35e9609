"""What could run the user's code while the kernel is idle: named, for the user's sake.

A pause releases the device memory behind every pointer of the process; code of the
user's that runs while the kernel waits for its next message (a thread, a timer, an
asyncio task, a GUI event loop) would touch it. That is made safe by the pausable
allocator's gate (``native/gate.c``): its GPU calls wait while the kernel is away and
bring it back. So this list keeps no kernel on the card; ``%vgpu status`` and the JupyterLab
panel show it (``between cells``), in a notebook user's words (a DataLoader's
pin-memory thread, a timer, an asyncio task), so that a user who sees their kernel come
back on its own knows why. Where the allocator cannot hold every driver call (not
x86-64), it keeps a kernel from being suspended (:meth:`.pausing.PauseControl._suspend_risk`).

The kernel's own machinery does not count: ipykernel's and IPython's threads and
tasks, pyzmq's and tornado's, this package's, tqdm's monitor, ``torch.compile``'s
worker-pool reader (it reads compiled code from a pipe), and threads PyTorch created in
C++ (``threading._DummyThread``: autograd's workers, which run only while a cell calls
``backward``).
"""

from __future__ import annotations

import asyncio
import sys
import threading

#: Modules whose threads and tasks belong to the kernel, not to the user.
KERNEL_MODULES = (
    "ipykernel",
    "IPython",
    "jupyter_client",
    "jupyter_core",
    "zmq",
    "tornado",
    "asyncio",
    "jupyter_vgpu",
    "tqdm",
    "anyio",
    "torch._inductor.compile_worker",  # torch.compile's pool: reads results from a pipe
)
#: Name prefixes of this package's own threads.
OWN_THREADS = ("jupyter-vgpu", "vgpu-codec")


def _ours(module: str | None) -> bool:
    return bool(module) and any(module == m or module.startswith(m + ".") for m in KERNEL_MODULES)


def _idle_pool_worker(t: threading.Thread) -> bool:
    """A ``ThreadPoolExecutor`` worker waiting for work (it runs nothing until a cell
    submits some)."""
    frame = sys._current_frames().get(t.ident)
    if frame is not None and frame.f_code.co_name == "get" and frame.f_code.co_filename.endswith("queue.py"):
        frame = frame.f_back  # a pure-Python queue
    return frame is not None and frame.f_code.co_name == "_worker"


#: Threads that only wait for what the kernel's own code hands them (and so never run
#: while it is idle), by their target's module and name: a multiprocessing queue's feeder
#: (it pickles what a cell put, into a pipe: a DataLoader's index queues, a Pool's tasks).
WAITING_ONLY = frozenset({("multiprocessing.queues", "_feed")})

#: Threads libraries start on the user's behalf, by their target's module and name: what
#: a notebook user knows them as.
KNOWN_THREADS = {
    ("torch.utils.data._utils.pin_memory", "_pin_memory_loop"): (
        "a DataLoader's pin-memory thread (pin_memory=True with persistent workers, "
        "or an iterator not finished)"
    ),
}


def _describe(t: threading.Thread) -> str:
    target = getattr(t, "_target", None)
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if (module, name) in KNOWN_THREADS:
        return KNOWN_THREADS[module, name]
    if isinstance(t, threading.Timer):
        return f"a timer ({t.name})"
    what = getattr(target, "__qualname__", None) or type(t).__name__
    return f"thread {t.name!r} ({what})"


def _user_thread(t: threading.Thread) -> bool:
    if t is threading.main_thread() or isinstance(t, threading._DummyThread):
        return False
    if t.name.startswith(OWN_THREADS):
        return False
    if isinstance(t, threading.Timer):
        return not t.finished.is_set()
    target = getattr(t, "_target", None)
    if target is not None:
        module = getattr(target, "__module__", None)
        if module == "concurrent.futures.thread":
            return not _idle_pool_worker(t)
        if (module, getattr(target, "__name__", None)) in WAITING_ONLY:
            return False
        return not _ours(module)
    if type(t) is threading.Thread:  # a plain Thread with no target has nothing to run
        return False
    return not _ours(type(t).__module__)


def _task_module(task: asyncio.Task) -> str | None:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
    if code is None:
        return None
    frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
    if frame is not None:
        return frame.f_globals.get("__name__")
    return None


def idle_code(loop: asyncio.AbstractEventLoop | None = None, kernel=None) -> list[str]:
    """A readable line for each thread, task or event loop of the user's that may run
    while the kernel is idle; empty when a pause is safe.

    Args:
        loop: the kernel's asyncio loop (its tasks are checked), or None.
        kernel: the ipykernel ``Kernel`` (its GUI event loop is checked), or None.
    """
    found = [_describe(t) for t in threading.enumerate() if t.is_alive() and _user_thread(t)]
    if loop is not None:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:
            tasks = []
        for task in tasks:
            if not task.done() and not _ours(_task_module(task)):
                found.append(f"an asyncio task ({task.get_coro().__qualname__})")
    if kernel is not None and getattr(kernel, "eventloop", None) is not None:
        found.append(f"a GUI event loop ({getattr(kernel.eventloop, '__name__', kernel.eventloop)})")
    return found
