"""``%vgpu status``: the user's slice and this kernel's use of it, as a readable table."""

from __future__ import annotations

from jupyter_vgpu.units import format_bytes

from .hook import KernelHook


def _rows(hook: KernelHook) -> list[tuple[str, str]]:
    s = hook.slice
    rows: list[tuple[str, str]] = []
    if s is None:
        rows.append(("slice", "none: this server has no vGPU slice (not started by a jupyter-vgpu hub)"))
        if hook.slice_error:
            rows.append(("error", hook.slice_error))
    else:
        kind = "simulated (no NVIDIA GPU behind it)" if s.simulated else "real"
        rows += [
            ("GPU", f"{s.gpu_name}, index {s.gpu_index} ({kind})"),
            ("GPU UUID", s.gpu_uuid),
            (
                "budget",
                f"{format_bytes(s.memory_limit)} ({s.memory_fraction:.1%} of {format_bytes(s.gpu_memory)})",
            ),
            ("compute share", f"{s.compute_share}%"),
            ("placement", f"{s.placement}, overcommit ratio {s.overcommit_ratio:g}"),
        ]
    torch = hook.torch
    if torch is None:
        rows.append(("PyTorch", "not imported yet (the budget applies on `import torch`)"))
    elif not hook.cuda:
        rows.append(("PyTorch", "CUDA is not available: this kernel computes on the CPU"))
    else:
        rows.append(("PyTorch", hook.budget.status))
    allocated, reserved = hook.torch_memory()
    rows.append(("used (PyTorch)", f"{format_bytes(allocated)} allocated, {format_bytes(reserved)} reserved"))
    nvml = hook.nvml_memory()
    if nvml is not None:
        rows.append(("used (NVML)", f"{format_bytes(nvml)} for this process"))
    if hook.simulated:
        rows.append(
            ("used (tensors)", f"{format_bytes(hook.simulated_used)} held by tensors in the namespace")
        )
    if hook.engine is not None:
        st = hook.engine.stats()
        if st.get("count"):
            ratio = f"{st['ratio']:.2f}×" if st.get("ratio") else "—"
            rows.append(
                (
                    "offloaded",
                    f"{st['count']} storages, {format_bytes(st['offloaded_bytes'])} "
                    f"→ {format_bytes(st['compressed_bytes'])} on the host (ratio {ratio})",
                )
            )
        else:
            rows.append(("offloaded", "nothing"))
        if st.get("last_offload_seconds") is not None:
            rows.append(("last offload", f"{st['last_offload_seconds'] * 1e3:.1f} ms"))
        if st.get("last_restore_seconds") is not None:
            rows.append(("last restore", f"{st['last_restore_seconds'] * 1e3:.1f} ms"))
    return rows


def format_status(hook: KernelHook) -> str:
    """The status table as plain text, one ``label  value`` row per line."""
    rows = _rows(hook)
    width = max(len(label) for label, _ in rows)
    lines = ["jupyter-vgpu slice status"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
