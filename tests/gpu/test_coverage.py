"""Every way a kernel allocates GPU memory leaves the card, and comes back bit-exact; what
works without the pausable allocator works with it.

Real kernels on the H100, in chaos mode ``pause`` (paused after every cell) and
``suspend`` (paused when it can be, then checkpointed by the driver; suspended outright
when a pause is not safe): PyTorch's caching allocator, its expandable segments and its
``cudaMallocAsync`` backend, CuPy's default and stream-ordered pools, JAX with and without
its preallocation; CUDA IPC between a kernel and a ``torch.multiprocessing`` worker both
ways (such a kernel is paused in part, what is shared staying on the card); a DataLoader
with persistent workers and pinned memory; and the node arbiter suspending, on its own, a
kernel it cannot pause when another needs room.
"""

from __future__ import annotations

import re

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.digest_code import DIGEST
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30
#: The most a paused kernel may keep on the card: its CUDA context (0.67 GiB measured).
CONTEXT_BOUND = int(0.75 * GiB)


TORCH = (
    "import torch\ng = torch.Generator(device='cuda').manual_seed(1)\n"
    "held = [(torch.randn(2**26, device='cuda', generator=g) * 0.02).to(torch.bfloat16) for _ in range(6)]\n"
    "held += [torch.randn(n, device='cuda', generator=g) for n in (1, 7, 1000, 12345, 3_000_001)]\n"
    "host = lambda: [t.view(torch.uint8).cpu().numpy() for t in held]\n"
)
MIXED = (
    TORCH + "import cupy as cp, jax, jax.numpy as jnp\n"
    "rs = cp.random.RandomState(2)\n"
    "cpy = [rs.standard_normal(n, dtype=cp.float32) for n in (2**27, 3, 100_001)]\n"
    "with cp.cuda.using_allocator(cp.cuda.MemoryAsyncPool().malloc):\n"
    "    cpy += [cp.arange(2**25, dtype=cp.int32), cp.full(777, 3.5)]\n"
    "jx = [jax.random.normal(jax.random.PRNGKey(3), (2**26,)), jnp.arange(5.0)]\n"
    "torch_host = host\n"
    "host = lambda: torch_host() + [cp.asnumpy(a) for a in cpy] + [np.asarray(a + 0) for a in jx]\n"
)
JAX = (
    "import jax, jax.numpy as jnp\n"
    "jx = [jax.random.normal(jax.random.PRNGKey(i), (2**26,)) for i in range(4)]\n"
    "host = lambda: [np.asarray(a + 0) for a in jx]\n"
)

PATHS = {
    # one kernel, one pause: PyTorch's cudaMalloc, CuPy's two pools, JAX allocating on demand
    "torch, cupy, jax together": ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, MIXED),
    "torch expandable segments": ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, TORCH),
    "torch cudaMallocAsync backend": ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, TORCH),
    "jax preallocating": ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}, JAX),
}


def kernel_state(kernel: Kernel) -> str:
    out = kernel.run("%vgpu status")
    return re.search(r"^\s*state\s+(\S+)", out, re.M).group(1)


def report(channel, kernel: Kernel) -> dict:
    """The kernel's report in the channel directory ({} while there is none yet)."""
    import json

    try:
        return json.loads((channel / f"kernel-{kernel.id}.json").read_text())
    except (OSError, ValueError):
        return {}


def report_state(channel, kernel: Kernel) -> str | None:
    return report(channel, kernel).get("state")


def start(tmp_path, mode: str, **extra: str) -> tuple[Kernel, object]:
    channel = tmp_path / f"channel-{mode or 'plain'}"
    channel.mkdir()
    env = environment(JUPYTER_VGPU_CHAOS=mode, JUPYTER_VGPU_CHANNEL=str(channel), **extra)
    return Kernel(tmp_path, env, load_extension=True), channel


def away_bytes(kernel: Kernel, channel, mode: str, pids: list[int] | None = None) -> list[int]:
    """Wait until the kernel is away (``mode``), then NVML's bytes for it (and ``pids``)."""
    wanted = {"pause": "paused", "suspend": "suspended"}[mode]
    wait_for(lambda: report_state(channel, kernel) == wanted, what=f"the kernel {wanted} after the cell")
    uuid = nvml.list_gpus()[0].uuid
    limit = CONTEXT_BOUND if mode == "pause" else 0

    def settled():
        used = nvml.process_memory(uuid)
        return all(used.get(p, 0) <= limit for p in [kernel.pid, *(pids or [])])

    wait_for(settled, timeout=5, what=f"NVML to show the {wanted} kernel at most {limit} bytes")
    used = nvml.process_memory(uuid)
    return [used.get(p, 0) for p in [kernel.pid, *(pids or [])]]


