"""Slices on Kubernetes: :class:`VGPUKubeSpawner`, the slice mixin on KubeSpawner.

``c.JupyterHub.spawner_class = "vgpu-kube"`` (Zero to JupyterHub: ``hub.config``
``JupyterHub.spawner_class``; ``deploy/kubernetes/z2jh-values.yaml`` has the whole
snippet). Needs the ``kubernetes`` extra (``pip install jupyter-vgpu[kubernetes]``).

On Kubernetes the scheduler places pods, so this spawner never picks a GPU. It sizes the
slice (the user's quota, or less where the chosen profile asks for less; more is
refused), turns it into the pod's GPU request for the configured sharing mode
(:mod:`hub_spawner.kube_modes`: ``whole``, ``mig``, ``hami``, ``dra``), mounts the node
arbiter's socket and adds the slice's environment. When the pod runs, the spawner
records where it landed: the node from the pod, the GPU from HAMi's annotation (``hami``)
or from the node arbiter's report (:mod:`hub_spawner.nodes`), which names the GPU a pod's
processes use. Until one of them says, the slice's GPU is :data:`PENDING`; the server and
the arbiter pick the located slice up from the Hub within seconds.

A slice of several cards (``vgpu_gpu_count``, or the quota's ``gpu_count``) asks for that
many in the modes that give a container several (``whole``: ``nvidia.com/gpu: k``;
``hami``: k devices, ``gpumem`` and ``gpucores`` on each); its other cards are
placeholders (``pending-1``, ...) until every card is known: HAMi's annotation names
them all at once, the node arbiter's report once the pod's processes have used each
(or at once on a node with exactly that many GPUs). A slice is never half located.

Quota changes: Kubernetes fixes a running pod's extended resources and claims, so a
running slice keeps its sizes and only its priority follows the quota (as a MIG
instance's does on one host); the next spawn applies the new sizes.
"""

from __future__ import annotations

import asyncio
import posixpath
from collections.abc import Sequence
from typing import Any

from kubernetes_asyncio.client import CoreV1ResourceClaim, V1PodResourceClaim, V1Volume, V1VolumeMount
from kubernetes_asyncio.client.rest import ApiException
from kubespawner import KubeSpawner
from traitlets import Dict, Enum, List, Unicode, default

from jupyter_vgpu.slice import Card, Slice, SliceError

from . import kube_modes, kube_profiles
from .inventory import GPU
from .kube_modes import MODES
from .profiles import ProfileSizedSlice, Size, arbiter_socket_setting, describe, gpu_memory_setting
from .spawner import VGPUSpawnerMixin

#: The slice's ``gpu_uuid`` until the Hub knows which GPU the pod got.
PENDING = "pending"
#: The spawner state's key for the shared claim the pod names.
CLAIM_KEY = "vgpu_claim"
#: Label on the pod naming its sharing mode (for the arbiter and for people).
MODE_LABEL = "jupyter-vgpu/mode"


