"""The arbiter's Prometheus metrics (prometheus-client), in a registry of its own.

``jupyter_vgpu_pauses_total{gpu, reason}`` (reason, :class:`.books.Reason`: ``room``
for another kernel, ``room ahead`` for a prefetched kernel's cell, ``idle`` in the
background, ``over budget`` or ``wrong GPU`` by the watchdog), ``jupyter_vgpu_suspends_total{gpu}``,
``jupyter_vgpu_contexts_evened_total{gpu, outcome}`` (``ArbiterApp.even_contexts``),
``jupyter_vgpu_resume_seconds{gpu, tier}`` (tier: ``pause`` or ``suspend``),
``jupyter_vgpu_queue_wait_seconds{gpu}`` (how long a cell waited for room),
``jupyter_vgpu_grow_wait_seconds{gpu}`` (how long a running cell's allocation waited for
its room to grow, ``ArbiterApp.grant_on_demand``; its count: the grows granted),
``jupyter_vgpu_enforcement_actions_total{gpu, action}`` (servers over their budget),
``jupyter_vgpu_unowned_processes{gpu}`` (processes on a managed card that belong to no
server, at the last look) and ``jupyter_vgpu_unowned_actions_total{gpu, action}``.

The node's tiers: ``jupyter_vgpu_host_bytes`` (host memory kernels hold for their GPU
memory: paused data, checkpoints, pinned slabs kept warm for a next pause),
``jupyter_vgpu_host_limit_bytes`` (``ArbiterApp.host_memory_limit``),
``jupyter_vgpu_disk_bytes`` (what the disk tier holds),
``jupyter_vgpu_kernel_process_bytes`` (the kernel processes' own resident memory, RSS,
summed: shared library pages counted in each), ``jupyter_vgpu_kernel_process_pss_bytes{tier}``
(their proportional share, PSS, summed by where their GPU memory is: what they take from
the host together, :mod:`.process_memory`), ``jupyter_vgpu_kernels{tier}``
(``gpu``, ``host``, ``disk``, ``suspended``), ``jupyter_vgpu_spills_total`` and
``jupyter_vgpu_spill_failures_total`` (moves to the disk tier, and those a full or
failing disk refused), ``jupyter_vgpu_trimmed_bytes_total`` (pinned memory
kernels let go when the host needed it: idle kernels' warm slabs, paused kernels' staging),
``jupyter_vgpu_kernels_joined_total{tier}`` (hellos, by where the kernel's memory was:
after a restart, the kernels that came back). Resume seconds carry ``tier`` ``disk``
too. Served on the loopback interface when ``ArbiterApp.metrics_port`` is set.
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
        self.prefetches = Counter(
            "jupyter_vgpu_prefetches",
            "Kernels brought back ahead of a cell the user was about to run, by outcome "
            "(granted, no room, too soon, not away, leaving, evening, card unreadable).",
            ["gpu", "outcome"],
            registry=r,
        )
        self.suspends = Counter(
            "jupyter_vgpu_suspends", "Kernels suspended by the arbiter.", ["gpu"], registry=r
        )
        self.releases = Counter(
            "jupyter_vgpu_releases",
            "Idle kernels asked to give back their allocator's cached free blocks for a cell's room "
            "(ArbiterApp.release_first), and that did.",
            ["gpu"],
            registry=r,
        )
        self.evens = Counter(
            "jupyter_vgpu_contexts_evened",
            "Paused kernels' CUDA contexts taken through the driver's checkpoint and straight back "
            "(ArbiterApp.even_contexts), by outcome (evened, refused, restore waits).",
            ["gpu", "outcome"],
            registry=r,
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
        self.grow_wait = Histogram(
            "jupyter_vgpu_grow_wait_seconds",
            "Seconds a running cell's allocation waited for the room to grow (ArbiterApp.grant_on_demand).",
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
        self.host_bytes = Gauge(
            "jupyter_vgpu_host_bytes", "Host memory paused and suspended kernels hold, bytes.", registry=r
        )
        self.process_bytes = Gauge(
            "jupyter_vgpu_kernel_process_bytes",
            "Host memory the kernel processes have resident (their RSS, summed), bytes.",
            registry=r,
        )
        self.process_pss = Gauge(
            "jupyter_vgpu_kernel_process_pss_bytes",
            "The kernel processes' proportional share of host memory (PSS, summed by tier: "
            "shared library pages counted once over all kernels), bytes.",
            ["tier"],
            registry=r,
        )
        self.host_limit = Gauge(
            "jupyter_vgpu_host_limit_bytes", "The node's host memory budget for paused kernels.", registry=r
        )
        self.disk_bytes = Gauge(
            "jupyter_vgpu_disk_bytes", "Bytes paused kernels keep in the disk tier.", registry=r
        )
        self.kernels = Gauge(
            "jupyter_vgpu_kernels", "Kernels by where their memory is: gpu, host, disk, suspended.",
            ["tier"], registry=r,
        )  # fmt: skip
        self.spills = Counter("jupyter_vgpu_spills", "Paused kernels moved to the disk tier.", registry=r)
        self.trimmed = Counter(
            "jupyter_vgpu_trimmed_bytes",
            "Pinned host memory kernels let go when the host needed it, bytes.",
            registry=r,
        )
        self.spill_failures = Counter(
            "jupyter_vgpu_spill_failures",
            "Moves to the disk tier refused by a full or failing disk.",
            registry=r,
        )
        self.joined = Counter(
            "jupyter_vgpu_kernels_joined", "Kernels that said hello, by where their memory was.", ["tier"],
            registry=r,
        )  # fmt: skip
        self.refused_connections = Counter(
            "jupyter_vgpu_refused_connections",
            "Connections turned away: their process had ended, or their user held the most allowed.",
            registry=r,
        )
        self.refused_peers = Counter(
            "jupyter_vgpu_refused_peers",
            "Processes refused as a kernel: not of the server's account, or no longer the process "
            "that connected.",
            registry=r,
        )
