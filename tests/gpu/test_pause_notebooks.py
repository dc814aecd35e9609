"""Notebook patterns that broke per-tensor offload, each run in a real kernel plain, in
chaos mode ``pause`` (the kernel pauses after every cell) and in chaos mode ``suspend``
(it pauses, then the driver checkpoints it): every output is identical, nothing crashes,
no update is lost, and the card holds at most the CUDA context while paused."""

import json

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu

SETUP = (
    "import os, time, threading, torch, numpy as np\n"
    "torch.manual_seed(0)\n"
    "torch.use_deterministic_algorithms(True, warn_only=True)\n"
    "print('ready')"
)
# NVML's figure for the kernel's CUDA context once every pattern ran: PyTorch's memory
# (all it still reserves) left out, every module the patterns and the pause path loaded
# counted in. A context only grows, so this bounds what may stay on the card while paused.
CONTEXT = (
    "%reset -f\n"
    "import gc, os, torch\n"
    "from jupyter_vgpu import nvml as _nvml\n"
    "torch._dynamo.reset()\ngc.collect()\n"
    "torch._C._cuda_clearCublasWorkspaces()\ntorch.cuda.empty_cache()\n"
    "_used = _nvml.process_memory(_nvml.list_gpus()[0].uuid).get(os.getpid(), 0)\n"
    "print(_used - torch.cuda.memory_reserved())"
)

