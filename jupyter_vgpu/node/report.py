"""The node arbiter's report to the Hub, on Kubernetes and Slurm: this node's GPUs and
which pods (or Slurm jobs, as ``job:<id>``) use them (the contract ``node-report``).

Every ``report_seconds`` the arbiter POSTs it to
``{JUPYTERHUB_API_URL}/vgpu/nodes/{node}`` with its token (which needs the scope
``custom:vgpu-nodes:write``). The Hub builds its inventory from these reports, and a
slice whose GPU it does not know yet takes the one the report names for its pod.
Pods are found through NVML's processes (host PIDs: the arbiter runs with the host's
PID namespace) and the cgroup each process is in (:mod:`.namespaces`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable

from jupyter_vgpu import contracts

from . import namespaces

log = logging.getLogger("jupyter_vgpu.node")


#: The fields of a device row of :func:`read_devices`, NVML's but ``used``.
_ROW = ("uuid", "index", "name", "memory", "mig_profile", "compute_percent")


def read_devices() -> tuple[list[dict], dict[str, dict[int, int]], list[str]]:
    """This node's devices from NVML: ``(devices, processes, problems)``.

    Returns:
        devices: ``{"uuid", "index", "name", "memory", "used", "mig_profile",
        "compute_percent"}`` each, bytes (a GPU in MIG mode contributes its instances);
        processes: bytes per host PID, per device UUID; problems: what failed (NVML
        missing: one problem, no device).
    """
    from jupyter_vgpu import nvml

    devices: list[dict] = []
    processes: dict[str, dict[int, int]] = {}
    problems: list[str] = []
    try:
        gpus, failing = nvml.survey()
    except nvml.NVMLUnavailable as e:
        return [], {}, [f"NVML failed on this node: {e}"]
    problems += [f"GPU {index} takes no slice: {why}" for index, why in failing.items()]
    for g in gpus:
        rows = []
        if g.mig_enabled:
            try:
                rows = [
                    (m.uuid, m.parent_index, m.name, m.memory_total, m.profile, m.compute_percent)
                    for m in nvml.mig_devices(g.index)
                ]
            except nvml.NVMLUnavailable as e:
                problems.append(f"GPU {g.index}: cannot list its MIG instances: {e}")
        else:
            rows = [(g.uuid, g.index, g.name, g.memory_total, None, None)]
        for values in rows:
            row = dict(zip(_ROW, values, strict=True))
            try:
                row["used"] = nvml.device_usage(row["uuid"])[0]
                processes[row["uuid"]] = nvml.process_memory(row["uuid"])
            except nvml.NVMLUnavailable as e:
                row["used"] = None
                problems.append(f"{row['uuid']}: {e}")
            devices.append(row)
    return devices, processes, problems


def build(
    node: str,
    devices: list[dict],
    processes: dict[str, dict[int, int]],
    kernel_pids: Iterable[int],
    *,
    watermark: float,
    problems: Iterable[str] = (),
    pod_of: Callable[[int], str | None] = namespaces.pod_uid,
) -> dict:
    """The report document (contract ``node-report``, checked here).

    Args:
        node: this node's name.
        devices: from :func:`read_devices`.
        processes: bytes per host PID per device UUID, from :func:`read_devices`.
        kernel_pids: host PIDs of the kernels connected to the arbiter.
        watermark: a device above this fraction of its memory in use is under pressure.
        problems: what went wrong reading the devices.
        pod_of: a PID's pod uid (:func:`.namespaces.pod_uid`).

    Raises:
        jupyter_vgpu.contracts.ContractError: the document would break its contract
            (a bug here, never sent).
    """
    pods: dict[str, dict] = {}

    def pod(uid: str) -> dict:
        return pods.setdefault(uid, {"uid": uid, "gpus": [], "kernels": 0})

    for uuid, by_pid in processes.items():
        for pid in sorted(by_pid):
            uid = pod_of(pid)
            if uid and uuid not in pod(uid)["gpus"]:
                pod(uid)["gpus"].append(uuid)
    for pid in kernel_pids:
        uid = pod_of(pid)
        if uid:
            pod(uid)["kernels"] += 1
    gpus = [
        {
            **d,
            "pressure": bool(d["used"] is not None and d["memory"] and d["used"] > watermark * d["memory"]),
        }
        for d in devices
    ]
    document = {
        "version": contracts.version("node-report"),
        "node": node,
        "gpus": gpus,
        "pods": sorted(pods.values(), key=lambda p: p["uid"]),
        "problems": [p[:1000] for p in problems][:64],
    }
    contracts.validate("node-report", document)
    return document


class NodeReporter:
    """POSTs this node's report to the Hub.

    Args:
        arbiter: the :class:`~.arbiter.Arbiter` (its connected kernels).
        node: this node's name.
        api_url: ``JUPYTERHUB_API_URL``.
        token: the arbiter's Hub API token.
        watermark: the arbiter's watermark (pressure).
    """

    def __init__(self, arbiter, node: str, api_url: str, token: str, watermark: float):
        self.arbiter = arbiter
        self.node = node
        self.url = f"{api_url.rstrip('/')}/vgpu/nodes/{node}"
        self.token = token
        self.watermark = watermark
        self._warned = False

    def document(self) -> dict:
        devices, processes, problems = read_devices()
        return build(
            self.node,
            devices,
            processes,
            [k.pid for k in self.arbiter.kernels],
            watermark=self.watermark,
            problems=problems,
            pod_of=self.owner,
        )

    def owner(self, pid: int) -> str | None:
        """What the report files process ``pid`` under: its pod's uid, or ``"job:<id>"`` of
        its Slurm job (:mod:`.slurm`); None for neither."""
        pod = self.arbiter.pod_of(pid)
        if pod:
            return pod
        job = self.arbiter.job_of(pid)
        return f"job:{job}" if job else None

    async def send(self) -> bool:
        """Send one report; False (logged once until it works again) when it failed."""
        from tornado.httpclient import AsyncHTTPClient, HTTPClientError

        body = await asyncio.get_running_loop().run_in_executor(None, self.document)
        try:
            await AsyncHTTPClient().fetch(
                self.url,
                method="POST",
                body=json.dumps(body),
                headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
                request_timeout=10,
            )
        except (HTTPClientError, OSError) as e:
            if not self._warned:
                log.warning("cannot report node %s to the Hub at %s: %s", self.node, self.url, e)
                self._warned = True
            return False
        self._warned = False
        return True
