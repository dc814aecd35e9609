"""Seconds from a spawn request to a ready server: on a real Slurm cluster, and with the
local spawner.

Slurm: the demo Hub on ``scripts/slurm-cluster`` (slurmctld, munge, two slurmd nodes in
network namespaces, two simulated 16 GiB GPUs of 16 shards each per node, a node arbiter
per node), placement ``spread``: ten users, each with a 4 GiB quota, spawn one after
another; each spawn goes through sbatch, Slurm's scheduling, ``srun`` and the server's
start in the job, and is timed from the POST to ``/hub/api/users/{name}/server`` to the
``ready`` event of its progress stream (what the spawn page waits for). Local: the same
ten spawns with the demo Hub's local spawner. Every server stays up until the end, so
later spawns share the machine with the earlier servers, as on a Hub filling up.

    python benchmarks/slurm_spawn.py --out benchmarks/results/slurm-cpu.json

Needs root and Debian's Slurm and munge (``scripts/install``).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import provenance

from jupyter_vgpu.testing.hub_process import HubProcess
from jupyter_vgpu.testing.percentiles import percentile
from jupyter_vgpu.testing.slurm_cluster import SlurmCluster, hub_api_url, slurm_hub, why_not

USERS = [f"user{i:02d}" for i in range(10)]


def timed_spawn(hub: HubProcess, user: str) -> float:
    """Seconds from the spawn request to the progress stream's ``ready`` event.

    Raises:
        RuntimeError: the spawn failed (with its message).
    """
    start = time.monotonic()
    r = hub.api("POST", f"/users/{user}/server", json={})
    if r.status_code not in (201, 202):
        raise RuntimeError(f"spawn {user}: {r.status_code} {r.text}")
    if r.status_code == 201:
        return time.monotonic() - start
    with hub.api("GET", f"/users/{user}/server/progress", stream=True) as stream:
        for line in stream.iter_lines(decode_unicode=True):
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if event.get("ready"):
                return time.monotonic() - start
            if event.get("failed"):
                raise RuntimeError(f"spawn {user} failed: {event.get('message')}")
    raise RuntimeError(f"spawn {user}: the progress stream ended without ready")


def run(hub: HubProcess) -> list[float]:
    for user in USERS:
        hub.user_token(user)
        r = hub.api("PUT", f"/vgpu/quotas/users/{user}", json={"memory_limit": "4G"})
        assert r.status_code == 200, r.text
    return [timed_spawn(hub, user) for user in USERS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the JSON result here")
    args = parser.parse_args()
    record = provenance.record()
    reason = why_not()
    if reason:
        sys.exit(f"cannot run a Slurm cluster here: {reason}")

    cluster = SlurmCluster(nodes=2, gpus=2, shards=16).start()
    hub = slurm_hub(cluster, "slurm-bench", {"JUPYTER_VGPU_DEMO_PLACEMENT": "spread"})
    try:
        hub.start()
        cluster.start_arbiters(hub_api_url(cluster, hub))
        slurm_s = run(hub)
        slices = hub.api("GET", "/vgpu/slices").json()
        per_node = collections.Counter(s["node"] for s in slices)
        per_gpu = collections.Counter(f"{s['node']} GPU {s['gpu_index']}" for s in slices)
    finally:
        hub.shutdown()
        cluster.stop()

    local = HubProcess("local-bench")
    try:
        local.start()
        local_s = run(local)
    finally:
        local.shutdown()

    result = {
        **record,
        "benchmark": "spawn request to ready server, 10 users one after another",
        "spawns": len(slurm_s),
        "p50_s": percentile(slurm_s, 50),
        "max_s": max(slurm_s),
        "local_p50_s": percentile(local_s, 50),
        "local_max_s": max(local_s),
        "slurm_s": [round(s, 3) for s in slurm_s],
        "local_s": [round(s, 3) for s in local_s],
        "slices_per_node": dict(sorted(per_node.items())),
        "slices_per_gpu": dict(sorted(per_gpu.items())),
        "cluster": "2 slurmd nodes (network namespaces), 2 simulated 16 GiB GPUs x 16 shards each, spread",
    }
    provenance.write(result, args.out)


if __name__ == "__main__":
    main()
