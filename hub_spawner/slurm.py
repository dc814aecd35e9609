"""Slices on Slurm: :class:`VGPUSlurmSpawner`, the slice mixin on batchspawner's
``SlurmSpawner``.

``hub_spawner.setup_slurm(c)`` in ``jupyterhub_config.py`` (spawner ``vgpu-slurm``; the
``slurm`` extra: ``pip install jupyter-vgpu[slurm]``). Each user's server runs as a
Slurm batch job, as with batchspawner alone; what the slice adds:

1. **The Hub places the slice** on a GPU of a node of the partition, as on one host
   (binpack or spread, overcommit, guarantees): the GPUs are the nodes' ``gpu`` GRES,
   named and sized by each node arbiter's report (:mod:`hub_spawner.slurm_nodes`).
2. **The job asks Slurm for it**: ``--nodelist=<node>`` and ``--gres=shard:<n>``, the
   shards the slice's guaranteed memory needs (``vgpu_gres = "shard"``), or every shard
   of one GPU for a whole GPU (``"gpu"``; ``--gres=gpu:1`` on a node without shards).
   Slurm then holds those shards for the job: its own accounting agrees with the Hub's
   guarantees, and batch jobs outside the Hub see them taken. A slice of several cards
   (``vgpu_gpu_count``, or the quota's ``gpu_count``) takes whole GPUs of one node,
   ``--gres=gpu:<k>`` (mode ``"gpu"``): Slurm 22.05 gives a job's shards from one GPU
   (``shard:32`` on a node of two 16-shard GPUs stays pending), so shards cannot ask
   for a share of each of several cards.
3. **The slice records where the job landed**: its node, and the GPU Slurm gave the
   shards on (``scontrol show job -d``: ``GRES=shard:3(IDX:1)``); Slurm, not the Hub,
   picks the GPU within the node. The job id is in the slice listing, so that the
   node's arbiter knows the job's processes by its cgroup (``job:<id>``).
4. **Slurm's refusals reach the spawn page**: ``sbatch`` refusing the job (an unknown
   partition, more GRES than the node has) and a job Slurm keeps pending longer than
   ``vgpu_pending_timeout`` (its reason: ``Resources`` when the GPU's shards are taken)
   end the spawn with Slurm's words.

Choices on the spawn form come from ``profile_list``, in KubeSpawner's shape
(:mod:`hub_spawner.slurm_profiles`): each profile's ``spawner_override`` sets this
spawner's settings (``vgpu_*`` sizes, and
batchspawner's ``req_*``: partition, runtime, ...). A running job keeps the shards Slurm
gave it, so a quota change resizes the budget live and the guarantee up to those shards.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
from collections.abc import Sequence
from typing import Any

from batchspawner import SlurmSpawner
from batchspawner.batchspawner import JobStatus
from traitlets import Dict, Enum, Float, List, Unicode, default

from jupyter_vgpu.slice import Card, Slice, SliceError

from . import slurm_nodes, slurm_profiles
from .inventory import GPU
from .placement import Placement, PlacementError
from .profiles import (
    ProfileSizedSlice,
    QuotaExceeded,
    Size,
    arbiter_socket_setting,
    describe,
    gpu_memory_setting,
)
from .spawner import VGPUSpawnerMixin


class SlurmRefused(Exception):
    """Slurm refused or would not start a server's job; JupyterHub shows the message on
    the spawn page."""

    def __init__(self, message: str):
        super().__init__(message)
        self.jupyterhub_message = message


class VGPUSlurmSpawner(VGPUSpawnerMixin, ProfileSizedSlice, SlurmSpawner):
    """batchspawner's SlurmSpawner with a vGPU slice per server (entry point ``vgpu-slurm``),
    sized by the user's quota and the chosen profile (:mod:`hub_spawner.profiles`)."""

    vgpu_kind = "slurm"
    vgpu_profile_settings = slurm_profiles.SLICE_SETTINGS
    vgpu_mode_setting = "vgpu_gres"
    vgpu_multi_card_modes = ("gpu",)  # whole GPUs: a job's shards all come from one GPU

    vgpu_gres = Enum(
        ["shard", "gpu"],
        default_value="shard",
        help="""What the job asks Slurm for: 'shard' (--gres=shard:<n>, the shards of the
        slice's GPU its guaranteed memory needs, rounded up; several users per GPU) or
        'gpu' (a whole GPU: every shard of one GPU, --gres=shard:<Count>, so that no
        shard job shares it; --gres=gpu:1 on a node without shards). A whole GPU is the
        slice's budget and guarantee, if the quota allows it.""",
    ).tag(config=True)

    vgpu_gpu_memory = gpu_memory_setting(
        """Memory of each GPU of a node whose node arbiter has not reported yet, bytes
        or a size like '80G'; None: such a node takes no slice until its arbiter reports
        the real cards (NVML)."""
    )

    vgpu_arbiter_socket = arbiter_socket_setting(
        """The node arbiter's socket on every Slurm node (its systemd unit's), named to
        servers and kernels in JUPYTER_VGPU_ARBITER; '{node}' in it is replaced by the
        node's name (test clusters whose nodes share one filesystem). '' names none."""
    )

    vgpu_pending_timeout = Float(
        120.0,
        help="""Seconds Slurm may keep a server's job pending (Resources, Priority, ...)
        before the spawn gives up, cancels the job and shows Slurm's reason. Keep it below
        start_timeout.""",
    ).tag(config=True)

    vgpu_nodes_cmd = Unicode(
        "scontrol show node -o", help="Lists the cluster's nodes, one a line (run as the Hub's user)."
    ).tag(config=True)

    vgpu_job_cmd = Unicode(
        "scontrol show job -d -o {job_id}",
        help="Shows one job in detail on one line, where its GRES landed (run as the Hub's user).",
    ).tag(config=True)

    profile_list = List(
        Dict(),
        help="""Choices on the spawn form, in KubeSpawner's shape: [{"display_name": "Small
        GPU", "slug": "small", "description": "...", "default": True, "spawner_override":
        {"vgpu_memory_limit": "4G", "req_partition": "gpu"}}]. A choice's overrides set this
        spawner's settings for that spawn; sizes it leaves unset come from the user's quota,
        and sizes above the quota are refused. Empty: no form, the quota's slice.""",
    ).tag(config=True)

    #: Where the job runs: ``{"node", "job_id", "gres", "shards", "shards_per_gpu"}``, and
    #: once it runs the ``account`` (and ``uid``) Slurm runs it as.
    vgpu_where: dict[str, Any] = {}
    #: The cluster's nodes by name, as the last look at Slurm found them (shared).
    _nodes: dict[str, slurm_nodes.SlurmNode] = {}
    #: Why some node takes no slice (the last look), for the log.
    vgpu_node_problems: list[str] = []

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._vgpu_events: list[dict] = []
        self._vgpu_done = False
        self._vgpu_saved: dict[str, Any] = {}  # settings as they were before a profile's overrides

    # -- the spawn form ---------------------------------------------------------------

    @default("options_form")
    def _vgpu_slurm_options_form(self):
        return VGPUSlurmSpawner._vgpu_render_form if self.profile_list else ""

    def _profile(self, user_options) -> dict | None:
        """The profile ``user_options`` choose (:func:`hub_spawner.slurm_profiles.chosen`).

        Raises:
            ValueError: no profile of that slug.
        """
        return slurm_profiles.chosen(self.profile_list, user_options)

    def _vgpu_render_form(self) -> str:
        """One radio button per profile, each saying the slice it gives (or why it is
        above the user's quota)."""
        effective = self.vgpu_resolve()
        slugs = [p["slug"] for p in slurm_profiles.normalized(self.profile_list)]
        lines = {slug: self.vgpu_choice_line(slug, effective) for slug in slugs}
        return slurm_profiles.render(self.profile_list, lines, self._profile({})["slug"])

    def options_from_form(self, formdata):
        """``{"profile": slug}`` from the form, refused (the form comes back with the
        message) when the choice asks for more than the user's quota."""
        slug = (formdata.get("profile") or [""])[0]
        options = {"profile": slug} if slug else {}
        self.vgpu_check_choice(options)
        return options

    def vgpu_overrides(self, user_options) -> dict[str, Any]:
        """The chosen profile's ``spawner_override``.

        Raises:
            ValueError: no profile of that slug.
        """
        return (self._profile(user_options) or {}).get("spawner_override") or {}

    def vgpu_what(self, user_options) -> str:
        """The chosen profile, by its slug (the default one where ``user_options`` name none).

        Raises:
            ValueError: no profile of that slug.
        """
        profile = self._profile(user_options)
        return f"The profile {profile['slug']!r}" if profile else "Your server's profile"

    def _vgpu_apply_profile(self) -> dict | None:
        """Set the chosen profile's overrides on this spawner (undoing the last spawn's).

        Raises:
            SlurmRefused: ``user_options`` name anything but ``profile``. batchspawner
                renders every user option into the batch script (``cmd``, ``gres``,
                ``options``...), which would let a user rewrite their job around the slice.
        """
        for name, value in self._vgpu_saved.items():
            setattr(self, name, value)
        self._vgpu_saved = {}
        unknown = sorted(set(self.user_options or {}) - {"profile"})
        if unknown:
            raise SlurmRefused(
                f"Unknown spawn option(s) {', '.join(map(repr, unknown))}: a server on Slurm takes "
                'only a profile ({"profile": <slug>})'
            )
        try:
            profile = self._profile(self.user_options)
        except ValueError as e:
            raise QuotaExceeded(str(e)) from None
        for name, value in ((profile or {}).get("spawner_override") or {}).items():
            if not self.has_trait(name):
                raise SlurmRefused(f"The profile {profile['slug']!r} sets {name!r}, which is no setting here")
            self._vgpu_saved.setdefault(name, getattr(self, name))
            setattr(self, name, value)
        return profile

    # -- sizing and placing the slice -------------------------------------------------

    def vgpu_describe_choice(self, ask, sized: Size) -> str:
        """The spawn form's line for a choice (mode ``gpu``: on a whole GPU)."""
        return describe(sized, self.vgpu_isolation(ask), whole=ask["mode"] == "gpu")

    def vgpu_multi_card_refusal(self, ask) -> str:
        """Why mode ``shard`` takes no slice of several cards."""
        return (
            f"a slice of {ask['gpu_count']} GPUs takes whole GPUs on Slurm: vgpu_gres 'gpu' "
            "(a job's shards all come from one GPU)"
        )

    def vgpu_size(self, ask, effective, what: str) -> Size:
        """The sizes ``ask`` gets under the quota ``effective``: in mode ``gpu`` the
        largest GPU of the partition, all of it guaranteed, on each card.

        Raises:
            hub_spawner.profiles.QuotaExceeded: it asks for more than the quota, or a
                whole GPU is more than the quota's budget.
        """
        sized = super().vgpu_size(ask, effective, what)
        if ask["mode"] != "gpu":
            return sized
        allocator = self.vgpu_hub.allocator
        card = max((g.memory for g in allocator.shared if self._in_partition(g)), default=0)
        if card > effective.memory_limit:
            raise QuotaExceeded(
                f"A whole GPU ({card / 2**30:.2f} GiB) is more than your vGPU quota of "
                f"{effective.memory_limit / 2**30:.2f} GiB; choose a smaller profile or ask an admin."
            )
        return dataclasses.replace(sized, memory_limit=card, memory_request=card) if card else sized

    async def vgpu_refresh_nodes(self) -> None:
        """Read the cluster's nodes (``vgpu_nodes_cmd``) and give the allocator their GPUs.

        Raises:
            SlurmRefused: Slurm does not answer.
        """
        try:
            text = await self.run_command(self.vgpu_nodes_cmd)
        except RuntimeError as e:
            raise SlurmRefused(f"Slurm does not answer ({self.vgpu_nodes_cmd}): {e}") from None
        nodes = slurm_nodes.parse_nodes(text)
        VGPUSlurmSpawner._nodes = {n.name: n for n in nodes}
        hub = self.vgpu_hub
        board = hub.nodes
        reports = {}
        for node in nodes:
            report = board.report(node.name)
            if report is not None:
                reports[node.name] = list(report.devices)
        inventory = hub.inventory
        found, problems = slurm_nodes.devices(
            nodes,
            reports,
            gpu_memory=None if self.vgpu_gpu_memory is None else int(self.vgpu_gpu_memory),
            simulate=inventory.simulate,
            simulated_memory=int(inventory.simulated_memory),
            simulated_name=inventory.simulated_name,
        )
        if problems != VGPUSlurmSpawner.vgpu_node_problems:
            for p in problems:
                self.log.warning("vGPU: %s", p)
        VGPUSlurmSpawner.vgpu_node_problems = problems
        allocator = hub.allocator
        known = {d.uuid for d in found}
        held = {p.gpu_uuid for p in allocator.placements.values()}
        # a device that left Slurm's list keeps the slices placed on it until they stop
        allocator.gpus = found + [g for g in allocator.gpus if g.uuid not in known and g.uuid in held]
        allocator.unavailable = "; ".join(problems) or "no Slurm node has a GPU (Gres=gpu:…)"
        partition = self.req_partition
        if partition and not any(partition in n.partitions for n in nodes if n.gpus):
            offered = sorted({p for n in nodes if n.gpus for p in n.partitions})
            raise SlurmRefused(
                f"Slurm has no GPU node in partition {partition!r} (partitions with GPUs: "
                f"{', '.join(offered) or 'none'}); ask an admin"
            )

    def _in_partition(self, gpu: GPU) -> bool:
        """Whether ``gpu``'s node is in the job's partition (any, without one)."""
        node = VGPUSlurmSpawner._nodes.get(gpu.node)
        return node is not None and (not self.req_partition or self.req_partition in node.partitions)

    def vgpu_place(self) -> Slice:
        """Size this server's slice (settings after the profile's overrides, and the
        quota) and place it on a GPU of the cluster.

        Raises:
            hub_spawner.profiles.QuotaExceeded: more than the quota.
            hub_spawner.placement.PlacementError: no GPU has room.
        """
        hub = self.vgpu_hub
        allocator = hub.allocator
        ask = self.vgpu_ask()
        effective = self.vgpu_resolve()
        sized = self.vgpu_size(ask, effective, self.vgpu_what(self.user_options))
        limit, request = sized.memory_limit, sized.memory_request  # mode gpu: a whole card
        count = sized.gpu_count
        cards = allocator.place_cards(
            self.vgpu_key, limit, sized.compute_share, hub.placement, request,
            only=self._in_partition, count=count,
        )  # fmt: skip
        gpu = cards[0]
        node = VGPUSlurmSpawner._nodes.get(gpu.node)
        per_gpu = node.shards_per_gpu if node else 0
        if count > 1:
            gres, shards = f"gpu:{count}", 0  # whole cards (vgpu_ask: mode gpu)
        elif ask["mode"] == "gpu":
            # every shard of one GPU, so that no shard job shares it (Slurm 22.05 lets a
            # gpu:1 job and shard jobs share a card); gpu:1 on a node without shards
            gres, shards = (f"shard:{per_gpu}", per_gpu) if per_gpu else ("gpu:1", 0)
        else:
            try:
                shards = slurm_nodes.shards_for(request, gpu.memory, per_gpu)
            except ValueError:
                allocator.release(self.vgpu_key)
                raise PlacementError(
                    f"Slurm node {gpu.node} has no GPU shards (gres.conf: Name=shard Count=…): ask an admin"
                ) from None
            gres = f"shard:{shards}"
        self.vgpu_where = {
            "node": gpu.node,
            "job_id": "",
            "gres": gres,
            "shards": shards,
            "shards_per_gpu": per_gpu,
        }
        self.vgpu_slice = self.vgpu_new_slice(gpu, sized, self.vgpu_isolation(ask), more=cards[1:])
        self.log.info("vGPU slice for %s: %s; asks Slurm for %s", self._log_name, self.vgpu_describe(), gres)
        return self.vgpu_slice

    def vgpu_describe(self) -> str:
        where = self.vgpu_where.get("node")
        text = super().vgpu_describe()
        return f"Slurm node {where}, {text}" if where else text

    # -- the job ----------------------------------------------------------------------

    def _vgpu_event(self, progress: int, message: str) -> None:
        self._vgpu_events.append({"progress": progress, "message": message})
        self.log.info("vGPU spawn of %s: %s", self._log_name, message)

    async def _get_batch_script(self, **subvars):
        """batchspawner's script with the slice's GRES and node (``#SBATCH`` lines right
        after the first line)."""
        if self.vgpu_slice is not None and self.vgpu_where:
            subvars["gres"] = self.vgpu_where["gres"]
        script = await super()._get_batch_script(**subvars)
        if self.vgpu_slice is None or not self.vgpu_where:
            return script
        head, _, rest = script.partition("\n")
        ours = f"#SBATCH --nodelist={self.vgpu_where['node']}\n"
        if "--gres=" not in script:
            ours += f"#SBATCH --gres={self.vgpu_where['gres']}\n"
        return f"{head}\n{ours}{rest}"

    async def start(self):
        self._vgpu_foreign = None  # a new server: what the database said before is gone
        self._vgpu_events = []
        self._vgpu_done = False
        try:
            self._vgpu_apply_profile()
            await self.vgpu_refresh_nodes()
            self.vgpu_place()
            self._vgpu_event(40, f"Placed your vGPU slice on {self.vgpu_describe()}")
            return await self._vgpu_run_job()
        except BaseException:
            self.vgpu_release()
            raise
        finally:
            self._vgpu_done = True

    async def _vgpu_run_job(self):
        """Submit the job, wait until it runs (or Slurm's refusal), record where it
        landed, wait for the server's port; batchspawner's start, with Slurm's reasons."""
        self.ip = self.traits()["ip"].default_value
        self.port = self.traits()["port"].default_value
        if self.server:
            self.server.port = self.port
        try:
            await self.submit_batch_script()
        except RuntimeError as e:
            raise SlurmRefused(f"Slurm refused your server's job: {_slurm_words(e)}") from None
        if not self.job_id:
            raise SlurmRefused("Slurm accepted no job (sbatch printed no job id); ask an admin")
        where = self.vgpu_where
        where["job_id"] = self.job_id
        self._vgpu_event(
            50, f"Submitted Slurm job {self.job_id} to node {where['node']} (--gres={where['gres']})"
        )
        since, told = time.monotonic(), None
        while True:
            status = await self.query_job_status()
            if status == JobStatus.RUNNING:
                break
            if status == JobStatus.NOTFOUND:
                message = (
                    f"Slurm job {self.job_id} ended before your server started; its log is "
                    f"jupyterhub_slurmspawner_{self.job_id}.log in {self.req_homedir}"
                )
                self.clear_state()
                raise SlurmRefused(message)
            place = await self._vgpu_read_job()
            reason = place.reason if place is not None else "unknown"
            if reason != told and reason not in ("None", ""):
                self._vgpu_event(55, f"Slurm job {self.job_id} is pending: {reason}")
                told = reason
            waited = time.monotonic() - since
            if waited >= self.vgpu_pending_timeout:
                await self.cancel_batch_job()
                raise SlurmRefused(
                    f"Slurm kept your server's job {self.job_id} pending for {waited:.0f} s on node "
                    f"{where['node']} ({reason}) and it was cancelled: the GPU shards it needs "
                    f"(--gres={where['gres']}) are taken there. Try again later, or ask an admin."
                )
            await asyncio.sleep(self.startup_poll_interval)
        place = await self._vgpu_read_job()
        if place is not None:
            self.vgpu_locate(place)
        node = VGPUSlurmSpawner._nodes.get(where["node"])
        self.ip = node.address if node else self.state_gethost()
        s = self.vgpu_slice
        self._vgpu_event(
            70,
            f"Slurm job {self.job_id} runs on node {where['node']}, GPU {s.gpu_index}; starting your server",
        )
        await self._vgpu_port()
        self.log.info("Slurm job %s of %s serves at %s:%s", self.job_id, self._log_name, self.ip, self.port)
        return self.ip, self.port

    async def _vgpu_port(self) -> None:
        """Wait for the server's port, which batchspawner's API sets when the server posts it."""
        known = asyncio.Event()

        def seen(change):
            if change.new:
                known.set()

        self.observe(seen, "port")
        try:
            if self.port == 0:
                await known.wait()
        finally:
            self.unobserve(seen, "port")

    async def _vgpu_read_job(self) -> slurm_nodes.JobPlace | None:
        """The job as ``vgpu_job_cmd`` shows it, or None when Slurm does not say."""
        try:
            text = await self.run_command(self.vgpu_job_cmd.format(job_id=self.job_id))
        except RuntimeError as e:
            self.log.warning("vGPU: cannot read Slurm job %s: %s", self.job_id, e)
            return None
        return slurm_nodes.parse_job(text)

    def vgpu_locate(self, place: slurm_nodes.JobPlace) -> Slice:
        """Record the node and GPUs the running job got: Slurm picks the GPUs within the
        node, so the slice (and the Hub's placement) moves to them if they differ."""
        where = self.vgpu_where
        if place.node:
            where["node"] = place.node
        if place.user:
            where["account"] = place.user
            where["uid"] = place.uid
        count = len(self.vgpu_slice.gpu_uuids) if self.vgpu_slice is not None else 1
        if len(place.gpu_indices) >= count:
            allocator = self.vgpu_hub.allocator
            on_node = {g.index: g for g in allocator.gpus if g.node == where["node"]}
            devices = [on_node.get(i) for i in place.gpu_indices[:count]]
            if all(devices):
                self._vgpu_move_to(devices)
        return self.vgpu_slice

    def _vgpu_move_to(self, devices: Sequence[GPU]) -> bool:
        """Put the slice (and its placement) on ``devices``, one per card of the slice,
        the first first.

        Returns:
            True when the slice changed.
        """
        allocator = self.vgpu_hub.allocator
        s = self.vgpu_slice
        if s is None or tuple(d.uuid for d in devices) == s.gpu_uuids:
            return False
        first, *more = devices
        old = allocator.placements.get(self.vgpu_key)
        if old is not None:
            known = {g.uuid for g in allocator.gpus}
            allocator.gpus.extend(d for d in devices if d.uuid not in known)
            allocator.restore(
                Placement(
                    self.vgpu_key, first.uuid, old.memory_limit, old.compute_share, old.memory_request,
                    tuple(d.uuid for d in more),
                )
            )  # fmt: skip
        try:
            self.vgpu_slice = s.replace(
                gpu_uuid=first.uuid,
                gpu_index=first.index,
                gpu_name=first.name,
                gpu_memory=first.memory,
                more_gpus=tuple(Card(d.uuid, d.index, d.memory) for d in more),
            )
        except SliceError as e:
            uuids = [d.uuid for d in devices]
            self.log.error("vGPU: cannot record %s's GPUs %s: %s", self._log_name, uuids, e)
            return False
        self.log.info("vGPU slice of %s is on %s", self._log_name, ", ".join(d.label for d in devices))
        return True

    def vgpu_relocate(self, board) -> bool:
        """Take the GPUs from the node arbiter's report of this job's node: those it saw
        the job's processes on, else the reported GPUs of the slice's indices (placeholders
        until the node reported). Simulated slices stay.

        Returns:
            True when the slice changed (its state is then saved).
        """
        where, s = self.vgpu_where, self.vgpu_slice
        if not where.get("job_id") or s is None or s.simulated:
            return False
        report = board.report(where["node"])
        if report is None:
            return False
        found = board.devices_of(where["node"], f"job:{where['job_id']}", s.gpu_uuids, len(s.gpu_uuids))
        if found is None:
            whole = {d.index: d for d in report.devices if d.mig_profile is None}
            found = [whole.get(i) for i in s.gpu_indices]
        if not all(found) or not self._vgpu_move_to(found):
            return False
        if self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
            self.user.db.commit()
        return True

    async def progress(self):
        """The slice's placement, the job's submission, Slurm's pending reasons and where
        it landed, as they happen."""
        seen = 0
        while True:
            while seen < len(self._vgpu_events):
                yield self._vgpu_events[seen]
                seen += 1
            if self._vgpu_done:
                return
            await asyncio.sleep(0.25)

    def get_env(self) -> dict[str, str]:
        # Slurm shows the job the GPU its GRES are on (CUDA_VISIBLE_DEVICES); the Hub's
        # host's arbiter socket and MPS pipes mean nothing on a node.
        socket = self.vgpu_arbiter_socket.replace("{node}", self.vgpu_where.get("node", ""))
        return self.vgpu_node_env(super().get_env(), socket)

    def vgpu_listing(self) -> dict[str, Any]:
        """Where the slice runs, for ``GET /hub/api/vgpu/slices``: ``node``, ``job_id``
        (the node arbiter knows the job's processes by it), ``slurm_gres``, and the
        ``account`` Slurm runs the job as (None until it runs)."""
        where = self.vgpu_where
        if not where:
            return {}
        return {
            "node": where["node"],
            "job_id": where["job_id"] or None,
            "slurm_gres": where["gres"],
            "account": where.get("account"),
        }

    def vgpu_account(self) -> tuple[int | None, str] | None:
        """``(uid, name)`` of the account Slurm runs the job as (``scontrol show job``'s
        ``UserId``), or None before it runs."""
        name = self.vgpu_where.get("account")
        return (self.vgpu_where.get("uid"), name) if name else None

    # -- quota changes ----------------------------------------------------------------

    def _vgpu_resized(self, effective) -> tuple[int, int, int, int]:
        """``(limit, request, share, priority)`` for a running job under ``effective``: the
        profile's sizes capped at the new quota; the guarantee at most what the job's
        shards hold (Slurm does not resize a running job's GRES)."""
        ask = self.vgpu_ask()
        s = self.vgpu_slice

        def capped(field):
            quota = getattr(effective, field)
            return quota if ask[field] is None else min(ask[field], quota)

        if ask["mode"] == "gpu":  # the whole card stays the job's
            return s.memory_limit, s.memory_request, capped("compute_share"), capped("priority")

        limit = capped("memory_limit")
        held = slurm_nodes.shard_bytes(
            self.vgpu_where.get("shards", 0), s.gpu_memory, self.vgpu_where.get("shards_per_gpu", 0)
        )
        request = min(capped("memory_request"), limit, held or limit)
        return limit, request, capped("compute_share"), capped("priority")

    def vgpu_check_update(self, effective) -> None:
        limit, request, _, _ = self._vgpu_resized(effective)
        self.vgpu_hub.allocator.check_resize(self.vgpu_key, limit, request)

    def vgpu_update(self, effective) -> Slice:
        """The budget, share and priority follow the quota; the guarantee too, up to the
        shards Slurm holds for the job."""
        limit, request, share, priority = self._vgpu_resized(effective)
        self.vgpu_hub.allocator.resize(self.vgpu_key, limit, share, request)
        self.vgpu_slice = self.vgpu_slice.replace(
            memory_limit=limit, memory_request=request, compute_share=share, priority=priority
        )
        self.orm_spawner.state = self.get_state()
        self.user.db.commit()
        return self.vgpu_slice

    async def stop(self, now=False):
        """batchspawner's stop (``scancel``, then wait for the job to leave), or, with no
        job to cancel (a spawn that never submitted one, a server of another kind of
        spawner ended at load), only the slice's release."""
        if not self.job_id:
            self.vgpu_release()
            return
        return await super().stop(now=now)

    # -- the Hub's books --------------------------------------------------------------

    def vgpu_restore(self, state: dict[str, Any]) -> None:
        """The slice's devices join the allocator (until the next look at Slurm lists the
        nodes again) and its placement is restored there."""
        s = self.vgpu_slice
        allocator = self.vgpu_hub.allocator
        known = {g.uuid for g in allocator.gpus}
        node = self.vgpu_where.get("node")
        cards = [(s.gpu_uuid, s.gpu_index, s.gpu_memory), *((c.uuid, c.index, c.memory) for c in s.more_gpus)]
        for uuid, index, memory in cards:
            if uuid not in known:
                allocator.gpus.append(GPU(index, uuid, s.gpu_name, memory, s.simulated, node=node))
        super().vgpu_restore(state)


def _slurm_words(error: Exception) -> str:
    """sbatch's message without its ``sbatch: error:`` prefixes, one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    words = [re.sub(r"^sbatch: error: (Batch job submission failed: )?", "", line) for line in lines]
    return "; ".join(dict.fromkeys(words)) or "no reason given"
