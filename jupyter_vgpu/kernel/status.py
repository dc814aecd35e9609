"""``%vgpu status``: the user's slice and this kernel's use of it, as a readable table."""

from __future__ import annotations

import time

from jupyter_vgpu.units import format_bytes

from .hook import KernelHook
from .usage import tensor_bytes


def _rows(hook: KernelHook) -> list[tuple[str, str]]:
    s = hook.slice
    rows: list[tuple[str, str]] = []
    if s is None:
        rows.append(("slice", "none: this server has no vGPU slice (not started by a jupyter-vgpu hub)"))
        if hook.slice_error:
            rows.append(("error", hook.slice_error))
    else:
        kind = "simulated (no NVIDIA GPU behind it)" if s.simulated else "real"
        if not s.more_gpus:
            of = f"{s.memory_fraction:.1%} of {format_bytes(s.gpu_memory)}"
            rows += [
                ("GPU", f"{s.gpu_name}, index {s.gpu_index} ({kind})"),
                ("GPU UUID", s.gpu_uuid),
                ("budget", f"{format_bytes(s.memory_limit)} ({of})"),
            ]
        else:  # a slice of several cards: a row per card, as the kernel numbers them
            rows.append(("GPUs", f"{len(s.gpu_uuids)} cards of {s.gpu_name} ({kind}), the budget on each"))
            for device, (uuid, index, fraction) in enumerate(
                zip(s.gpu_uuids, s.gpu_indices, s.memory_fractions(), strict=True)
            ):
                rows.append(
                    (
                        f"cuda:{device}",
                        f"index {index}, {uuid}: budget {format_bytes(s.memory_limit)} "
                        f"({fraction:.1%} of {format_bytes(s.card_memory(uuid))})",
                    )
                )
        rows += [
            ("budget request", f"{format_bytes(s.memory_request)} guaranteed, priority {s.priority}"),
            ("compute share", _share(s)),
            ("isolation", s.isolation),
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
    if hook.simulated:  # counted now: the figure kept for reports is from the last cell's end
        held = tensor_bytes(hook.shell.user_ns)
        rows.append(("used (tensors)", f"{format_bytes(held)} held by tensors in the namespace"))
    rows += _pause_rows(hook.pausing.stats())
    rows += _tier_rows(hook)
    if hook.pausing.last_notice:
        rows.append(("node arbiter", hook.pausing.last_notice))
    last = hook.last_prefetch
    if last is not None:
        ago = time.time() - last["asked_at"]
        text = f"{last['outcome']}, asked {ago:.0f} s ago (the notebook opened, focused or edited)"
        if last.get("message"):
            text += f": {last['message']}"
        rows.append(("last prefetch", text))
    return rows


_TIERS = {
    "gpu": "GPU (resident)",
    "host": "host memory (paused, compressed)",
    "disk": "disk (paused, moved to the node's disk tier)",
    "suspended": "suspended (the driver's process checkpoint)",
}


def _tier_rows(hook: KernelHook) -> list[tuple[str, str]]:
    """Where this kernel's memory is, and the node's host memory and disk tier."""
    from .hook import tier_of

    pause = hook.pausing.stats()
    rows = [("tier", _TIERS[tier_of(pause)])]
    if pause.get("disk_bytes"):
        rows.append(("on disk", f"{format_bytes(pause['disk_bytes'])} in the node's disk tier"))
    client = hook.arbiter
    if client is None:
        return rows
    if client.unavailable():
        rows.append(("node arbiter", client.unavailable()))
    node = client.node
    if node:
        rows.append(
            (
                "node memory",
                f"{format_bytes(node['host_used'])} of {format_bytes(node['host_limit'])} host memory "
                f"held for kernels' GPU memory (paused, or kept warm for a next pause); "
                f"{format_bytes(node['disk_used'])} in the disk tier",
            )
        )
    return rows


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f} s" if value >= 1 else f"{value * 1e3:.0f} ms"


def _share(s) -> str:
    """The share and what it means: ``30%, not enforced (time-sliced)``; the backend's
    own wording when it names the share already (``50% under MPS, not enforced (...)``, a MIG
    instance)."""
    text = s.compute_share_text
    return text if text[:1].isdigit() or s.isolation == "mig" else f"{s.compute_share}%, {text}"