PATTERNS = {
    "backward in the next cell": [
        "w1 = torch.randn(256, 256, device='cuda', requires_grad=True)\nloss1 = (w1 @ w1).tanh().sum()",
        "loss1.backward()\nprint(w1.grad.double().sum().item())",
    ],
    "backward twice, graph retained": [
        "w2 = torch.randn(128, 128, device='cuda', requires_grad=True)\n"
        "l2 = (w2 * 3).pow(2).sum()\nl2.backward(retain_graph=True)",
        "l2.backward()\nprint(w2.grad.double().sum().item())",
    ],
    "inference mode output, sliced later": [
        "with torch.inference_mode():\n    inf3 = torch.randn(1000, device='cuda') * 2",
        "print(inf3.is_inference(), inf3[10:20].double().sum().item())",
    ],
    "torch.compile": [
        "f4 = torch.compile(lambda t: (t.sin() + t.cos()).sum())\n"
        "x4 = torch.linspace(0, 1, 4096, device='cuda')\nprint(f4(x4).item())",
        "x4.add_(1)\nprint(f4(x4).item())",
    ],
    "TorchScript script and trace": [
        "s5 = torch.jit.script(torch.nn.Linear(64, 64).cuda())\n"
        "t5 = torch.jit.trace(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).cuda(), "
        "torch.ones(2, 64, device='cuda'))",
        "one = torch.ones(2, 64, device='cuda')\nprint(s5(one).sum().item(), t5(one).sum().item())",
    ],
    "DLPack to numpy, and a GPU tensor beside it": [
        "c6 = torch.arange(10.0)\nn6 = np.from_dlpack(c6)\ng6 = torch.arange(1000.0, device='cuda')",
        "c6.add_(1)\nprint(n6.sum(), g6.sum().item())",
    ],
    "from_numpy, then writing the array": [
        "a7 = np.zeros(5)\nt7 = torch.from_numpy(a7)",
        "a7[:] = 3\nprint(t7.sum().item())",
    ],
    "a held storage and a shared-memory tensor": [
        "x8 = torch.zeros(100, device='cuda')\ns8 = x8.untyped_storage()\n"
        "y8 = torch.zeros(10).share_memory_()",
        "x8.fill_(2)\ny8.fill_(5)\n"
        "print(torch.empty(0, device='cuda').set_(s8, 0, (100,)).sum().item(), y8.sum().item())",
    ],
    "conjugate view": [
        "z9 = torch.randn(64, dtype=torch.complex64, device='cuda')\nzc9 = z9.conj()",
        "print(zc9.is_conj(), torch.view_as_real(zc9.resolve_conj()).double().sum().item())",
    ],
    "a thread updating while the cell ends": [
        "acc10 = torch.zeros(1, device='cuda')\n"
        "def work10():\n    for _ in range(60):\n        acc10.add_(1)\n        torch.cuda.synchronize()\n"
        "        time.sleep(0.005)\n"
        "th10 = threading.Thread(target=work10)\nth10.start()",
        "th10.join()\nprint(acc10.item())",
    ],
    "a TorchFunctionMode entered in one cell, left in another": [
        "from torch.overrides import TorchFunctionMode\n"
        "class Count11(TorchFunctionMode):\n    n = 0\n"
        "    def __torch_function__(self, func, types, args=(), kwargs=None):\n"
        "        Count11.n += 1\n        return func(*args, **(kwargs or {}))\n"
        "mode11 = Count11()\nmode11.__enter__()\nv11 = torch.ones(8, device='cuda') * 2",
        "mode11.__exit__(None, None, None)\nprint(v11.sum().item(), Count11.n)",
    ],
    "jagged nested tensor": [
        "nt12 = torch.nested.nested_tensor([torch.arange(3.0), torch.arange(5.0)], "
        "layout=torch.jagged, device='cuda')",
        "print(nt12.values().sum().item(), nt12.offsets().tolist())",
    ],
    "Python attributes on a tensor": [
        "t13 = torch.ones(4, device='cuda')\nt13.note = 'hello'",
        "print(t13.note, t13.sum().item())",
    ],
    "CUDA graph captured, replayed later": [
        "g14 = torch.cuda.CUDAGraph()\nin14 = torch.ones(1024, device='cuda')\n"
        "side14 = torch.cuda.Stream()\nside14.wait_stream(torch.cuda.current_stream())\n"
        "with torch.cuda.stream(side14):\n    out14 = in14 * 2\n"
        "torch.cuda.current_stream().wait_stream(side14)\n"
        "with torch.cuda.graph(g14):\n    out14 = in14 * 2 + 1",
        "in14.fill_(3)\ng14.replay()\ntorch.cuda.synchronize()\nprint(out14.sum().item())",
    ],
    "BatchNorm MLP training, gradients read back": [
        "net16 = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), "
        "torch.nn.Linear(64, 1)).cuda()\nopt16 = torch.optim.Adam(net16.parameters(), 1e-3)\n"
        "X16, Y16 = torch.randn(256, 32, device='cuda'), torch.randn(256, 1, device='cuda')",
        "for _ in range(5):\n    opt16.zero_grad()\n"
        "    l16 = torch.nn.functional.mse_loss(net16(X16), Y16)\n    l16.backward()\n    opt16.step()\n"
        "print(l16.item())",
        "print([round(p.grad.abs().sum().item(), 6) for p in net16.parameters()])\n"
        "print(net16[1].running_mean.sum().item())",
    ],
    "pinned memory in flight at the end of a cell": [
        "src18 = torch.randn(2**22, device='cuda')\ndst18 = torch.empty(2**22, pin_memory=True)\n"
        "dst18.copy_(src18, non_blocking=True)\nev18 = torch.cuda.Event()\nev18.record()",
        "ev18.synchronize()\nprint(torch.equal(dst18, src18.cpu()), dst18.double().sum().item())",
    ],
    "many tiny allocations and a few huge ones": [
        "tiny19 = [torch.full((i % 7 + 1,), float(i), device='cuda') for i in range(20000)]\n"
        "huge19 = torch.ones(3 * 2**28, dtype=torch.uint8, device='cuda')\nhuge19[-5:] = 7",
        "print(sum(t.sum().item() for t in tiny19[::997]), huge19.double().sum().item())",
    ],
    "a thread pool allocating on its own threads": [
        "from concurrent.futures import ThreadPoolExecutor\npool20 = ThreadPoolExecutor(3)\n"
        "futs20 = [pool20.submit(torch.full, (999,), i, device='cuda') for i in range(9)]\n"
        "made20 = [f.result() for f in futs20]",
        "print(sum(m.sum().item() for m in made20))",
    ],
    "CuPy arrays of odd sizes beside PyTorch": [
        "import cupy as cp\nc21 = [cp.arange(n, dtype=cp.float32) for n in (1, 1000, 12345, 3_000_001)]\n"
        "c21.append(cp.cuda.alloc(1000))",
        "print([float(x.sum()) for x in c21[:4]], c21[4].mem.size)",
    ],
    "CUDA memory allocated directly from the driver": [
        "import ctypes\nlib22 = ctypes.CDLL('libcuda.so.1')\np22 = ctypes.c_uint64()\n"
        "print(lib22.cuMemAlloc_v2(ctypes.byref(p22), ctypes.c_size_t(5 * 2**20 + 3)))\n"
        "t22 = torch.arange(1000, device='cuda', dtype=torch.float32)\n"
        "lib22.cuMemcpyDtoD_v2(p22, ctypes.c_uint64(t22.data_ptr()), ctypes.c_size_t(4000))",
        "back22 = torch.empty(1000, device='cuda')\n"
        "lib22.cuMemcpyDtoD_v2(ctypes.c_uint64(back22.data_ptr()), p22, ctypes.c_size_t(4000))\n"
        "torch.cuda.synchronize()\nprint(back22.sum().item(), lib22.cuMemFree_v2(p22))",
    ],
    "the allocator's settings changed between cells": [
        "before23 = torch.randn(3 * 2**20, device='cuda')\n"
        "torch._C._accelerator_setAllocatorSettings('expandable_segments:True')",
        "after23 = torch.randn(5 * 2**20 + 1, device='cuda') + before23.sum()",
        "print(before23.double().sum().item(), after23.double().mean().item())",
    ],
    "a large tensor kept across cells": [
        "big17 = torch.randn(1 << 28, device='cuda')\nsum17 = big17.double().sum().item()",
        "print(big17.double().sum().item() == sum17)",
    ],
}


