"""A Slurm cluster's GPU nodes as the Hub sees them, and what a slice asks of Slurm.

Pure functions, no I/O: :mod:`hub_spawner.slurm` runs ``scontrol`` and hands the text
here. The Hub places slices itself (its allocator, binpack or spread, overcommit) on the
GPUs of the partition's nodes, then asks Slurm for that node and as many GPU *shards*
as the slice's guaranteed memory needs (Slurm's ``shard`` GRES, 22.05 and later: a GPU's
``Count`` shards in ``gres.conf``, each job holding some, several jobs per GPU). The
GPUs come from:

- the node arbiter's report (:mod:`hub_spawner.nodes`): NVML's UUID, name and memory of
  each GPU, by NVML index, which is Slurm's GRES index where ``gres.conf`` lists the
  devices in order (``File=/dev/nvidia[0-3]``; ``AutoDetect=nvml`` where Slurm has it);
- else the node's ``Gres=gpu:<count>`` and the memory the admin names
  (``VGPUSlurmSpawner.vgpu_gpu_memory``), with placeholder ids ``<node>/gpu-<index>``
  until its arbiter reports;
- or simulated GPUs (``GPUInventory.simulate``): ``Gres=gpu:<count>`` of the simulated
  size, for test clusters whose GPUs are dummy device files.
"""

from __future__ import annotations

import dataclasses
import math
import re

from .inventory import GPU

#: A GRES entry of ``scontrol show node``: ``gpu:2``, ``gpu:a100:4(S:0-1)``, ``shard:32``,
#: ``shard:a100:32``.
_GRES = re.compile(r"(?P<name>[a-z]+)(?::(?P<type>[^:,()]+))?:(?P<count>[0-9]+)(?:\([^)]*\))?")
#: The allocation of ``scontrol show job -d``: ``GRES=shard:3(IDX:0)``, ``GRES=gpu:2(IDX:0-1)``.
_IDX = re.compile(r"\(IDX:(?P<idx>[0-9,\-]+)\)")


@dataclasses.dataclass(frozen=True)
class SlurmNode:
    """One node of ``scontrol show node -o``.

    Attributes:
        name: its NodeName.
        address: its NodeAddr (where its servers listen).
        state: its State (``IDLE``, ``MIXED``, ``ALLOCATED``, ``DOWN+DRAIN``, ...).
        partitions: the partitions it is in.
        gpus: its ``gpu`` GRES count.
        shards: its ``shard`` GRES count (every GPU's together).
    """

    name: str
    address: str
    state: str
    partitions: tuple[str, ...]
    gpus: int
    shards: int

    @property
    def shards_per_gpu(self) -> int:
        """Shards of each GPU (gres.conf gives each GPU the same Count; 0 without shards)."""
        return self.shards // self.gpus if self.gpus else 0

    @property
    def usable(self) -> bool:
        """Slurm may start jobs on it (not down, drained, failing or powered off)."""
        bad = ("DOWN", "DRAIN", "FAIL", "POWER", "NOT_RESPONDING", "INVAL", "FUTURE")
        return not any(word in self.state for word in bad)


