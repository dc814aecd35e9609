"""A real Slurm cluster for the tests and benchmarks (``scripts/slurm-cluster``): slurmctld,
munge and a slurmd per node, each node in its own network namespace, simulated GPUs as
GRES; and the demo Hub on it (``hub_spawner/demo/slurm_config.py``) with a node arbiter
per node."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .hub_process import ARTIFACTS, ROOT, HubProcess

SCRIPT = ROOT / "scripts" / "slurm-cluster"
CONFIG = ROOT / "hub_spawner" / "demo" / "slurm_config.py"
#: The node arbiters' Hub token in the tests (service vgpu-nodes).
NODE_TOKEN = "slurm-node-arbiters-token-0123456789abcdef"


def why_not() -> str | None:
    """Why this machine cannot run the cluster (not root, Slurm missing, ...), or None."""
    if importlib.util.find_spec("batchspawner") is None:
        return "batchspawner is not installed (pip install -e '.[slurm]'; scripts/install does)"
    r = subprocess.run(["bash", str(SCRIPT), "check"], capture_output=True, text=True, check=False)
    return None if r.returncode == 0 else (r.stdout.strip() or r.stderr.strip() or "unknown")


class SlurmCluster:
    """``scripts/slurm-cluster start`` in a new directory; :meth:`stop` ends it.

    Args:
        nodes, gpus, shards: nodes, simulated GPUs per node, shards per GPU (1 GiB each).
    """

    def __init__(self, nodes: int = 2, gpus: int = 2, shards: int = 16):
        self.dir = Path(tempfile.mkdtemp(prefix="vgpu-slurm-"))
        self.dir.chmod(0o755)  # users' jobs read its slurm.conf and reach its arbiters' sockets
        self.size = (nodes, gpus, shards)
        self.info: dict = {}

    def start(self) -> SlurmCluster:
        subprocess.run(
            ["bash", str(SCRIPT), "start", str(self.dir), *map(str, self.size)],
            check=True,
            capture_output=True,
            text=True,
        )
        self.info = json.loads((self.dir / "cluster.json").read_text())
        return self

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": self.info["conf"]}

    def run(self, *command: str, check: bool = True) -> str:
        """A Slurm command (sbatch, squeue, scontrol, ...) against this cluster; its stdout."""
        r = subprocess.run(command, env=self.env, capture_output=True, text=True, check=False, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(command)}: exit {r.returncode}: {r.stderr}")
        return r.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -d -o`` of one job as ``{field: value}`` (the first of each)."""
        out: dict[str, str] = {}
        for token in self.run("scontrol", "show", "job", "-d", "-o", job_id).split():
            key, _, value = token.partition("=")
            out.setdefault(key, value)
        return out

    def start_arbiters(self, api_url: str, *args: str) -> None:
        subprocess.run(
            ["bash", str(SCRIPT), "arbiters", str(self.dir), api_url, *args],
            check=True,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHON": sys.executable, "JUPYTER_VGPU_NODE_TOKEN": NODE_TOKEN},
        )

    def arbiter_socket(self, node: str) -> str:
        return str(self.dir / "arbiter" / node / "arbiter.sock")

    def stop(self) -> None:
        """Stop every daemon, keep the logs in ``test-artifacts/slurm-<folder>/``, remove the folder."""
        subprocess.run(["bash", str(SCRIPT), "stop", str(self.dir)], check=False, capture_output=True)
        if (self.dir / "log").is_dir():
            shutil.copytree(self.dir / "log", ARTIFACTS / f"slurm-{self.dir.name}", dirs_exist_ok=True)
        shutil.rmtree(self.dir, ignore_errors=True)


def slurm_hub(cluster: SlurmCluster, name: str, extra_env: dict[str, str] | None = None) -> HubProcess:
    """The demo Hub on ``cluster`` (not started)."""
    return HubProcess(
        name,
        {
            "JUPYTER_VGPU_DEMO_SLURM": str(cluster.dir / "cluster.json"),
            "JUPYTER_VGPU_DEMO_NODE_TOKEN": NODE_TOKEN,
            "SLURM_CONF": cluster.info["conf"],
            **(extra_env or {}),
        },
        config=CONFIG,
    )


def hub_api_url(cluster: SlurmCluster, hub: HubProcess) -> str:
    """The Hub's API as the nodes reach it (on the cluster's bridge)."""
    return f"http://{cluster.info['host_address']}:{hub.env['JUPYTER_VGPU_DEMO_HUB_PORT']}/hub/api"
