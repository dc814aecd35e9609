"""The offload engine: idle tensors to compressed host memory, and back before use.

Bookkeeping is per **storage**: every tensor object the namespace reaches that views a
storage (views, ``.detach()`` copies, optimizer references) is offloaded with it, and
all come back viewing one new storage with their old offsets and strides.

Offload: the storage's bytes go through pinned buffers to the codec and the host store
(or, when every word is equal, only that word is kept); then each tensor object is
swapped (``swap.swap_impl``) with a placeholder on the ``meta`` device of the
same class, shape, strides, dtype and ``requires_grad``, and the original tensor
implementation, kept aside, drops its storage. The user's object keeps its ``id`` and
class; reading its data by mistake raises a clear error (``meta`` tensors have none),
never a crash or a wrong value. Restore allocates one storage, decodes into it, points
every kept-aside implementation at it and swaps back: ``.grad``, ``requires_grad``,
hooks and the version counter come back with it.

When: after a cell, if the kernel holds more than ``high_watermark`` of its budget
(least recently used, then largest, first), when the server signals pressure, on
``%vgpu offload``, or after every cell in chaos mode (``JUPYTER_VGPU_CHAOS=1``). Before
a cell, everything its code names is restored; a torch function mode, pushed only while
something is offloaded, restores whatever else an op touches.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from jupyter_vgpu.slice import Slice
from jupyter_vgpu.units import format_bytes

from . import policy, reach
from .cells import cell_names, expand_through_functions
from .codec import Codec, CodecError
from .dispatch import RestoreOnTouch
from .safety import graph_pins, refusal
from .store import HostMemoryFull, HostStore
from .swap import swap_impl
from .transfer import Transfer

log = logging.getLogger("jupyter_vgpu")


class RestoreError(RuntimeError):
    """Offloaded data could not be brought back; it is still held on the host, intact."""


@dataclasses.dataclass
class EngineConfig:
    """Settings of one engine.

    Attributes:
        device: where tensors live (``"cuda"``, ``"cuda:1"``; ``"cpu"`` runs the whole
            engine on CPU tensors, which is how CI proves it without a GPU).
        idle_seconds: a storage no cell mentioned for this long is idle, seconds.
        high_watermark: offload idle storages above this fraction of the budget.
        budget_bytes: the slice's budget, bytes (None: no watermark policy).
        host_cap_bytes: host memory the store may hold (None: half of MemAvailable).
        spill_dir: directory for data past the host cap (None: refuse past it).
        chaos: offload everything offloadable after every cell.
    """

    device: str = "cuda"
    idle_seconds: float = 300.0
    high_watermark: float = 0.9
    budget_bytes: int | None = None
    host_cap_bytes: int | None = None
    spill_dir: str | None = None
    chaos: bool = False


@dataclasses.dataclass(eq=False)
class _Alias:
    tensor: torch.Tensor  # the user's object, holding a meta placeholder
    real: torch.Tensor  # the original implementation, kept aside without storage
    path: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclasses.dataclass(eq=False)
class _Record:
    nbytes: int
    device: torch.device
    aliases: list[_Alias]
    pieces: list[int]  # host store keys, one per transfer piece
    constant: torch.Tensor | None  # the repeated word when the storage is constant
    stored_bytes: int
    path: str


@dataclasses.dataclass
class Report:
    """What an offload or restore did, printed by ``%vgpu offload`` / ``%vgpu restore``."""

    verb: str
    moved: list[tuple[str, int, int]] = dataclasses.field(default_factory=list)  # path, raw, stored
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # path, reason
    seconds: float = 0.0

    def __str__(self) -> str:
        if not self.moved and not self.skipped:
            return f"Nothing to {self.verb}."
        raw = sum(m[1] for m in self.moved)
        done = {"offload": "Offloaded", "restore": "Restored"}[self.verb]
        lines = [f"{done} {len(self.moved)} storage(s), {format_bytes(raw)}"]
        if self.verb == "offload" and self.moved:
            stored = sum(m[2] for m in self.moved)
            ratio = f"{raw / stored:.2f}×" if stored else "∞"
            lines[0] += f" → {format_bytes(stored)} on the host (ratio {ratio})"
        if self.seconds and raw:
            lines[0] += f" in {self.seconds * 1e3:.1f} ms ({raw / self.seconds / 1e9:.2f} GB/s)"
        lines += [f"  {path}: {format_bytes(n)}" for path, n, _ in self.moved[:20]]
        if len(self.moved) > 20:
            lines.append(f"  … and {len(self.moved) - 20} more")
        lines += [f"  skipped {path}: {reason}" for path, reason in self.skipped[:20]]
        return "\n".join(lines)


class OffloadEngine:
    """Offloads and restores the tensors of one kernel (see the module docstring).

    Thread safety: every method takes the engine's lock; :meth:`offload_idle` may be
    called from another thread and does nothing while a cell runs. Every method also
    runs with torch function handling off: the engine reading a placeholder's
    properties must not count as the user touching it.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.codec = Codec()
        self.store = HostStore(config.host_cap_bytes, config.spill_dir)
        self.transfer = Transfer(self.device)
        self._lock = threading.RLock()
        self._by_tensor: dict[int, _Record] = {}  # id(user tensor) -> record
        self._by_real: dict[int, _Record] = {}  # id(kept-aside implementation) -> record
        self._records: list[_Record] = []
        self._last_used: dict[tuple, float] = {}
        self._mode: RestoreOnTouch | None = None
        self._step_hook = None
        self._busy = False
        self._last: dict[str, float | None] = {
            "offload_seconds": None,
            "restore_seconds": None,
            "offload_gbps": None,
            "restore_gbps": None,
        }
        self.last_skipped: list[tuple[str, str]] = []

    @classmethod
    def for_kernel(cls, slice_: Slice | None) -> OffloadEngine:
        """An engine for this kernel: its GPU (or the CPU stand-in without CUDA), the
        slice's policy, and the environment's ``JUPYTER_VGPU_CHAOS``,
        ``JUPYTER_VGPU_SPILL_DIR`` and ``JUPYTER_VGPU_HOST_CAP`` (bytes)."""
        cap = os.environ.get("JUPYTER_VGPU_HOST_CAP")
        return cls(
            EngineConfig(
                device="cuda" if torch.cuda.is_available() else "cpu",
                idle_seconds=slice_.idle_seconds if slice_ else 300.0,
                high_watermark=slice_.high_watermark if slice_ else 0.9,
                budget_bytes=slice_.memory_limit if slice_ else None,
                host_cap_bytes=int(cap) if cap else None,
                spill_dir=os.environ.get("JUPYTER_VGPU_SPILL_DIR") or None,
                chaos=os.environ.get("JUPYTER_VGPU_CHAOS") == "1",
            )
        )

    # -- the kernel hook's calls ---------------------------------------------------

    def before_cell(self, raw_cell: str, user_ns: dict) -> None:
        """Restore what the cell's code names (everything if it does not parse), mark
        it used, and make sure restore-on-touch is active while anything is offloaded."""
        with self._lock, torch._C.DisableTorchFunction():
            self._busy = True
            names = cell_names(_shell(), raw_cell)
            if names is not None:
                names = expand_through_functions(names, user_ns)
            if self._records:
                if names is None:
                    self._restore_records(list(self._records))
                else:
                    self._restore_found(reach.walk(user_ns, names))
            if names:
                now = time.monotonic()
                for f in reach.walk(user_ns, names):
                    self._last_used[f.storage_key] = now
            self._sync_mode()

    def after_cell(self, user_ns: dict) -> None:
        """Apply the policy (chaos, or the watermark) now that the cell is done."""
        with self._lock, torch._C.DisableTorchFunction():
            self._busy = False
            try:
                self._drop_orphans()
                if self.config.chaos:
                    self._offload(user_ns, None, idle_only=False)
                elif self._above_watermark():
                    self._offload(user_ns, None, idle_only=True, until_under_watermark=True)
            finally:
                self._sync_mode()

    def offload_idle(self, user_ns: dict) -> Report | None:
        """Offload every idle storage (the server signalled pressure); no-op while a cell runs."""
        with self._lock, torch._C.DisableTorchFunction():
            if self._busy:
                return None
            return self._offload(user_ns, None, idle_only=True)

    def offload(self, user_ns: dict, names: list[str] | None = None) -> Report:
        """Offload the storages reachable from ``names`` (all, if None), idle or not."""
        with self._lock, torch._C.DisableTorchFunction():
            report = self._offload(user_ns, names, idle_only=False)
            self._sync_mode()
            return report

    def restore(self, user_ns: dict, names: list[str] | None = None) -> Report:
        """Restore what ``names`` reach (everything, if None).

        Raises:
            RestoreError: data could not be brought back (it stays on the host).
        """
        with self._lock, torch._C.DisableTorchFunction():
            start = time.perf_counter()
            records = list(self._records) if names is None else self._records_for(reach.walk(user_ns, names))
            report = Report("restore")
            self._restore_records(records, report)
            report.seconds = time.perf_counter() - start
            self._sync_mode()
            return report

    def update_slice(self, slice_: Slice) -> None:
        with self._lock, torch._C.DisableTorchFunction():
            self.config.budget_bytes = slice_.memory_limit
            self.config.idle_seconds = slice_.idle_seconds
            self.config.high_watermark = slice_.high_watermark

    def is_offloaded(self, tensor: torch.Tensor) -> bool:
        return id(tensor) in self._by_tensor

    def stats(self) -> dict[str, Any]:
        """Offloaded bytes (raw and stored), ratio, counts, last timings, store use."""
        with self._lock, torch._C.DisableTorchFunction():
            raw = sum(r.nbytes for r in self._records)
            stored = sum(r.stored_bytes for r in self._records)
            store = self.store.stats()
            return {
                "offloaded_bytes": raw,
                "compressed_bytes": stored,
                "ratio": (raw / stored if stored else None) if raw else None,
                "count": len(self._records),
                "tensors": sum(len(r.aliases) for r in self._records),
                "last_offload_seconds": self._last["offload_seconds"],
                "last_restore_seconds": self._last["restore_seconds"],
                "last_offload_gbps": self._last["offload_gbps"],
                "last_restore_gbps": self._last["restore_gbps"],
                "host_bytes": store["host_bytes"],
                "disk_bytes": store["disk_bytes"],
                "skipped": [{"path": p, "reason": r} for p, r in self.last_skipped[:20]],
                "dispatch_mode": self._mode is not None,
            }

    def close(self) -> None:
        """Restore everything (leaving data on the host if that fails), then free."""
        with self._lock, torch._C.DisableTorchFunction():
            try:
                self._restore_records(list(self._records))
            finally:
                self._sync_mode()
                if not self._records:
                    self.store.close()
                self.codec.close()

    # -- offload -------------------------------------------------------------------

    def _above_watermark(self) -> bool:
        budget = self.config.budget_bytes
        if not budget or self.device.type != "cuda" or not torch.cuda.is_initialized():
            return False
        return torch.cuda.memory_allocated(self.device) > self.config.high_watermark * budget

    def _groups(self, found: list[reach.Found]) -> dict[tuple, list[reach.Found]]:
        groups: dict[tuple, list[reach.Found]] = defaultdict(list)
        for f in found:
            t = f.tensor
            if t.device == self.device and id(t) not in self._by_tensor and f.nbytes > 0:
                groups[f.storage_key].append(f)
        return groups

    def _offload(self, user_ns, names, *, idle_only: bool, until_under_watermark: bool = False) -> Report:
        start = time.perf_counter()
        report = Report("offload")
        found = reach.walk(user_ns, names)
        groups = self._groups(found)
        pinned = graph_pins(f.tensor for f in found)
        now = time.monotonic()
        candidates = [
            policy.Candidate(key, fs[0].nbytes, self._last_used.setdefault(key, now))
            for key, fs in groups.items()
        ]
        chosen = policy.order(
            candidates, now=now, idle_seconds=self.config.idle_seconds if idle_only else None
        )
        for c in chosen:
            if until_under_watermark and not self._above_watermark():
                break
            self._offload_group(groups[c.key], pinned, report)
        report.seconds = time.perf_counter() - start
        moved = sum(m[1] for m in report.moved)
        if moved:
            self._last["offload_seconds"] = report.seconds
            self._last["offload_gbps"] = moved / report.seconds / 1e9
        self.last_skipped = report.skipped
        return report

    def _offload_group(self, found: list[reach.Found], pinned: set[int], report: Report) -> None:
        tensors, paths = [], []
        for f in found:
            if all(f.tensor is not t for t in tensors):
                tensors.append(f.tensor)
                paths.append(f.path)
        path = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} view(s))"
        reason = refusal(tensors, pinned)
        if reason is not None:
            report.skipped.append((path, reason))
            return
        storage = tensors[0].untyped_storage()
        nbytes = storage.nbytes()
        src = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (nbytes,), (1,))
        constant = _constant_word(src)
        pieces: list[int] = []
        stored = 4 if constant is not None else 0
        if constant is None:
            dtype = tensors[0].dtype
            try:
                packed = self.transfer.download(
                    src,
                    lambda host: self.codec.encode(
                        host.numpy(), itemsize=dtype.itemsize, floating=dtype.is_floating_point
                    ),
                )
                for p in packed:
                    pieces.append(self.store.put(p))
                    stored += p.stored_bytes
            except (HostMemoryFull, OSError) as e:
                for key in pieces:
                    self.store.drop(key)
                report.skipped.append((path, str(e)))
                return
        del src, storage
        record = _Record(nbytes, self.device, [], pieces, constant, stored, path)
        try:
            for t, p in zip(tensors, paths, strict=True):
                record.aliases.append(self._swap_out(t, p))
        except Exception as e:  # put back what was swapped; the data never left the GPU
            for alias in record.aliases:
                swap_impl(alias.tensor, alias.real)
            for key in pieces:
                self.store.drop(key)
            report.skipped.append((path, f"could not swap: {e}"))
            return
        for alias in record.aliases:  # release the storage (the last reference to it)
            alias.real.data = torch.empty(0, dtype=alias.dtype, device=self.device)
        self._records.append(record)
        for alias in record.aliases:
            self._by_tensor[id(alias.tensor)] = record
            self._by_real[id(alias.real)] = record
        report.moved.append((path, nbytes, stored))

    def _swap_out(self, t: torch.Tensor, path: str) -> _Alias:
        size, stride, offset = tuple(t.size()), tuple(t.stride()), t.storage_offset()
        numel = t.untyped_storage().nbytes() // t.element_size()
        placeholder = torch.empty(numel, dtype=t.dtype, device="meta").as_strided(size, stride, offset)
        if isinstance(t, torch.nn.Parameter):
            placeholder = torch.nn.Parameter(placeholder, requires_grad=t.requires_grad)
        else:
            placeholder.requires_grad_(t.requires_grad)
        swap_impl(t, placeholder)  # t: the placeholder now; placeholder: the original
        return _Alias(t, placeholder, path, size, stride, offset, t.dtype)

    # -- restore -------------------------------------------------------------------

    def _records_for(self, found: list[reach.Found]) -> list[_Record]:
        records = []
        for f in found:
            r = self._by_tensor.get(id(f.tensor))
            if r is not None and all(r is not x for x in records):
                records.append(r)
        return records

    def _restore_found(self, found: list[reach.Found]) -> None:
        self._restore_records(self._records_for(found))

    def _restore_tensors(self, tensors: list[torch.Tensor]) -> None:
        with self._lock, torch._C.DisableTorchFunction():
            records = []
            for t in tensors:
                r = self._by_tensor.get(id(t))
                if r is not None and all(r is not x for x in records):
                    records.append(r)
            self._restore_records(records)

    def _restore_records(self, records: list[_Record], report: Report | None = None) -> None:
        start = time.perf_counter()
        moved = 0
        for record in records:
            if record not in self._records:
                continue
            self._restore_one(record)
            moved += record.nbytes
            if report is not None:
                report.moved.append((record.path, record.nbytes, record.stored_bytes))
            for alias in record.aliases:  # a gradient offloaded on its own comes back too
                grad_record = (
                    self._by_real.get(id(alias.tensor.grad)) if alias.tensor.grad is not None else None
                )
                if grad_record is not None and grad_record in self._records:
                    self._restore_one(grad_record)
                    moved += grad_record.nbytes
                    if report is not None:
                        report.moved.append((grad_record.path, grad_record.nbytes, grad_record.stored_bytes))
        if moved:
            seconds = time.perf_counter() - start
            self._last["restore_seconds"] = seconds
            self._last["restore_gbps"] = moved / seconds / 1e9

    def _restore_one(self, record: _Record) -> None:
        dst = torch.empty(record.nbytes, dtype=torch.uint8, device=record.device)
        if record.constant is not None:
            dst.view(torch.int32).fill_(int(record.constant))
        else:
            try:
                packed = [self.store.get(key) for key in record.pieces]
                self.transfer.upload(dst, packed, lambda p, host: self.codec.decode(p, host.numpy()))
            except (CodecError, OSError, KeyError) as e:
                raise RestoreError(
                    f"could not restore {record.path} ({format_bytes(record.nbytes)}): {e}. "
                    "The compressed copy is still held on the host; nothing was changed."
                ) from e
        storage = dst.untyped_storage()
        for alias in record.aliases:
            view = torch.empty(0, dtype=alias.dtype, device=record.device)
            alias.real.data = view.set_(storage, alias.offset, alias.size, alias.stride)
            swap_impl(alias.tensor, alias.real)  # the user's object gets its data back
        self._forget(record)

    def _forget(self, record: _Record) -> None:
        for key in record.pieces:
            self.store.drop(key)
        self._records.remove(record)
        now = time.monotonic()
        for alias in record.aliases:
            self._by_tensor.pop(id(alias.tensor), None)
            self._by_real.pop(id(alias.real), None)
            if alias.tensor.device.type != "meta":
                self._last_used[reach.storage_key(alias.tensor)] = now

    def _drop_orphans(self) -> None:
        """Free the host copy of storages whose tensors nobody but us still holds."""
        for record in list(self._records):
            # references: the alias field and getrefcount's own argument
            if all(sys.getrefcount(a.tensor) <= 2 for a in record.aliases):
                self._forget(record)

    # -- restore on touch ----------------------------------------------------------

    def _sync_mode(self) -> None:
        """Push the dispatch mode while anything is offloaded, pop it when nothing is.
        Main thread only (modes are thread-local); popping waits until ours is innermost."""
        if threading.current_thread() is not threading.main_thread():
            return
        if self._records and self._mode is None:
            self._mode = RestoreOnTouch(self._restore_tensors, self.is_offloaded)
            self._mode.__enter__()
            # optimizers hand their state to C++ calls no torch function mode sees
            self._step_hook = register_optimizer_step_pre_hook(self._before_step)
        elif not self._records and self._mode is not None and self._mode.is_innermost():
            self._mode.__exit__(None, None, None)
            self._mode = None
            if self._step_hook is not None:
                self._step_hook.remove()
                self._step_hook = None

    def _before_step(self, optimizer, args, kwargs) -> None:
        """Restore an optimizer's parameters, gradients and state before it steps."""
        with self._lock, torch._C.DisableTorchFunction():
            self._restore_found(reach.walk({"optimizer": optimizer}))


def _constant_word(src: torch.Tensor) -> torch.Tensor | None:
    """The 32-bit word repeated over all of ``src`` (uint8, on the device), or None.
    One pass on the device; a constant storage needs no codec at all."""
    n = src.numel()
    if n == 0 or n % 4:
        return None
    words = src.view(torch.int32)
    first = words[0]
    if bool((words == first).all()):
        return first.cpu()
    return None


def _shell():
    try:
        from IPython import get_ipython

        return get_ipython()
    except ImportError:
        return None
