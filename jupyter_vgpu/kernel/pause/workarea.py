"""Device memory the pause engine holds only while it pauses or resumes, at the same
addresses every time (:class:`WorkArea`): the GPU path's scratch and the host path's
staging, segments of the pausable allocator whose physical memory is mapped for the work
and released after it."""

from __future__ import annotations

from . import vmm


class WorkArea:
    """Device memory the engine holds only while it pauses or resumes (the GPU path's
    scratch, the host path's staging), at the same addresses every time.

    The first :meth:`take` allocates a segment of the pausable allocator; :meth:`give_back`
    releases its physical memory and keeps its addresses reserved, and the next
    :meth:`take` maps new memory behind them. The codec's CUDA graphs are captured on
    those addresses (``codec.device``), so they stay valid from one pause or resume to
    the next instead of being captured again each time (about 0.4 ms per graph on the
    H100 box). Between uses the segment is a paused one: a pause lists mapped segments
    only, so it never stores it.

    Args:
        allocator: the process's :class:`~.vmm.VMM`.
        device: CUDA ordinal.
        nbytes: its size, bytes.
    """

    def __init__(self, allocator: vmm.VMM, device: int, nbytes: int):
        self.allocator, self.device, self.nbytes = allocator, device, nbytes
        self.ptr: int | None = None
        self.held = False

    def take(self) -> int | None:
        """Map the area; its address, or None when the device has no room for it."""
        try:
            if self.ptr is None:
                self.ptr = self.allocator.malloc(self.nbytes, self.device)
            else:
                self.allocator.map(self.ptr)
        except vmm.DeviceFull:
            return None
        self.held = True
        return self.ptr

    def give_back(self) -> None:
        """Release its physical memory (the caller has synchronized the device)."""
        if self.held:
            self.allocator.unmap(self.ptr)
            self.held = False

    def free(self) -> None:
        """Release its addresses too."""
        if self.ptr is not None:
            self.allocator.free(self.ptr, self.device)
            self.ptr, self.held = None, False
