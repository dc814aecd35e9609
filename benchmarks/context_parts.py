"""What a paused kernel's CUDA context keeps on its card, part by part.

A paused kernel gives back every allocation (``jupyter_vgpu.kernel.pause``); what stays
is its CUDA context: the driver's own state, the code of the modules loaded so far, and
the local memory reserved for every thread the card can hold (per-thread stack times
threads per SM times SMs, grown to the most any launched kernel needed and kept,
CUDA Driver API, ``cuCtxSetLimit`` and ``CU_CTX_LMEM_RESIZE_TO_MAX``). At 12x on an
H100 (48 MLP sessions) those contexts, 0.73 GiB each, are 44% of the card
(``benchmarks/results/sessions-h100.json``, ``context_bytes``).

This runs the MLP sessions' steps (``benchmarks/sessions.py``'s defaults: width 4096, 2
blocks, batch 61,440 rows, bf16, AdamW) in one process, gives every allocation back
(``torch.cuda.empty_cache``: what a pause frees), then reads the card's used memory
(``cuMemGetInfo``, bytes; the only process on its card) after each of:

- ``cublas``: PyTorch's cuBLAS workspaces cleared;
- ``local_given_back``: the per-thread stack limit (``CU_LIMIT_STACK_SIZE``) set to the
  smallest the driver takes, by the pause's own code
  (``jupyter_vgpu.kernel.pause.local_memory``, ``VGPUKernel.give_back_local_memory``):
  the local memory a pause gives back beside the allocations, as the card shows it and
  as the engine counts it;
- ``local_taken_back``: the limit set back, as a resume does before any code runs (how
  long the call takes, what the card holds again);
- ``again``: five more steps (timed), then every allocation given back once more: does
  the local memory grow past ``local_taken_back``'s?

Writes ``--out`` (JSON: bytes, seconds; the limits before and after).

    python3 benchmarks/context_parts.py --out benchmarks/results/context-parts-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402 - benchmarks/provenance.py, beside this file

WIDTH, LAYERS, BATCH = 4096, 2, 61440


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch
    from cuda.bindings import driver as cu

    def check(result):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {err}")
        return rest[0] if len(rest) == 1 else rest

    def used() -> int:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free

    limits = {
        "stack_bytes": cu.CUlimit.CU_LIMIT_STACK_SIZE,
        "malloc_heap_bytes": cu.CUlimit.CU_LIMIT_MALLOC_HEAP_SIZE,
        "printf_fifo_bytes": cu.CUlimit.CU_LIMIT_PRINTF_FIFO_SIZE,
    }

    def read_limits() -> dict:
        return {k: int(check(cu.cuCtxGetLimit(v))) for k, v in limits.items()}

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    torch.cuda.empty_cache()
    before_any = used()  # a context and PyTorch's first kernel
    start_limits = read_limits()

    torch.manual_seed(0)
    blocks = []
    for _ in range(LAYERS):
        blocks += [torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.GELU(), torch.nn.Linear(4 * WIDTH, WIDTH)]
    model = torch.nn.Sequential(*blocks).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def steps(n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            x = torch.randn(BATCH, WIDTH, device="cuda", dtype=torch.bfloat16)
            model(x).float().square().mean().backward()
            opt.step()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t)
        return out

    first = steps(5)
    peak = torch.cuda.max_memory_reserved()
    # what a pause frees: every allocation (the model, the optimizer's state, the cache)
    params = [p.detach().cpu() for p in model.parameters()]
    state = {k: {n: t.cpu() if torch.is_tensor(t) else t for n, t in v.items()} for k, v in opt.state.items()}
    for p in model.parameters():
        p.data = torch.empty(0, device="cuda", dtype=p.dtype)
        p.grad = None
    opt.state.clear()
    torch.cuda.empty_cache()
    parts = {"context_after_steps": used(), "limits_after_steps": read_limits()}

    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    parts["after_cublas"] = used()

    # what a pause gives back too with VGPUKernel.give_back_local_memory, through the
    # kernel's own code (jupyter_vgpu.kernel.pause.local_memory), and what taking it
    # back before a resume costs
    from jupyter_vgpu.kernel.pause.local_memory import LocalMemory

    local = LocalMemory(torch.cuda.current_device())
    t = time.perf_counter()
    given = local.give_back()
    parts["local_given_back"] = {
        "counted_bytes": given,  # the limit's fall times the threads the card holds
        "stack_bytes": read_limits()["stack_bytes"],
        "used": used(),
        "call_s": time.perf_counter() - t,
    }
    t = time.perf_counter()
    local.take_back()
    parts["local_taken_back"] = {
        "stack_bytes": read_limits()["stack_bytes"],
        "used": used(),
        "call_s": time.perf_counter() - t,
    }

    # back as before, and the steps again: the local memory grows back as kernels need it
    for p, saved in zip(model.parameters(), params, strict=True):
        p.data = saved.to("cuda")
    for k, v in state.items():
        opt.state[k] = {n: t.to("cuda") if torch.is_tensor(t) else t for n, t in v.items()}
    again = steps(5)
    for p in model.parameters():
        p.data = torch.empty(0, device="cuda", dtype=p.dtype)
        p.grad = None
    opt.state.clear()
    torch.cuda.empty_cache()
    parts["context_after_again"] = used()
    parts["limits_after_again"] = read_limits()

    props = torch.cuda.get_device_properties(0)
    row = provenance.record()
    row.update(
        {
            "what": "a CUDA context's bytes on its card after the MLP sessions' steps, "
            "every allocation given back, part by part (bytes: the card's used memory, "
            "cuMemGetInfo, the only process on it)",
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy, the default)"),
            "torch": torch.__version__,
            "width": WIDTH,
            "layers": LAYERS,
            "batch": BATCH,
            "context_before_steps": before_any,
            "limits_at_start": start_limits,
            "steps_peak_reserved": peak,
            "steps_s": first,
            "steps_again_s": again,
            **parts,
        }
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
