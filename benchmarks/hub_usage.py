"""How long the Hub takes to answer GET /hub/api/vgpu/usage for 200 servers.

The handler's whole work, in process: join 200 running slices with their latest
reports (``hub_spawner.usage.slice_rows``), group them by GPU (``gpu_rows``) and encode
the JSON answer. Stand-in spawners carry real ``Slice`` objects; reports (valid
documents of the ``usage-report`` contract, :mod:`jupyter_vgpu.testing.documents`) go
through the same parser the POST endpoint uses. Goal (issue): under 50 ms.

    python benchmarks/hub_usage.py --out benchmarks/results/hub-usage.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import provenance

from hub_spawner.inventory import GPU
from hub_spawner.usage import UsageBoard, gpu_rows, parse_report, slice_rows
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import documents
from jupyter_vgpu.testing.percentiles import percentile

GiB = 2**30


def setup(servers: int, gpus: int):
    cards = [GPU(i, f"GPU-sim-{i}", "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, True) for i in range(gpus)]
    board = UsageBoard()
    spawners = []
    for n in range(servers):
        card = cards[n % gpus]
        s = Slice(
            card.uuid, card.index, card.name, card.memory, 2 * GiB, 25, overcommit_ratio=4.0, simulated=True
        )
        spawners.append((f"user{n:03d}", types.SimpleNamespace(name="", vgpu_slice=s)))
        kernels = [documents.kernel_usage(str(k), used=GiB // 4, offloaded=GiB // 8) for k in range(3)]
        totals = {
            "used": 3 * GiB // 4,
            "reserved": GiB,
            "offloaded": 3 * GiB // 8,
            "offloaded_compressed": GiB // 4,
        }
        body = documents.report(s, gpu=None, totals=totals, kernels=kernels)
        board.record(f"user{n:03d}/", parse_report(body)[1])
    return cards, board, spawners


def answer(cards, board, spawners) -> bytes:
    rows = slice_rows(spawners, board)
    return json.dumps({"slices": rows, "gpus": gpu_rows(cards, 4.0, rows)}).encode()


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--servers", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    record = provenance.record()
    cards, board, spawners = setup(args.servers, args.gpus)
    answer(cards, board, spawners)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        body = answer(cards, board, spawners)
        times.append(time.perf_counter() - start)
    times.sort()
    result = {
        **record,
        "benchmark": "GET /hub/api/vgpu/usage work (aggregate + JSON), in process",
        "servers": args.servers,
        "gpus": args.gpus,
        "answer_bytes": len(body),
        "ms_median": percentile(times, 50) * 1e3,
        "ms_p95": percentile(times, 95) * 1e3,
        "ms_max": times[-1] * 1e3,
        "goal_ms": 50,
    }
    provenance.write(result, args.out)


if __name__ == "__main__":
    main()