@pytest.mark.parametrize("mode", ["pause", "suspend"])
@pytest.mark.parametrize("path", list(PATHS))
def test_every_allocation_path_leaves_the_card_and_comes_back_bit_exact(tmp_path, path, mode):
    env, fill = PATHS[path]
    kernel, channel = start(tmp_path, mode, **env)
    try:
        before = kernel.run(DIGEST + fill + "print(digest(host()))").strip().splitlines()[-1]
        assert re.fullmatch(r"[0-9a-f]{64}", before), before
        used = away_bytes(kernel, channel, mode)
        assert used[0] <= (CONTEXT_BOUND if mode == "pause" else 0)
        after = kernel.run("print(digest(host()))").strip().splitlines()[-1]
        assert after == before, f"{path}: the data changed across a {mode}"
    finally:
        kernel.shutdown()


WORKER = '''
import torch

def serve(inbox, outbox):
    """A torch.multiprocessing worker: keeps the CUDA tensors it is given, and exports one."""
    held = {}
    while True:
        msg = inbox.get()
        if msg is None:
            return
        if msg[0] == "take":
            held["t"] = msg[1]
            outbox.put(("took", float(held["t"][0])))
        elif msg[0] == "add":
            held["t"].add_(1)
            torch.cuda.synchronize()
            outbox.put(("added", float(held["t"][0])))
        elif msg[0] == "read":
            outbox.put(("read", float(held["t"].sum())))
        elif msg[0] == "export":
            held["mine"] = torch.full((2**24,), 5.0, device="cuda")
            outbox.put(held["mine"])
        elif msg[0] == "read mine":
            torch.cuda.synchronize()
            outbox.put(("mine", float(held["mine"].sum())))
'''

IPC_CELLS = [
    "import sys, torch, torch.multiprocessing as mp\nsys.path.insert(0, {dir!r})\n"
    "from ipcworker import serve\n"
    "ctx = mp.get_context('spawn')\ninbox, outbox = ctx.Queue(), ctx.Queue()\n"
    "worker = ctx.Process(target=serve, args=(inbox, outbox), daemon=True)\nworker.start()\n"
    "t = torch.zeros(2**26, device='cuda')\ninbox.put(('take', t))\n"
    "print(outbox.get(timeout=120), worker.pid)",
    "inbox.put(('add',))\nprint(outbox.get(timeout=60))\ntorch.cuda.synchronize()\nprint(float(t[0]))",
    "t.fill_(2)\ntorch.cuda.synchronize()\ninbox.put(('read',))\nprint(outbox.get(timeout=60))",
    "inbox.put(('export',))\nu = outbox.get(timeout=60)\nprint(float(u.sum()))\nu.add_(1)\n"
    "torch.cuda.synchronize()\ninbox.put(('read mine',))\nprint(outbox.get(timeout=60))",
    "inbox.put(('add',))\nprint(outbox.get(timeout=60), float(t.sum()), float(u[0]))",
]


def run_ipc(tmp_path, mode: str) -> tuple[list[str], str, list[tuple[int, int]]]:
    """The IPC cells in a kernel of chaos ``mode``: their outputs, ``%vgpu status``, and
    after each cell (in a chaos mode) NVML's bytes for the kernel once it is paused beside
    the bytes its allocator says stay (shared with the worker, or mapped from it)."""
    tmp_path.mkdir()
    (tmp_path / "ipcworker.py").write_text(WORKER)
    kernel, channel = start(tmp_path, mode)
    uuid = nvml.list_gpus()[0].uuid
    outputs, away = [], []
    try:
        for cell in IPC_CELLS:
            outputs.append(kernel.run(cell.format(dir=str(tmp_path)), timeout=180))
            if mode:  # neither paused whole nor suspended: paused in part, the shared memory staying
                wait_for(lambda: report_state(channel, kernel) == "paused", what="the kernel paused in part")
                stays = report(channel, kernel)["pause"]["unpausable_bytes"]

                def settled(stays=stays):
                    return nvml.process_memory(uuid).get(kernel.pid, 0) <= CONTEXT_BOUND + stays

                wait_for(settled, timeout=5, what="NVML to show the kernel at its context and what stays")
                away.append((nvml.process_memory(uuid).get(kernel.pid, 0), stays))
        status = kernel.run("%vgpu status")
        kernel.run("inbox.put(None)\nworker.join(30)")
    finally:
        kernel.shutdown()
    outputs[0] = outputs[0].rsplit(maxsplit=1)[0]  # the worker's PID differs between runs
    return outputs, status, away


