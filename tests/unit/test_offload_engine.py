"""The offload engine on the CPU stand-in: everything but the device copies, proven in CI.

The engine treats ``device="cpu"`` tensors exactly as it treats CUDA ones on a GPU
(placeholders, bookkeeping, codec, store, restore on touch); the GPU tests repeat the
correctness checks on CUDA tensors.
"""

import weakref

import pytest
import torch

from jupyter_vgpu.kernel.offload import policy
from jupyter_vgpu.kernel.offload.engine import EngineConfig, OffloadEngine, RestoreError


@pytest.fixture
def engine():
    e = OffloadEngine(EngineConfig(device="cpu"))
    yield e
    e.close()


def trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(64, 16), torch.randn(64, 4)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return model, opt, x, y


def snapshot(ns):
    model, opt = ns["model"], ns["opt"]
    return {
        "params": {
            n: (id(p), type(p), p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()
        },
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "state": [{k: v.clone() for k, v in s.items()} for s in opt.state.values()],
    }


def assert_same(ns, before):
    model, opt = ns["model"], ns["opt"]
    for n, p in model.named_parameters():
        pid, cls, rg, value = before["params"][n]
        assert (id(p), type(p), p.requires_grad) == (pid, cls, rg)
        assert torch.equal(p, value)
        assert torch.equal(p.grad, before["grads"][n])
    for s, ref in zip(opt.state.values(), before["state"], strict=True):
        for k, v in s.items():
            assert torch.equal(v, ref[k])


def test_offload_and_restore_keep_identity_class_grads_and_values(engine):
    model, opt, x, y = trained()
    ns = {"model": model, "opt": opt, "x": x, "y": y}
    before = snapshot(ns)
    report = engine.offload(ns)
    assert len(report.moved) >= 4 + 4 + 8 + 2  # params, grads, Adam state, x and y
    w = model[0].weight
    assert engine.is_offloaded(w)
    assert type(w) is torch.nn.Parameter
    stats = engine.stats()
    assert stats["count"] == len(report.moved)
    assert stats["offloaded_bytes"] > stats["compressed_bytes"] > 0
    assert stats["dispatch_mode"]
    engine.restore(ns)
    assert_same(ns, before)
    assert engine.stats()["count"] == 0
    assert not engine.stats()["dispatch_mode"]


def test_training_continues_identically_after_a_round_trip(engine):
    ns_a = dict(zip(("model", "opt", "x", "y"), trained(), strict=True))
    ns_b = dict(zip(("model", "opt", "x", "y"), trained(), strict=True))
    for _ in range(3):
        engine.offload(ns_b)
        engine.restore(ns_b)
        for ns in (ns_a, ns_b):
            ns["opt"].zero_grad()
            torch.nn.functional.mse_loss(ns["model"](ns["x"]), ns["y"]).backward()
            ns["opt"].step()
    for pa, pb in zip(ns_a["model"].parameters(), ns_b["model"].parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_views_come_back_sharing_one_storage(engine):
    base = torch.arange(1000.0).reshape(10, 100)
    row, col, t = base[3], base[:, 7], base.t()
    ns = {"base": base, "row": row, "col": col, "t": t}
    ref = base.clone()
    report = engine.offload(ns)
    assert len(report.moved) == 1  # one storage, five tensors
    assert engine.stats()["tensors"] == 5  # with the tensor reshape() viewed: base._base
    engine.restore(ns)
    assert torch.equal(base, ref)
    row[0] = -1.0  # still aliases: a write through one view shows in the others
    assert base[3, 0] == -1.0
    assert t[0, 3] == -1.0
    assert (col.storage_offset(), col.stride()) == (7, (100,))
    assert row._base is base._base  # views of views point at the root base, as before


def test_constant_storages_keep_only_their_word(engine):
    ns = {"zeros": torch.zeros(1 << 20), "ones": torch.ones(1000, dtype=torch.bfloat16)}
    report = engine.offload(ns)
    assert sorted(m[2] for m in report.moved) == [4, 4]
    engine.restore(ns)
    assert torch.equal(ns["zeros"], torch.zeros(1 << 20))
    assert torch.equal(ns["ones"], torch.ones(1000, dtype=torch.bfloat16))


def test_a_touch_restores_through_the_dispatch_mode(engine):
    model, _, x, _ = trained()
    ns = {"model": model}
    expected = model(x)
    engine.offload(ns)
    helper = lambda inp: model(inp)  # noqa: E731 - the cell names only `helper`
    out = helper(x)
    assert torch.equal(out, expected)
    assert model[0].weight.device.type == "cpu"


def test_before_cell_restores_what_the_cell_names(engine):
    a, b = torch.randn(100), torch.randn(100)
    ns = {"a": a, "b": b}
    engine.offload(ns)
    engine.before_cell("print(a.shape)", ns)
    assert not engine.is_offloaded(a)
    assert engine.is_offloaded(b)
    engine.after_cell(ns)
    engine.before_cell("this is not python (", ns)  # unknown reach: restore everything
    assert not engine.is_offloaded(b)
    engine.after_cell(ns)


def test_any_torch_call_on_a_placeholder_restores_it_first(engine):
    w = torch.nn.Parameter(torch.randn(32, 16))
    ref = w.detach().clone()
    engine.offload({"w": w})
    assert engine.is_offloaded(w)
    assert w.shape == (32, 16)  # a property read is a torch call too: w comes back
    assert not engine.is_offloaded(w)
    assert w.device.type == "cpu"
    assert torch.equal(w, ref)


def test_what_cannot_be_offloaded_safely_is_skipped_and_reported(engine):
    class Sub(torch.Tensor):
        pass

    leaf = torch.randn(8, requires_grad=True)
    out = (leaf * 2).sum()  # a live graph holds `leaf`
    weak_target = torch.randn(8)
    keep = weakref.ref(weak_target)
    hidden_base = torch.randn(8)
    hidden_view = hidden_base[2:]  # noqa: F841 - a view the namespace does not reach
    ns = {
        "sub": torch.randn(8).as_subclass(Sub),
        "leaf": leaf,
        "out": out,
        "weak": weak_target,
        "partial": hidden_base,
    }
    report = engine.offload(ns)
    reasons = dict(report.skipped)
    assert "subclass" in reasons["sub (+1 view(s))"]
    assert "live autograd graph" in reasons["leaf"]
    assert "autograd graph" in reasons["out"]
    assert "weak reference" in reasons["weak"]
    assert "shared with 1 tensor" in reasons["partial"]
    assert report.moved == []
    assert keep() is weak_target
    out.backward()  # the graph still works: nothing was touched
    assert leaf.grad is not None


def test_a_failed_restore_raises_and_keeps_the_host_copy(engine):
    x = torch.randn(1 << 16)
    ref = x.clone()
    ns = {"x": x}
    engine.offload(ns)
    entry = next(iter(engine.store._entries.values()))
    good = entry.packed
    chunk = good.chunks[0]
    broken = chunk.payload[:-8] + bytes(8)
    entry.packed = good.__class__(
        good.nbytes,
        good.itemsize,
        (chunk.__class__(**{**chunk.__dict__, "payload": broken}), *good.chunks[1:]),
        good.stored_bytes,
    )
    with pytest.raises(RestoreError, match="still held on the host"):
        engine.restore(ns)
    assert engine.is_offloaded(x)
    assert engine.stats()["count"] == 1
    entry.packed = good
    engine.restore(ns)
    assert torch.equal(x, ref)


def test_host_cap_refusal_leaves_the_tensor_in_place():
    e = OffloadEngine(EngineConfig(device="cpu", host_cap_bytes=1000))
    x = torch.randn(10_000)
    report = e.offload({"x": x})
    assert "host memory cap" in report.skipped[0][1]
    assert not e.is_offloaded(x)
    assert x.device.type == "cpu"
    e.close()


def test_spill_to_disk_past_the_cap(tmp_path):
    e = OffloadEngine(EngineConfig(device="cpu", host_cap_bytes=1000, spill_dir=str(tmp_path)))
    x = torch.randn(10_000)
    ref = x.clone()
    e.offload({"x": x})
    assert e.stats()["disk_bytes"] > 0
    e.restore({"x": x})
    assert torch.equal(x, ref)
    e.close()


def test_chaos_offloads_after_every_cell_and_orphans_are_dropped():
    e = OffloadEngine(EngineConfig(device="cpu", chaos=True))
    ns = {"x": torch.randn(1000)}
    e.before_cell("y = x * 2", ns)
    ns["y"] = ns["x"] * 2
    e.after_cell(ns)
    assert e.stats()["count"] == 2
    del ns["y"]
    e.after_cell(ns)
    assert e.stats()["count"] == 1  # y's host copy was freed with y
    e.close()
    assert ns["x"].device.type == "cpu"


def test_policy_orders_idle_storages_lru_then_largest():
    c = [
        policy.Candidate(("a",), 10, last_used=5.0),
        policy.Candidate(("b",), 99, last_used=1.0),
        policy.Candidate(("c",), 50, last_used=1.0),
        policy.Candidate(("d",), 70, last_used=9.5),
    ]
    assert [x.key for x in policy.order(c, now=10.0, idle_seconds=2.0)] == [("b",), ("c",), ("a",)]
    assert [x.key for x in policy.order(c, now=10.0, idle_seconds=None)][-1] == ("d",)


def test_the_watermark_policy_only_moves_idle_storages():
    e = OffloadEngine(EngineConfig(device="cpu", idle_seconds=3600))
    ns = {"x": torch.randn(100)}
    report = e._offload(ns, None, idle_only=True)
    assert report.moved == []  # seen just now: not idle
    e.config.idle_seconds = 0.0
    assert len(e._offload(ns, None, idle_only=True).moved) == 1
    e.close()


def test_training_through_restore_on_touch_matches_plain_training(engine):
    torch.manual_seed(0)
    net, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(net.state_dict())
    opt, ref_opt = torch.optim.Adam(net.parameters()), torch.optim.Adam(ref.parameters())
    x = torch.randn(8, 4)
    for _ in range(3):
        engine.offload({"net": net, "opt": opt, "x": x})  # nothing restores them but the touch
        for m, o in ((net, opt), (ref, ref_opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a.grad, b.grad)


def test_optimizer_steps_and_called_functions_bring_their_tensors_back():
    e = OffloadEngine(EngineConfig(device="cpu", chaos=True))
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(net.parameters())
    x = torch.randn(8, 4)
    ns = {"net": net, "opt": opt, "x": x}

    def train():
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        opt.step()

    ns["train"] = train
    for _ in range(3):  # chaos: everything is offloaded between these "cells"
        e.before_cell("train()", ns)
        train()
        e.after_cell(ns)
    assert e.stats()["count"] > 0
    opt.step()  # state offloaded, nothing names it: the step pre-hook restores it
    e.close()
