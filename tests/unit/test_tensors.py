"""The reachability walk over what notebooks hold tensors in."""

import pytest

pytest.importorskip("torch", reason="needs PyTorch (scripts/install brings its CPU build)")

import torch

from jupyter_vgpu.kernel.tensors import storage_key, unique_storage_bytes, walk


class Holder:
    def __init__(self, t):
        self.t = t


class Slotted:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def test_walk_finds_tensors_through_containers_modules_and_optimizers():
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    base = torch.randn(10)
    ns = {
        "model": model,
        "opt": opt,
        "things": [base, {"view": base[2:5]}, (Holder(torch.ones(3)),)],
        "slotted": Slotted(torch.zeros(2)),
        "cycle": [],
        "_": torch.ones(100),
        "Out": {1: torch.ones(100)},
        "n": 3,
    }
    ns["cycle"].append(ns["cycle"])
    found = walk(ns)
    paths = {f.path for f in found}
    assert {"model.weight", "model.bias", "model.weight.grad", "things[0]", "things[1]['view']"} <= paths
    assert "things[2][0].t" in paths
    assert "slotted.t" in paths
    assert any(p.startswith("opt.state[") and p.endswith("['exp_avg']") for p in paths)
    assert not any(p.startswith(("_", "Out")) for p in paths)
    # views share a storage key; the storage is counted once
    keys = {f.path: f.storage_key for f in found}
    assert keys["things[0]"] == keys["things[1]['view']"]
    assert storage_key(base[1:]) == storage_key(base)
    assert unique_storage_bytes(f for f in found if f.path.startswith("things[")) == 40 + 12


def test_walk_by_names_only_looks_there():
    ns = {"a": torch.ones(2), "b": torch.ones(3)}
    assert [f.path for f in walk(ns, ["a", "missing"])] == ["a"]
    assert walk({}, None) == []
