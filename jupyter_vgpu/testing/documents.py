"""Valid documents of the contracts (``jupyter_vgpu/contracts``), for tests and benchmarks that send them."""

from __future__ import annotations

import time

from jupyter_vgpu.slice import Slice

GiB = 2**30


def kernel_usage(kernel_id: str = "k1", **changes) -> dict:
    """One kernel's entry of a usage document (contract ``usage``, ``kernels[]``)."""
    entry = {
        "id": kernel_id,
        "name": f"{kernel_id}.ipynb",
        "pid": 4242,
        "execution_state": "idle",
        "used": 0,
        "torch_allocated": 0,
        "torch_reserved": 0,
        "nvml_memory": None,
        "simulated_used": 0,
        "sm_percent": None,
        "offloaded": 0,
        "offloaded_compressed": 0,
        "ratio": None,
        "budget_status": "torch not imported yet: the budget applies when it is",
        "reported": True,
        "stale": False,
        "updated": time.time(),
    }
    entry.update(changes)
    return entry


def usage(slice_: Slice | None, totals: dict | None = None, kernels: list | None = None, **changes) -> dict:
    """A server's usage document (contract ``usage``)."""
    document = {
        "version": 1,
        "slice": slice_.to_dict() if slice_ else None,
        "simulated": slice_ is None or slice_.simulated,
        "pressure": False,
        "timestamp": time.time(),
        "gpu": None,
        "totals": {"used": 0, "reserved": 0, "offloaded": 0, "offloaded_compressed": 0, **(totals or {})},
        "kernels": kernels if kernels is not None else [],
    }
    document.update(changes)
    return document


def report(slice_: Slice | None, server_name: str = "", **usage_changes) -> dict:
    """A usage report's body (contract ``usage-report``)."""
    return {"server_name": server_name, "usage": usage(slice_, **usage_changes)}
