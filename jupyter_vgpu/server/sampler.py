"""Usage sampling: the kernels' own reports, joined with NVML's per-process figures.

One sample at most every ``VGPUServer.sample_seconds``; NVML calls run in a thread so
the server's event loop never waits on the driver. The document is the contract
``usage`` (``jupyter_vgpu/contracts/usage.schema.json``): the payload of
``/api/vgpu/usage``, of the usage stream and of the reports to the Hub. Each kernel's
report is checked against the contract ``kernel-report`` before any figure of it is
used; a kernel whose report breaks it is listed as not reported, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from jupyter_vgpu import channel, contracts

from .config import VGPUServer
from .state import ServerState

log = logging.getLogger("jupyter_vgpu")


def _nvml_sample(gpu_uuid: str) -> dict[str, Any]:
    from jupyter_vgpu import nvml

    used, total, _ = nvml.device_usage(gpu_uuid)
    sm = nvml.utilization(gpu_uuid)
    return {
        "memory_used": used,
        "memory_total": total,
        "sm_percent": sm.device,
        "processes": nvml.process_memory(gpu_uuid),
        "process_sm": sm.processes,
    }


def _nvml_samples(gpu_uuids) -> list[dict[str, Any]]:
    return [_nvml_sample(uuid) for uuid in gpu_uuids]


def merge_cards(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """One card's figures for the per-kernel columns, from each card of a slice
    (``samples``, the first card first, as :func:`_nvml_sample` makes them): the
    processes' bytes summed over the cards (a kernel of several cards holds memory on
    each), their SM percent the highest on any card, the card figures the first card's."""
    processes: dict[int, int] = {}
    process_sm: dict[int, float] = {}
    for sample in samples:
        for pid, nbytes in sample["processes"].items():
            processes[pid] = processes.get(pid, 0) + nbytes
        for pid, sm in sample["process_sm"].items():
            process_sm[pid] = max(sm, process_sm.get(pid, 0))
    return {**samples[0], "processes": processes, "process_sm": process_sm}


def read_kernel_report(directory, kernel_id: str) -> tuple[dict[str, Any] | None, str | None]:
    """``(report, None)`` for a kernel's valid report (contract ``kernel-report``),
    ``(None, None)`` when it has written none yet, ``(None, why)`` when it breaks the
    contract. Never raises for what a kernel wrote."""
    path = channel.kernel_path(directory, kernel_id)
    report = channel.read_json(path)
    if report is None:
        return None, None if not path.exists() else "the report is not a JSON object"
    try:
        contracts.validate("kernel-report", report)
    except contracts.ContractError as e:
        log.debug("jupyter-vgpu: kernel %s: report refused: %s", kernel_id, e)
        return None, f"report refused: {e}"
    return report, None


