"""Memory held by torch tensors in the user's namespace: the "used" figure of a
simulated GPU (or of PyTorch without CUDA), where no device counter exists."""

from __future__ import annotations

import sys
from collections.abc import Mapping


def tensor_bytes(user_ns: Mapping[str, object]) -> int:
    """Bytes of the unique storages of the torch tensors reachable from ``user_ns``.

    Tensors sharing a storage (views, slices) count once, at the whole storage's
    size. Uses the offload engine's reachability walk
    (``jupyter_vgpu.kernel.offload.reach.walk``) when installed, else looks at
    top-level tensors and ``nn.Module`` parameters and buffers only. 0 when torch is
    not imported. Never imports torch.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    try:
        from .offload.reach import walk
    except ImportError:
        return _shallow_bytes(torch, user_ns)
    storages: dict[tuple, int] = {}
    for found in walk(user_ns):
        storages[found.storage_key] = found.nbytes
    return sum(storages.values())


def _shallow_bytes(torch, user_ns: Mapping[str, object]) -> int:
    storages: dict[tuple, int] = {}

    def add(t) -> None:
        storage = t.untyped_storage()
        storages[(str(t.device), storage.data_ptr() or id(storage))] = storage.nbytes()

    for value in list(user_ns.values()):
        if isinstance(value, torch.Tensor):
            add(value)
        elif isinstance(value, torch.nn.Module):
            for t in (*value.parameters(), *value.buffers()):
                add(t)
    return sum(storages.values())
