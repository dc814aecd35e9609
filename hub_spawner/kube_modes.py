"""What a vGPU slice asks of Kubernetes: the pod's GPU resources for each sharing mode.

Pure functions, no I/O, no Kubernetes client: :mod:`hub_spawner.kube` applies the
result to the pod KubeSpawner builds. On Kubernetes the cluster, not the Hub, decides
which node and GPU a pod gets; the Hub only says how much it wants, in the terms of
the device plugin or DRA driver that shares the GPUs:

``whole``
    ``nvidia.com/gpu: 1``, one whole card for the pod (NVIDIA device plugin,
    "Scheduling GPUs" in the Kubernetes documentation).
``mig``
    one MIG instance, ``nvidia.com/mig-<profile>: 1`` (the device plugin's ``mixed``
    MIG strategy, "GPU Operator with MIG" in NVIDIA's documentation).
``hami``
    HAMi's three resources: ``nvidia.com/gpu: 1`` (one vGPU), ``nvidia.com/gpumem``
    (device memory in **MiB**, an integer) and ``nvidia.com/gpucores`` (percent of the
    card's compute, 0-100). HAMi's scheduler picks the card and HAMi-core, preloaded
    in the container, limits memory and compute there; past the memory limit the
    process gets a CUDA out-of-memory error (HAMi's README, "Device resources").
    The resource names are HAMi's defaults and configurable there, so they are
    arguments here.
``dra``
    no extended resource: the pod names a ResourceClaim (``spec.resourceClaims`` and
    the container's ``resources.claims``, Kubernetes "Dynamic Resource Allocation"):
    either its own, made from a ResourceClaimTemplate, or a *shared* ResourceClaim
    that other notebook pods name too. The claim's configuration carries the sharing
    strategy for NVIDIA's DRA driver (``GpuConfig`` with ``sharing.strategy``
    ``TimeSlicing`` or ``MPS``; ``deploy/kubernetes/dra-claims.yaml``). A
    device allocated to one claim is not allocated to another, so a claim from a
    template gives its pod a GPU of its own (the strategy then shares it among that
    pod's processes); pods of several users share a GPU by naming one shared claim.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from .inventory import MIG_PROFILE, MIG_SLICES

#: The sharing modes, in the order the README's table lists them.
MODES = ("whole", "mig", "hami", "dra")

#: DRA sharing strategies by the slice isolation they give (NVIDIA's DRA driver names).
DRA_STRATEGIES = {"time-slicing": "TimeSlicing", "mps": "MPS"}

#: HAMi's default resource names (its Helm chart's ``resourceName``, ``resourceMem``,
#: ``resourceCores``).
HAMI_RESOURCES = {"gpu": "nvidia.com/gpu", "memory": "nvidia.com/gpumem", "cores": "nvidia.com/gpucores"}

#: The pod annotation HAMi's scheduler writes with the devices it gave each container:
#: ``"<uuid>,<type>,<memory MiB>,<cores %>:"`` per device, ``;`` after each container
#: (HAMi "Protocol design": ``GPU-0fc3…,NVIDIA,3000,0:;``).
HAMI_ALLOCATED = "hami.io/vgpu-devices-allocated"

#: The name of the pod's resource claim in ``dra`` mode.
CLAIM_NAME = "vgpu"

MiB = 2**20

#: The modes a slice of several GPUs may use: the device plugin (``whole``) and HAMi
#: give a container several cards for a count of them; a MIG instance is one device,
#: and a DRA claim's device count is its template's, which the slice does not set.
MULTI_CARD_MODES = ("whole", "hami")


@dataclasses.dataclass(frozen=True)
class GPURequest:
    """What the notebook container and its pod ask for.

    Attributes:
        limits: extended resources for the container's ``resources.limits``, values as
            Kubernetes quantities (strings of integers). For extended resources a limit
            alone is the request too.
        pod_claims: entries for the pod's ``spec.resourceClaims`` (camelCase keys).
        container_claims: entries for the container's ``resources.claims``.
        isolation: the slice's isolation backend under this mode (``mig``, ``mps`` or
            ``time-slicing``; HAMi's limits are recorded as ``time-slicing`` until the
            slice contract names HAMi).
    """

    limits: dict[str, str]
    pod_claims: list[dict]
    container_claims: list[dict]
    isolation: str


def mig_resource(profile: str) -> str:
    """The device plugin's resource for a MIG profile: ``"1g.10gb"`` ->
    ``"nvidia.com/mig-1g.10gb"``.

    Raises:
        ValueError: not a MIG profile name.
    """
    if not isinstance(profile, str) or not MIG_PROFILE.fullmatch(profile):
        raise ValueError(f"a MIG profile is named like '1g.10gb'; got {profile!r}")
    return f"nvidia.com/mig-{profile}"


def mig_memory(profile: str) -> int:
    """A MIG profile's nominal memory, bytes: its GB figure taken as GiB (``"3g.40gb"``:
    40 GiB). NVML's figure is slightly less (9984 MiB for a 1g.10gb on an H100); the
    node arbiter reports the real one once the pod runs."""
    return int(MIG_PROFILE.fullmatch(profile)[2]) * 2**30


def mig_compute(profile: str) -> int:
    """A MIG profile's share of its GPU's compute slices, percent (``"3g.40gb"``: 43)."""
    return round(100 * int(MIG_PROFILE.fullmatch(profile)[1]) / MIG_SLICES)


def gpu_request(
    mode: str,
    *,
    memory_limit: int,
    compute_share: int,
    mig_profile: str | None = None,
    dra_template: str | None = None,
    dra_claim: str | None = None,
    dra_sharing: str = "time-slicing",
    hami_resources: Mapping[str, str] = HAMI_RESOURCES,
    count: int = 1,
) -> GPURequest:
    """The pod's GPU request for a slice.

    Args:
        mode: one of :data:`MODES`.
        memory_limit: the slice's budget, bytes (``hami``: rounded down to whole MiB,
            at least 1 MiB).
        compute_share: percent, 1-100 (``hami``: ``gpucores``).
        mig_profile: the MIG profile (``mig`` only).
        dra_template: the ResourceClaimTemplate's name (``dra``, a claim of the pod's own).
        dra_claim: a shared ResourceClaim's name (``dra``; preferred over the template).
        dra_sharing: ``"time-slicing"`` or ``"mps"``, the strategy ``dra_template``
            configures (``dra`` only).
        hami_resources: HAMi's resource names, keys ``gpu``, ``memory``, ``cores``.
        count: cards, from 1 (``whole`` and ``hami`` only: :data:`MULTI_CARD_MODES`);
            HAMi's ``gpumem`` and ``gpucores`` hold on each card.

    Raises:
        ValueError: unknown mode, what the mode needs is missing or malformed, or
            several cards in a mode that gives one.
    """
    if count < 1:
        raise ValueError(f"a slice has at least one GPU, not {count}")
    if count > 1 and mode not in MULTI_CARD_MODES:
        raise ValueError(multi_card_refusal(mode, count))
    if mode == "whole":
        return GPURequest({"nvidia.com/gpu": str(count)}, [], [], "time-slicing")
    if mode == "mig":
        if mig_profile is None:
            raise ValueError("mode 'mig' needs a MIG profile (vgpu_mig_profile, e.g. '1g.10gb')")
        return GPURequest({mig_resource(mig_profile): "1"}, [], [], "mig")
    if mode == "hami":
        mib = max(1, memory_limit // MiB)
        limits = {
            hami_resources["gpu"]: str(count),
            hami_resources["memory"]: str(mib),
            hami_resources["cores"]: str(compute_share),
        }
        return GPURequest(limits, [], [], "time-slicing")
    if mode == "dra":
        if dra_sharing not in DRA_STRATEGIES:
            raise ValueError(f"DRA sharing must be one of {', '.join(DRA_STRATEGIES)}; got {dra_sharing!r}")
        if dra_claim:
            source = {"resourceClaimName": dra_claim}
        elif dra_template:
            source = {"resourceClaimTemplateName": dra_template}
        else:
            raise ValueError(f"mode 'dra' needs a ResourceClaim or ResourceClaimTemplate for {dra_sharing!r}")
        return GPURequest({}, [{"name": CLAIM_NAME, **source}], [{"name": CLAIM_NAME}], dra_sharing)
    raise ValueError(f"vGPU mode must be one of {', '.join(MODES)}; got {mode!r}")


def multi_card_refusal(mode: str, count: int) -> str:
    """Why mode ``mode`` cannot give a slice of ``count`` cards (the message a
    misconfigured profile is shown with)."""
    return (
        f"a slice of {count} GPUs needs vgpu_mode {' or '.join(map(repr, MULTI_CARD_MODES))} "
        f"(mode {mode!r} gives one device)"
    )


_HAMI_DEVICE = re.compile(r"(?P<uuid>[^,:;]+),(?P<type>[^,:;]*),(?P<memory>[0-9]+),(?P<cores>[0-9]+)")


def hami_devices(annotation: str | None) -> list[list[dict]]:
    """The devices in HAMi's :data:`HAMI_ALLOCATED` annotation, per container.

    Returns:
        one list per container (in the pod's container order), each of
        ``{"uuid": str, "type": str, "memory": bytes, "cores": percent}``; ``[]`` for
        None or an empty annotation. Malformed devices are left out.
    """
    if not annotation:
        return []
    containers = []
    for part in annotation.split(";")[:-1] if annotation.endswith(";") else annotation.split(";"):
        devices = []
        for text in filter(None, part.split(":")):
            m = _HAMI_DEVICE.fullmatch(text.strip())
            if m:
                devices.append(
                    {
                        "uuid": m["uuid"],
                        "type": m["type"],
                        "memory": int(m["memory"]) * MiB,
                        "cores": int(m["cores"]),
                    }
                )
        containers.append(devices)
    return containers
