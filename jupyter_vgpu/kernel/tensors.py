"""Which torch tensors the user's namespace can reach, and by what path.

The walk follows what notebooks hold tensors in: ``nn.Module`` (parameters, buffers,
submodules, ``.grad``), optimizers (``state``, ``param_groups``), lists, tuples, dicts,
sets, and plain objects' ``__dict__`` / ``__slots__``. It is cycle-safe and bounded in
depth and in the number of objects visited, skips IPython's own history variables
(``_``, ``_i3``, ``Out``, …), and never imports torch itself: a namespace without
torch has no tensors.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
from collections.abc import Iterable, Mapping

#: IPython's history and helper names; a cell can still reach their tensors by name.
_IPYTHON_NAMES = re.compile(r"^(_+|_i+|_i\d+|_\d+|_oh|_ih|_dh|In|Out|exit|quit|get_ipython|__\w+__)$")

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, slice)
_OPAQUE = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_SKIP = _ATOMS + _OPAQUE


@dataclasses.dataclass(frozen=True)
class Found:
    """A tensor reachable from the namespace.

    Attributes:
        tensor: the tensor (the very object the user holds).
        path: how the user reaches it, e.g. ``"model.fc.weight"``, ``"opt.state[0].exp_avg"``.
        storage_key: identifies the storage it views (tensors sharing memory share it);
            ``("meta", id)`` for tensors on the meta device, which have no storage.
        nbytes: size of that whole storage, bytes (0 on the meta device).
        device: the tensor's device as a string, e.g. ``"cuda:0"``.
    """

    tensor: object
    path: str
    storage_key: tuple
    nbytes: int
    device: str


def storage_key(tensor) -> tuple:
    """A key equal for all tensors viewing the same storage: ``(device, data_ptr)``,
    or the storage object's id when its data pointer is null (empty or meta)."""
    storage = tensor.untyped_storage()
    ptr = storage.data_ptr()
    return (str(tensor.device), ptr) if ptr else ("id", id(storage))


def walk(
    user_ns: Mapping[str, object],
    names: Iterable[str] | None = None,
    *,
    max_depth: int = 8,
    max_objects: int = 200_000,
) -> list[Found]:
    """Every tensor reachable from ``user_ns`` (or from ``names`` in it only).

    Each tensor object is reported once, under the first path that reaches it.

    Args:
        user_ns: the kernel's user namespace.
        names: restrict the roots to these names (absent names are ignored).
        max_depth: containers nested deeper than this are not entered.
        max_objects: stop after visiting this many objects (a guard for huge graphs).
    """
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    Tensor = torch.Tensor
    Module = torch.nn.Module
    Optimizer = torch.optim.Optimizer
    found: list[Found] = []
    seen: set[int] = set()
    budget = [max_objects]

    def visit(obj, path: str, depth: int) -> None:
        if isinstance(obj, _SKIP) or budget[0] <= 0:
            return
        if id(obj) in seen:
            return
        seen.add(id(obj))
        budget[0] -= 1
        if isinstance(obj, Tensor):
            if obj.is_meta:  # an offloaded tensor's placeholder (or the user's own): no memory
                found.append(Found(obj, path, ("meta", id(obj)), 0, "meta"))
            elif obj.layout == torch.strided:
                storage = obj.untyped_storage()
                found.append(Found(obj, path, storage_key(obj), storage.nbytes(), str(obj.device)))
            grad = obj.grad if obj.is_leaf else None
            if grad is not None:
                visit(grad, f"{path}.grad", depth + 1)
            if obj._base is not None:  # a view keeps its base alive: count it among the views
                visit(obj._base, f"{path}._base", depth + 1)
            return
        if depth >= max_depth:
            return
        if isinstance(obj, Module):
            for name, p in obj.named_parameters(recurse=False):
                visit(p, f"{path}.{name}", depth + 1)
            for name, b in obj.named_buffers(recurse=False):
                visit(b, f"{path}.{name}", depth + 1)
            for name, child in obj.named_children():
                visit(child, f"{path}.{name}", depth + 1)
            for name, value in vars(obj).items():
                if name not in ("_parameters", "_buffers", "_modules") and not name.startswith("_"):
                    visit(value, f"{path}.{name}", depth + 1)
            return
        if isinstance(obj, Optimizer):
            for i, group in enumerate(obj.param_groups):
                for j, p in enumerate(group["params"]):
                    visit(p, f"{path}.param_groups[{i}].params[{j}]", depth + 1)
            for i, (_, state) in enumerate(obj.state.items()):
                visit(state, f"{path}.state[{i}]", depth + 1)
            return
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                if isinstance(key, Tensor):
                    visit(key, f"{path}.keys()", depth + 1)
                visit(value, f"{path}[{key!r}]", depth + 1)
            return
        if isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, f"{path}[{i}]", depth + 1)
            return
        if isinstance(obj, (set, frozenset)):
            for value in list(obj):
                visit(value, f"{path}{{…}}", depth + 1)
            return
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict):
            for name, value in list(attrs.items()):
                visit(value, f"{path}.{name}", depth + 1)
        for name in getattr(type(obj), "__slots__", ()):
            if isinstance(name, str) and hasattr(obj, name):
                visit(getattr(obj, name), f"{path}.{name}", depth + 1)

    roots = list(user_ns.keys()) if names is None else [n for n in names if n in user_ns]
    # Reading a tensor's properties is a torch call: with the engine's restore-on-touch
    # mode active it would bring back every offloaded tensor the walk passes. Looking
    # is not touching.
    try:
        with torch._C.DisableTorchFunction():
            for name in roots:
                if names is None and _IPYTHON_NAMES.match(name):
                    continue
                visit(user_ns[name], name, 0)
    finally:
        visit = None  # break the closure's self-reference: `found` must not outlive us
    return found


def unique_storage_bytes(found: Iterable[Found]) -> int:
    """Sum of the sizes of the distinct storages behind ``found``, bytes."""
    sizes = {f.storage_key: f.nbytes for f in found}
    return sum(sizes.values())
