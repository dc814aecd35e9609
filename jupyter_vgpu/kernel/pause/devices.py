"""A pause of a kernel that sees several devices: one engine per device, moved as one.

A slice of several cards gives its kernels every card (``CUDA_VISIBLE_DEVICES`` lists
them all), and the kernel's code may put memory on any of them: tensors on ``cuda:0``
and ``cuda:1``, a model spread by ``device_map="auto"``. Each device's memory goes
through a :class:`~.engine.PauseEngine` of its own (its own codec, scratch, pinned slabs
and host store: a codec's kernels and work areas live on one device), made the first
time that device holds memory at a pause. :class:`DevicesEngine` pauses and resumes them
as one kernel:

- a pause pauses each device holding memory, in device order; where one fails, those
  already paused are resumed before the error is raised: nothing is left half paused
  (:class:`~.outcomes.PauseError`, ``still_paused`` only where that undo failed too);
- a resume first maps every device's memory back and takes each device's scratch, and
  only once all of it was had writes the bytes back: a device without room
  (:class:`~.vmm.DeviceFull`) gives back what the others took, and the kernel stays
  paused on every card (never half back). Damaged host data of one device
  (:class:`~.outcomes.ResumeError`) leaves that device paused with its host copy kept;
  devices written back before it stay back, and the kernel stays paused (its code runs
  only once every device is back).

Host memory is shared out: each device's store may hold ``host_cap_bytes`` divided by
the devices the kernel sees. Its interface is the engine's, so the kernel's pause,
resume, spill, trim and pin-ahead paths drive either.
"""

from __future__ import annotations

import contextlib
import threading
import time

from ..codec.pinned_arena import PinnedArena
from . import vmm
from .engine import PauseEngine
from .outcomes import Outcome, PauseError
from .states import PauseState
from .store import DEFAULT_HOST_FRACTION, available_host_memory
from .torch_calls import plain_torch


class _Arenas:
    """The pinned slabs of every device's engine, read as one arena is by the kernel's
    pin-ahead rules (:meth:`.host_memory.HostMemory._keep_pinning`): ``held_bytes`` of
    all of them, and the ``slab_bytes`` they pin by."""

    def __init__(self, engines: dict[int, PauseEngine]):
        self._engines = engines

    @property
    def held_bytes(self) -> int:
        return sum(e.arena.held_bytes for e in list(self._engines.values()))

    @property
    def slab_bytes(self) -> int:
        return max((e.arena.slab_bytes for e in list(self._engines.values())), default=PinnedArena.SLAB_BYTES)


def _combined(outcomes: list[Outcome], seconds: float) -> Outcome:
    return Outcome(
        seconds,
        sum(o.segment_bytes for o in outcomes),
        sum(o.live_bytes for o in outcomes),
        sum(o.host_bytes for o in outcomes),
        tuple(sorted({c for o in outcomes for c in o.codecs})),
    )


