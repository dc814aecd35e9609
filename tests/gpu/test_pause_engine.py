"""The pause engine on a real GPU, in preloaded processes: memory leaves the card, comes
back bit-exact at the same addresses through both codec paths, works on a full card,
catches damage, and survives a long random fuzz."""

import pytest

from jupyter_vgpu.testing.preloaded import run

pytestmark = pytest.mark.gpu

SETUP = """
import json, os, torch
from jupyter_vgpu import nvml
from jupyter_vgpu.kernel.pause import vmm
from jupyter_vgpu.kernel.pause.engine import PauseEngine, ResumeError
torch.manual_seed(0)
dev = torch.device("cuda")
GiB = 1 << 30
def used():
    uuid = nvml.list_gpus()[0].uuid
    return nvml.process_memory(uuid).get(os.getpid(), 0)
def context():  # NVML's figure for the CUDA context with cuBLAS loaded, before any workload
    a = torch.ones(256, 256, device=dev)
    (a @ a).sum().item()
    del a
    torch.cuda.empty_cache()
    return used()
def workload():
    w = (torch.randn(GiB // 2, device=dev) * 0.02).to(torch.bfloat16)
    m = torch.randn(GiB // 16, device=dev) * 1e-3
    v = m * m
    z = torch.zeros(64 << 20, dtype=torch.uint8, device=dev)
    x = torch.randn(512, 512, device=dev, requires_grad=True)
    loss = (x @ x).square().sum()  # backward pending, saved tensors on the GPU
    with torch.inference_mode():
        inf = w[:1000].float() * 2
    scripted = torch.jit.script(torch.nn.Linear(256, 256).to(dev))
    g, a = torch.cuda.CUDAGraph(), torch.ones(1 << 20, device=dev)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        b = a * 3
    g.replay()
    torch.cuda.synchronize()
    return dict(w=w, m=m, v=v, z=z, x=x, loss=loss, inf=inf, scripted=scripted, g=g, a=a, b=b)
def snapshot(t):
    return {k: t[k].detach().clone().cpu() for k in ("w", "m", "v", "z", "x", "inf", "b")}
def same(before, t):
    return {k: bool(torch.equal(before[k], t[k].detach().cpu())) for k in before}
"""


@pytest.mark.parametrize("use_nvcomp", [True, False])
def test_every_byte_leaves_the_card_and_comes_back_at_the_same_address(use_nvcomp):
    got = run(
        SETUP
        + f"""
allocator = vmm.load()
assert allocator.preloaded
ctx = context()
t = workload()
before, ptrs = snapshot(t), {{k: t[k].data_ptr() for k in ("w", "x", "b")}}
engine = PauseEngine(torch, allocator, 0, use_nvcomp={use_nvcomp})
stats0 = torch.cuda.memory_stats()["allocation.all.allocated"]
held = used()
out = engine.pause()
paused = used()
back = engine.resume()
stats1 = torch.cuda.memory_stats()["allocation.all.allocated"]
t["loss"].backward()
t["g"].replay(); torch.cuda.synchronize()
print(json.dumps(dict(
    held=held, paused=paused, ctx=ctx, same=same(before, t),
    ptrs=all(t[k].data_ptr() == p for k, p in ptrs.items()),
    inference=t["inf"].is_inference(), grad=bool(torch.isfinite(t["x"].grad).all()),
    scripted=list(t["scripted"](torch.ones(2, 256, device=dev)).shape), graph=t["b"][0].item(),
    torch_allocations=stats1 - stats0, codec=list(out.codecs), ratio=out.ratio,
    pause_s=out.seconds, resume_s=back.seconds)))
"""
    )
    assert all(got["same"].values()), got["same"]
    assert got["ptrs"]
    assert got["held"] > 1.5 * 2**30
    assert got["paused"] <= got["ctx"] + 64 * 2**20, "only the CUDA context may stay on the card"
    assert got["inference"]
    assert got["grad"]
    assert got["scripted"] == [2, 256]
    assert got["graph"] == 3.0
    assert got["torch_allocations"] == 0, "the pause path must not allocate through PyTorch"
    assert ("nvCOMP" in got["codec"][0]) == use_nvcomp
    assert got["ratio"] > 1.2


# Another user's process: on "fill" it takes all but 200 MiB of what is free.
BLOCKER = """
import sys, torch
held = []
for line in sys.stdin:
    if line.strip() != "fill":
        break
    free, _ = torch.cuda.mem_get_info()
    held.append(torch.empty(free - (200 << 20), dtype=torch.uint8, device="cuda"))
    print("full", flush=True)
"""