class VGPUKubeSpawner(VGPUSpawnerMixin, ProfileSizedSlice, KubeSpawner):
    """KubeSpawner with a vGPU slice per server (entry point ``vgpu-kube``).

    Every ``vgpu_*`` setting may be overridden per profile (``kubespawner_override`` in
    ``profile_list``, or in a profile option's choice); sizes left unset (None) come from
    the user's quota, and a profile asking more than the quota is refused
    (:mod:`hub_spawner.profiles`).
    """

    vgpu_kind = "kube"
    vgpu_profile_settings = kube_profiles.SLICE_SETTINGS
    vgpu_multi_card_modes = kube_modes.MULTI_CARD_MODES

    vgpu_mode = Enum(
        list(MODES),
        default_value="hami",
        help="""How the pod gets its GPU: 'whole' (nvidia.com/gpu: 1, an exclusive card),
        'mig' (nvidia.com/mig-<vgpu_mig_profile>: 1, a MIG instance), 'hami' (HAMi's
        nvidia.com/gpu, gpumem in MiB and gpucores in percent, from the slice), 'dra' (a
        ResourceClaim from the template vgpu_dra_claim_templates names for
        vgpu_dra_sharing).""",
    ).tag(config=True)

    vgpu_mig_profile = Unicode(None, allow_none=True, help="The MIG profile ('1g.10gb') of mode 'mig'.").tag(
        config=True
    )

    vgpu_dra_sharing = Enum(
        ["time-slicing", "mps"],
        default_value="time-slicing",
        help="Mode 'dra': how the claimed GPU is shared (NVIDIA's DRA driver: TimeSlicing or MPS).",
    ).tag(config=True)

    vgpu_dra_claim_templates = Dict(
        default_value={"time-slicing": "vgpu-time-slicing", "mps": "vgpu-mps"},
        key_trait=Unicode(),
        value_trait=Unicode(),
        help="""Mode 'dra': the ResourceClaimTemplate (in the pod's namespace) for each
        sharing strategy (a claim, and a GPU, of each pod's own); deploy/kubernetes/dra-claims.yaml
        defines these two.""",
    ).tag(config=True)

    vgpu_dra_shared_claims = Dict(
        key_trait=Unicode(),
        value_trait=List(Unicode()),
        help="""Mode 'dra': shared ResourceClaims (in the pods' namespace) per sharing
        strategy, e.g. {"mps": ["vgpu-mps-0", "vgpu-mps-1"]}: pods of several users name
        the same claim and so share its GPU. A new pod takes the claim fewest running
        slices name (the first on a tie). A strategy without shared claims gives each
        pod a claim of its own from vgpu_dra_claim_templates (a GPU of its own).""",
    ).tag(config=True)

    vgpu_hami_resources = Dict(
        default_value=dict(kube_modes.HAMI_RESOURCES),
        key_trait=Unicode(),
        value_trait=Unicode(),
        help="""Mode 'hami': HAMi's resource names, keys 'gpu', 'memory' (MiB) and
        'cores' (percent); HAMi's defaults unless its chart renamed them.""",
    ).tag(config=True)

    vgpu_gpu_memory = gpu_memory_setting(
        """Memory of the GPUs this profile's pods land on, bytes or a size like '80G',
        for the slice until the node arbiter reports the real card; None: the budget.
        Kernels size their PyTorch memory fraction from it until then."""
    )

    vgpu_arbiter_socket = arbiter_socket_setting(
        """The node arbiter's socket on every GPU node (the DaemonSet's hostPath);
        its folder is mounted read-only at the same path in the notebook container and
        named to kernels in JUPYTER_VGPU_ARBITER (kernels connect through a read-only
        mount; on a node without the arbiter the folder is made empty and kernels run
        without it). '' mounts nothing."""
    )

    #: Where the running pod is: ``{"node", "namespace", "pod", "uid"}`` (empty before it runs).
    vgpu_where: dict[str, str] = {}
    #: The shared ResourceClaim the running slice names (mode 'dra'), or None.
    vgpu_claim: str | None = None
    #: Running slices per shared ResourceClaim, across the Hub's spawners (by vgpu_key).
    _claims: dict[str, set[str]] = {}

    # -- the spawn form ---------------------------------------------------------------

    @default("options_form")
    def _vgpu_kube_options_form(self):
        if not self.profile_list:
            return ""
        return VGPUKubeSpawner._vgpu_render_form

    async def _vgpu_render_form(self) -> str:
        """KubeSpawner's profile form, each profile's description ending with the slice it
        gives (or why it is above the user's quota)."""
        from jupyterhub.utils import maybe_future

        profiles = self._sorted_dict_values(self.profile_list)
        if callable(profiles):
            profiles = await maybe_future(profiles(self))
        profiles = self._get_initialized_profile_list(profiles)
        effective = self.vgpu_resolve()
        lines = {p["slug"]: self.vgpu_choice_line(p["slug"], effective) for p in profiles}
        return self._render_options_form(kube_profiles.annotate(profiles, lines))

    def options_from_form(self, formdata):
        """KubeSpawner's ``user_options`` from the form, refused (the form comes back with
        the message) when the choice asks for more than the user's quota."""
        user_options = KubeSpawner._options_from_form(self, formdata)
        self.vgpu_check_choice(user_options)
        return user_options

    def vgpu_overrides(self, user_options) -> dict[str, Any]:
        """The ``vgpu_*`` overrides ``user_options`` choose, in KubeSpawner's order
        (:func:`hub_spawner.kube_profiles.chosen_overrides`).

        Raises:
            ValueError: no such profile.
        """
        return kube_profiles.chosen_overrides(self, user_options)

    # -- sizing the slice -------------------------------------------------------------

    def vgpu_ask(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """What this spawner's settings ask for, with ``overrides`` (``vgpu_*`` keys)
        taking the place of the settings they name; sizes in bytes.

        Raises:
            traitlets.TraitError: an override is not valid for its setting.
            ValueError: mode ``mig`` without a well-formed MIG profile, or several
                cards in a mode that gives one device (:data:`.kube_modes.MULTI_CARD_MODES`).
        """
        ask = super().vgpu_ask(overrides)
        if ask["mode"] == "mig":
            if not ask["mig_profile"]:
                raise ValueError("vGPU mode 'mig' needs a MIG profile (vgpu_mig_profile, e.g. '1g.10gb')")
            kube_modes.mig_resource(ask["mig_profile"])  # ValueError on a malformed profile
        return ask

    def vgpu_multi_card_refusal(self, ask) -> str:
        """The words :func:`hub_spawner.kube_modes.gpu_request` refuses the pod's request with."""
        return kube_modes.multi_card_refusal(ask["mode"], ask["gpu_count"])

    def vgpu_size(self, ask, effective, what: str) -> Size:
        """The sizes ``ask`` gets under the quota ``effective``: a MIG instance's own
        (:func:`hub_spawner.kube_profiles.mig_size`) in mode ``mig``.

        Raises:
            hub_spawner.profiles.QuotaExceeded: it asks for more than the quota.
        """
        if ask["mode"] == "mig":
            return kube_profiles.mig_size(ask, effective, what=what)
        return super().vgpu_size(ask, effective, what)

    def vgpu_isolation(self, ask: dict[str, Any]) -> str:
        """The slice's isolation backend under ``ask``'s mode."""
        return {"mig": "mig", "dra": ask["dra_sharing"]}.get(ask["mode"], "time-slicing")

    def vgpu_describe_choice(self, ask, sized: Size) -> str:
        """The spawn form's line for a choice: HAMi enforces the compute share in mode ``hami``."""
        return describe(
            sized,
            self.vgpu_isolation(ask),
            mig_profile=ask["mig_profile"],
            whole=ask["mode"] == "whole",
            enforced_by="HAMi" if ask["mode"] == "hami" else None,
        )

    async def load_user_options(self):
        """KubeSpawner applies the chosen profile's overrides; then the slice is sized."""
        await super().load_user_options()
        self.vgpu_place()

    def vgpu_place(self) -> Slice:
        """Size this server's slice from its settings (after the profile's overrides)
        and the user's quota; its GPU is :data:`PENDING` until the pod runs (and its
        other cards, for a slice of several, ``pending-1``, ...).

        Raises:
            hub_spawner.profiles.QuotaExceeded: the settings ask for more than the
                quota (shown on the spawn page).
        """
        ask = self.vgpu_ask()
        sized = self.vgpu_size(ask, self.vgpu_resolve(), self.vgpu_what(self.user_options))
        if ask["mode"] == "hami":
            # HAMi-core shows the container a device of gpumem MiB: that is its card.
            card = max(1, sized.memory_limit // kube_modes.MiB) * kube_modes.MiB
        else:
            card = ask["gpu_memory"] or sized.memory_limit
        name = self.vgpu_device_name(ask)
        pending = [GPU(0, PENDING, name, card, simulated=False)]
        pending += [GPU(i, f"{PENDING}-{i}", name, card, simulated=False) for i in range(1, sized.gpu_count)]
        self.vgpu_slice = self.vgpu_new_slice(pending[0], sized, self.vgpu_isolation(ask), more=pending[1:])
        self.vgpu_where = {}
        self._vgpu_take_claim(ask)
        self.log.info("vGPU slice for %s (mode %s): %s", self._log_name, ask["mode"], self.vgpu_describe())
        return self.vgpu_slice

    def _vgpu_take_claim(self, ask: dict[str, Any]) -> None:
        self._vgpu_drop_claim()
        shared = self.vgpu_dra_shared_claims.get(ask["dra_sharing"]) if ask["mode"] == "dra" else None
        if shared:
            claims = VGPUKubeSpawner._claims
            self.vgpu_claim = min(shared, key=lambda name: len(claims.get(name, ())))
            claims.setdefault(self.vgpu_claim, set()).add(self.vgpu_key)

    def _vgpu_drop_claim(self) -> None:
        if self.vgpu_claim is not None:
            VGPUKubeSpawner._claims.get(self.vgpu_claim, set()).discard(self.vgpu_key)
            self.vgpu_claim = None

    def vgpu_device_name(self, ask: dict[str, Any]) -> str:
        """The slice's ``gpu_name`` before the pod lands (a MIG name carries its profile)."""
        if ask["mode"] == "mig":
            return f"NVIDIA GPU MIG {ask['mig_profile']}"
        return {"whole": "NVIDIA GPU (whole)", "hami": "NVIDIA GPU (HAMi vGPU)"}.get(
            ask["mode"], f"NVIDIA GPU (DRA, {ask['dra_sharing']})"
        )

    def vgpu_gpu_request(self) -> kube_modes.GPURequest:
        """The pod's GPU request for the placed slice (:func:`hub_spawner.kube_modes.gpu_request`)."""
        ask = self.vgpu_ask()
        s = self.vgpu_slice
        template = self.vgpu_dra_claim_templates.get(ask["dra_sharing"])
        return kube_modes.gpu_request(
            ask["mode"],
            memory_limit=s.memory_limit,
            compute_share=s.compute_share,
            mig_profile=ask["mig_profile"],
            dra_template=template,
            dra_claim=self.vgpu_claim,
            dra_sharing=ask["dra_sharing"],
            hami_resources=self.vgpu_hami_resources,
            count=len(s.gpu_uuids),
        )

    # -- the pod ----------------------------------------------------------------------

    async def get_pod_manifest(self):
        """KubeSpawner's pod, with the slice's GPU request, the arbiter's socket and a
        label naming the mode."""
        pod = await super().get_pod_manifest()
        if self.vgpu_slice is None:
            return pod
        request = self.vgpu_gpu_request()
        container = next(c for c in pod.spec.containers if c.name == "notebook")
        container.resources.limits = {**(container.resources.limits or {}), **request.limits}
        if request.pod_claims:
            pod.spec.resource_claims = [
                *(pod.spec.resource_claims or []),
                *(
                    V1PodResourceClaim(
                        name=c["name"],
                        resource_claim_name=c.get("resourceClaimName"),
                        resource_claim_template_name=c.get("resourceClaimTemplateName"),
                    )
                    for c in request.pod_claims
                ),
            ]
            container.resources.claims = [
                *(container.resources.claims or []),
                *(CoreV1ResourceClaim(name=c["name"]) for c in request.container_claims),
            ]
        if self.vgpu_arbiter_socket:
            folder = posixpath.dirname(self.vgpu_arbiter_socket)
            pod.spec.volumes = [
                *(pod.spec.volumes or []),
                V1Volume(name="vgpu-arbiter", host_path={"path": folder, "type": "DirectoryOrCreate"}),
            ]
            container.volume_mounts = [
                *(container.volume_mounts or []),
                V1VolumeMount(name="vgpu-arbiter", mount_path=folder, read_only=True),
            ]
        pod.metadata.labels = {**(pod.metadata.labels or {}), MODE_LABEL: self.vgpu_ask()["mode"]}
        return pod

    def get_env(self) -> dict[str, str]:
        # The device plugin or DRA driver shows the container its GPU; a UUID in
        # CUDA_VISIBLE_DEVICES would hide it (and is not known before the pod lands).
        # MPS here is the DRA driver's daemon, whose pipe directory its CDI spec gives the
        # container; the node's arbiter socket (mounted at the same path) is the
        # spawner's, not the Hub host's.
        return self.vgpu_node_env(super().get_env(), self.vgpu_arbiter_socket)

    # -- the running pod --------------------------------------------------------------

    def start(self):
        # KubeSpawner.start keeps the future of _start for progress(); the mixin's start
        # would size the slice before the profile's overrides are applied.
        self._vgpu_foreign = None  # a new server: what the database said before is gone
        return KubeSpawner.start(self)

    async def _start(self):
        try:
            url = await super()._start()
            pod = self.pod_reflector.pods.get(f"{self.namespace}/{self.pod_name}")
            await self._vgpu_read_node(((pod or {}).get("spec") or {}).get("nodeName"))
            self.vgpu_locate(pod)
            return url
        except BaseException:
            self.vgpu_release()
            raise

    async def _vgpu_read_node(self, name: str | None) -> None:
        """Remember what the pod's node advertises, while its arbiter has not reported
        (needs ``get`` on nodes: ``deploy/kubernetes/hub-rbac.yaml``)."""
        if not name or self.vgpu_hub.nodes.report(name) is not None:
            return
        try:
            node = await asyncio.wait_for(self.api.read_node(name), self.k8s_api_request_timeout)
        except (ApiException, TimeoutError) as e:
            self.log.warning(
                "vGPU: cannot read node %s (%s); its GPUs stay unknown until its arbiter reports", name, e
            )
            return
        self.vgpu_hub.nodes.record_node(self.api.api_client.sanitize_for_serialization(node))

    def vgpu_locate(self, pod: dict | None) -> Slice | None:
        """Record where the running pod landed and, where known, which GPU it got.

        Args:
            pod: the pod as the API returns it (camelCase JSON, KubeSpawner's reflector).

        The GPUs come from HAMi's ``hami.io/vgpu-devices-allocated`` annotation (mode
        ``hami``: every card of the container), else from the node arbiter's latest
        report (:meth:`vgpu_relocate`).
        """
        if pod is None or self.vgpu_slice is None:
            return self.vgpu_slice
        meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
        self.vgpu_where = {
            "node": spec.get("nodeName") or "",
            "namespace": meta.get("namespace") or self.namespace,
            "pod": meta.get("name") or self.pod_name,
            "uid": meta.get("uid") or "",
        }
        if self.vgpu_ask()["mode"] == "hami":
            annotation = (meta.get("annotations") or {}).get(kube_modes.HAMI_ALLOCATED)
            containers = [c.get("name") for c in spec.get("containers") or []]
            devices = kube_modes.hami_devices(annotation)
            index = containers.index("notebook") if "notebook" in containers else 0
            count = len(self.vgpu_slice.gpu_uuids)
            if index < len(devices) and len(devices[index]) >= count:
                self._vgpu_move([(d["uuid"], None, None, None) for d in devices[index][:count]])
        self.vgpu_relocate(self.vgpu_hub.nodes)
        return self.vgpu_slice

    def vgpu_relocate(self, board) -> bool:
        """Take the GPUs from the node arbiter's report of this pod's node, once it names
        every card of the slice (:meth:`hub_spawner.nodes.NodeBoard.devices_of`).

        Args:
            board: the Hub's :class:`hub_spawner.nodes.NodeBoard`.

        Returns:
            True when the slice changed (its state is then saved).
        """
        where = self.vgpu_where
        if not where or self.vgpu_slice is None:
            return False
        ask = self.vgpu_ask()
        profile = ask["mig_profile"] if ask["mode"] == "mig" else None
        uuids = self.vgpu_slice.gpu_uuids
        found = board.devices_of(where["node"], where["uid"], uuids, len(uuids), profile)
        if found is None:
            return False
        before = self.vgpu_slice
        hami = ask["mode"] == "hami"
        self._vgpu_move([(d.uuid, d.index, d.name, None if hami else d.memory) for d in found])
        if self.vgpu_slice != before and self.orm_spawner is not None:
            self.orm_spawner.state = self.get_state()
            self.user.db.commit()
            labels = ", ".join(d.label for d in found)
            self.log.info("vGPU slice of %s is on %s of node %s", self._log_name, labels, where["node"])
        return self.vgpu_slice != before

    def _vgpu_move(self, cards: Sequence[tuple[str, int | None, str | None, int | None]]) -> None:
        """Put the slice on ``cards``, each ``(uuid, index, name, memory in bytes)``
        (None where not known: the slice's own figure stays), as many as it has."""
        s = self.vgpu_slice
        (uuid, index, name, memory), *more = cards
        changes: dict[str, Any] = {"gpu_uuid": uuid}
        if index is not None:
            changes["gpu_index"] = index
        if name and (s.isolation != "mig" or " MIG " in name):
            changes["gpu_name"] = name
        if memory:
            changes["gpu_memory"] = memory
            if s.isolation == "mig":  # a whole instance: its real size is the budget
                changes.update(memory_limit=memory, memory_request=memory)
        if more:
            changes["more_gpus"] = tuple(
                Card(u, old.index if i is None else i, old.memory if m is None else m)
                for (u, i, _, m), old in zip(more, s.more_gpus, strict=True)
            )
        try:
            self.vgpu_slice = s.replace(**changes)
        except SliceError as e:
            self.log.error("vGPU: cannot record %s's GPUs %s: %s", self._log_name, [c[0] for c in cards], e)

    def vgpu_listing(self) -> dict[str, Any]:
        """Where the slice runs, for ``GET /hub/api/vgpu/slices``: ``node``, ``namespace``,
        ``pod`` and ``pod_uid`` (the node arbiter registers the pod by its uid), and
        ``resource_claim`` (the shared ResourceClaim it names, or None)."""
        where = self.vgpu_where
        if not where:
            return {}
        return {
            "node": where["node"],
            "namespace": where["namespace"],
            "pod": where["pod"],
            "pod_uid": where["uid"],
            "resource_claim": self.vgpu_claim,
        }

    # -- quota changes and the Hub's books --------------------------------------------

    def vgpu_check_update(self, effective) -> None:
        """Any quota change fits: the pod keeps its sizes (Kubernetes fixes them)."""

    def vgpu_update(self, effective) -> Slice:
        """Only the priority follows a quota change; the sizes wait for the next spawn."""
        self.vgpu_slice = self.vgpu_slice.replace(priority=effective.priority)
        self.orm_spawner.state = self.get_state()
        self.user.db.commit()
        return self.vgpu_slice

    def vgpu_release(self) -> None:
        # The Kubernetes scheduler placed the slice; no allocator holds it.
        self.vgpu_hub.usage.forget(self.vgpu_key)
        self._vgpu_drop_claim()
        self.vgpu_slice = None
        self.vgpu_where = {}

    def get_state(self) -> dict[str, Any]:
        state = super().get_state()
        if self.vgpu_slice is not None and self.vgpu_claim:
            state[CLAIM_KEY] = self.vgpu_claim
        return state

    def vgpu_restore(self, state: dict[str, Any]) -> None:
        """The Kubernetes scheduler placed the slice: no allocator holds it. The shared
        ResourceClaim it names (mode ``dra``) counts it again."""
        if state.get(CLAIM_KEY):
            self.vgpu_claim = state[CLAIM_KEY]
            VGPUKubeSpawner._claims.setdefault(self.vgpu_claim, set()).add(self.vgpu_key)