class DevicesEngine:
    """Pauses and resumes the pausable memory of every device of the process as one.

    Args:
        torch: the torch module (built with CUDA).
        allocator: the process's :class:`~.vmm.VMM` (CUDA backend).
        devices: CUDA ordinals the kernel sees (``torch.cuda.device_count()`` of them).
        host_cap_bytes: host memory all devices' stores may hold together, bytes
            (default: half of ``MemAvailable``, as one engine's); each device's store
            gets an equal share.
        **options: the rest of :class:`~.engine.PauseEngine`'s keyword arguments
            (``use_nvcomp``, ``scratch_bytes``, ``spill_dir``, ``threads``), for each
            device's engine.
    """

    def __init__(
        self, torch, allocator: vmm.VMM, devices: list[int], *, host_cap_bytes: int | None = None, **options
    ):
        if not devices:
            raise ValueError("a DevicesEngine needs at least one device")
        if host_cap_bytes is None:
            host_cap_bytes = int(available_host_memory() * DEFAULT_HOST_FRACTION)
        self.torch, self.vmm, self.devices = torch, allocator, sorted(devices)
        self.device = self.devices[0]  # not None: the engine of a GPU (the host stand-in's is None)
        self._share = host_cap_bytes // len(self.devices)
        self._options = options
        self.engines: dict[int, PauseEngine] = {}
        self.arena = _Arenas(self.engines)
        self._lock = threading.Lock()  # a pause or a resume at a time
        self._making = threading.Lock()  # one engine per device
        self.last_pause: Outcome | None = None
        self.last_resume: Outcome | None = None
        self.last_spill: Outcome | None = None

    def _on(self, device: int):
        """``device`` current in this thread (its primary context) while one device's
        engine works: the GPU codec's streams, events and kernels belong to the context
        they were made in, and the driver refuses them in another's
        (``CUDA_ERROR_INVALID_HANDLE``)."""
        return self.torch.cuda.device(device)

    def _engine(self, device: int) -> PauseEngine:
        """``device``'s engine, made on first use (a pause and the thread pinning ahead
        may both ask: one is made)."""
        with self._making:
            engine = self.engines.get(device)
            if engine is not None:
                return engine
            with self._on(device):
                engine = self.engines[device] = PauseEngine(
                    self.torch,
                    self.vmm,
                    device,
                    host_cap_bytes=self._share,
                    among_devices=True,
                    **self._options,
                )
            return engine

    def _holding(self) -> list[int]:
        """The devices on which the process has memory mapped now, in order."""
        with self.vmm.machinery():
            return sorted({u.device for u in self.vmm.segments() if u.mapped})

    def _paused(self) -> list[PauseEngine]:
        return [self.engines[d] for d in sorted(self.engines) if self.engines[d].state == PauseState.PAUSED]

    @property
    def state(self) -> PauseState:
        """``paused`` while any device's memory is paused, else ``active``."""
        return PauseState.PAUSED if self._paused() else PauseState.ACTIVE

    def _first(self) -> PauseEngine | None:
        """The engine of the lowest device made so far (None before any pause): what the
        figures name the codec by. Reports never make one (that loads the codec)."""
        return self.engines[min(self.engines)] if self.engines else None

    @property
    def codec_name(self) -> str | None:
        """The codec a pause uses first, for ``%vgpu status`` (the first device's); None
        before the first pause."""
        first = self._first()
        return None if first is None else first.codec_name

    # -- pause and resume --------------------------------------------------------------

    def pause(self) -> Outcome:
        """Pause the memory of every device that holds some (the kernel is idle).

        Raises:
            PauseError: the pause failed; the devices paused before the one that failed
                were resumed (``still_paused`` where that, or the failed device's own
                undo, failed too: :meth:`resume` brings every paused byte back).
        """
        with self._lock:
            if self.state != PauseState.ACTIVE:
                raise PauseError(f"the kernel is {self.state}, not active")
            t0 = time.perf_counter()
            holding = self._holding()
            done: list[tuple[PauseEngine, Outcome]] = []
            for device in holding:
                engine = self._engine(device)
                try:
                    with self._on(device):
                        done.append((engine, engine.pause()))
                except BaseException as e:
                    still = isinstance(e, PauseError) and e.still_paused
                    for earlier, _ in reversed(done):
                        try:
                            with self._on(earlier.device):
                                earlier.resume()
                        except Exception as again:
                            raise PauseError(
                                f"pausing device {device} failed ({e}), and resuming device "
                                f"{earlier.device}, paused before it, failed too ({again})",
                                still_paused=True,
                            ) from e
                    if not isinstance(e, PauseError):
                        raise
                    back = ", ".join(str(x.device) for x, _ in done)
                    raise PauseError(
                        f"pausing device {device} failed: {e}" + (f"; device {back} resumed" if back else ""),
                        still_paused=still,
                    ) from e
            self.last_pause = _combined([o for _, o in done], time.perf_counter() - t0)
            return self.last_pause

    def resume(self) -> Outcome:
        """Bring every paused device's memory back: all devices' memory mapped first, then
        written.

        Raises:
            vmm.DeviceFull: a device has no room (:meth:`room_needed`); nothing was
                written, every device still paused.
            ResumeError: one device's host data is damaged or unreadable; that device
                stays paused, its host copy intact (see the module's docstring).
        """
        with self._lock:
            paused = self._paused()
            if not paused:
                return Outcome(0.0, 0, 0, 0, ())
            t0 = time.perf_counter()
            with contextlib.ExitStack() as stack:
                for engine in paused:  # device order: the same order wherever they are taken
                    stack.enter_context(engine._lock)
                stack.enter_context(plain_torch(self.torch))
                stack.enter_context(self.vmm.machinery())
                taken = []
                try:
                    for engine in paused:
                        with self._on(engine.device):
                            taken.append((engine, engine._map_back()))
                except BaseException:
                    for engine, t in reversed(taken):
                        with self._on(engine.device):
                            engine._undo_map_back(t)
                    raise
                outcomes, failed = [], None
                for engine, t in taken:
                    with self._on(engine.device):
                        if failed is None:
                            try:
                                outcomes.append(engine._write_back(t, t0))
                                continue
                            except BaseException as e:
                                failed = e
                                continue
                        engine._undo_map_back(t)  # after a failure: none written, still paused
                if failed is not None:
                    raise failed
            self.last_resume = _combined(outcomes, time.perf_counter() - t0)
            return self.last_resume

    def room_needed(self) -> int:
        """Free memory the most demanding device needs for a resume, bytes
        (:meth:`room_needed_per_device` has each)."""
        return max(self.room_needed_per_device().values(), default=0)

    def room_needed_per_device(self) -> dict[int, int]:
        """Free memory each paused device needs for a resume, bytes, by CUDA ordinal."""
        return {e.device: e.room_needed() for e in self._paused()}

    @property
    def paused_bytes(self) -> int:
        """Device memory a resume needs back, every device together, bytes."""
        return sum(e.paused_bytes for e in self._paused())

    # -- host memory and the disk tier -------------------------------------------------

    def spill(self, directory) -> Outcome:
        """Every paused device's host data to files in ``directory``
        (:meth:`.engine.PauseEngine.spill`; its errors, device by device: those moved
        before a failure stay on disk).

        Raises:
            PauseError: nothing is paused.
        """
        paused = self._paused()
        if not paused:
            raise PauseError(f"the kernel is {self.state}, not paused: nothing to move to disk")
        t0 = time.perf_counter()
        outcomes = []
        for engine in paused:
            with self._on(engine.device):
                outcomes.append(engine.spill(directory))
        self.last_spill = _combined(outcomes, time.perf_counter() - t0)
        return self.last_spill

    def prepare(self, keep_going=lambda: True) -> int:
        """Pin ahead, device by device, the host memory the next pause stores into
        (:meth:`.engine.PauseEngine.prepare`); returns the bytes pinned."""
        holding = self._holding()
        made = 0
        for device in holding:
            if not keep_going():
                break
            engine = self._engine(device)
            with self._on(device):
                made += engine.prepare(keep_going)
        return made

    def host_held(self) -> int:
        """Host memory held for paused data now, every device's, bytes."""
        return sum(e.host_held() for e in list(self.engines.values()))

    def trim(self) -> int:
        """Let go of every device's warm pinned slabs; returns the bytes given back."""
        freed = 0
        for engine in list(self.engines.values()):
            with self._on(engine.device):
                freed += engine.trim()
        return freed

    def disk_bytes(self) -> int:
        """Bytes of paused data in the disk tier, every device's."""
        return sum(e.disk_bytes() for e in list(self.engines.values()))

    # -- figures -----------------------------------------------------------------------

    def stats(self) -> dict:
        """:meth:`.engine.PauseEngine.stats` of every device together: bytes summed,
        ``ratio`` over all devices' bytes, ``codec`` the first device's (the kernel
        report's ``pause`` fields, ``contracts/kernel-report.schema.json``)."""
        engines = [e for _, e in sorted(self.engines.items())]
        each = [e.stats() for e in engines]
        total = {
            key: sum(s[key] for s in each)
            for key in ("paused_bytes", "live_bytes", "host_bytes", "disk_bytes", "pinned_bytes")
        }
        stored = sum(e._stored_bytes() for e in engines)
        first = self._first()
        return {
            "state": self.state,
            **total,
            "unpausable_bytes": self.vmm.figures().unpausable,
            "ratio": total["live_bytes"] / stored if stored else None,
            "codec": None if first is None else "nvcomp-ans" if first.device_codec is not None else "zstd",
            "codec_name": None if first is None else first.codec_name,
            "last_pause_seconds": self.last_pause.seconds if self.last_pause else None,
            "last_resume_seconds": self.last_resume.seconds if self.last_resume else None,
        }

    def close(self) -> None:
        """Close every device's engine."""
        for engine in list(self.engines.values()):
            with self._on(engine.device):
                engine.close()
