"""Prometheus metrics of the vGPU slices, served by the Hub's own ``/hub/metrics``.

A prometheus-client collector registered in the default registry, which JupyterHub's
metrics endpoint serves (with its own ``read:metrics`` permission). Values are
computed at scrape time from the slices and the servers' latest reports, so a series
disappears as soon as its server stops. A slice of several cards has its settings
(budget, request, priority, compute share) in a series per card, as they hold on each;
what its server reports (one figure for the server) is in its first card's series.
"""

from __future__ import annotations

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily

PREFIX = "jupyterhub_vgpu"


class SliceCollector:
    """Collects per-slice and per-GPU gauges.

    Args:
        snapshot: callable returning ``(slice_rows, gpu_rows)`` as built by
            :mod:`hub_spawner.usage`, or None while the Hub is not running.
    """

    def __init__(self, snapshot):
        self.snapshot = snapshot

    def collect(self):
        data = self.snapshot()
        if data is None:
            return
        rows, gpus = data
        labels = ["user", "server", "gpu"]
        per_slice = {
            "budget_bytes": ("Memory budget (limit) of the slice, bytes.", lambda r: r["memory_limit"]),
            "request_bytes": ("Guaranteed memory of the slice, bytes.", lambda r: r["memory_request"]),
            "priority": ("Priority of the slice (0-100, higher wins).", lambda r: r["priority"]),
            "compute_share_percent": ("Compute share of the slice, percent.", lambda r: r["compute_share"]),
            "used_bytes": ("GPU memory the slice's kernels use, bytes (last report).", lambda r: r["used"]),
            "offloaded_bytes": (
                "Bytes the slice's kernels hold offloaded (uncompressed).",
                lambda r: r["offloaded"],
            ),
            "compression_ratio": ("Uncompressed over stored size of offloaded data.", lambda r: r["ratio"]),
            "sm_percent": (
                "SM utilisation of the slice's GPU, percent (last report).",
                lambda r: r["sm_percent"],
            ),
        }
        on_each = ("budget_bytes", "request_bytes", "priority", "compute_share_percent")
        for name, (doc, value) in per_slice.items():
            family = GaugeMetricFamily(f"{PREFIX}_slice_{name}", doc, labels=labels)
            for r in rows:
                v = value(r)
                if v is None:
                    continue
                cards = r["gpu_indices"] if name in on_each else [r["gpu_index"]]
                for index in cards:
                    family.add_metric([r["user"], r["server_name"], str(index)], float(v))
            yield family
        per_gpu = {
            "memory_bytes": ("Total memory of the GPU, bytes.", "memory"),
            "committed_bytes": ("Sum of the budgets (limits) placed on the GPU, bytes.", "committed"),
            "requested_bytes": ("Sum of the requests (guaranteed) placed on the GPU, bytes.", "requested"),
            "overcommit_ratio": ("Committed budgets over the GPU's memory.", "overcommit"),
            "used_bytes": ("Sum of the memory its slices report using, bytes.", "used"),
            "offloaded_bytes": ("Sum of the bytes its slices hold offloaded.", "offloaded"),
        }
        gpu_labels = ["gpu", "uuid"]
        # a MIG instance is its own series: label gpu "1/3g.40gb" (parent index / profile)
        for name, (doc, key) in per_gpu.items():
            family = GaugeMetricFamily(f"{PREFIX}_gpu_{name}", doc, labels=gpu_labels)
            for g in gpus:
                family.add_metric([_gpu_label(g), g["uuid"]], float(g[key]))
            yield family
        family = GaugeMetricFamily(
            f"{PREFIX}_gpu_slices", "Slices placed on the GPU.", labels=["gpu", "uuid"]
        )
        for g in gpus:
            family.add_metric([_gpu_label(g), g["uuid"]], float(len(g["slices"])))
        yield family


def _gpu_label(row: dict) -> str:
    """The ``gpu`` label of a device row: its index, and ``/profile`` for a MIG instance."""
    return f"{row['index']}/{row['mig_profile']}" if row.get("mig_profile") else str(row["index"])


_registered: SliceCollector | None = None


def register(snapshot) -> SliceCollector:
    """Register the collector once per process (later calls keep the first)."""
    global _registered
    if _registered is None:
        _registered = SliceCollector(snapshot)
        REGISTRY.register(_registered)
    return _registered
