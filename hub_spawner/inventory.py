"""The GPUs the Hub places slices on: real ones from NVML, or simulated ones.

On a host without an NVIDIA driver (a laptop, CI) the inventory simulates identical
cards, so the whole path hub -> server -> kernel can be run and tested anywhere; every
slice placed on them carries ``simulated=True``.
"""

from __future__ import annotations

import dataclasses
import logging

from jupyterhub.traitlets import ByteSpecification
from traitlets import Bool, Integer, Unicode, default
from traitlets.config import LoggingConfigurable

from jupyter_vgpu import nvml


@dataclasses.dataclass(frozen=True)
class GPU:
    """A GPU slices can be placed on.

    Attributes:
        index: NVML index on the host (0-based).
        uuid: NVML UUID (``GPU-…``); simulated cards use ``GPU-sim-…``.
        name: product name.
        memory: total memory, bytes.
        simulated: no NVML device behind it.
    """

    index: int
    uuid: str
    name: str
    memory: int
    simulated: bool


class GPUInventory(LoggingConfigurable):
    """Lists the GPUs of this host once, at first use."""

    simulate = Bool(
        None,
        allow_none=True,
        help="""Simulate GPUs instead of asking NVML.

        None (default): use NVML's GPUs when a driver answers, else simulate.
        True: always simulate (demos, tests). False: NVML only; no GPU is an error.""",
    ).tag(config=True)

    simulated_count = Integer(2, help="Number of simulated GPUs.").tag(config=True)

    simulated_memory = ByteSpecification(
        80 * 2**30,
        help="Memory of each simulated GPU, bytes or a size string like '80G'.",
    ).tag(config=True)

    simulated_name = Unicode(
        "NVIDIA H100 80GB HBM3 (simulated)", help="Product name shown for simulated GPUs."
    ).tag(config=True)

    _gpus: list[GPU] | None = None

    @default("log")
    def _log_default(self):
        return logging.getLogger("jupyterhub")

    @property
    def gpus(self) -> list[GPU]:
        """The GPUs, in index order (at least one).

        Raises:
            RuntimeError: ``simulate`` is False and NVML finds no GPU.
        """
        if self._gpus is None:
            self._gpus = self._discover()
        return self._gpus

    def _discover(self) -> list[GPU]:
        if self.simulate is not True:
            try:
                found = [
                    GPU(g.index, g.uuid, g.name, g.memory_total, simulated=False) for g in nvml.list_gpus()
                ]
            except nvml.NVMLUnavailable as e:
                found = []
                reason = str(e)
            else:
                reason = "NVML lists no GPU"
            if found:
                self.log.info("vGPU inventory: %s", ", ".join(f"{g.index}: {g.name}" for g in found))
                return found
            if self.simulate is False:
                raise RuntimeError(f"no GPU to place slices on: {reason}")
            self.log.info("vGPU inventory: %s; simulating %d GPU(s)", reason, self.simulated_count)
        return [
            GPU(
                index=i,
                uuid=f"GPU-sim-{i:08x}-0000-4000-8000-000000000000",
                name=self.simulated_name,
                memory=int(self.simulated_memory),
                simulated=True,
            )
            for i in range(self.simulated_count)
        ]

    def by_uuid(self, uuid: str) -> GPU | None:
        """The GPU with this UUID, or None."""
        return next((g for g in self.gpus if g.uuid == uuid), None)
