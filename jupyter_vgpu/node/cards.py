"""The cards of this host as the arbiter sees them: measured by NVML, or simulated.

A simulated card (the slices on it say ``simulated``: CI, laptops, the demo) has no
counters: its memory is the slice's ``gpu_memory`` and its memory in use the sum of
what the kernels on it report holding, so the arbiter keeps the same books and makes
the same decisions, and tests exercise them for real.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable


@dataclasses.dataclass(frozen=True)
class Reading:
    """One look at a card.

    Attributes:
        total: memory, bytes.
        used: memory in use by every process, bytes.
        processes: bytes per PID (the kernels' own figures on a simulated card).
    """

    total: int
    used: int
    processes: dict[int, int]

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


def read(
    uuid: str,
    simulated_total: int | None,
    reported: dict[int, int],
    index: int | None = None,
    reserve: int = 0,
) -> Reading:
    """The card ``uuid`` now, less ``reserve``.

    Args:
        uuid: the card's NVML UUID.
        simulated_total: its memory when it is simulated (None: ask NVML).
        reported: bytes per PID as the kernels report them; the whole truth on a
            simulated card, ignored on a real one.
        index: its NVML index (a simulated card's, from its slices).
        reserve: bytes of the card kept out of the arbiter's reach
            (``ArbiterApp.card_reserve``): taken off its ``total``, so off its free
            memory too; what is in use counts whole.

    Raises:
        jupyter_vgpu.nvml.NVMLUnavailable: the driver does not answer for the card (a
            simulated card: when ``JUPYTER_VGPU_NVML_FAIL`` names it).
    """
    from jupyter_vgpu import nvml

    if simulated_total is not None:
        why = nvml.injected_failure(uuid, index)  # a simulated card fails only when named
        if why is not None:
            raise nvml.NVMLUnavailable(f"GPU {uuid!r}: {why}")
        return Reading(max(0, simulated_total - reserve), sum(reported.values()), dict(reported))

    used, total, _ = nvml.device_usage(uuid)
    return Reading(max(0, total - reserve), used, nvml.process_memory(uuid))


def let_go(before: Reading, now: Reading, pids: Iterable[int]) -> bool:
    """Whether ``now`` shows the memory that ``pids`` (a paused kernel; a suspended kernel
    and its group) let go of since ``before``, two readings of one card: their own bytes
    (NVML's per process) below what they held; where NVML had no figure for them, the
    card's memory in use below what it was.

    The card's total alone is no sign while cells run beside the move: they grow as the
    kernel lets go. Waited for that way (2 s at most), suspends of paused kernels' 0.73 GiB
    contexts took 2.5-3.6 s where the quiet card's took 0.7-0.9 s (48 MLP sessions, seeds
    7 and 11 at 76fac3b, ``benchmarks/results/sessions-h100.json``)."""
    pids = list(pids)
    held = sum(before.processes.get(pid, 0) for pid in pids)
    if held > 0:
        return sum(now.processes.get(pid, 0) for pid in pids) < held
    return now.used < before.used
