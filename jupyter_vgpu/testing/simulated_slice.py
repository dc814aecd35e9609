"""A slice of a simulated H100 for tests: the fields every test would otherwise repeat."""

from __future__ import annotations

from jupyter_vgpu.slice import Slice

GiB = 2**30


def simulated_slice(**changes) -> Slice:
    """An 8 GiB, 50% slice of GPU 0, a simulated ``NVIDIA H100 80GB HBM3`` (80 GiB), with
    ``changes`` (any :class:`~jupyter_vgpu.slice.Slice` field) applied.

    Raises:
        ValueError: the fields make no valid slice (as :class:`Slice` does).
    """
    fields = dict(
        gpu_uuid="GPU-sim-0",
        gpu_index=0,
        gpu_name="NVIDIA H100 80GB HBM3 (simulated)",
        gpu_memory=80 * GiB,
        memory_limit=8 * GiB,
        compute_share=50,
        simulated=True,
    )
    fields.update(changes)
    return Slice(**fields)
