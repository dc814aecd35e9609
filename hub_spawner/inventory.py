"""The devices the Hub places slices on: real GPUs and MIG instances from NVML, or
simulated ones when asked.

Simulation happens only when configured (``GPUInventory.simulate = True``; the demo
asks for it when no driver answers). On a GPU host whose driver fails, the inventory
is empty and says why (:attr:`GPUInventory.problems`): the Hub then refuses to spawn
slices with that reason on the spawn page, instead of placing real users on GPUs that
do not exist.

Each device has an isolation backend (``time-slicing``, ``mps`` or ``mig``): a GPU in
MIG mode offers its MIG instances, each placed whole (``mig``); any other GPU is
shared with the backend ``VGPUHub.isolation`` or its per-GPU override.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from jupyterhub.traitlets import ByteSpecification
from traitlets import Bool, Dict, Enum, Integer, List, TraitError, Unicode, validate
from traitlets.config import LoggingConfigurable

from jupyter_vgpu import nvml

#: A MIG profile name: GPU slices, memory in GB, optional extensions ("1g.10gb+me").
MIG_PROFILE = re.compile(r"([1-8])g\.([0-9]{1,4})gb(\+[a-z]+)?", re.ASCII)
#: Compute slices of a whole GPU in MIG mode (A100, H100, H200).
MIG_SLICES = 7


@dataclasses.dataclass(frozen=True)
class GPU:
    """A device slices can be placed on: a whole GPU, or one MIG instance of a GPU.

    Attributes:
        index: NVML index on the host (0-based); a MIG instance's parent GPU.
        uuid: NVML UUID (``GPU-…``, ``MIG-…``); simulated devices use ``GPU-sim-…``
            and ``MIG-sim-…``.
        name: product name (MIG instances: ``"<GPU name> MIG <profile>"``).
        memory: total memory, bytes.
        simulated: no NVML device behind it.
        isolation: how it is shared, one of ``jupyter_vgpu.slice.ISOLATIONS``.
        mig_profile: the MIG profile (``"3g.40gb"``) of a MIG instance, else None.
        compute_percent: a MIG instance's share of its GPU's SMs, percent, else None.
        node: the Kubernetes node it is on (a node arbiter's report), else None (this host).
    """

    index: int
    uuid: str
    name: str
    memory: int
    simulated: bool
    isolation: str = "time-slicing"
    mig_profile: str | None = None
    compute_percent: int | None = None
    node: str | None = None

    @property
    def exclusive(self) -> bool:
        """One slice at most, taking the whole device (a MIG instance)."""
        return self.mig_profile is not None

    @property
    def label(self) -> str:
        """``"GPU 0"``, or ``"GPU 1 MIG 3g.40gb"`` for a MIG instance; on a Kubernetes node
        its name first (``"gpu-node-1 GPU 0"``)."""
        where = f"{self.node} " if self.node else ""
        return f"{where}GPU {self.index}" + (f" MIG {self.mig_profile}" if self.mig_profile else "")


@dataclasses.dataclass(frozen=True)
class Card:
    """A physical GPU as discovered: the GPU, and its MIG instances when in MIG mode."""

    gpu: GPU
    mig: tuple[GPU, ...] | None = None


class GPUInventory(LoggingConfigurable):
    """Lists the GPUs (and MIG instances) of this host once, at first use."""

    simulate = Bool(
        False,
        help="""Simulate GPUs instead of asking NVML (demos, tests, CI).

        False (default): NVML's GPUs only. A host whose driver fails then has no GPU:
        the Hub logs why and refuses to spawn slices with that reason on the spawn
        page. True: simulate `simulated_count` cards and never ask NVML.""",
    ).tag(config=True)

    source = Enum(
        ["nvml", "nodes"],
        default_value="nvml",
        help="""Where the GPUs come from. 'nvml' (default): this host's NVML (the Hub runs
        on the GPU host). 'nodes': the node arbiters' reports and the Kubernetes nodes'
        allocatable resources (VGPUKubeSpawner; hub_spawner.kube.setup sets it); NVML is
        never asked on the Hub's host.""",
    ).tag(config=True)

    simulated_count = Integer(2, help="Number of simulated GPUs (when `simulate` is True).").tag(config=True)

    simulated_memory = ByteSpecification(
        80 * 2**30,
        help="Memory of each simulated GPU, bytes or a size string like '80G'.",
    ).tag(config=True)

    simulated_name = Unicode(
        "NVIDIA H100 80GB HBM3 (simulated)", help="Product name shown for simulated GPUs."
    ).tag(config=True)

    simulated_mig_profiles = Dict(
        key_trait=Unicode(),
        value_trait=List(Unicode()),
        help="""Simulated GPUs in MIG mode, by index, with the profiles of their MIG
        instances, e.g. {"1": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]}. A simulated
        instance has the profile's memory in GiB ("3g.40gb": 40 GiB) and the profile's
        share of the GPU's 7 compute slices. Only with `simulate` True.""",
    ).tag(config=True)

    @validate("simulated_mig_profiles")
    def _check_profiles(self, proposal):
        for key, profiles in proposal.value.items():
            if not key.isdigit() or not key.isascii():
                raise TraitError(f"GPUInventory.simulated_mig_profiles: key {key!r} is not a GPU index")
            for p in profiles:
                if not MIG_PROFILE.fullmatch(p):
                    raise TraitError(
                        f"GPUInventory.simulated_mig_profiles: {p!r} is not a MIG profile like '3g.40gb'"
                    )
        return proposal.value

    _cards: list[Card] | None = None
    _error: str | None = None
    _failing: dict[int, str] = {}  # cards NVML listed but could not query at discovery, by index

    @property
    def cards(self) -> list[Card]:
        """The physical GPUs, in index order; empty when NVML failed (see :attr:`error`)."""
        if self._cards is None:
            self._cards = self._discover()
        return self._cards

    @property
    def error(self) -> str | None:
        """Why there is no GPU (NVML failed or listed none), or None."""
        self.cards  # noqa: B018 - discovery sets it
        return self._error

    def devices(self, isolation: str = "time-slicing", per_gpu: Mapping[str, str] | None = None):
        """``(devices, problems)``: what slices can be placed on, and why some GPU (or
        every GPU) cannot take any.

        Args:
            isolation: the backend of GPUs not in MIG mode (``VGPUHub.isolation``).
            per_gpu: overrides by GPU index (``"0"``) or UUID (``VGPUHub.gpu_isolation``).

        A GPU in MIG mode contributes its instances (``isolation="mig"``) whatever the
        setting; a GPU configured for ``mig`` but not in MIG mode contributes nothing
        and a problem saying how to enable it.
        """
        per_gpu = per_gpu or {}
        devices: list[GPU] = []
        problems: list[str] = [self.error] if self.error else []
        problems += self._failing.values()
        for card in self.cards:
            g = card.gpu
            wanted = per_gpu.get(g.uuid, per_gpu.get(str(g.index), isolation))
            if card.mig is not None:
                if wanted != "mig":
                    self.log.info(
                        "vGPU: GPU %d is in MIG mode: its %d MIG instance(s) are placed whole "
                        "(isolation %r does not apply to it)",
                        g.index,
                        len(card.mig),
                        wanted,
                    )
                if not card.mig:
                    problems.append(f"GPU {g.index} ({g.name}) is in MIG mode but has no MIG instance")
                devices.extend(card.mig)
            elif wanted == "mig":
                problems.append(
                    f"GPU {g.index} ({g.name}) is configured for MIG but is not in MIG mode "
                    f"(enable it with `nvidia-smi -i {g.index} -mig 1` and create instances)"
                )
            else:
                devices.append(dataclasses.replace(g, isolation=wanted))
        return devices, problems

    def down(self, devices: list[GPU]) -> dict[str, str]:
        """Which of ``devices`` cannot take a slice now, and why: ``{uuid: why}`` for each
        whose card no longer answers NVML (fell off the bus, or :data:`nvml.FAIL_ENV` names
        it; a simulated card only then). One NVML query per card, made now (milliseconds
        on a working card); a MIG instance is down with its card.
        """
        out: dict[str, str] = {}
        asked: dict[int, str | None] = {}
        for d in devices:
            if d.node is not None:
                continue  # a Kubernetes node's device: its arbiter reports on it
            if d.index not in asked:
                if d.simulated:
                    asked[d.index] = nvml.injected_failure(d.uuid, d.index)
                else:
                    try:
                        nvml.device_usage(d.index)
                        asked[d.index] = None
                    except nvml.NVMLUnavailable as e:
                        asked[d.index] = str(e)
            if asked[d.index] is not None:
                out[d.uuid] = asked[d.index]
        return out

    def _discover(self) -> list[Card]:
        if self.source == "nodes":
            self.log.info("vGPU inventory: from the node arbiters' reports (GPUInventory.source = 'nodes')")
            return []
        if self.simulate:
            cards = self._simulated()
            self.log.info(
                "vGPU inventory: simulating %d GPU(s) (GPUInventory.simulate = True)%s",
                len(cards),
                "".join(f"; GPU {c.gpu.index} in MIG mode" for c in cards if c.mig is not None),
            )
            return cards
        try:
            found, failing = nvml.survey()
            self._failing = {
                i: f"GPU {i} takes no slice: {why} (restart the Hub once it answers)"
                for i, why in failing.items()
            }
            cards = []
            for g in found:
                gpu = GPU(g.index, g.uuid, g.name, g.memory_total, simulated=False)
                mig = None
                if g.mig_enabled:
                    mig = tuple(
                        GPU(
                            m.parent_index,
                            m.uuid,
                            m.name,
                            m.memory_total,
                            simulated=False,
                            isolation="mig",
                            mig_profile=m.profile,
                            compute_percent=m.compute_percent,
                        )
                        for m in nvml.mig_devices(g.index)
                    )
                cards.append(Card(gpu, mig))
        except nvml.NVMLUnavailable as e:
            self._error = f"NVML failed on this host: {e}"
            cards = []
        else:
            if not cards:
                self._error = "NVML lists no GPU on this host"
        if cards:
            self.log.info(
                "vGPU inventory: %s",
                ", ".join(
                    f"{c.gpu.index}: {c.gpu.name}"
                    + ("" if c.mig is None else f" (MIG: {len(c.mig)} instances)")
                    for c in cards
                ),
            )
        else:
            self.log.error(
                "vGPU inventory: %s. No vGPU slice can be placed: spawns will be refused until the "
                "NVIDIA driver works (set c.GPUInventory.simulate = True only for a demo).",
                self._error,
            )
        return cards

    def _simulated(self) -> list[Card]:
        cards = []
        for i in range(self.simulated_count):
            gpu = GPU(
                index=i,
                uuid=f"GPU-sim-{i:08x}-0000-4000-8000-000000000000",
                name=self.simulated_name,
                memory=int(self.simulated_memory),
                simulated=True,
            )
            profiles = self.simulated_mig_profiles.get(str(i))
            mig = None
            if profiles is not None:
                mig = tuple(
                    GPU(
                        index=i,
                        uuid=f"MIG-sim-{i:08x}-{n:04x}-4000-8000-000000000000",
                        name=f"{self.simulated_name} MIG {p}",
                        memory=int(MIG_PROFILE.fullmatch(p)[2]) * 2**30,
                        simulated=True,
                        isolation="mig",
                        mig_profile=p,
                        compute_percent=round(100 * int(MIG_PROFILE.fullmatch(p)[1]) / MIG_SLICES),
                    )
                    for n, p in enumerate(profiles)
                )
            cards.append(Card(gpu, mig))
        return cards
