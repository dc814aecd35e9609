"""The node arbiter's program: ``jupyter-vgpu-arbiter`` (or ``python -m jupyter_vgpu.node``).

One per GPU host. ``hub_spawner.setup(c)`` runs it as a JupyterHub-managed service
(the Hub starts and restarts it and gives it a token); on Kubernetes the same program
runs as a DaemonSet. Settings are traits of ``c.ArbiterApp`` in a config file
(``--config``) or on the command line (``--ArbiterApp.queue_timeout=120``).

Where slices come from: a Hub-managed arbiter reads the Hub's running slices
(``GET /hub/api/vgpu/slices``, with its service token) every ``hub_poll_seconds``,
whenever an unknown process connects, and when the Hub says a quota changed; any other
program running as the arbiter's own user (or root) may register a process tree with a
slice over the socket (benchmarks, tests). Nothing a kernel sends is an authority on limits.

On Kubernetes (``node_name`` set, from the pod's ``spec.nodeName``) the arbiter takes
the slices of its own node's pods, each known by its pod's uid rather than a process
tree (:mod:`.namespaces`), and reports the node's GPUs and pods to the Hub every
``report_seconds`` (:mod:`.report`). On a Slurm node (``node_name`` set to the node's
Slurm name) it does the same for the Slurm jobs of its node, each known by its job's
cgroup (:mod:`.slurm`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal

from traitlets import Bool, Enum, Float, Int, List, Unicode, default
from traitlets.config import Application

from jupyter_vgpu.host.socket_path import default_socket
from jupyter_vgpu.slice import Slice, SliceError
from jupyter_vgpu.units import ByteSize

from . import disk
from .arbiter import Arbiter
from .checkpoint_pool import CheckpointPool
from .limits import RateLimit, raise_descriptor_limit
from .shared_pieces import SCOPES as SHARE_SCOPES

#: Environment variable naming the Kubernetes node (the DaemonSet sets it from spec.nodeName).
NODE_ENV = "JUPYTER_VGPU_NODE"
#: The ``gpu_uuid`` of a slice whose GPU the Hub does not know yet (``hub_spawner.kube``).
PENDING = "pending"
#: Seconds a stopping arbiter gives its tasks, cancelled, to end (a connection's task ends
#: at once; one that does not is left, and the loop closes all the same).
STOP_SECONDS = 5.0


def _count(value) -> bool:
    """Whether ``value`` is a non-negative integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class HubLink:
    """Reads the running slices from the Hub with the service's token.

    Each entry of ``GET {JUPYTERHUB_API_URL}/vgpu/slices`` with a ``slice`` and either a
    ``pid`` (the server's process on this host, with its ``cgroup`` and
    ``cgroup_hierarchy`` where it has one), a ``pod_uid`` (its pod, on this arbiter's
    ``node``) or a ``job_id`` (its Slurm job, on this ``node``) registers that server;
    with ``start_time`` (the start time of the process ``pid``, as the spawner recorded it
    when it started the server: a PID that changed hands since gets no slice) and ``uid``
    (the account it runs as: no process of another uid is admitted as its kernel).
    Slices whose GPU the Hub does not know
    yet (``gpu_uuid`` ``"pending"``) wait: their kernels are admitted once it does.
    """

    def __init__(self, arbiter: Arbiter, api_url: str, token: str, node: str = ""):
        self.arbiter = arbiter
        self.url = api_url.rstrip("/") + "/vgpu/slices"
        self.token = token
        self.node = node
        self.log = logging.getLogger("jupyter_vgpu.node")
        self._warned = False

    async def refresh(self) -> None:
        from tornado.httpclient import AsyncHTTPClient, HTTPClientError

        try:
            response = await AsyncHTTPClient().fetch(
                self.url, headers={"Authorization": f"token {self.token}"}, request_timeout=10
            )
            entries = json.loads(response.body)
        except (HTTPClientError, OSError, ValueError) as e:
            if not self._warned:
                self.log.warning("cannot read the Hub's slices at %s: %s", self.url, e)
                self._warned = True
            return
        self._warned = False
        if isinstance(entries, dict):
            entries = entries.get("slices", [])
        seen: set[int | str] = set()
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict):
                continue
            pid, pod, job = entry.get("pid"), entry.get("pod_uid"), entry.get("job_id")
            pod = pod if isinstance(pod, str) and pod else None
            job = job if isinstance(job, str) and job else None
            if pod or job:
                if self.node and entry.get("node") != self.node:
                    continue  # another node's pod or job
                pid = 0
            elif not isinstance(pid, int) or pid <= 0:
                continue
            cgroup, hierarchy = entry.get("cgroup"), entry.get("cgroup_hierarchy") or "cgroup2"
            if (
                pod
                or job
                or not (isinstance(cgroup, str) and cgroup.startswith("/") and isinstance(hierarchy, str))
            ):
                cgroup, hierarchy = None, "cgroup2"
            try:
                slice_ = Slice.from_dict(entry["slice"])
            except (SliceError, KeyError, TypeError) as e:
                self.log.error("the Hub sent an unusable slice for %s: %s", pod or pid, e)
                continue
            if slice_.gpu_uuid == PENDING:
                continue
            user, name = str(entry.get("user", "")), str(entry.get("server_name", ""))
            start, uid = entry.get("start_time"), entry.get("uid")
            server = self.arbiter.register(
                pid, user, name, slice_, pod_uid=pod, job_id=job, cgroup=cgroup, cgroup_hierarchy=hierarchy,
                start=start if _count(start) and pid else None, uid=uid if _count(uid) else None,
            )  # fmt: skip
            seen.add(server.root)
        for root in [r for r in self.arbiter.servers if r not in seen]:
            del self.arbiter.servers[root]  # stopped on the Hub


