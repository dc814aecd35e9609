"""What may be offloaded without risk; everything else is skipped and reported.

An offload swaps each tensor's data for a placeholder and frees the storage. That is
safe only if every tensor object viewing the storage is known (else an unknown view
would keep stale memory or see it change), none is part of a live autograd graph
(saved tensors are not reachable through the namespace), and each is a plain strided
``Tensor`` or ``Parameter`` we can swap.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_MAX_GRAPH_NODES = 20_000


def refusal(tensors: list[torch.Tensor], pinned: set[int]) -> str | None:
    """Why the storage behind ``tensors`` (all the distinct tensor objects the walk found
    viewing it) must stay, or None when it may be offloaded.

    Args:
        tensors: distinct tensor objects sharing one storage.
        pinned: ids of leaf tensors a live autograd graph holds (:func:`graph_pins`).
    """
    for t in tensors:
        if type(t) not in _PLAIN:
            return f"tensor subclass {type(t).__name__} is not offloaded"
        if t.layout != torch.strided or t.is_quantized or t.is_nested:
            return "not a plain strided tensor"
        if t.grad_fn is not None:
            return "part of an autograd graph (a view of a tensor that requires grad)"
        if id(t) in pinned:
            return "held by a live autograd graph (run backward, or del the loss, to free it)"
        if weakref.getweakrefcount(t):
            return "something holds a weak reference to it"
    storage = tensors[0].untyped_storage()
    users = torch._C._storage_Use_Count(storage._cdata) - 1  # minus our own storage object
    if users > len(tensors):
        return f"its memory is shared with {users - len(tensors)} tensor(s) the namespace does not reach"
    return None


def graph_pins(tensors: Iterable[torch.Tensor]) -> set[int]:
    """Ids of the leaf tensors held by live autograd graphs hanging off ``tensors``.

    A graph is live while its nodes still hold saved tensors (before backward, or after
    ``backward(retain_graph=True)``); after a plain backward they are freed and the graph
    pins nothing. Past a bound on nodes visited, every leaf seen counts as pinned.
    """
    pinned: set[int] = set()
    seen: set[int] = set()
    for t in tensors:
        root = getattr(t, "grad_fn", None)
        if root is None or id(root) in seen:
            continue
        leaves, live, stack = [], False, [root]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if len(seen) > _MAX_GRAPH_NODES:
                live = True
                break
            variable = getattr(node, "variable", None)
            if variable is not None:
                leaves.append(variable)
            if not live:
                live = _holds_saved_tensors(node)
            stack.extend(fn for fn, _ in node.next_functions)
        if live:
            pinned.update(id(v) for v in leaves)
    return pinned


def _holds_saved_tensors(node) -> bool:
    for name in dir(node):
        if name.startswith("_saved_"):
            try:
                value = getattr(node, name)
            except RuntimeError:  # freed by backward
                return False
            if isinstance(value, torch.Tensor) or (
                isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value)
            ):
                return True
    return False
