"""Property-based fuzz on a real GPU: random tensor programs run twice, plain and with
everything offloaded between every step; the results must be bit-identical."""

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jupyter_vgpu.kernel.offload.engine import EngineConfig, OffloadEngine

pytestmark = pytest.mark.gpu
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
COUNTS = {"programs": 0, "ops": 0}

step = st.one_of(
    st.tuples(
        st.just("new"), st.sampled_from(["float32", "bfloat16", "float16", "int64"]), st.integers(1, 300)
    ),
    st.tuples(st.just("zeros"), st.integers(1, 5000)),
    st.tuples(st.just("view"), st.integers(0, 50), st.integers(0, 3)),
    st.tuples(st.just("inplace"), st.integers(0, 50), st.sampled_from(["add", "mul", "neg"])),
    st.tuples(st.just("combine"), st.integers(0, 50), st.integers(0, 50)),
    st.tuples(st.just("detach"), st.integers(0, 50)),
    st.tuples(st.just("train"), st.integers(1, 3)),
    st.tuples(st.just("touch"), st.integers(0, 50)),
)


def run(program, engine):
    torch.manual_seed(1234)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(64, 16, device="cuda")
    ns = {"model": model, "opt": opt, "data": data, "t": []}
    tensors = ns["t"]
    for i, op in enumerate(program):
        if engine is not None:
            engine.offload(ns)
            if op[0] in ("train", "inplace", "view", "detach", "combine"):
                engine.restore(ns)  # what the pre-cell hook does for names a cell mentions
        g = torch.Generator(device="cuda").manual_seed(i)
        kind = op[0]
        if kind == "new":
            dtype = getattr(torch, op[1])
            if dtype.is_floating_point:
                tensors.append(torch.randn(op[2], 7, device="cuda", generator=g).to(dtype))
            else:
                tensors.append(torch.randint(0, 1000, (op[2], 7), device="cuda", generator=g))
        elif kind == "zeros":
            tensors.append(torch.zeros(op[1], device="cuda"))
        elif not tensors:
            continue
        elif kind == "view":
            t = tensors[op[1] % len(tensors)]
            views = [
                lambda x: x[1:],
                lambda x: x.t() if x.dim() == 2 else x,
                lambda x: x.view(-1) if x.is_contiguous() else x.reshape(-1),
                lambda x: x[::2],
            ]
            tensors.append(views[op[2]](t))
        elif kind == "inplace":
            t = tensors[op[1] % len(tensors)]
            if t.dtype.is_floating_point and op[2] == "add":
                t.add_(1.5)
            elif t.dtype.is_floating_point and op[2] == "mul":
                t.mul_(1.5)
            elif t.dtype.is_floating_point:
                t.neg_()
            else:
                t.add_(3)
        elif kind == "combine":
            a, b = tensors[op[1] % len(tensors)], tensors[op[2] % len(tensors)]
            if a.shape == b.shape and a.dtype == b.dtype:
                tensors.append(a * 2 + b)
            else:
                tensors.append(a.float().sum().reshape(1) + 1)
        elif kind == "detach":
            tensors.append(tensors[op[1] % len(tensors)].detach())
        elif kind == "touch":  # no restore first: the dispatch mode must bring it back
            t = tensors[op[1] % len(tensors)]
            tensors.append((t + t).clone())
        if kind == "train":
            for _ in range(op[1]):
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(data), torch.ones(64, 8, device="cuda")).backward()
                opt.step()
        COUNTS["ops"] += 1
    if engine is not None:
        engine.restore(ns)
    torch.cuda.synchronize()
    return ns


@settings(
    max_examples=int(os.environ.get("VGPU_FUZZ_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
@given(program=st.lists(step, min_size=1, max_size=25))
def test_offloaded_programs_match_plain_ones_bit_for_bit(program):
    torch.use_deterministic_algorithms(True)
    engine = OffloadEngine(EngineConfig(device="cuda"))
    try:
        plain = run(program, None)
        offloaded = run(program, engine)
    finally:
        engine.close()
    assert len(plain["t"]) == len(offloaded["t"])
    for a, b in zip(plain["t"], offloaded["t"], strict=True):
        assert b.device.type == "cuda"
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)
        assert torch.equal(a, b)
    for (n, a), b in zip(plain["model"].named_parameters(), offloaded["model"].parameters(), strict=True):
        assert torch.equal(a, b), n
        assert torch.equal(a.grad, b.grad) if a.grad is not None else b.grad is None
    COUNTS["programs"] += 1


def test_report_fuzz_counts():
    print(f"fuzz: {COUNTS['programs']} programs, {COUNTS['ops']} ops (each run plain and offloaded)")