def _fields(line: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def gres_counts(gres: str) -> dict[str, int]:
    """The count of each GRES name in a ``Gres=`` value (types summed):
    ``"gpu:a100:2(S:0),shard:16"`` -> ``{"gpu": 2, "shard": 16}``; ``"(null)"`` -> ``{}``."""
    counts: dict[str, int] = {}
    for m in _GRES.finditer(gres or ""):
        counts[m["name"]] = counts.get(m["name"], 0) + int(m["count"])
    return counts


def parse_nodes(text: str) -> list[SlurmNode]:
    """The nodes of ``scontrol show node -o`` (one node a line), in its order."""
    nodes = []
    for line in text.splitlines():
        f = _fields(line)
        if not f.get("NodeName"):
            continue
        counts = gres_counts(f.get("Gres", ""))
        nodes.append(
            SlurmNode(
                name=f["NodeName"],
                address=f.get("NodeAddr") or f["NodeName"],
                state=f.get("State", ""),
                partitions=tuple(p for p in f.get("Partitions", "").split(",") if p),
                gpus=counts.get("gpu", 0),
                shards=counts.get("shard", 0),
            )
        )
    return nodes


@dataclasses.dataclass(frozen=True)
class JobPlace:
    """Where a running job landed (``scontrol show job -d -o``).

    Attributes:
        state: its JobState (``RUNNING``, ``PENDING``, ...).
        reason: why it waits (``Resources``, ``Priority``, ...; ``None`` when it does not).
        node: the node its GPU GRES is on ('' before it runs).
        gpu_indices: Slurm's GRES indices of the GPUs its ``gpu`` or ``shard`` GRES are on.
        user: the account it runs as, ``UserId``'s name (``vgpu-ada(999)`` -> ``vgpu-ada``).
        uid: that account's uid, or None where Slurm does not say.
    """

    state: str
    reason: str
    node: str
    gpu_indices: tuple[int, ...]
    user: str = ""
    uid: int | None = None


def _indices(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        if low.isdigit():
            out.extend(range(int(low), int(high or low) + 1))
    return out


def parse_job(text: str) -> JobPlace:
    """A job's state, reason and placement from ``scontrol show job -d -o <id>``.

    The detail part names each node and what it got: ``Nodes=vgpu-n1 CPU_IDs=0 Mem=0
    GRES=shard:3(IDX:0)``; the first node with a ``gpu`` or ``shard`` GRES is the job's.
    Slurm writes the reason's spaces as ``_`` in this form; they are given back here.
    """
    f = _fields(text)
    node, indices = "", ()
    current = ""
    for token in text.split():
        if token.startswith("Nodes="):
            current = token[len("Nodes=") :]
        elif token.startswith("GRES=") and current and not node:
            gres = token[len("GRES=") :]
            m = _IDX.search(gres)
            if m and re.match(r"(gpu|shard)\b", gres):
                node, indices = current, tuple(_indices(m["idx"]))
    if not node and f.get("JobState") == "RUNNING":
        node = f.get("BatchHost") or f.get("NodeList", "")
    m = re.fullmatch(r"(?P<user>[^()]*)(?:\((?P<uid>[0-9]+)\))?", f.get("UserId", ""))
    user, uid = (m["user"], int(m["uid"]) if m["uid"] else None) if m else ("", None)
    return JobPlace(f.get("JobState", ""), f.get("Reason", "").replace("_", " "), node, indices, user, uid)


def devices(
    nodes: list[SlurmNode],
    reports: dict[str, list[GPU]],
    *,
    gpu_memory: int | None = None,
    simulate: bool = False,
    simulated_memory: int = 0,
    simulated_name: str = "",
) -> tuple[list[GPU], list[str]]:
    """The GPUs slices may be placed on, and why some node offers none.

    Args:
        nodes: the cluster's nodes (:func:`parse_nodes`).
        reports: each node's GPUs as its arbiter reported them (``GPU.node`` set).
        gpu_memory: bytes of each GPU of a node whose arbiter has not reported; None: such
            a node offers nothing until it reports.
        simulate: simulated GPUs (``GRES gpu`` count of them, ``simulated_memory`` bytes
            and ``simulated_name`` each), whatever the reports say.

    Returns:
        ``(devices, problems)``: one :class:`GPU` per GPU of each usable node with a
        ``gpu`` GRES, node by node in Slurm's order, index = Slurm's GRES index.
    """
    out: list[GPU] = []
    problems: list[str] = []
    for node in nodes:
        if not node.gpus:
            continue
        if not node.usable:
            problems.append(f"Slurm node {node.name} is {node.state}: no slice goes there")
            continue
        whole = [d for d in reports.get(node.name, []) if d.mig_profile is None]
        reported = sorted(whole, key=lambda d: d.index)
        name = node.name
        for i in range(node.gpus):
            if simulate:
                out.append(GPU(i, f"GPU-sim-{name}-{i}", simulated_name, simulated_memory, True, node=name))
            elif i < len(reported):
                out.append(dataclasses.replace(reported[i], index=i, node=name))
            elif gpu_memory:
                out.append(GPU(i, f"{name}/gpu-{i}", "NVIDIA GPU", gpu_memory, False, node=name))
            else:
                problems.append(
                    f"Slurm node {node.name}: GPU {i} is not known yet (its node arbiter has not reported, "
                    "and VGPUSlurmSpawner.vgpu_gpu_memory is not set)"
                )
    return out, problems


def shards_for(memory_request: int, gpu_memory: int, shards_per_gpu: int) -> int:
    """Shards a guarantee of ``memory_request`` bytes takes on a GPU of ``gpu_memory``
    bytes cut into ``shards_per_gpu`` shards: rounded up, at least 1, at most all."""
    if shards_per_gpu <= 0 or gpu_memory <= 0:
        raise ValueError("a GPU without shards (gres.conf Name=shard Count=…) cannot be shared by shards")
    return max(1, min(shards_per_gpu, math.ceil(memory_request * shards_per_gpu / gpu_memory)))


def shard_bytes(shards: int, gpu_memory: int, shards_per_gpu: int) -> int:
    """The memory ``shards`` shards stand for on such a GPU, bytes (rounded down)."""
    return gpu_memory * shards // shards_per_gpu if shards_per_gpu else 0
