"""The slice's memory budget, applied to PyTorch the moment torch is imported.

PyTorch's caching allocator enforces ``torch.cuda.set_per_process_memory_fraction``
per device: past it, an allocation raises ``torch.OutOfMemoryError`` and the kernel
lives on (measured on the H100, see the design map). The budget holds on every device
the kernel sees (a slice of several cards has it on each). We never import torch
ourselves: an import hook waits for the user's ``import torch``, then queues the
fraction with ``torch.cuda._lazy_call`` so that it is set when CUDA initialises (before
the first allocation) without creating a CUDA context in kernels that never use the GPU.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

from jupyter_vgpu.slice import Slice
from jupyter_vgpu.units import format_bytes


class TorchImportHook(importlib.abc.MetaPathFinder):
    """Calls ``callback(torch_module)`` once, right after ``import torch`` completes."""

    def __init__(self, callback: Callable[[object], None]):
        self.callback = callback
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or self._busy:
            return None
        self._busy = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            self._busy = False
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        hook = self

        def exec_and_notify(module):
            exec_module(module)
            hook.remove()
            hook.callback(module)

        loader.exec_module = exec_and_notify
        return spec

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class TorchBudget:
    """Applies a slice's budget to PyTorch's CUDA allocator; safe to call from any thread.

    Attributes:
        status: one human line: what was applied, or why nothing was.
        fraction: the fraction of the first device given to the allocator (0-1], or None.
        device_total: total memory of the first device, bytes, or None without CUDA.
        fractions: the fraction given on each device the kernel sees, device 0 first.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self.slice: Slice | None = None
        self.torch = None
        self.fraction: float | None = None
        self.device_total: int | None = None
        self.fractions: tuple[float, ...] = ()
        self.status = "torch not imported yet: the budget applies when it is"

    def set_slice(self, slice_: Slice | None) -> None:
        """Remember the slice and apply it now if torch is imported."""
        with self._lock:
            self.slice = slice_
        if self.torch is not None:
            self.apply()

    def attach(self, torch) -> None:
        """Called once torch is imported: apply now if CUDA is up, else when it initialises."""
        self.torch = torch
        if not torch.cuda.is_available():
            self.status = "CUDA is not available to PyTorch: the budget cannot be enforced here"
            return
        if torch.cuda.is_initialized():
            self.apply()
        else:
            self.status = "budget queued: applies when CUDA initialises"
            torch.cuda._lazy_call(self.apply)

    def apply(self) -> None:
        """Set the allocator's fraction on every visible device from the slice (no-op
        without torch, CUDA or slice)."""
        torch = self.torch
        with self._lock:
            s = self.slice
            if torch is None or s is None or not torch.cuda.is_available():
                return
            fractions, over = [], []
            for device in range(torch.cuda.device_count()):
                total = torch.cuda.get_device_properties(device).total_memory
                fraction = min(1.0, s.memory_limit / total)
                torch.cuda.set_per_process_memory_fraction(fraction, device)
                fractions.append(fraction)
                held = torch.cuda.memory_reserved(device)
                if held > s.memory_limit:
                    over.append(f"{format_bytes(held)} on device {device}")
                if device == 0:
                    self.device_total = total
            self.fractions = tuple(fractions)
            self.fraction = fractions[0] if fractions else None
            each = f" on each of {len(fractions)} devices" if len(fractions) > 1 else ""
            shown = ", ".join(f"{f:.4f}" for f in fractions)
            self.status = f"budget {format_bytes(s.memory_limit)} applied to PyTorch{each} (fraction {shown})"
            if over:
                self.status += (
                    f"; this kernel already holds {', '.join(over)}, over the new budget: "
                    "new allocations fail until tensors are freed"
                )

    def oom_note(self) -> str:
        """The sentence appended to an out-of-memory error: the budget and what to do."""
        s = self.slice
        if s is None:
            return "jupyter-vgpu: this kernel has no vGPU slice."
        where = (
            f"GPU {s.gpu_index}" if not s.more_gpus else f"each of GPUs {', '.join(map(str, s.gpu_indices))}"
        )
        return (
            f"vGPU slice budget: {format_bytes(s.memory_limit)} of {s.gpu_name} ({where}). "
            "Free tensors (del, torch.cuda.empty_cache()) "
            "or ask your hub admin for a larger quota."
        )