class Sampler:
    """Builds usage documents for one server.

    Args:
        serverapp: the running ``ServerApp`` (its kernel and session managers).
        state: the server's slice state (its pressure flag is set from NVML here).
        config: the extension's settings.
    """

    def __init__(self, serverapp, state: ServerState, config: VGPUServer):
        self.serverapp = serverapp
        self.state = state
        self.config = config
        self.latest: dict[str, Any] | None = None
        self._revision = -1
        self._lock = asyncio.Lock()

    async def current(self) -> dict[str, Any]:
        """The latest sample, taken now if the last is older than ``sample_seconds`` or
        the slice or pressure flag changed since."""
        async with self._lock:
            if (
                self.latest is None
                or self._revision != self.state.revision
                or time.time() - self.latest["timestamp"] >= self.config.sample_seconds
            ):
                self.latest = await self.sample()
                self._revision = self.state.revision  # after: the sample may set the pressure flag
            return self.latest

    async def _names(self) -> dict[str, str]:
        try:
            sessions = await self.serverapp.session_manager.list_sessions()
        except Exception:
            return {}
        return {s["kernel"]["id"]: s.get("path") or s.get("name") or "" for s in sessions if s.get("kernel")}

    def _kernel_row(self, kid, kernel, names, report, error, nv, now) -> dict[str, Any]:
        """One kernel's entry of the usage document (``kernels[]`` of the contract)."""
        report = report or {}
        pid = report.get("pid")
        nvml_memory = nv["processes"].get(pid) if nv is not None and pid else None
        pause = report.get("pause") or {}
        reserved = report.get("torch_reserved", 0)
        simulated_used = report.get("simulated_used", 0)
        if nvml_memory is not None:
            used = nvml_memory
        elif report.get("cuda_available") and not report.get("simulated"):
            used = reserved
        else:
            used = simulated_used
        sm = nv["process_sm"].get(pid) if nv is not None and pid else None
        return {
            "id": kid,
            "name": names.get(kid) or getattr(kernel, "kernel_name", "") or kid,
            "pid": pid,
            "execution_state": getattr(kernel, "execution_state", "unknown"),
            "used": used,
            "torch_allocated": report.get("torch_allocated", 0),
            "torch_reserved": reserved,
            "nvml_memory": nvml_memory,
            "simulated_used": simulated_used,
            "sm_percent": None if sm is None else min(100.0, max(0.0, float(sm))),
            "offloaded": pause.get("live_bytes", 0),
            "offloaded_compressed": pause.get("host_bytes", 0),
            "ratio": pause.get("ratio"),
            "budget_status": report.get("budget_status"),
            "reported": bool(report),
            "stale": bool(report) and now - report["updated"] > self.config.stale_seconds,
            "updated": report.get("updated"),
            "report_error": error,
            "state": report.get("state"),
            "host_bytes": pause.get("host_bytes"),
            "tier": report.get("tier"),
            "disk_bytes": pause.get("disk_bytes"),
            "last_pause_seconds": pause.get("last_pause_seconds"),
            "last_resume_seconds": pause.get("last_resume_seconds"),
            "codec": pause.get("codec"),
            "pausable": pause.get("pausable"),
            "not_pausable": pause.get("not_pausable"),
            "unpausable_bytes": pause.get("unpausable_bytes"),
            "between_cells": pause.get("between_cells"),
        }

    async def sample(self) -> dict[str, Any]:
        """Take one sample (see the module docstring for where each figure comes from)."""
        s = self.state.slice
        samples: list[dict[str, Any]] = []  # NVML's, a card each (the slice's first card first)
        if s is not None and not s.simulated:
            try:
                samples = await asyncio.get_running_loop().run_in_executor(None, _nvml_samples, s.gpu_uuids)
            except Exception as e:
                log.debug("jupyter-vgpu: NVML sample failed: %s", e)
        nv = merge_cards(samples) if samples else None
        if samples:
            fraction = self.config.pressure_fraction
            self.state.update(pressure=any(c["memory_used"] > fraction * c["memory_total"] for c in samples))
        km = self.serverapp.kernel_manager
        names = await self._names()
        kernels = []
        node, heard = None, 0.0  # the node's tiers, from the kernel that heard of them last
        now = time.time()
        for kid in list(km.list_kernel_ids()):
            try:
                kernel = km.get_kernel(kid)
            except KeyError:
                continue
            report, error = read_kernel_report(self.state.directory, kid)
            kernels.append(self._kernel_row(kid, kernel, names, report, error, nv, now))
            if report and report.get("node") and report["updated"] > heard:
                node, heard = report["node"], report["updated"]
        totals = {
            key: sum(k[field] for k in kernels)
            for key, field in (
                ("used", "used"),
                ("reserved", "torch_reserved"),
                ("offloaded", "offloaded"),
                ("offloaded_compressed", "offloaded_compressed"),
            )
        }
        cards = []
        if s is not None:
            for i, (uuid, index) in enumerate(zip(s.gpu_uuids, s.gpu_indices, strict=True)):
                c = samples[i] if samples else None
                cards.append(
                    {
                        "index": index,
                        "uuid": uuid,
                        "name": s.gpu_name,
                        "memory_total": c["memory_total"] if c else s.card_memory(uuid),
                        "memory_used": c["memory_used"] if c else None,
                        "sm_percent": c["sm_percent"] if c else None,
                    }
                )
        return {
            "version": contracts.version("usage"),
            "slice": s.to_dict() if s else None,
            "simulated": s is None or s.simulated,
            "pressure": self.state.pressure,
            "timestamp": now,
            "gpu": cards[0] if cards else None,
            "more_gpus": cards[1:],
            "totals": totals,
            "kernels": kernels,
            "node": node,
        }