class ArbiterApp(Application):
    """The node arbiter of one GPU host."""

    name = "jupyter-vgpu-arbiter"
    description = "Owns this host's GPUs: makes room for whoever runs a cell by pausing idle kernels."

    socket_path = Unicode(
        help="Unix socket kernels and servers connect to; its directory is made writable by "
        "the arbiter's user alone. Default: $JUPYTER_VGPU_ARBITER, /run/jupyter-vgpu/arbiter.sock "
        "for root, else under the Jupyter runtime directory."
    ).tag(config=True)

    @default("socket_path")
    def _socket_default(self):
        return default_socket()

    queue_timeout = Float(
        600.0, help="Seconds a cell waits for room on its GPU before it fails with a readable error."
    ).tag(config=True)

    pause_timeout = Float(120.0, help="Seconds to wait for a kernel to acknowledge a pause or suspend.").tag(
        config=True
    )

    watermark = Float(
        0.9,
        help="Above this fraction of a card's memory in use, kernels idle longer than their "
        "slice's idle_seconds are paused in the background, while no kernel on that card runs code.",
    ).tag(config=True)

    card_reserve = ByteSize(
        None,
        allow_none=True,
        help="""Memory of each card kept out of the arbiter's reach, bytes or a size like
        '60G': it decides as if every card had that much less (its free memory too), so
        that what a process of no server needs there (a display, a monitoring agent) is
        never counted as room. The watermark is a fraction of what remains. Also how a
        benchmark runs a larger card as a smaller one (benchmarks/sessions.py: an H200 as
        the H100 its calibration was measured on). One as large as a card leaves it no room
        at all: the decision 'card reserved whole' says so, once per card. Default: none.""",
    ).tag(config=True)

    prefetch_interval = Float(
        5.0,
        help="Seconds between two prefetches of one user's kernels (a paused kernel brought back "
        "because its user started working in its notebook, before the cell runs): the rate limit "
        "per user.",
    ).tag(config=True)

    room_ahead = Bool(
        True,
        help="""Whether a granted prefetch also makes the room its cell will need, while the
        kernel comes back: kernels idle past their idle_seconds are paused and paused
        kernels suspended until the cell's budget fits beside the running cells' promises,
        instead of when the cell runs (its user waiting). A prefetch whose cell never comes
        has then taken them off the card for nothing. A prefetch whose kernel itself does
        not fit takes one such step first where that covers it, rather than being
        refused. False: a prefetch brings back the kernel's own bytes alone, where they
        fit.""",
    ).tag(config=True)

    room_held_seconds = Float(
        0.0,
        help="""Seconds a granted prefetch holds its cell's room once the kernel is back
        (with room_ahead): the kernel's growth to its budget counts as promised to another
        kernel's prefetch, as a running cell's does, so that prefetch makes its own room
        rather than taking this one's; the hold ends when the cell asks for its room, when
        the kernel leaves the card, or after these seconds. 0 (the default): no hold, a
        prefetched kernel's room is anyone's until its cell runs. Off by default since it
        was measured worse: 48 MLP sessions on one card with 5 s holds (52d113a,
        benchmarks/results/sessions-h100.json) made 2.4-2.6 times the suspends on two of
        three schedules, ran into the host memory budget (trimmed slabs, spills, pauses
        that pinned again at 0.8 s), and put p95 at 93-485 points of a solo cell over the
        compute-sharing model, against -0.5 to 57 without (777869e, b101c5c).""",
    ).tag(config=True)

    decisions_kept = Int(
        200,
        min=1,
        help="""How many of its latest decisions the arbiter keeps for its books (the Hub's
        admin page, {"type": "books"}). Every decision is also a line of its log, whatever
        this is; a benchmark that reads a whole run's decisions from the books keeps more.""",
    ).tag(config=True)

    suspend_after = Float(
        1800.0,
        help="Paused kernels idle longer than this (seconds) are suspended (the driver's checkpoint: "
        "their CUDA context leaves the card too); 0 never suspends.",
    ).tag(config=True)

    poll_seconds = Float(1.0, help="Seconds between two background looks at the cards.").tag(config=True)

    share_pieces = Enum(
        list(SHARE_SCOPES),
        default_value="all",
        help="""Who may share identical paused pieces (a class's frozen base weights held once
        in host memory): 'all' users (the default), 'same-user' (within one user's kernels),
        or 'off'. Sharing reveals to a kernel that another in its scope holds the same
        bytes; never the bytes of another (the arbiter compares them first). See
        docs/security.md and docs/design.md, "Identical paused pieces held once".""",
    ).tag(config=True)

    checkpoint_timeout = Float(
        30.0,
        help="""Seconds any call of the driver's process checkpoint may take, on top of 1 s per
        GiB it moves (and the lock's 10 s). A call past it is given up (its worker process
        ended): the kernel is left as the driver has it (locked or checkpointed), the
        decision log and the kernel say so, and no other kernel waits for it.""",
    ).tag(config=True)

    hub_poll_seconds = Float(5.0, help="Seconds between two reads of the Hub's slices.").tag(config=True)

    node_name = Unicode(
        help="""The Kubernetes or Slurm node this arbiter runs on (default: $JUPYTER_VGPU_NODE,
        which the DaemonSet sets from spec.nodeName; on Slurm the node's NodeName); '' on a
        single host. When set, the arbiter takes the slices of this node's pods or jobs
        only and reports the node to the Hub."""
    ).tag(config=True)

    @default("node_name")
    def _node_default(self):
        return os.environ.get(NODE_ENV, "")

    mps_daemons = Bool(
        help="""Run an MPS control daemon per GPU of 'mps' slices. Default: on, except on
        Kubernetes (node_name set), where MPS sharing is the DRA driver's and its daemon
        serves the claim's pods."""
    ).tag(config=True)

    @default("mps_daemons")
    def _mps_default(self):
        return not self.node_name

    report_seconds = Float(
        10.0, help="Seconds between two reports of the node to the Hub (on Kubernetes)."
    ).tag(config=True)

    process_memory_seconds = Float(
        10.0,
        help="""Seconds between two looks at every kernel process's own host memory (RSS,
        PSS, anonymous, shared: /proc/<pid>/smaps_rollup, in a thread; it costs about 20 to
        30 ms per GiB a process has resident). A kernel never looked at is looked at on
        the next poll.""",
    ).tag(config=True)

    metrics_port = Int(0, help="Serve Prometheus metrics on 127.0.0.1:PORT (0: not served).").tag(config=True)

    over_budget = Enum(
        ["report", "pause", "kill"],
        default_value="report",
        help="""What happens to a process over its slice's budget (NVML's figure, every
        poll_seconds) once grace_seconds have passed: 'report' (warn the user and the log,
        again every minute), 'pause' (pause its kernel if it is idle), 'kill' (end the
        process). A warning goes out the moment it is seen over.""",
    ).tag(config=True)

    grace_seconds = Float(
        10.0, help="Seconds a process may stay over its budget before over_budget applies."
    ).tag(config=True)

    unowned_policy = Enum(
        ["report", "kill"],
        help="""What happens to a process that uses a managed GPU (managed_gpus) and belongs
        to no server, nor to the allowlist (allowed_executables, allowed_cgroups): it is
        reported at once (the log, the Hub's /hub/vgpu page, the metric
        jupyter_vgpu_unowned_processes); after grace_seconds, 'report' keeps reporting it
        every minute and 'kill' ends it. Default: 'kill' when over_budget is 'kill', else
        'report'. This arbiter's process and its ancestors (the Hub) are never ended.""",
    ).tag(config=True)

    @default("unowned_policy")
    def _unowned_default(self):
        return "kill" if self.over_budget == "kill" else "report"

    managed_gpus = List(
        Unicode(),
        default_value=["all"],
        help="""GPUs whose every process must belong to a server (default deny), by NVML UUID
        (GPU-… or MIG-…) or index; 'all' (default): every GPU, or MIG instance, NVML lists on
        this host. The GPUs of the registered slices are always watched.""",
    ).tag(config=True)

    allowed_executables = List(
        Unicode(),
        default_value=[
            "nvidia-cuda-mps-server",
            "nvidia-cuda-mps-control",
            "nvidia-smi",
            "nvidia-persistenced",
            "nv-hostengine",
            "dcgm-exporter",
            "dcgmi",
            "nvidia_gpu_exporter",
            "Xorg",
            "Xwayland",
        ],
        help="""Programs that may use a managed GPU outside every server: an absolute path
        (matched against /proc/<pid>/exe), or a bare name, which matches a program of that
        name only where the file and its directory are root's and writable by root alone
        (a user cannot copy a program there). Default: NVIDIA's MPS daemons, nvidia-smi,
        the persistence daemon, DCGM's host engine, exporter and CLI, the GPU exporter for
        Prometheus, and X servers.""",
    ).tag(config=True)

    allowed_cgroups = List(
        Unicode(),
        help="""cgroups whose processes may use a managed GPU outside every server (and those
        below them): a path in the unified hierarchy ('/system.slice/dcgm.service') or
        'HIERARCHY:PATH' for a v1 one ('name=systemd:/system.slice/dcgm.service'). Empty by
        default: name the services of monitoring agents and admin jobs here.""",
    ).tag(config=True)

    hello_timeout = Float(
        10.0, help="Seconds a client may stay silent after it connects before it is hung up on."
    ).tag(config=True)

    max_connections_per_user = Int(
        128,
        help="""Connections one user (uid) may hold to the arbiter at once: a kernel holds
        one, a server's control requests one each while they last. Past it, new ones are
        refused with a message (and counted in jupyter_vgpu_refused_connections). Root's
        are not counted.""",
    ).tag(config=True)

    registrars = Enum(
        ["none", "same-user"],
        help="""Who may register slices over the socket. 'none': nobody, slices come from
        the Hub (the default under a Hub). 'same-user': the arbiter's own user or root,
        from outside every registered server (the default standalone: benchmarks,
        tests). A kernel never may.""",
    ).tag(config=True)

    @default("registrars")
    def _registrars_default(self):
        return "none" if os.environ.get("JUPYTERHUB_API_TOKEN") else "same-user"

    aliases = {
        "socket": "ArbiterApp.socket_path",
        "registrars": "ArbiterApp.registrars",
        "over-budget": "ArbiterApp.over_budget",
        "queue-timeout": "ArbiterApp.queue_timeout",
        "metrics-port": "ArbiterApp.metrics_port",
        "config": "ArbiterApp.config_file",
    }

    host_memory_limit = ByteSize(
        None,
        allow_none=True,
        help="""Host memory that the kernels of this node may hold for their GPU memory in
        all (paused data, checkpoints, pinned memory kept warm for a fast next pause), bytes
        or a size like '64G' (default: host_memory_fraction of the host's RAM). Idle
        kernels let their warm memory go, then the coldest paused kernels move to the disk
        tier, before it is reached, and a pause that would pass it is not made, so the
        host's OOM killer never has to act.""",
    ).tag(config=True)

    host_memory_fraction = Float(
        0.5, help="The default host_memory_limit, as a fraction of the host's RAM (MemTotal)."
    ).tag(config=True)

    host_spill_fraction = Float(
        0.8,
        help="""Past this fraction of host_memory_limit, idle kernels let go of the pinned
        memory they keep warm for a fast next pause, then the coldest paused kernels
        (longest idle first) move to the disk tier, in the background.""",
    ).tag(config=True)

    trim_before_spill = Bool(
        True,
        help="""With host memory for paused kernels full (past host_spill_fraction in the
        background, or a pause that would pass host_memory_limit), idle kernels let go of
        their warm pinned slabs before any paused kernel's data moves to the disk tier
        (True: a trim loses no data). False: the coldest paused kernels move to disk first,
        and slabs are trimmed only where nothing can be spilled. A trimmed kernel's next
        pause pins its slabs again: 0.82 s at the median against 0.08 s warm (71 and 293
        pauses, 48 MLP sessions on one card, docs/design.md, the tenth try), and an idle
        kernel's next move is usually that pause, made for another user's cell, which
        then takes host memory back; a spilled kernel pays when its own user returns
        (a resume from disk), which an edit's prefetch may hide.""",
    ).tag(config=True)

    even_contexts = Bool(
        False,
        help="""Take each paused kernel's CUDA context (with its child processes') through
        the driver's process checkpoint and straight back, once, while it is idle, so that
        every context on a card is one the driver restored. The driver's time-slicing
        gives a restored context about three quarters of the card beside one that never
        left it (a step of 0.20 s against 0.66 s, where two steps of one kind took 0.30-0.33
        s; 48 MLP sessions on one card, eleven runs), and shares evenly between contexts of
        one kind; with every kernel cycled so, both kinds of pair took 0.30 s a step (two
        runs; docs/design.md, the twelfth try). Each cycle holds the kernel's CUDA calls
        for about 1.2 s (a paused MLP kernel on an H200), its cell waiting that long at
        most; kernels the driver cannot checkpoint (CUDA IPC, managed memory) are left as
        they are. Needs the driver's checkpoint (driver 550+). Off by default: at 12x (48
        MLP sessions, seeds 11 and 7) it evened 42 and 43 contexts in 1.2-1.3 s each and
        left the p95 where it was without it (69 and 72 points of a solo cell over the
        compute-sharing model, against 74 and 71; docs/design.md, the thirteenth try).""",
    ).tag(config=True)

    grant_on_demand = Bool(
        False,
        help="""Grant a starting cell what its kernel holds and brings back plus
        grant_margin, instead of its whole budget, and make the rest of its room when it
        grows: an allocation the driver finds no room for waits in the kernel while the
        arbiter takes idle kernels off the card, then is made again (kernels of protocol
        version 4; older ones keep the whole budget). A cell is admitted only where the
        budgets of all the card's running cells fit what the card could give them at once,
        so a cell below its budget never meets an out-of-memory error. For cells that use
        well below their budget (a budget set for the largest cell a user may run); a cell
        that uses about all of it gains nothing and waits for its room as it grows rather
        than as it starts. Off by default: not yet measured where a card's memory ends
        (docs/design.md, "Growth on demand" and the fourteenth try).""",
    ).tag(config=True)

    release_first = Bool(
        True,
        help="""Before pausing or suspending anyone for a cell's room, ask idle kernels to
        give back the free blocks their allocator keeps cached on the card (PyTorch's
        empty_cache; kernels of protocol version 5 say how much they hold), where those
        cover what is short: nothing is stored, the kernels stay on the card, and their
        next cells need no resume. A kernel idle after an MLP cell of the 12x benchmark
        holds 16.7 GiB, of which about 14 GiB is cached free blocks: about the room the
        next starting cell needs. Where they do not cover it, the pauses are made as
        without (a pause releases the cache too). A prefetch's room ahead of its cell asks
        them as well, kernels idle within their idle_seconds among them (a release takes
        nobody off the card). The books are read from NVML after each
        release, never from what a kernel says it gave back. On by default: at 12x (48 MLP
        sessions on an H100's memory) the memory path's share of p95 went from 9.2, 25.9
        and 30.3 points of a solo cell to -26.6, -41.6 and 31.5 on seeds 7, 23 and 11, with
        no suspend (docs/design.md, the sixteenth try).""",
    ).tag(config=True)

    suspend_wait = Float(
        3.0,
        min=0.0,
        help="""Seconds a cell waits for another cell running on its card to end, where its
        room would otherwise need a paused kernel suspended (its CUDA context taken off the
        card by the driver's checkpoint); then the suspends are made. Meanwhile the room
        made ahead of prefetched cells on that card pauses but suspends nobody. 0: suspends
        at once. Cells that meet share the card's compute by time slices, so a group of
        cells ends at about the same time whether they run together or a cell waits for
        another to end, and the wait costs no checkpoints, no host memory for them and no
        restores later; a long-running cell holds a waiting cell up by this much at most.
        At 12x on the H100 (48 MLP sessions) two cells of 16.7 GiB fit beside the other 46
        kernels' contexts, a third needs 5 contexts off the card and a fourth 27; with 3 s
        the memory path's share of p95 fell on seeds 7, 23 and 11 (from 70.7, 29.7 and 74.4
        points of a solo cell to 9.2, 25.9 and 30.3; suspends from 33, 12 and 42 to 15, 11
        and 13; docs/design.md, the fifteenth try), hence on by default.""",
    ).tag(config=True)

    turn_wait = Float(
        2.0,
        min=0.0,
        help="""Seconds a cell the user ran waits for its turn: for the young cells running
        on its card (of its priority or above, begun less than this long ago) to end, and
        for those sent before it to take theirs, before it starts beside them. Cells that
        meet share the card's compute, so two 1 s cells sent together each take about 2 s;
        taking turns, the first takes 1 s and the second 2 s. A cell that has run this
        long is long (a training loop): nobody waits for it, so a cell waits behind
        another for this long at most, and only when sent just as that one began. Only
        cells take turns (kernels of protocol version 6 say which requests are for a
        cell), never completion, widgets or code between cells; a kernel that runs code
        this long on a request it did not call a cell takes turns with every request
        since. 0: off. Measured at 12x (48 MLP sessions on one H200,
        benchmarks/results/sessions-h100.json at 4734218, docs/design.md, "Cells take
        turns"): with 2 s the p50 was +1.9% and +3.5% of a solo cell on seed 23 (two runs;
        sharing, +18.4%), +4.8% on seed 11 and +1.8% on seed 7, and p95 below sharing's on
        every seed, hence on by default.""",
    ).tag(config=True)

    grant_margin = ByteSize(
        "1G",
        help="""With grant_on_demand: bytes granted beyond what a cell's kernel holds and
        brings back as the cell starts, and beyond each allocation it grows by, so that a
        cell growing a little asks nothing and one growing a lot asks once per margin.""",
    ).tag(config=True)

    host_reserve = ByteSize(
        None,
        allow_none=True,
        help="""Available host memory (MemAvailable) below which paused kernels move to the
        disk tier whatever host_memory_limit says, bytes or a size (default: 5% of RAM, at
        least 1 GiB).""",
    ).tag(config=True)

    disk_dir = Unicode(
        help="""The disk tier: paused kernels' memory moved out of host memory goes to files
        under <disk_dir>/<uid>/ (each user's directory 0700, theirs; the root 0711, the
        arbiter's), written by the kernels, compressed and checksummed, removed when a
        kernel ends. A disk-backed directory (not /run, not a tmpfs) that the arbiter makes
        itself: every directory on the way must be root's or the arbiter's user's and
        writable by no one else (a sticky /tmp aside), else the disk tier stays off and the
        log says why. Default: /var/lib/jupyter-vgpu/disk for root, else
        $XDG_CACHE_HOME/jupyter-vgpu/disk. '' turns the disk tier off.""",
    ).tag(config=True)

    @default("disk_dir")
    def _disk_dir_default(self):
        return disk.default_root()

    disk_limit = ByteSize(
        None, allow_none=True, help="Bytes the disk tier may hold in all (default: what its disk has)."
    ).tag(config=True)

    disk_reserve = ByteSize(
        2**30, help="Free bytes to leave on the disk tier's file system, bytes or a size like '10G'."
    ).tag(config=True)

    config_file = Unicode("", help="A Python or JSON config file to load.").tag(config=True)

    def initialize(self, argv=None):
        super().initialize(argv)
        if self.config_file:
            self.load_config_file(self.config_file)
        logging.basicConfig(level=logging.INFO, format="[%(name)s %(asctime)s] %(message)s")
        limit = RateLimit()
        for handler in logging.getLogger().handlers:  # whatever logs, through whichever logger
            handler.addFilter(limit)
        descriptors = raise_descriptor_limit()
        self.log.info("open files: up to %d", descriptors)

    async def serve(self) -> None:
        from pathlib import Path

        import jupyter_vgpu
        from jupyter_vgpu.host import checkpoint

        # which code runs (an upgrade restarts the arbiter on the new one: docs/admin.md)
        logging.getLogger("jupyter_vgpu.node").info(
            "jupyter-vgpu node arbiter %s, pid %d, code in %s",
            jupyter_vgpu.__version__,
            os.getpid(),
            Path(jupyter_vgpu.__file__).parent,
        )
        reason = checkpoint.unavailable()
        standin = os.environ.get("JUPYTER_VGPU_CHECKPOINT_STANDIN")
        if standin:  # tests: a recording stand-in answers in the workers
            reason = None
            self.log.warning(
                "the driver's checkpoint is a recording stand-in (%s): nothing is suspended", standin
            )
        elif reason:
            self.log.info("suspend unavailable here (%s): kernels are paused, never suspended", reason)
        pool = None if reason else CheckpointPool(base_timeout=self.checkpoint_timeout)
        arbiter = Arbiter(self, checkpoint=pool)
        url, token = os.environ.get("JUPYTERHUB_API_URL"), os.environ.get("JUPYTERHUB_API_TOKEN")
        hub = HubLink(arbiter, url, token, self.node_name) if url and token else None
        if hub is not None:
            arbiter.refresh_servers = hub.refresh
            if self.node_name:
                from .report import NodeReporter

                reporter = NodeReporter(arbiter, self.node_name, url, token, self.watermark)
                arbiter.spawn_every(self.report_seconds, reporter.send)
        if self.metrics_port:
            from prometheus_client import start_http_server

            start_http_server(self.metrics_port, addr="127.0.0.1", registry=arbiter.metrics.registry)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # listen first: kernels reconnecting after a restart say hello while the Hub's
        # slices are read (their hello waits for that one read)
        try:
            await arbiter.start(self.socket_path)
        except OSError as e:  # an unsafe socket directory (safe_dirs.UnsafePath), a lock not let go
            self.log.error("cannot serve on %s: %s", self.socket_path, e)
            self.exit(1)
        while not stop.is_set():
            if hub is not None:
                await arbiter.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.hub_poll_seconds)
        await arbiter.stop()
        if pool is not None:
            pool.close()

    def start(self):
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self.serve())
        finally:
            # its clients' connections, and whatever else still waits, end before the loop
            # closes (each one left wrote "Task was destroyed but it is pending!" and a
            # traceback); not the executor's threads, unlike asyncio.run: threads stuck in a
            # driver call must not keep a stopping arbiter alive, and a task awaiting one
            # ends at its cancellation
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.wait(pending, timeout=STOP_SECONDS))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()


def main(argv=None) -> None:
    """The ``jupyter-vgpu-arbiter`` command."""
    ArbiterApp.launch_instance(argv)