def pause_stats(report) -> dict:
    try:
        return json.loads(report.read_text())["pause"]
    except (OSError, ValueError, KeyError):
        return {}


def run_all(tmp_path, mode: str) -> tuple[dict, list, int]:
    channel = tmp_path / "channel"
    channel.mkdir()
    env = environment(JUPYTER_VGPU_CHAOS=mode, JUPYTER_VGPU_CHANNEL=str(channel))
    kernel = Kernel(tmp_path, env, load_extension=True)
    outputs, paused = {}, []
    try:
        assert kernel.run(SETUP).strip() == "ready"
        pid = int(kernel.run("print(os.getpid())"))
        uuid = nvml.list_gpus()[0].uuid
        for name, cells in PATTERNS.items():
            outputs[name] = [kernel.run(cell) for cell in cells]
            if mode:
                report = channel / f"kernel-{kernel.id}.json"
                wanted = "paused" if mode == "pause" else "suspended"
                try:
                    wait_for(
                        lambda r=report, w=wanted: pause_stats(r).get("state") == w,
                        what=f"{wanted} after {name}",
                    )
                except AssertionError as e:
                    raise AssertionError(f"{e}; the kernel's figures: {pause_stats(report)}") from None
                paused.append((name, nvml.process_memory(uuid).get(pid, 0)))
        context = int(kernel.run(CONTEXT).split()[-1])  # after any warning gc printed
    finally:
        kernel.shutdown()
    return outputs, paused, context


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    outputs, _, _ = run_all(tmp_path_factory.mktemp("plain"), "")
    return outputs


@pytest.mark.parametrize("mode", ["pause", "suspend"])
def test_every_pattern_gives_the_same_outputs_with_the_kernel_away_between_cells(plain, tmp_path, mode):
    outputs, paused, context = run_all(tmp_path, mode)
    for name in PATTERNS:
        assert outputs[name] == plain[name], name
        assert not any("Error" in out for out in outputs[name]), (name, outputs[name])
    limit = context + 64 * 2**20 if mode == "pause" else 0
    over = [
        (name, used)
        for name, used in paused
        if used > limit and name != "a thread updating while the cell ends"
    ]
    assert not over, f"memory left on the card while {mode}d (context {context} bytes): {over}"
