"""Pinned host memory for the device codec's stored pieces (:class:`PinnedArena`): slabs
handed out front to back, kept warm between pauses."""

from __future__ import annotations

import threading
from collections.abc import Callable

from . import nvcomp

MiB = 1 << 20


def round_up(n: int, to: int = nvcomp.ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``to`` (nvCOMP's alignment, 16 bytes)."""
    return -(-n // to) * to


class PinnedArena:
    """Pinned host memory for stored pieces: slabs handed out front to back.

    Pinning is slow (1 GiB took 0.40 s on the H100 box, so a kernel's first pause of
    32 GiB spent much of its 16 s pinning); handing out a slab already pinned costs
    microseconds. So :meth:`clear` keeps the slabs as **warm** ones, which the next pause
    takes again, and they stay counted in :attr:`held_bytes`: the node arbiter counts
    them against its host budget and asks a kernel to :meth:`trim` them when the host
    needs the memory. (Handing them back to PyTorch's pinned-memory cache instead, as
    this class once did, kept them pinned where no figure of ours saw them.)

    A kernel that was never paused has no slabs, and its first pause would pin them all
    on the way; :meth:`prepare` pins them ahead instead, while the kernel is idle (a
    thread of the kernel's does it, :meth:`.pausing.PauseControl.prepare_ahead`). The
    slabs it makes are warm ones like any other: counted, and let go by :meth:`trim`.

    Args:
        torch: the torch module.
        slab_bytes: bytes per slab (a piece never spans two slabs).
        pin: makes a pinned uint8 tensor of the bytes it is given (default:
            ``torch.empty(n, dtype=torch.uint8, pin_memory=True)``).

    Every method may be called from any thread: a lock guards the slab lists (pinning
    itself runs outside it, so a pause never waits on :meth:`prepare`'s pinning).
    """

    #: Bytes per slab unless told otherwise.
    SLAB_BYTES = 256 * MiB

    def __init__(self, torch, slab_bytes: int = SLAB_BYTES, pin: Callable[[int], object] | None = None):
        self.torch = torch
        self.slab_bytes = slab_bytes
        self._pin = pin or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._lock = threading.Lock()
        self.slabs: list = []
        self.held_bytes = 0  # pinned bytes of every slab, in use or warm (an int: no torch call)
        self._used = 0  # bytes handed out of the last slab
        self._last_size = 0  # bytes of the last slab
        self._bases: list[int] = []  # each slab's address
        self._warm: list = []  # slabs kept for the next pause, largest first

    @property
    def warm_bytes(self) -> int:
        """Pinned bytes kept for the next pause and holding nothing now."""
        with self._lock:
            return sum(slab.numel() for slab in self._warm)

    def reserve(self, nbytes: int) -> tuple[int, int]:
        """``(slab index, offset)`` of ``nbytes`` fresh bytes, 16-byte aligned."""
        if not self.slabs or self._used + nbytes > self._last_size:
            size = max(self.slab_bytes, round_up(nbytes))
            with self._lock:
                slab = next((w for w in self._warm if w.numel() >= size), None)
                if slab is not None:
                    self._warm.remove(slab)
            if slab is None:
                slab = self._pin(size)
                with self._lock:
                    self.held_bytes += size
            self.slabs.append(slab)
            self._bases.append(slab.data_ptr())
            self._last_size = slab.numel()
            self._used = 0
        start = self._used
        self._used = round_up(start + nbytes)
        return len(self.slabs) - 1, start

    def prepare(self, nbytes: int, keep_going: Callable[[], bool] = lambda: True) -> int:
        """Pin warm slabs of ``slab_bytes`` until ``nbytes`` are warm, asking
        ``keep_going()`` before each slab (it stops early when that says False: the
        kernel ran a cell, was paused, or was asked to let its slabs go). Returns the
        bytes pinned by this call.

        Raises:
            whatever pinning raises (out of host memory, no CUDA); the slabs pinned
            before stay, warm and counted.
        """
        made = 0
        while self.warm_bytes < nbytes and keep_going():
            slab = self._pin(self.slab_bytes)
            with self._lock:
                self._warm.append(slab)
                self.held_bytes += slab.numel()
            made += slab.numel()
        return made

    def address(self, slab: int, start: int) -> int:
        """The address of byte ``start`` of slab ``slab``."""
        return self._bases[slab] + start

    def adopt(self, address: int) -> int:
        """A slab index for memory this arena does not own (a piece read from a mapping
        of the node's shared pieces, :mod:`..pause.sharing`): ``address(index, 0)`` is
        ``address``. Nothing is counted in :attr:`held_bytes`, and :meth:`clear` forgets
        it. The next :meth:`reserve` starts a slab of its own."""
        self.slabs.append(None)
        self._bases.append(address)
        self._last_size = self._used = 0
        return len(self.slabs) - 1

    def release(self, slab: int) -> int:
        """Let go of slab ``slab`` while the others stay in use (every piece it held was
        moved elsewhere); returns its bytes (0 for an adopted or released one). They go
        back to PyTorch's pinned-memory cache: the caller empties it
        (``torch.accelerator.empty_host_cache``) for the memory to reach the system."""
        tensor = self.slabs[slab]
        if tensor is None:
            return 0
        self.slabs[slab] = None
        with self._lock:
            self.held_bytes -= tensor.numel()
        return tensor.numel()

    def clear(self) -> None:
        """Forget every piece; the slabs stay pinned, warm, for the next pause (adopted
        and released ones are forgotten)."""
        with self._lock:
            own = [slab for slab in self.slabs if slab is not None]
            self._warm = sorted(self._warm + own, key=lambda slab: -slab.numel())
        self.slabs.clear()
        self._bases.clear()
        self._last_size = self._used = 0

    def trim(self) -> int:
        """Let go of the warm slabs (in-use ones stay); returns the bytes let go. They go
        back to PyTorch's pinned-memory cache: the caller empties it
        (``torch.accelerator.empty_host_cache``) for the memory to reach the system."""
        with self._lock:
            freed = sum(slab.numel() for slab in self._warm)
            self._warm.clear()
            self.held_bytes -= freed
        return freed