def test_cuda_ipc_with_a_worker_both_ways_pauses_all_but_the_shared_memory(tmp_path):
    """A kernel and a torch.multiprocessing worker share CUDA tensors both ways and see
    each other's writes, as without the allocator. Such a kernel cannot be paused whole
    (the worker maps its memory) nor suspended (on the H100 the driver checkpointed such
    a pair, then refused to restore it): in both chaos modes it is paused in part, what
    is shared staying on the card (NVML: at most its CUDA context and that), its outputs
    identical, and ``%vgpu status`` says why."""
    plain, _, _ = run_ipc(tmp_path / "plain", "")
    assert "Error" not in "".join(plain), plain
    assert plain[1].split() == ["('added',", "1.0)", "1.0"]  # the worker's write is the kernel's
    assert "('read', 134217728.0)" in plain[2]  # and the kernel's write the worker's
    assert "('mine', 100663296.0)" in plain[3]  # a tensor the worker exported, written by the kernel
    for mode in ("pause", "suspend"):
        outputs, status, away = run_ipc(tmp_path / mode, mode)
        assert outputs == plain, f"chaos {mode}: {outputs}"
        for used, stays in away:
            assert 0 < stays < 1 << 30, away  # the 256 MiB tensor's segment, not the kernel's all
            assert used <= CONTEXT_BOUND + stays, away
        line = next(x for x in status.splitlines() if x.strip().startswith("pausable"))
        assert "CUDA IPC" in line, line
        assert "stays on the GPU and the rest of this kernel's is paused" in line, line


LOADER_CELLS = [
    "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\ntorch.manual_seed(0)\n"
    "w = torch.randn(2**26, device='cuda')\nds = TensorDataset(torch.randn(2048, 64))\n"
    "dl = DataLoader(ds, batch_size=64, num_workers=2, persistent_workers=True, pin_memory=True)\n"
    "first = sum(float(b.cuda(non_blocking=True).sum()) for (b,) in dl)\nprint(round(first, 3))",
    "again = sum(float(b.cuda(non_blocking=True).sum()) for (b,) in dl)\n"
    "print(round(again, 3), float(w.sum()))",
]


def test_a_dataloader_with_persistent_workers_goes_away_like_any_kernel_its_next_epoch_the_same(tmp_path):
    """A DataLoader's pin-memory thread runs between cells; its GPU calls would wait at the
    allocator's gate and bring the kernel back, so it keeps no kernel on the card: paused
    (or suspended) after the cell like any other, ``%vgpu status`` naming the thread, and
    the next epoch's sums the same as without the allocator."""
    results = {}
    for mode in ("", "pause", "suspend"):
        (tmp_path / (mode or "plain")).mkdir()
        kernel, channel = start(tmp_path / (mode or "plain"), mode)
        try:
            outs = [kernel.run(LOADER_CELLS[0])]
            if mode:
                used = away_bytes(kernel, channel, mode)
                assert used[0] <= (CONTEXT_BOUND if mode == "pause" else 0), used
            outs.append(kernel.run(LOADER_CELLS[1]).strip().splitlines()[-1])
            status = kernel.run("%vgpu status")
        finally:
            kernel.shutdown()
        outs[0] = outs[0].strip().splitlines()[-1]
        results[mode] = outs
        if mode:
            line = next(x for x in status.splitlines() if x.strip().startswith("between cells"))
            assert "DataLoader's pin-memory thread" in line, line
    assert results["pause"] == results[""]
    assert results["suspend"] == results[""]


def test_the_arbiter_suspends_a_kernel_it_cannot_pause_to_make_room(tmp_path):
    """Kernel A holds 30 GiB and may not be paused (``VGPUKernel.pause=False``); kernel B
    needs 50 GiB on the 80 GB card: the arbiter's pause of A is refused, it suspends A
    instead (NVML: nothing of A left), B gets its room; A's next cell restores it, its
    data intact."""
    gpu = nvml.list_gpus()[0]
    slice_ = Slice.on_card(gpu, 52 * GiB, 100, overcommit_ratio=2.0)  # B's 50 GiB need A's room
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.suspend_after=0").start()
    kernels = []
    try:
        for i in range(2):
            args = ("--VGPUKernel.pause=False",) if i == 0 else ()
            kernels.append(arbiter.start_kernel(tmp_path, f"user{i}", slice_, args))
        a, b = kernels
        fill = (
            "import torch\n"
            "data = [torch.full((2**28,), float(i), device='cuda') for i in range({n})]\nprint('filled')"
        )
        assert "filled" in a.run(fill.format(n=30), timeout=300)
        assert "filled" in b.run(fill.format(n=50), timeout=300)
        entry = arbiter.kernel(a.pid)
        assert entry["state"] == "suspended", entry
        assert nvml.process_memory(gpu.uuid).get(a.pid, 0) == 0
        decisions = [d["what"] for d in arbiter.books()["decisions"]]
        assert "pause refused" in decisions, decisions
        assert "suspend" in decisions, decisions
        b.run("del data\ntorch.cuda.empty_cache()")
        out = a.run("print(all(float(d[12345]) == i for i, d in enumerate(data)), len(data))", timeout=300)
        assert "restoring this kernel from the driver's checkpoint" in out, out  # never silent
        assert out.strip().splitlines()[-1].split() == ["True", "30"], out
    finally:
        for kernel in kernels:
            kernel.shutdown()
        arbiter.stop()
