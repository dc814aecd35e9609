"""Memory held by torch tensors in the user's namespace: the "used" figure of a
simulated GPU (or of PyTorch without CUDA), where no device counter exists."""

from __future__ import annotations

from collections.abc import Mapping

from .tensors import unique_storage_bytes, walk


def tensor_bytes(user_ns: Mapping[str, object]) -> int:
    """Bytes of the unique storages of the torch tensors reachable from ``user_ns``.

    Tensors sharing a storage (views, slices) count once, at the whole storage's size;
    tensors on the meta device count nothing. Uses the reachability walk
    (:func:`jupyter_vgpu.kernel.tensors.walk`). 0 when torch is not imported;
    never imports torch.
    """
    return unique_storage_bytes(walk(user_ns))
