"""What docs/admin.md installs on a GPU host: the systemd units pass `systemd-analyze
verify` (as systemd itself would load them), and the Hub's config gives what the guide
says (the arbiter a unit of its own, known by its token; servers kept across a restart)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
#: Where the units expect jupyter-vgpu's virtual environment.
PREFIX = "/opt/jupyter-vgpu"


def units() -> list[Path]:
    return sorted(UNITS.glob("*.service"))


def test_the_guide_names_every_unit_and_the_units_live_together():
    guide = (ROOT / "docs" / "admin.md").read_text()
    assert [u.name for u in units()] == ["jupyter-vgpu-arbiter.service", "jupyterhub.service"]
    for unit in units():
        assert f"deploy/systemd/{unit.name}" in guide, unit.name
    assert not (ROOT / "deploy" / "slurm").exists(), "one arbiter unit, for the Hub's host and Slurm nodes"


def test_the_systemd_units_pass_systemd_analyze_verify(tmp_path):
    """Each unit as shipped, its programs taken from this environment instead of
    /opt/jupyter-vgpu (verify checks that ExecStart's program exists): any warning about
    a unit's file (an unknown setting, a bad value, a missing program) fails it."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if os.environ.get("CI"):
            pytest.fail("CI must check the units, but systemd-analyze is missing (scripts/install has it)")
        pytest.skip("systemd-analyze is missing (scripts/install installs Debian's systemd as root)")
    prefix = Path(sys.prefix)
    for program in ("jupyterhub", "jupyter-vgpu-arbiter"):
        assert (prefix / "bin" / program).exists(), f"{program} is not in {prefix}/bin"
    copies = []
    for unit in units():
        text = unit.read_text()
        assert PREFIX + "/bin/" in text, f"{unit.name} does not run jupyter-vgpu's environment"
        copy = tmp_path / unit.name
        copy.write_text(text.replace(PREFIX, str(prefix)))
        copies.append(str(copy))
    done = subprocess.run(
        [analyze, "verify", "--man=no", *copies], capture_output=True, text=True, timeout=120, check=False
    )
    said = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, said
    assert said == "", said


def test_both_units_and_the_hub_config_agree_on_the_socket_and_the_token():
    arbiter = (UNITS / "jupyter-vgpu-arbiter.service").read_text()
    hub = (UNITS / "jupyterhub.service").read_text()
    config = (UNITS / "jupyterhub_config.py").read_text()
    socket = re.search(r"--socket=(\S+)", arbiter)[1]
    assert f'arbiter_socket="{socket}"' in config
    assert "JUPYTERHUB_API_TOKEN=" in arbiter  # its token, in arbiter.env
    assert "JUPYTER_VGPU_ARBITER_TOKEN" in hub
    assert 'os.environ["JUPYTER_VGPU_ARBITER_TOKEN"]' in config
    # the Hub starts after the arbiter, and neither's restart takes the other down
    assert "After=network-online.target jupyter-vgpu-arbiter.service" in hub
    assert "Requires=" not in hub
    assert "KillMode=process" in arbiter  # its MPS daemons outlive a restart


def test_the_hub_config_runs_the_arbiter_outside_the_hub_and_keeps_servers():
    """deploy/systemd/jupyterhub_config.py, loaded as JupyterHub loads it."""
    code = (
        "import json, sys\n"
        "from traitlets.config.loader import PyFileConfigLoader\n"
        "c = PyFileConfigLoader(sys.argv[1]).load_config()\n"
        "print(json.dumps({'services': c.JupyterHub.services, 'roles': c.JupyterHub.load_roles,\n"
        "    'socket': c.VGPUHub.arbiter_socket, 'cleanup': c.JupyterHub.cleanup_servers,\n"
        "    'spawner': c.JupyterHub.spawner_class, 'cgroup': c.VGPUSpawner.cgroup_mode}))\n"
    )
    env = {**os.environ, "JUPYTER_VGPU_ARBITER_TOKEN": "a-token-of-64-hex-digits"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(UNITS / "jupyterhub_config.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    c = json.loads(done.stdout.strip().splitlines()[-1])
    arbiter = next(s for s in c["services"] if s["name"] == "vgpu-arbiter")
    assert arbiter["api_token"] == "a-token-of-64-hex-digits"
    assert "command" not in arbiter  # its own unit runs it, not the Hub
    role = next(r for r in c["roles"] if r["name"] == "vgpu-arbiter")
    assert role["scopes"] == ["read:users"]
    assert c["socket"] == "/run/jupyter-vgpu/arbiter.sock"
    assert c["cleanup"] is False
    assert c["spawner"] == "vgpu"
    assert c["cgroup"] == "systemd"