def test_a_pause_succeeds_on_a_card_with_almost_no_free_memory():
    got = run(
        SETUP
        + f"BLOCKER = {BLOCKER!r}\n"
        + """
import subprocess, sys, time
t = workload()
before = snapshot(t)
engine = PauseEngine(torch, vmm.load(), 0)
free, _ = torch.cuda.mem_get_info()
blocker = subprocess.Popen([sys.executable, "-c", BLOCKER],
    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
def fill():
    blocker.stdin.write("fill\\n"); blocker.stdin.flush()
    assert blocker.stdout.readline().strip() == "full"
fill()
left, _ = torch.cuda.mem_get_info()
out = engine.pause()
fill()  # take what the pause released, so the resume finds no room
full_room = None
try:
    engine.resume()
except vmm.DeviceFull:
    full_room = engine.room_needed()
blocker.stdin.write("done\\n"); blocker.stdin.flush(); blocker.wait(60)
engine.resume()
print(json.dumps(dict(free_before=left, codecs=list(out.codecs), same=same(before, t), waited_for=full_room)))
"""
    )
    assert got["free_before"] < 256 * 2**20
    assert all(got["same"].values())
    assert got["waited_for"], "a resume with no room must wait, not fail or fault"


def test_a_damaged_chunk_is_caught_and_the_kernel_stays_paused_with_its_host_copy():
    got = run(
        SETUP
        + """
ctx = context()
t = workload()
before = snapshot(t)
engine = PauseEngine(torch, vmm.load(), 0)
engine.pause()
piece = next(p for seg in engine._paused for r in seg.ranges for p in r.pieces if p.sizes[0] > 8192)
slab, at = engine.arena.slabs[piece.slab], piece.start + piece.sizes[0] // 2
keep = slab[at].item()
slab[at] = keep ^ 0xFF
try:
    engine.resume()
    error = None
except ResumeError as e:
    error = str(e)
state, low = engine.state, used()
slab[at] = keep
engine.resume()
print(json.dumps(dict(error=error, state=state, low=low, ctx=ctx, same=same(before, t))))
"""
    )
    assert got["error"]
    assert "CRC-32" in got["error"]
    assert got["state"] == "paused"
    assert got["low"] <= got["ctx"] + 64 * 2**20
    assert all(got["same"].values())


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "backend:cudaMallocAsync"])
def test_ten_thousand_random_ops_with_pauses_between_them_match_a_plain_run(conf):
    """The same random program with 2,000 pause and resume cycles gives the same bytes as a
    plain run, with PyTorch's default allocator, its expandable segments (cuMemCreate of
    its own) and its cudaMallocAsync backend (stream-ordered allocations)."""
    got = run(
        """
import json, random, hashlib, torch
from jupyter_vgpu.kernel.pause import vmm
from jupyter_vgpu.kernel.pause.engine import PauseEngine

def program(engine, ops=10_000, every=5, seed=7):
    rnd = random.Random(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pool = [torch.randn(rnd.randint(1, 4096), device="cuda", generator=gen) for _ in range(16)]
    cycles = 0
    for i in range(ops):
        k = rnd.randrange(len(pool))
        a = pool[k]
        op = rnd.randrange(9)
        if op == 0:
            a.mul_(0.999).add_(0.001)
        elif op == 1:
            pool[k] = torch.cat([a, a[: rnd.randint(1, a.numel())]])[:8192]
        elif op == 2:
            b = pool[rnd.randrange(len(pool))]
            n = min(a.numel(), b.numel())
            a[:n] += b[:n].flip(0)
        elif op == 3:
            pool[k] = torch.randn(rnd.randint(1, 8192), device="cuda", generator=gen)
        elif op == 4:
            v = a[:: rnd.randint(1, 3)]
            v.copy_(v.sin())
        elif op == 5:
            n = int(a.numel() ** 0.5)
            if n > 1:
                m = a[: n * n].view(n, n)
                pool[k] = (m @ m.t()).flatten() / n
        elif op == 6:
            a.index_fill_(0, torch.tensor([0], device="cuda"), float(i % 7))
        elif op == 7:
            pool[k] = a.to(torch.bfloat16).to(torch.float32)
        else:
            pool.append(a.clone()[: rnd.randint(1, a.numel())])
            if len(pool) > 32:
                pool.pop(0)
        if engine is not None and i % every == every - 1:
            engine.pause()
            engine.resume()
            cycles += 1
    torch.cuda.synchronize()
    digest = hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in pool)).hexdigest()
    return digest, cycles

plain, _ = program(None)
engine = PauseEngine(torch, vmm.load(), 0)
paused, cycles = program(engine)
print(json.dumps(dict(plain=plain, paused=paused, cycles=cycles)))
""",
        timeout=900,
        PYTORCH_CUDA_ALLOC_CONF=conf,
    )
    assert got["cycles"] == 2000
    assert got["paused"] == got["plain"]
