"""The driver calls of a pause or a resume, on a thread beside the copies.

A unit's physical memory is released by ``cuMemUnmap`` and ``cuMemRelease`` (pause) and
made again by ``cuMemCreate``, ``cuMemMap`` and ``cuMemSetAccess`` (resume): about 55 µs a
call and 70 µs a unit end to end on the H100 with driver 580. PyTorch's expandable
segments are units of 20 MiB, so 4.6 GiB of them are 235 units and about 16 ms of calls;
made in line with the copies, they left a pause 25% and a resume 31% slower than the
same bytes in a few large units (``benchmarks/results/coverage-h100.json``, run B).

Here they run on a thread of their own (ctypes lets the GIL go during each call) while
the copies run on the GPU: :class:`Releaser` releases each unit as soon as the pause has
stored its bytes, :class:`Mapper` maps the units of a resume in the order the copies
need them, and the copy of a range waits only for its own units.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

MiB = 1 << 20


class Releaser:
    """Releases the units a pause hands over (:meth:`put`), in order, on its own thread.

    Args:
        release: called with each unit on the thread; what it raises stops the thread,
            and :meth:`put` or :meth:`close` raises it in the caller.
    """

    def __init__(self, release: Callable[[object], None]):
        self._release = release
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="jupyter-vgpu-release", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (unit := self._queue.get()) is not None:
            if self.error is not None:
                continue  # after a failure, the rest stay mapped: the pause is undone
            try:
                self._release(unit)
            except BaseException as e:  # handed to the pausing thread
                self.error = e

    def put(self, unit) -> None:
        """Release ``unit`` once those handed over before it are released.

        Raises:
            Whatever releasing an earlier unit raised.
        """
        if self.error is not None:
            raise self.error
        self._queue.put(unit)

    def close(self, *, check: bool = True) -> None:
        """Wait until every unit handed over is released (or the thread stopped at a
        failure); then raise that failure when ``check``."""
        self._queue.put(None)
        self._thread.join()
        if check and self.error is not None:
            raise self.error


class Mapper:
    """Maps the paused units of a resume on its own thread, in the order given, a few at a
    time (``map_many`` sets the access of adjacent units in one call); :meth:`wait` blocks
    until the first ``count`` are mapped.

    Args:
        map_many: maps a list of unit addresses, all or none (:meth:`.vmm.VMM.map_many`).
        units: ``(address, size)`` of every unit to map, in the order they are needed.
        chunk_bytes: bytes mapped per call, at least one unit.
    """

    def __init__(
        self,
        map_many: Callable[[list[int]], None],
        units: Sequence[tuple[int, int]],
        chunk_bytes: int = 64 * MiB,
    ):
        self._map_many, self._units, self._chunk = map_many, list(units), chunk_bytes
        self._ready = 0  # units mapped, from the first
        self._error: BaseException | None = None
        self._stop = False
        self._done = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="jupyter-vgpu-map", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        i, n = 0, len(self._units)
        while i < n:
            j, nbytes = i, 0
            while j < n and (j == i or nbytes < self._chunk):
                nbytes += self._units[j][1]
                j += 1
            with self._done:
                if self._stop:
                    return
            try:
                self._map_many([ptr for ptr, _ in self._units[i:j]])
            except BaseException as e:  # handed to the resuming thread
                with self._done:
                    self._error = e
                    self._done.notify_all()
                return
            with self._done:
                self._ready = j
                self._done.notify_all()
            i = j

    def wait(self, count: int) -> None:
        """Block until the first ``count`` units are mapped.

        Raises:
            Whatever mapping them raised (:class:`.vmm.DeviceFull`: no room on the device).
        """
        with self._done:
            while self._ready < count and self._error is None:
                self._done.wait()
            if self._ready < count:
                raise self._error

    def wait_all(self) -> None:
        """:meth:`wait` for every unit."""
        self.wait(len(self._units))

    def close(self) -> list[int]:
        """Stop after the call under way; the addresses of the units mapped."""
        with self._done:
            self._stop = True
        self._thread.join()
        return [ptr for ptr, _ in self._units[: self._ready]]
