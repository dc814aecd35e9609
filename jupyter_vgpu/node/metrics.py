"""The arbiter's Prometheus metrics (prometheus-client), in a registry of its own.

``jupyter_vgpu_pauses_total{gpu, reason}`` (reason: ``room`` for another kernel, or
``idle`` in the background), ``jupyter_vgpu_suspends_total{gpu}``,
``jupyter_vgpu_resume_seconds{gpu, tier}`` (tier: ``pause`` or ``suspend``),
``jupyter_vgpu_queue_wait_seconds{gpu}`` (how long a cell waited for room),
``jupyter_vgpu_enforcement_actions_total{gpu, action}`` (servers over their budget),
``jupyter_vgpu_unowned_processes{gpu}`` (processes on a managed card that belong to no
server, at the last look) and ``jupyter_vgpu_unowned_actions_total{gpu, action}``. Served on the loopback
interface when ``ArbiterApp.metrics_port`` is set.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

#: Buckets of the seconds histograms: from a quick cell to a long queue.
BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class Metrics:
    """The arbiter's series (one registry per arbiter, so tests may make several)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.pauses = Counter(
            "jupyter_vgpu_pauses", "Kernels paused by the arbiter.", ["gpu", "reason"], registry=r
        )
        self.suspends = Counter(
            "jupyter_vgpu_suspends", "Kernels suspended by the arbiter.", ["gpu"], registry=r
        )
        self.resume_seconds = Histogram(
            "jupyter_vgpu_resume_seconds",
            "Seconds a kernel took to come back before its code ran.",
            ["gpu", "tier"],
            buckets=BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "jupyter_vgpu_queue_wait_seconds",
            "Seconds a cell waited for room on its GPU.",
            ["gpu"],
            buckets=BUCKETS,
            registry=r,
        )
        self.enforcement = Counter(
            "jupyter_vgpu_enforcement_actions",
            "Actions taken on processes over their budget.",
            ["gpu", "action"],
            registry=r,
        )
        self.unowned = Gauge(
            "jupyter_vgpu_unowned_processes",
            "Processes on a managed GPU that belong to no server (default deny), at the last look.",
            ["gpu"],
            registry=r,
        )
        self.unowned_actions = Counter(
            "jupyter_vgpu_unowned_actions",
            "Actions taken on processes on a managed GPU that belong to no server.",
            ["gpu", "action"],
            registry=r,
        )
