"""The kernel hook: one per IPython shell, tying the slice, PyTorch and pausing together.

It reads the slice (from the server's channel, else from ``JUPYTER_VGPU_SLICE``),
applies the budget when torch is imported, names the budget in out-of-memory errors,
wraps ipykernel's message handlers so that a paused kernel comes back before any of
its code runs (:mod:`.dispatch`, :mod:`.pausing`), follows live quota changes through a
watcher thread, and reports usage to the server.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from jupyter_vgpu import channel
from jupyter_vgpu.host.socket_path import SOCKET_ENV
from jupyter_vgpu.slice import Slice, SliceError

from . import dispatch
from .arbiter_client import ArbiterClient
from .budget import TorchBudget, TorchImportHook
from .config import VGPUKernel
from .gate import AWAY
from .pause.states import PauseState
from .pausing import PauseControl
from .usage import tensor_bytes

#: Seconds a prefetch request stays worth acting on (its user may have gone since).
PREFETCH_FRESH = 10.0

log = logging.getLogger("jupyter_vgpu")

#: The kernel's states, transitions folded into where the memory is (the arbiter
#: protocol's four: :attr:`.pause.states.PauseState.kernel_state`).
KERNEL_STATES = {s: s.kernel_state for s in PauseState}
#: The states in which the kernel's memory is off the card, or on its way off.
OFF_THE_CARD = (PauseState.PAUSED, PauseState.SUSPENDED, PauseState.PAUSING, PauseState.SUSPENDING)


def tier_of(pause: dict) -> str:
    """Where the kernel's memory is, from its pause figures: ``gpu``, ``host`` (paused,
    in host memory), ``disk`` (paused, in the node's disk tier) or ``suspended``."""
    state = KERNEL_STATES.get(pause["state"], PauseState.IDLE)
    if state == PauseState.SUSPENDED:
        return "suspended"
    if state == PauseState.PAUSED:
        return "disk" if pause.get("disk_bytes") else "host"
    return "gpu"


def current_kernel_id() -> str | None:
    """This kernel's id, from its connection file's name (``kernel-<id>.json``), or None."""
    try:
        from ipykernel.connect import get_connection_file

        return channel.kernel_id_of(Path(get_connection_file()))
    except Exception:
        return None


class KernelHook:
    """State and callbacks of jupyter-vgpu inside one kernel.

    Attributes:
        slice: the current slice, or None (no hub, no ``JUPYTER_VGPU_SLICE``).
        budget: the PyTorch budget (:class:`TorchBudget`).
        pausing: pause, suspend and resume of this kernel (:class:`PauseControl`).
        simulated_used: bytes of torch tensors reachable from the namespace, counted
            after each cell when there is no real GPU to measure.
    """

    def __init__(self, shell, config: VGPUKernel | None = None):
        self.shell = shell
        self.config = config or VGPUKernel(parent=shell)
        self.channel = channel.channel_dir()
        self.kernel_id = current_kernel_id()
        self.kernel = getattr(shell, "kernel", None)
        self.budget = TorchBudget()
        self.simulated_used = 0
        self._torch_memory = (0, 0)
        self.slice: Slice | None = None
        self.slice_error: str | None = None
        self._server_mtime: float | None = None
        self._prefetch_seen = time.time()  # requests older than the kernel are not for it
        #: the last prefetch asked of this kernel and what came of it (:meth:`_prefetch_if_asked`)
        self.last_prefetch: dict | None = None
        self._torch_hook = TorchImportHook(self._on_torch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pausing = PauseControl(
            self.config,
            lambda: self.torch,
            lambda: self.slice is not None and self.slice.simulated,
            kernel=self.kernel,
            say=self._say,
            card_free=self.card_free,
            gpu_processes=self.gpu_processes,
        )
        self.pausing.listeners.append(lambda state: self.write_report())
        self.arbiter = None  # the ArbiterClient, under a node arbiter
        self.slice_from_arbiter = False
        self._resume_sent: float | None = None
        self._read_initial_slice()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self.shell.events.register("post_run_cell", self.post_run_cell)
        if "torch" in sys.modules:
            self._on_torch(sys.modules["torch"])
        else:
            self._torch_hook.install()
        if self.kernel is not None:
            dispatch.install(self.kernel, self.pausing.gate, after=self.pausing.after)
        path = os.environ.get(SOCKET_ENV)
        if path:
            self.arbiter = ArbiterClient(
                path, self.kernel_id or "", self._adopt_arbiter_slice, self._figures, self.pausing, self._say
            )
            # an arbiter that says nothing for a minute about a request (hung, stopped) is
            # given up on: the kernel decides for itself, as without one
            self.arbiter.patience = min(60.0, self.config.resume_timeout)
            self.pausing.ask_room = self.arbiter.room
            self.pausing.node_figures = lambda: self.arbiter.node
            self.pausing.listeners.append(self.arbiter.send_state)
            # where the arbiter grants growth on demand, the allocator asks it for room itself
            self.arbiter.grow_channel = self.pausing.grow_with
            self.arbiter.start()
        if self.channel is not None:
            self._thread = threading.Thread(target=self._watch, name="jupyter-vgpu-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.arbiter is not None:
            self.pausing.grow_with(None)
            self.arbiter.stop()
            self.pausing.ask_room = None
            self.pausing.node_figures = lambda: None
        self._torch_hook.remove()
        try:
            self.shell.events.unregister("post_run_cell", self.post_run_cell)
        except ValueError:
            pass
        if self.kernel is not None:
            dispatch.uninstall(self.kernel)
        if self._owns_custom_exc():
            self.shell.set_custom_exc((), None)
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _say(self, text: str, end: str = "\n") -> None:
        print(text, file=sys.stderr, end=end, flush=True)

    # -- slice ---------------------------------------------------------------------------

    def _read_initial_slice(self) -> None:
        if self.channel is not None and self._poll_channel():
            return
        try:
            self.set_slice(Slice.from_env())
        except SliceError as e:
            self.slice_error = f"JUPYTER_VGPU_SLICE is malformed: {e}"
            log.error("jupyter-vgpu: %s", self.slice_error)

    def set_slice(self, slice_: Slice | None) -> None:
        """Adopt a new slice: apply its budget and export framework limits."""
        changed = slice_ != self.slice
        self.slice = slice_
        self.budget.set_slice(slice_)
        if slice_ is not None:
            for key, value in slice_.environment().items():
                if key != "CUDA_VISIBLE_DEVICES":  # fixed at process start; never moved
                    os.environ[key] = value
        if changed and slice_ is not None:
            log.info(
                "jupyter-vgpu: slice budget %d bytes, %d%% compute", slice_.memory_limit, slice_.compute_share
            )

    def _adopt_arbiter_slice(self, doc: dict | None) -> None:
        """The node arbiter's slice: from now on the only authority on this kernel's limits."""
        if doc is None:
            return
        try:
            slice_ = Slice.from_dict(doc)
        except SliceError as e:
            self.slice_error = f"the node arbiter sent a malformed slice: {e}"
            log.error("jupyter-vgpu: %s", self.slice_error)
            return
        self.slice_from_arbiter = True
        self.slice_error = None
        self.set_slice(slice_)

    def _figures(self) -> dict:
        """What the arbiter is told (``ArbiterClient``'s ``figures``): ``state``,
        ``resident``, ``paused_bytes``, ``host_bytes`` (host memory held for paused data:
        pinned slabs and the store's entries), ``disk_bytes``, ``pausable_bytes`` (what a
        pause would store at most, before compression, while resident on a real card:
        :meth:`.memory_path.MemoryPath.pausable_bytes`; else None), ``cached_bytes`` (the
        allocator's cached free blocks a release gives back, likewise while resident on a
        real card: :meth:`.memory_path.MemoryPath.cached_bytes`; else None), ``budget``,
        ``idle_seconds`` and ``resume_seconds`` (the last resume's, once)."""
        st = self.pausing.stats()
        away = st["state"] in OFF_THE_CARD
        engine = self.pausing.engine
        host = engine.host_held() if engine is not None else st["host_bytes"]
        disk = st.get("disk_bytes") or 0
        if self.simulated:
            # the stand-in moves no memory; segments of the allocator's host backend do
            held = engine.vmm.mapped_bytes if engine is not None and engine.device is None else 0
            resident = 0 if away else self.simulated_used + held
            paused = (self.simulated_used if away else 0) + (st["paused_bytes"] if engine is not None else 0)
        else:
            resident, paused = self.torch_memory()[1], st["paused_bytes"]
            if st["state"] == PauseState.SUSPENDED and self.pausing.suspend_need:
                # what the driver took off the card (NVML's figure before the checkpoint):
                # what its restore needs back, for an arbiter that meets it suspended
                resident = sum(self.pausing.suspend_need.values())
        pausable = None if away or self.simulated else self.pausing.pausable_bytes()
        cached = None if away or self.simulated else self.pausing.cached_bytes()
        seconds = st.get("last_resume_seconds")
        fresh = seconds if seconds is not None and seconds != self._resume_sent else None
        self._resume_sent = seconds
        return {
            "state": KERNEL_STATES.get(st["state"], PauseState.IDLE),
            "resident": resident,
            "paused_bytes": paused,
            "host_bytes": host,
            "disk_bytes": disk,
            "pausable_bytes": pausable,
            "cached_bytes": cached,
            "budget": self.slice.memory_limit if self.slice else None,
            "idle_seconds": self.pausing.gate.idle_seconds,
            "resume_seconds": fresh,
        }

    def card_free(self) -> int | None:
        """Free bytes now of the slice's card with the least free (NVML; a slice of several
        cards needs its room on each), or None where that is unknown (no slice, a
        simulated card, no NVML). Safe while the kernel is suspended: NVML is not CUDA,
        and a suspended process's CUDA calls wait for its restore."""
        if self.slice is None or self.slice.simulated:
            return None
        try:
            from jupyter_vgpu import nvml

            return min(nvml.free_memory(uuid) for uuid in self.slice.gpu_uuids)
        except Exception:
            return None

    def _poll_channel(self) -> bool:
        """Apply ``server.json`` if it changed (and no node arbiter gave the slice); True
        when a document was read."""
        path = channel.server_path(self.channel)
        try:
            mtime = path.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        if mtime == self._server_mtime:
            return False
        doc = channel.read_json(path)
        if doc is None:
            return False
        self._server_mtime = mtime
        self._prefetch_if_asked(doc.get("prefetch"))
        if self.slice_from_arbiter:
            return True  # the arbiter's slice wins over a file the kernel could write
        try:
            new = Slice.from_dict(doc["slice"]) if doc.get("slice") else None
        except SliceError as e:
            self.slice_error = f"the server sent a malformed slice: {e}"
            log.error("jupyter-vgpu: %s", self.slice_error)
            return True
        self.slice_error = None
        self.set_slice(new)
        return True

    def _prefetch_if_asked(self, asked: object) -> None:
        """Start a prefetch (:meth:`PauseControl.prefetch`) when ``server.json`` holds a new
        request for this kernel (``{"prefetch": {<kernel id>: <unix seconds>}}``) of the
        last :data:`PREFETCH_FRESH` seconds; in a thread of its own, so that the channel's
        poll and the cells go on."""
        if not isinstance(asked, dict) or not self.kernel_id:
            return
        at = asked.get(self.kernel_id)
        if isinstance(at, bool) or not isinstance(at, (int, float)) or at <= self._prefetch_seen:
            return
        self._prefetch_seen = at
        now = time.time()
        if now - at > PREFETCH_FRESH:
            late = f"seen {now - at:.1f} s after it was asked (over {PREFETCH_FRESH:g} s)"
            self._prefetched(at, "late", late)
            return
        state = self.pausing.state
        if state not in AWAY:
            self._prefetched(at, "not away", f"the kernel was {state}: nothing to bring back")
            return
        self._prefetched(at, "under way")
        threading.Thread(target=self._prefetch, args=(at,), name="jupyter-vgpu-prefetch", daemon=True).start()

    def _prefetch(self, at: float) -> None:
        """The prefetch asked at ``at`` (unix seconds), in its own thread; its outcome goes
        into the watcher's next report (this thread writes none: a report reads PyTorch,
        which only the watcher does as the kernel's own calls)."""
        if self.pausing.prefetch():
            self._prefetched(at, "back")
        else:
            why = self.pausing.prefetch_refusal or "the kernel was not away by then"
            self._prefetched(at, "refused", why)

    def _prefetched(self, at: float, outcome: str, message: str | None = None) -> None:
        """Keep what came of the prefetch asked at ``at`` (:attr:`last_prefetch`, in the
        report and ``%vgpu status``): ``late`` (past :data:`PREFETCH_FRESH`), ``not away``,
        ``under way``, ``back`` or ``refused`` (``message``: why). A request the kernel
        dropped was said nowhere before: a user's click that brought nothing back could not
        be told from one that never reached the kernel."""
        now = time.time()
        message = message[:4000] if message else message  # the report's contract: text of 4,000 at most
        self.last_prefetch = {"asked_at": at, "outcome": outcome, "message": message, "decided_at": now}
        if outcome != "under way":
            log.info("jupyter-vgpu: prefetch asked at %.3f: %s (%s)", at, outcome, message or "")

    # -- torch ---------------------------------------------------------------------------

    def _on_torch(self, torch) -> None:
        self.budget.attach(torch)
        self.shell.set_custom_exc((torch.OutOfMemoryError,), self._show_oom)

    def _owns_custom_exc(self) -> bool:
        torch = self.torch
        return torch is not None and self.shell.custom_exceptions == (torch.OutOfMemoryError,)

    def _show_oom(self, shell, etype, evalue, tb, tb_offset=None):
        note = self.budget.oom_note()
        message = str(evalue.args[0]) if evalue.args else ""
        if note not in message:
            evalue.args = (f"{message}\n{note}", *evalue.args[1:])
        shell.showtraceback((etype, evalue, tb), tb_offset=tb_offset)

    # -- cells ---------------------------------------------------------------------------

    def post_run_cell(self, result) -> None:
        if self.simulated:
            self.simulated_used = tensor_bytes(self.shell.user_ns)
        if self.channel is not None:
            self.write_report()

    # -- usage ---------------------------------------------------------------------------

    @property
    def torch(self):
        return sys.modules.get("torch") if self.budget.torch is not None else None

    @property
    def cuda(self) -> bool:
        torch = self.torch
        return bool(torch is not None and torch.cuda.is_available())

    @property
    def simulated(self) -> bool:
        """No real GPU to measure: the slice is simulated, or PyTorch has no CUDA."""
        return (self.slice is not None and self.slice.simulated) or not self.cuda

    def torch_memory(self) -> tuple[int, int]:
        """``(allocated, reserved)`` bytes of PyTorch's CUDA allocator (0, 0 without CUDA).

        While the kernel is suspended the last figures are kept: every CUDA call of a
        suspended process waits for its restore."""
        torch = self.torch
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return 0, 0
        if self.pausing.state not in (PauseState.SUSPENDED, PauseState.SUSPENDING):
            self._torch_memory = (int(torch.cuda.memory_allocated()), int(torch.cuda.memory_reserved()))
        return self._torch_memory

    def gpu_processes(self) -> dict[int, int]:
        """Bytes per process on this kernel's GPU (every GPU without a slice), per NVML;
        empty on a simulated GPU.

        Raises:
            Exception: NVML fails (the caller decides what that means).
        """
        if self.slice is not None and self.slice.simulated:
            return {}
        from jupyter_vgpu import nvml

        uuids = self.slice.gpu_uuids if self.slice is not None else [g.uuid for g in nvml.list_gpus()]
        out: dict[int, int] = {}
        for uuid in uuids:
            for pid, nbytes in nvml.process_memory(uuid).items():
                out[pid] = out.get(pid, 0) + nbytes
        return out

    def nvml_memory(self) -> int | None:
        """This process's memory on the slice's GPUs per NVML (summed over the cards of
        a slice of several), bytes, or None when unknown."""
        if self.slice is None or self.slice.simulated:
            return None
        try:
            from jupyter_vgpu import nvml

            held = [nvml.process_memory(uuid).get(os.getpid()) for uuid in self.slice.gpu_uuids]
        except Exception:
            return None
        return None if all(h is None for h in held) else sum(h or 0 for h in held)

    def report(self) -> dict[str, Any]:
        """The document this kernel writes to ``kernel-<id>.json`` (see jupyter_vgpu.channel)."""
        allocated, reserved = self.torch_memory()
        pause = self.pausing.stats()
        return {
            "version": 2,
            "kernel_id": self.kernel_id,
            "pid": os.getpid(),
            "updated": time.time(),
            "torch_imported": self.torch is not None,
            "cuda_available": self.cuda,
            "torch_allocated": allocated,
            "torch_reserved": reserved,
            "budget": self.slice.memory_limit if self.slice else None,
            "budget_status": self.budget.status,
            "simulated": self.simulated,
            "simulated_used": self.simulated_used,
            "busy": pause["state"] == PauseState.ACTIVE,
            "state": KERNEL_STATES.get(pause["state"], PauseState.IDLE),
            "pause": pause,
            "tier": tier_of(pause),
            "node": self.arbiter.node if self.arbiter is not None else None,
            "last_prefetch": self.last_prefetch,
        }

    def write_report(self) -> None:
        if self.channel is None or self.kernel_id is None:
            return
        try:
            channel.write_json(channel.kernel_path(self.channel, self.kernel_id), self.report())
        except OSError as e:
            log.warning("jupyter-vgpu: cannot write the usage report: %s", e)

    def _watch(self) -> None:
        last_report = 0.0
        while not self._stop.wait(self.config.poll_seconds):
            try:
                with self.pausing.own_calls():
                    self._poll_channel()
                    now = time.monotonic()
                    if now - last_report >= self.config.report_seconds:
                        last_report = now
                        self.write_report()
            except Exception:  # the watcher must outlive any single failure
                log.exception("jupyter-vgpu: watcher step failed")
