"""MPS clients on the real card: the SMs and the speed a slice's compute share gives.

The arbiter's MPS control daemon (:class:`jupyter_vgpu.node.mps.MPSDaemons`) on the
first GPU, and three clients started with the environment the spawner gives a server
(:meth:`Slice.environment`): a 100% share with no pinned limit; a 25% share with a 2 GiB
budget (MPS's pinned limit); the same with the pausable allocator preloaded, as kernels
run. Each reports the SMs it sees, the seconds of 100 bf16 8192² matmuls after three warm
ones, and whether 1 GiB and 3 GiB are allocated or refused.

``goals`` (the issue's): the 25% client sees at most a quarter of the SMs (two more
for rounding), runs the matmuls at least 2× slower than the 100% client, and is refused
3 GiB where 1 GiB is allocated, with and without the pausable allocator.
(``tests/gpu/test_mps.py`` checks the same behaviour with bounds a busy machine meets.)

Usage (GPU machine): ``python benchmarks/mps.py --out benchmarks/results/mps-h100.json``
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed copy

import provenance  # noqa: E402
from gpu_common import require_gpu  # noqa: E402

from jupyter_vgpu import nvml  # noqa: E402
from jupyter_vgpu.slice import Slice  # noqa: E402
from jupyter_vgpu.testing.mps_client import client_environment, own_daemons  # noqa: E402
from jupyter_vgpu.testing.mps_client import run as client  # noqa: E402

GiB = 1 << 30
#: The issue's bound: a 25% client at least this many times slower than a 100% one.
SLOWER_GOAL = 2.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    require_gpu(parser)
    record = provenance.record()
    gpu = nvml.list_gpus()[0]
    with own_daemons([gpu.uuid]) as daemons:
        if not daemons.running(gpu.uuid):
            raise SystemExit(f"the MPS control daemon did not start on {gpu.uuid}")
        pipe = str(daemons.directories(gpu.uuid)[0])
        full = Slice.on_card(gpu, gpu.memory_total, 100, isolation="mps")
        quarter = Slice.on_card(gpu, 2 * GiB, 25, isolation="mps")

        def env(slice_: Slice, preload: bool) -> dict[str, str]:
            return client_environment(slice_, pipe, preload)

        clients = {
            "100% share, no pinned limit": client(env(full, False)),
            "25% share, 2 GiB budget": client(env(quarter, False)),
            "25% share, 2 GiB budget, pausable allocator preloaded": client(env(quarter, True)),
        }
    whole = clients["100% share, no pinned limit"]
    parts = [v for k, v in clients.items() if k.startswith("25%")]
    result = {
        **record,
        "gpu": gpu.name,
        "clients": clients,
        "matmul": "100 bf16 8192x8192 matmuls, seconds",
        "goals": {
            "quarter_sees_at_most_a_quarter_of_the_sms": all(
                p["sms"] <= math.ceil(0.25 * whole["sms"]) + 2 for p in parts
            ),
            f"quarter_at_least_{SLOWER_GOAL:g}x_slower": all(
                p["matmul_s"] >= SLOWER_GOAL * whole["matmul_s"] for p in parts
            ),
            "quarter_refused_3_gib_given_1_gib": all(
                p["1_gib"] == "allocated" and p["3_gib"].startswith("refused") for p in parts
            ),
        },
    }
    provenance.write(result, args.out)


if __name__ == "__main__":
    main()