def _held_once(shared: dict | None) -> str | None:
    """The row on paused pieces held once across the node's kernels, from
    :meth:`.pause.sharing.PieceSharing.figures` (None: sharing is not used here, or
    nothing was offered and nothing refused)."""
    if not shared or not (shared.get("offered") or shared.get("refused")):
        return None
    text = (
        f"{format_bytes(shared['mapped_bytes'])} of its paused data read from the node's copies now; "
        f"since it started, {shared['offered']} pieces offered: {format_bytes(shared['shared_bytes'])} "
        f"found identical to another kernel's (the node compared every byte), "
        f"{format_bytes(shared['kept_bytes'])} kept by the node for others"
    )
    if shared.get("refused"):
        text += f"; the last offer was refused: {shared['refused']}"
    return text


def _pause_rows(st: dict) -> list[tuple[str, str]]:
    rows = [("state", st["state"])]
    if st.get("stand_in") and st.get("codec_name"):
        rows.append(("pause", "host backend: no GPU; what the pausable allocator holds in host memory moves"))
    elif st.get("stand_in"):
        rows.append(("pause", "stand-in: the GPU is simulated, so a pause moves no memory"))
    elif st.get("unavailable"):
        rows.append(("pause", f"unavailable: {st['unavailable']}"))
    elif st.get("codec_name"):
        rows.append(("pause codec", st["codec_name"]))
    if st.get("pausable") is True:
        rows.append(("pausable", "yes: all of its GPU memory can be paused to host memory while it is idle"))
    elif st.get("pausable") is False:
        rows.append(("pausable", f"no: {st['not_pausable']}"))
    if st.get("between_cells"):
        rows.append(
            (
                "between cells",
                f"{st['between_cells']} may run while the kernel is idle: its GPU calls wait while "
                "the kernel is away and bring it back",
            )
        )
    if st.get("refused") and st.get("refused") != st.get("not_pausable"):
        rows.append(("not paused", st["refused"]))
    if st.get("error"):
        rows.append(("pause failed", st["error"]))
    if st.get("paused_bytes"):
        ratio = f"{st['ratio']:.2f}×" if st.get("ratio") else "—"
        rows.append(
            (
                "paused",
                f"{format_bytes(st['paused_bytes'])} of GPU memory released; "
                f"{format_bytes(st.get('host_bytes'))} in host memory (ratio {ratio})",
            )
        )
    if st.get("unpausable_bytes"):
        rows.append(("stays on the GPU", f"{format_bytes(st['unpausable_bytes'])} a pause cannot release"))
    held_once = _held_once(st.get("shared"))
    if held_once:
        rows.append(("held once", held_once))
    if st.get("last_pause_seconds") is not None or st.get("last_resume_seconds") is not None:
        rows.append(
            (
                "last pause",
                f"{_seconds(st.get('last_pause_seconds'))}, resume {_seconds(st.get('last_resume_seconds'))}",
            )
        )
    if st.get("last_suspend_seconds") is not None:
        restore = _seconds(st.get("last_restore_seconds"))
        rows.append(("last suspend", f"{_seconds(st.get('last_suspend_seconds'))}, restore {restore}"))
    if st.get("private_bytes") is not None:
        text = f"{format_bytes(st['private_bytes'])} of host memory this process alone holds"
        trim = st.get("last_trim") or {}
        if trim.get("private_before") is not None and trim.get("private_after") is not None:
            given = max(trim["private_before"] - trim["private_after"], 0)
            text += f"; {format_bytes(given)} given back when last paused"
            if trim.get("slabs"):
                text += f", and {format_bytes(trim['slabs'])} of pinned memory"
        rows.append(("own memory", text))
    return rows


def format_status(hook: KernelHook) -> str:
    """The status table as plain text, one ``label  value`` row per line."""
    rows = _rows(hook)
    width = max(len(label) for label, _ in rows)
    lines = ["jupyter-vgpu slice status"]
    lines += [f"  {label:<{width}}  {value}" for label, value in rows]
    return "\n".join(lines)
