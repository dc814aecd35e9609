"""`bash scripts/demo`, stopped as its README says (`bash scripts/demo stop` from another
terminal, or Ctrl-C), then `bash scripts/demo clean`: nothing it started keeps running
(the Hub, its proxy, its node arbiter, a user's server, her kernel and a process her
kernel daemonized out of its process tree), its cgroups are gone, and clean removes the
account it made and its state directory. Issue 43: Ctrl-C left every user's server and
kernel running, and there was no stop at all."""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hub_spawner.demo import settings, system_user
from jupyter_vgpu.host import cgroups
from jupyter_vgpu.testing.hub_process import ARTIFACTS, ROOT, HubProcess, account_prefix
from jupyter_vgpu.testing.kernel_escapes import FROM_A_KERNEL
from jupyter_vgpu.testing.lab_client import LabClient

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the demo's cgroups and accounts need root")

DEMO = ROOT / "scripts" / "demo"
#: A process the kernel daemonizes out of its process tree (a double fork and setsid).
DAEMON = FROM_A_KERNEL["double fork"]


def fresh_user() -> str:
    """A user name whose account no earlier run can have left (the demo removes only
    accounts it made itself)."""
    while True:
        name = f"t{secrets.token_hex(4)}"
        try:
            pwd.getpwnam(system_user.account_name(name, account_prefix()))
        except KeyError:
            return name


def gone(pid: int) -> bool:
    """``pid`` has ended (no such process, or a zombie nobody reaped yet)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def demo(name: str) -> HubProcess:
    """``bash scripts/demo`` in a new state directory, as a user starts it: servers stop
    with the Hub, cgroups under the demo's own parent (neither set by the environment)."""
    hub = HubProcess(name, {"PYTHON": sys.executable}, command=["bash", str(DEMO)])
    for setting in ("JUPYTER_VGPU_DEMO_KEEP_SERVERS", "JUPYTER_VGPU_DEMO_CGROUP_PARENT"):
        hub.env.pop(setting)
    return hub


def started(hub: HubProcess, user: str) -> tuple[dict[str, int], Path]:
    """A user's server with a kernel that daemonized a process: every process the demo
    runs for it, by what it is, and the server's cgroup directory."""
    token = hub.user_token(user)
    lab = LabClient(hub.spawn(user), token=token)
    kernel = lab.start_kernel()
    pids = {
        "hub": int((hub.state_dir / settings.HUB_PID).read_text()),
        "proxy": int((hub.state_dir / "proxy.pid").read_text()),
        "kernel": int(lab.execute(kernel, "import os; print(os.getpid())").strip()),
        "daemon": int(lab.execute(kernel, DAEMON).split("PID=")[1].split()[0]),
    }
    entry = next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == user)
    pids["server"] = entry["pid"]
    arbiter = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "jupyter_vgpu.node" in (p.info["cmdline"] or [])
        and any(str(hub.state_dir) in a for a in p.info["cmdline"])
    ]
    assert len(arbiter) == 1, arbiter
    pids["arbiter"] = arbiter[0]
    assert not any(gone(p) for p in pids.values()), pids
    where = cgroups.Cgroup(entry["cgroup_hierarchy"], entry["cgroup"])
    # the demo's own cgroup parent, named after its state directory
    assert where.path.startswith(settings.cgroup_names(hub.state_dir)[0] + "/"), where
    directory = cgroups.find_mount(where.hierarchy).directory(where.path)
    assert directory.is_dir()
    return pids, directory


def run_demo(*args: str, hub: HubProcess) -> subprocess.CompletedProcess:
    env = {**hub.env, "JUPYTER_VGPU_DEMO_DIR": str(hub.state_dir)}
    return subprocess.run(
        ["bash", str(DEMO), *args], env=env, capture_output=True, text=True, timeout=300, check=False
    )


def assert_nothing_runs(hub: HubProcess, pids: dict[str, int], directory: Path) -> None:
    left = {what: pid for what, pid in pids.items() if not gone(pid)}
    assert not left, f"still running after the demo stopped: {left}\n{hub.log_tail()}"
    assert not directory.exists(), f"{directory} is left"
    parent = settings.cgroup_names(hub.state_dir)[0]
    for mount in cgroups.mounts():
        top = mount.directory(parent)
        assert top is None or not top.exists(), f"{top} is left"


def clean_and_check(hub: HubProcess, user: str) -> None:
    account = hub.account_name(user)
    made = system_user.recorded(hub.state_dir / settings.ACCOUNTS)
    assert account in made, made  # the demo made it, and said so
    pwd.getpwnam(account)
    ARTIFACTS.mkdir(exist_ok=True)
    shutil.copy(hub.log_path, ARTIFACTS / f"{hub.name}-{hub.port}.log")
    done = run_demo("clean", hub=hub)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "clean: nothing of the demo is left" in done.stdout
    assert not hub.state_dir.exists()
    for name in made:
        with pytest.raises(KeyError):
            pwd.getpwnam(name)


def test_scripts_demo_stop_ends_everything_the_demo_started_and_clean_removes_the_rest():
    hub = demo("demo-stop")
    try:
        hub.start()
        user = fresh_user()
        pids, directory = started(hub, user)
        done = run_demo("stop", hub=hub)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"stopping the Hub (pid {pids['hub']})" in done.stdout
        assert "stopped: nothing of the demo runs" in done.stdout
        assert hub.proc.wait(60) is not None  # the demo script in its terminal ended too
        assert_nothing_runs(hub, pids, directory)
        # the Hub stopped the server itself (cleanup_servers), its cgroup's last process
        # (the daemon) ended with it
        assert "Cleaning up single-user servers" in hub.log_path.read_text()
        clean_and_check(hub, user)
    finally:
        hub.shutdown()


def test_ctrl_c_stops_everything_the_demo_started():
    hub = demo("demo-ctrl-c")
    try:
        hub.start()
        user = fresh_user()
        pids, directory = started(hub, user)
        # Ctrl-C: SIGINT to the terminal's foreground process group, the script's
        os.killpg(hub.proc.pid, signal.SIGINT)
        assert hub.proc.wait(120) is not None
        assert "stopped: nothing of the demo runs" in hub.log_path.read_text()
        assert_nothing_runs(hub, pids, directory)
        clean_and_check(hub, user)
    finally:
        hub.shutdown()


def test_each_mode_keeps_its_state_directory(tmp_path):
    """A Slurm demo's Hub on the local demo's state refuses, naming what to do: its
    database names servers the other mode started, which it could neither adopt nor end."""
    local = tmp_path / "state"
    settings.claim(local, "local")
    env = {**os.environ, "JUPYTER_VGPU_DEMO_DIR": str(local), "JUPYTER_VGPU_DEMO_SLURM": "/nonexistent"}
    done = subprocess.run(
        [sys.executable, "-m", "jupyterhub", "-f", str(ROOT / "hub_spawner/demo/slurm_config.py")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert f"{local} is the state directory of the local demo" in done.stdout + done.stderr
    assert settings.read_meta(local)["mode"] == "local"
    assert settings.DEFAULT_DIRS == {"local": ".vgpu-demo", "slurm": ".vgpu-demo-slurm"}
