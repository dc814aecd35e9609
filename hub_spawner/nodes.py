"""The GPU nodes of a Kubernetes cluster as the Hub knows them: from the node arbiters'
reports, else from the nodes' allocatable resources.

Each node arbiter (the DaemonSet, :mod:`jupyter_vgpu.node.report`) POSTs a report to
``/hub/api/vgpu/nodes/{node}`` every few seconds: its GPUs and MIG instances as NVML
lists them, memory in use, pressure, and which pods' processes use which GPU (the
contract ``node-report``). The Hub keeps the latest per node, in memory, as it keeps
usage reports: it never asks NVML on its own host. A node whose arbiter has not
reported is known from its Node object instead (:func:`devices_from_node`): the count
of ``nvidia.com/gpu`` or ``nvidia.com/mig-*`` in ``status.allocatable``, named and sized
by GPU Feature Discovery's labels.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

from jupyter_vgpu import contracts

from .inventory import GPU, MIG_PROFILE

#: A report older than this is stale, seconds (the arbiter reports every 10 s).
STALE_SECONDS = 60.0
#: The largest report the Hub reads, bytes of JSON.
MAX_REPORT_BYTES = 1 * 2**20
#: GPU Feature Discovery's labels (NVIDIA GPU Operator): product name, memory in MiB.
GFD_PRODUCT, GFD_MEMORY = "nvidia.com/gpu.product", "nvidia.com/gpu.memory"


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """The latest report of one node arbiter.

    Attributes:
        received: unix seconds when the Hub got it.
        devices: the node's GPUs and MIG instances (``GPU.node`` set).
        pods: GPU UUIDs per pod uid, as the arbiter saw the pod's processes on them.
        pressure: UUIDs of the cards above the arbiter's watermark.
        problems: what the arbiter could not do (NVML failed, ...).
    """

    received: float
    devices: tuple[GPU, ...]
    pods: dict[str, tuple[str, ...]]
    pressure: frozenset[str]
    problems: tuple[str, ...]


def parse_report(node: str, body: Any) -> NodeReport:
    """A :class:`NodeReport` from an arbiter's POST body (the contract ``node-report``).

    Raises:
        jupyter_vgpu.contracts.ContractError: the body breaks the contract, or names
            another node than the URL does.
    """
    contracts.validate("node-report", body)
    if body["node"] != node:
        raise contracts.ContractError("node-report", "node", f"must be the node in the URL, {node!r}")
    devices = tuple(
        GPU(
            index=g["index"],
            uuid=g["uuid"],
            name=g["name"],
            memory=g["memory"],
            simulated=False,
            isolation="mig" if g["mig_profile"] else "time-slicing",
            mig_profile=g["mig_profile"],
            compute_percent=g["compute_percent"],
            node=node,
        )
        for g in body["gpus"]
    )
    pods = {p["uid"]: tuple(p["gpus"]) for p in body["pods"]}
    pressure = frozenset(g["uuid"] for g in body["gpus"] if g["pressure"])
    return NodeReport(time.time(), devices, pods, pressure, tuple(body["problems"]))


def devices_from_node(node: dict) -> list[GPU]:
    """The GPUs a Node object advertises, for a node whose arbiter has not reported.

    Args:
        node: the Node as the API returns it (camelCase JSON).

    Returns:
        one device per ``nvidia.com/gpu`` and per ``nvidia.com/mig-<profile>`` in
        ``status.allocatable``, in that order, with UUIDs ``<node>/gpu-<i>`` and
        ``<node>/mig-<profile>-<i>`` (no NVML UUID is known), the product name and
        memory from GPU Feature Discovery's labels (``nvidia.com/gpu.product``,
        ``nvidia.com/gpu.memory`` in MiB; 0 bytes when absent) and MIG memory from the
        profile name. HAMi's shared ``nvidia.com/gpu`` count (cards × splits) is not a
        card count; a HAMi node is known from its arbiter's report.
    """
    name = (node.get("metadata") or {}).get("name") or "node"
    labels = (node.get("metadata") or {}).get("labels") or {}
    allocatable = (node.get("status") or {}).get("allocatable") or {}
    product = labels.get(GFD_PRODUCT, "NVIDIA GPU").replace("-", " ")
    memory_mib = labels.get(GFD_MEMORY, "0")
    memory = int(memory_mib) * 2**20 if memory_mib.isdigit() else 0
    devices = []
    for i in range(_count(allocatable.get("nvidia.com/gpu"))):
        devices.append(GPU(i, f"{name}/gpu-{i}", product, memory, simulated=False, node=name))
    for resource, quantity in sorted(allocatable.items()):
        profile = resource[len("nvidia.com/mig-") :] if resource.startswith("nvidia.com/mig-") else None
        m = MIG_PROFILE.fullmatch(profile or "")
        if not m:
            continue
        for i in range(_count(quantity)):
            devices.append(
                GPU(
                    0,
                    f"{name}/mig-{profile}-{i}",
                    f"{product} MIG {profile}",
                    int(m[2]) * 2**30,
                    simulated=False,
                    isolation="mig",
                    mig_profile=profile,
                    compute_percent=round(100 * int(m[1]) / 7),
                    node=name,
                )
            )
    return devices


def _count(quantity) -> int:
    text = str(quantity or "0")
    return int(text) if text.isdigit() else 0


class NodeBoard:
    """The latest report of every node arbiter, and devices from Node objects where no
    arbiter reported. Thread-safe."""

    def __init__(self):
        self._reports: dict[str, NodeReport] = {}
        self._fallback: dict[str, list[GPU]] = {}
        self._lock = threading.Lock()

    def record(self, node: str, report: NodeReport) -> None:
        with self._lock:
            self._reports[node] = report

    def record_node(self, node: dict) -> None:
        """Remember what a Node object advertises (:func:`devices_from_node`)."""
        devices = devices_from_node(node)
        with self._lock:
            self._fallback[devices[0].node if devices else (node.get("metadata") or {}).get("name", "")] = (
                devices
            )

    def report(self, node: str) -> NodeReport | None:
        with self._lock:
            return self._reports.get(node)

    def nodes(self, now: float | None = None) -> dict[str, dict]:
        """Every node: ``{"source": "arbiter" | "allocatable", "age": seconds | None,
        "stale": bool, "devices": [...], "pressure": [...], "problems": [...]}``."""
        now = time.time() if now is None else now
        with self._lock:
            reports, fallback = dict(self._reports), dict(self._fallback)
        out = {}
        for node, devices in fallback.items():
            out[node] = {"source": "allocatable", "age": None, "stale": False, "pressure": [], "problems": []}
            out[node]["devices"] = [dataclasses.asdict(d) for d in devices]
        for node, r in reports.items():
            age = max(0.0, now - r.received)
            out[node] = {
                "source": "arbiter",
                "age": age,
                "stale": age > STALE_SECONDS,
                "devices": [dataclasses.asdict(d) for d in r.devices],
                "pressure": sorted(r.pressure),
                "problems": list(r.problems),
            }
        return dict(sorted(out.items()))

    def devices(self) -> list[GPU]:
        """Every node's devices: the arbiter's report, else the Node object's."""
        with self._lock:
            merged = {**self._fallback, **{n: list(r.devices) for n, r in self._reports.items()}}
        return [d for node in sorted(merged) for d in merged[node]]

    def device_of(self, node: str, pod_uid: str, current: str, mig_profile: str | None = None) -> GPU | None:
        """The device a pod of one device uses, as far as the board knows
        (:meth:`devices_of` with a count of 1).

        Args:
            node: the pod's node.
            pod_uid: the pod's uid.
            current: the slice's ``gpu_uuid`` now (a UUID HAMi named, or ``"pending"``).
            mig_profile: the slice's MIG profile (its device is an instance of it), or
                None (its device is a whole GPU).

        Returns:
            the device the node's arbiter saw the pod's processes on; else the device
            ``current`` names on that node; else the node's only device of the slice's
            kind, while ``current`` names none; else None.
        """
        found = self.devices_of(node, pod_uid, (current,), 1, mig_profile)
        return found[0] if found else None

    def devices_of(
        self, node: str, pod_uid: str, current: Sequence[str], count: int, mig_profile: str | None = None
    ) -> list[GPU] | None:
        """The ``count`` devices a pod uses, as far as the board knows, or None while it
        knows fewer.

        Args:
            node: the pod's node.
            pod_uid: the pod's uid.
            current: the slice's card UUIDs now (UUIDs HAMi named, or placeholders
                starting ``"pending"``).
            count: the slice's cards, from 1.
            mig_profile: the slice's MIG profile (its device is an instance of it), or
                None (whole GPUs).

        Returns:
            the devices the node's arbiter saw the pod's processes on, then those
            ``current`` names on that node, the first ``count`` of them in index order;
            else, while ``current`` names no device, the node's devices of the slice's
            kind if it has exactly ``count``; else None (a pod of several cards whose
            processes have not yet used each of them, on a node with more).
        """
        with self._lock:
            report = self._reports.get(node)
            devices = list(report.devices) if report else list(self._fallback.get(node, []))
        by_uuid = {d.uuid: d for d in devices}
        named = [*(report.pods.get(pod_uid, ()) if report is not None else ()), *current]
        found = list(dict.fromkeys(by_uuid[u] for u in named if u in by_uuid))
        if len(found) >= count:
            return sorted(found[:count], key=lambda d: d.index)
        kind = [d for d in devices if d.mig_profile == mig_profile]
        if len(kind) == count and not any(u.startswith(("GPU-", "MIG-")) for u in current):
            return sorted(kind, key=lambda d: d.index)
        return None
