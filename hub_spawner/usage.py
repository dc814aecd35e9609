"""Usage as the single-user servers report it, joined with the slices the Hub placed.

Each server POSTs its ``/api/vgpu/usage`` document about every 10 seconds
(``jupyter_vgpu.server.hub_report``); the Hub keeps only the latest per server, in
memory (after a Hub restart the next reports refill it). The Hub never talks to GPUs:
everything here comes from those reports and from the allocator. One aggregation
(:func:`slice_rows`, :func:`gpu_rows`) serves the REST API, the admin page and the
Prometheus metrics.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterable
from typing import Any

from jupyter_vgpu import contracts
from jupyter_vgpu.slice import mig_profile

#: A report older than this is shown as stale, seconds (three missed reports).
STALE_SECONDS = 35.0


@dataclasses.dataclass(frozen=True)
class Report:
    """The latest usage of one server.

    Attributes:
        received: unix seconds when the Hub got it.
        totals: ``used``, ``reserved``, ``offloaded``, ``offloaded_compressed``, bytes.
        sm_percent: the GPU's SM utilisation, percent, or None (simulated, or unknown).
        kernels: number of kernels the server reported.
        simulated: the server measures a simulated GPU.
    """

    received: float
    totals: dict[str, int]
    sm_percent: float | None
    kernels: int
    simulated: bool


#: The largest usage report the Hub reads, bytes of JSON (a server with 1,000 kernels
#: sends about 1 MB).
MAX_REPORT_BYTES = 2 * 2**20


def parse_report(body: object) -> tuple[str, Report]:
    """``(server_name, Report)`` from a server's POST body, the contract ``usage-report``:
    ``{"server_name": str, "usage": <the server's usage document>}``.

    Every field is checked against the contract (types, ranges, sizes) before anything
    is kept, so no report can make a later aggregation or the metrics fail.

    Raises:
        jupyter_vgpu.contracts.ContractError: the body breaks the contract; the message
            names the field (``usage.totals.used: must be at most …``).
    """
    contracts.validate("usage-report", body)
    usage = body["usage"]
    fields = ("used", "reserved", "offloaded", "offloaded_compressed")
    report = Report(
        time.time(),
        {f: usage["totals"][f] for f in fields},
        usage["gpu"]["sm_percent"] if usage["gpu"] else None,
        len(usage["kernels"]),
        usage["simulated"],
    )
    return body["server_name"], report


class UsageBoard:
    """The latest report of every server, keyed ``"user/server name"``. Thread-safe."""

    def __init__(self):
        self._reports: dict[str, Report] = {}
        self._lock = threading.Lock()

    def record(self, key: str, report: Report) -> None:
        with self._lock:
            self._reports[key] = report

    def get(self, key: str) -> Report | None:
        with self._lock:
            return self._reports.get(key)

    def forget(self, key: str) -> None:
        with self._lock:
            self._reports.pop(key, None)


def slice_summary(user: str, spawner) -> dict[str, Any]:
    """The fields every listing of a running slice starts with: ``user``,
    ``server_name``, ``gpu_uuid``, ``gpu_index`` (its first card), ``gpu_uuids`` and
    ``gpu_indices`` (every card of the slice, the first first), ``gpu_name``,
    ``memory_limit`` and ``memory_request`` (bytes, on each card), ``compute_share``
    (percent), ``compute_share_text``
    (what the share means under the slice's backend: "not enforced (time-sliced)"
    under time-slicing), ``priority``, ``isolation``, ``mig_profile`` (or None),
    ``simulated``."""
    s = spawner.vgpu_slice
    return {
        "user": user,
        "server_name": spawner.name,
        "gpu_uuid": s.gpu_uuid,
        "gpu_index": s.gpu_index,
        "gpu_uuids": list(s.gpu_uuids),
        "gpu_indices": list(s.gpu_indices),
        "gpu_name": s.gpu_name,
        "memory_limit": s.memory_limit,
        "memory_request": s.memory_request,
        "compute_share": s.compute_share,
        "compute_share_text": s.compute_share_text,
        "priority": s.priority,
        "isolation": s.isolation,
        "mig_profile": mig_profile(s.gpu_name) if s.isolation == "mig" else None,
        "simulated": s.simulated,
    }


def slice_rows(
    spawners: Iterable[tuple[str, object]], board: UsageBoard, now: float | None = None
) -> list[dict]:
    """One row per running slice: the slice, and its latest reported usage.

    Args:
        spawners: ``(user name, spawner)`` for every spawner holding a slice.
        board: the reports.
        now: unix seconds (default: now), for report ages.

    Row fields: those of :func:`slice_summary`, then from the latest report (None
    before the first): ``used``, ``reserved``, ``offloaded``, ``offloaded_compressed``
    (bytes), ``ratio``, ``sm_percent``, ``kernels``, ``report_age`` (seconds), ``stale``.
    """
    now = time.time() if now is None else now
    rows = []
    for user, spawner in spawners:
        report = board.get(f"{user}/{spawner.name}")
        row = slice_summary(user, spawner)
        if report is None:
            row.update(dict.fromkeys(("used", "reserved", "offloaded", "offloaded_compressed", "ratio")))
            row.update(sm_percent=None, kernels=None, report_age=None, stale=True)
        else:
            t = report.totals
            row.update(t)
            row["ratio"] = t["offloaded"] / t["offloaded_compressed"] if t["offloaded_compressed"] else None
            row.update(
                sm_percent=report.sm_percent,
                kernels=report.kernels,
                report_age=max(0.0, now - report.received),
                stale=now - report.received > STALE_SECONDS,
            )
        rows.append(row)
    rows.sort(key=lambda r: (r["gpu_index"], r["user"], r["server_name"]))
    return rows


def gpu_rows(gpus: Iterable, overcommit_ratio: float, rows: list[dict]) -> list[dict]:
    """One row per device (GPU or MIG instance): its memory, the limits and requests
    placed on it, overcommit in use and the usage its slices report.

    Row fields: ``index`` (a MIG instance's parent GPU), ``uuid``, ``name``, ``label``
    (``"GPU 1 MIG 3g.40gb"``), ``isolation``, ``mig_profile``, ``memory`` (bytes),
    ``capacity`` (memory × overcommit ratio; memory for MIG, bytes), ``committed`` (sum
    of limits, bytes), ``requested`` (sum of requests, bytes), ``overcommit`` (committed
    / memory), ``used`` and ``offloaded`` (bytes, sums of reports), ``slices`` (the
    slice rows on it), ``simulated``, ``node`` (the Kubernetes node, or None on one host).

    A slice of several cards is on each of its cards (its limit and request count on
    each); its reported usage, one figure for the whole server, counts on its first card.
    """
    out = []
    for g in gpus:
        mine = [r for r in rows if g.uuid in r["gpu_uuids"]]
        first = [r for r in mine if r["gpu_uuid"] == g.uuid]
        committed = sum(r["memory_limit"] for r in mine)
        out.append(
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "label": g.label,
                "isolation": g.isolation,
                "mig_profile": g.mig_profile,
                "memory": g.memory,
                "capacity": g.memory if g.exclusive else int(g.memory * overcommit_ratio),
                "committed": committed,
                "requested": sum(r["memory_request"] for r in mine),
                "overcommit": committed / g.memory,
                "used": sum(r["used"] or 0 for r in first),
                "offloaded": sum(r["offloaded"] or 0 for r in first),
                "slices": mine,
                "simulated": g.simulated,
                "node": g.node,
            }
        )
    return out
