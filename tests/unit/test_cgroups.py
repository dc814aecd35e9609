"""cgroups: what /proc says of a process's cgroups and mounts, real cgroups made as the
spawner makes them (where these tests run as root with a hierarchy mounted read-write),
a process that daemonizes in every way staying in its cgroup and mapped to its server
by the arbiter, and the arbiter's allowlist for processes of no server."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from hub_spawner import server_cgroup
from hub_spawner.demo import system_user
from jupyter_vgpu.host import cgroups, peers
from jupyter_vgpu.host.cgroups import V2, Cgroup
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.server_process import TEST_CGROUP
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
SLICE = Slice("GPU-aaaa", 0, "NVIDIA H100 80GB HBM3", 80 * GiB, 2 * GiB, 50)
HYBRID = """\
9:name=systemd:/
8:pids:/user.slice
2:cpu,cpuacct:/
0::/jupyter-vgpu/ada-default-1a2b3c4d
"""
MOUNTINFO = """\
25 30 0:22 / /sys/fs/cgroup ro,nosuid,nodev,noexec shared:9 - tmpfs tmpfs ro,mode=755
26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,relatime shared:10 - cgroup2 cgroup2 rw,nsdelegate
27 25 0:24 / /sys/fs/cgroup/systemd rw,nosuid,relatime shared:11 - cgroup cgroup rw,xattr,name=systemd
28 25 0:25 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,relatime shared:12 - cgroup cgroup rw,cpu,cpuacct
29 25 0:26 /kubepods/pod1 /sys/fs/cgroup/pids ro,nosuid,relatime shared:13 - cgroup cgroup rw,pids
"""


def test_a_proc_cgroup_text_names_each_hierarchy():
    found = cgroups.parse(HYBRID)
    assert found[V2] == "/jupyter-vgpu/ada-default-1a2b3c4d"
    assert found["name=systemd"] == "/"
    assert found["pids"] == "/user.slice"
    assert found["cpu,cpuacct"] == found["cpu"] == found["cpuacct"] == "/"
    assert cgroups.parse("garbage\n1:x\n") == {}


def test_within_is_by_whole_path_components():
    assert cgroups.within("/a/b", "/a")
    assert cgroups.within("/a", "/a")
    assert cgroups.within("/anything", "/")
    assert not cgroups.within("/ab", "/a")
    assert not cgroups.within("/a", "/a/b")
    ada = Cgroup(V2, "/jupyter-vgpu/ada-default-1a2b3c4d")
    assert ada.holds(cgroups.parse(HYBRID))
    assert not Cgroup(V2, "/jupyter-vgpu/ada").holds(cgroups.parse(HYBRID))
    assert not Cgroup("pids", "/jupyter-vgpu").holds(cgroups.parse(HYBRID))
    assert not ada.holds(None)


def test_cgroup_names_round_trip_and_bad_ones_are_refused():
    assert str(Cgroup.parse_name("/a/b")) == "/a/b"
    assert Cgroup.parse_name("name=systemd:/a/b") == Cgroup("name=systemd", "/a/b")
    assert str(Cgroup("pids", "/x")) == "pids:/x"
    for bad in ("a/b", "pids:a", "/a/../b", ""):
        with pytest.raises(ValueError, match="absolute path"):
            Cgroup.parse_name(bad)


def test_mounts_are_read_from_mountinfo():
    found = cgroups.parse_mounts(MOUNTINFO)
    assert [(m.hierarchy, m.root, m.mountpoint, m.writable) for m in found] == [
        (V2, "/", "/sys/fs/cgroup/unified", True),
        ("name=systemd", "/", "/sys/fs/cgroup/systemd", True),
        ("cpu,cpuacct", "/", "/sys/fs/cgroup/cpu,cpuacct", True),
        ("pids", "/kubepods/pod1", "/sys/fs/cgroup/pids", False),
    ]
    assert cgroups.find_mount("cpuacct", found).mountpoint == "/sys/fs/cgroup/cpu,cpuacct"
    pids = cgroups.find_mount("pids", found)
    assert pids.directory("/kubepods/pod1/c1") == Path("/sys/fs/cgroup/pids/c1")
    assert pids.directory("/elsewhere") is None
    # this machine's own mounts parse, and its own cgroup lies in one of them
    mine = cgroups.of(os.getpid())
    assert mine, "no /proc/self/cgroup"
    assert all(m.mountpoint.startswith("/") for m in cgroups.mounts())


def test_the_spawner_picks_v2_then_v1_and_says_why_when_it_cannot():
    found = cgroups.parse_mounts(MOUNTINFO)
    with pytest.raises(server_cgroup.CgroupUnavailable, match="uid 1000, not root"):
        server_cgroup.probe("cgroupfs", euid=1000, found=found)
    with pytest.raises(server_cgroup.CgroupUnavailable, match="switched off"):
        server_cgroup.probe("off")
    v1_only = [m for m in found if m.hierarchy != V2]
    with pytest.raises(server_cgroup.CgroupUnavailable, match="no cgroup hierarchy is mounted read-write"):
        server_cgroup.probe("cgroupfs", v1_hierarchy="pids", euid=0, found=v1_only)
    with pytest.raises(ValueError, match="cgroup mode must be one of"):
        server_cgroup.probe("sometimes")


def test_systemd_scopes_are_named_and_run_as_systemd_spawner_runs_units():
    unit = server_cgroup.unit_name("Ada Lovelace", "", "1a2b3c4d")
    assert unit == "jupyter-vgpu-Ada_Lovelace-default-1a2b3c4d.scope"
    assert server_cgroup._slice_path("jupyter_vgpu.slice") == "jupyter_vgpu.slice"
    assert server_cgroup._slice_path("a-b.slice") == "a.slice/a-b.slice"
    cmd = server_cgroup.scope_command(
        unit, "jupyter_vgpu.slice", (1001, 1001), ["python", "-m", "x"], "/home/a"
    )
    assert cmd[:2] == ["systemd-run", "--scope"]
    assert f"--unit={unit}" in cmd
    assert "--slice=jupyter_vgpu.slice" in cmd
    setpriv = cmd.index("setpriv")
    assert cmd[setpriv:] == [
        "setpriv",
        "--reuid=1001",
        "--regid=1001",
        "--init-groups",
        "--",
        "python",
        "-m",
        "x",
    ]
    assert "setpriv" not in server_cgroup.scope_command(unit, "s.slice", None, ["x"], "/")


def test_demo_account_names_are_valid_and_never_shared():
    assert system_user.account_name("ada") == "vgpu-ada"
    names = ["Ada", "ada.b", "ada-b", "x" * 40, "root", "vgpu_ada", "ada b", "ådа"]
    accounts = [system_user.account_name(n) for n in names]
    assert len(set(accounts)) == len(names)
    for account in accounts:
        assert len(account) <= 32
        assert account[0].isalpha(), account
        assert all(c.isalnum() or c in "-_" for c in account), account
        assert account.startswith(("vgpu-", "vgpu_"))
    assert system_user.account_name("root") == "vgpu-root"


def test_another_prefix_makes_other_accounts_and_a_bad_one_is_refused(monkeypatch):
    """Demo Hubs side by side (the tests in several processes) give their users accounts of
    their own (JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX): each Hub removes the accounts it made."""
    names = ["ada", "Ada", "x" * 40, "ådа"]
    default = {system_user.account_name(n) for n in names}
    monkeypatch.setenv(system_user.PREFIX_VARIABLE, "vgpu12-")
    assert system_user.account_name("ada") == "vgpu12-ada"
    other = [system_user.account_name(n) for n in names]
    assert len(set(other)) == len(names)
    assert not default & set(other)
    for account in other:
        assert len(account) <= 32, account
        assert account.startswith(("vgpu12-", "vgpu12_")), account
    assert system_user.account_name("ada", "vgpu-") == "vgpu-ada"  # given, it wins
    for bad in ("Vgpu-", "vgpu", "1vgpu-", "vgpu_", "a" * 11 + "-", "vg pu-"):
        monkeypatch.setenv(system_user.PREFIX_VARIABLE, bad)
        with pytest.raises(ValueError, match="account prefix"):
            system_user.account_name("ada")


# -- real cgroups ---------------------------------------------------------------------

needs_cgroups = pytest.mark.skipif(os.geteuid() != 0, reason="making cgroups needs root")

# Python run by the "server": each leaves a process that prints its PID and sleeps,
# outside the server's process tree
DAEMONS = {
    "double fork": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        time.sleep(300)
    os._exit(0)
os.wait()
""",
    "setsid -f": """
import subprocess
subprocess.run(["setsid", "-f", "sh", "-c", "echo $$; exec sleep 300"])
""",
    "nohup and disown": """
import subprocess
subprocess.run(["bash", "-c", "nohup sh -c 'echo $$; exec sleep 300' 2>/dev/null & disown"])
""",
    "start-stop-daemon": """
import subprocess, time
subprocess.run(["start-stop-daemon", "--start", "--background", "--make-pidfile",
                "--pidfile", "{tmp}/ssd.pid", "--exec", "/bin/sleep", "--", "300"])
for _ in range(100):
    try:
        print(int(open("{tmp}/ssd.pid").read()), flush=True)
        break
    except (FileNotFoundError, ValueError):
        time.sleep(0.05)
""",
    "a subreaper that exits": """
import ctypes, os, time
if os.fork() == 0:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    if os.fork() == 0:
        if os.fork() == 0:
            print(os.getpid(), flush=True)
            time.sleep(300)
        os._exit(0)
    time.sleep(0.5)
    os._exit(0)
os.wait()
""",
}


@pytest.fixture
def server_in_cgroup():
    """A 'server' process (a Python that runs code from stdin) in a cgroup made as the
    spawner makes it, running as the unprivileged account nobody; yields
    ``(process, cgroup, directory)``; everything in it is ended afterwards."""
    try:
        host = server_cgroup.probe("cgroupfs", f"{TEST_CGROUP}/unit-{os.getpid()}")
    except server_cgroup.CgroupUnavailable as e:
        pytest.skip(str(e))
    cgroup = Cgroup(host.hierarchy, f"{host.parent}/server-{time.monotonic_ns()}")
    directory = host.mount.directory(cgroup.path)
    directory.mkdir(mode=0o755)
    join = server_cgroup.joiner(directory)
    nobody = system_user.ensure("nobody")

    def preexec():
        join()
        os.setgid(nobody.pw_gid)
        os.setgroups([])
        os.setuid(nobody.pw_uid)

    workdir = Path(tempfile.mkdtemp(prefix="vgpu-cgroup-test-"))  # nobody may write it
    workdir.chmod(0o777)
    process = subprocess.Popen(
        ["/usr/bin/python3", "-c", "import sys; exec(sys.stdin.read())"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
        cwd=workdir,
    )
    try:
        yield process, cgroup, directory, workdir
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        server_cgroup.kill_all(directory)
        process.wait(10)
        wait_for(lambda: not cgroups.procs(directory), 10, f"{directory} to empty")
        directory.rmdir()
        host.mount.directory(host.parent).rmdir()


@needs_cgroups
@pytest.mark.parametrize("how", sorted(DAEMONS))
def test_a_daemon_leaves_the_process_tree_but_not_its_cgroup(server_in_cgroup, how):
    process, cgroup, directory, workdir = server_in_cgroup
    if how == "start-stop-daemon" and not shutil.which("start-stop-daemon"):
        pytest.skip("no start-stop-daemon here")
    process.stdin.write(DAEMONS[how].replace("{tmp}", str(workdir)) + "\nimport time; time.sleep(300)\n")
    process.stdin.close()
    daemon = int(process.stdout.readline())
    # the subreaper case leaves the tree when its subreaper exits, 0.5 s later
    wait_for(lambda: process.pid not in peers.ancestors(daemon), 10, f"{daemon} to leave the server's tree")
    try:
        assert cgroup.holds(cgroups.of(daemon))
        assert daemon in cgroups.procs(directory)
        arbiter = Arbiter(ArbiterApp(registrars="none"))
        arbiter.register(process.pid, "ada", "", SLICE, None, cgroup.path, cgroup.hierarchy)
        assert arbiter.mapping(daemon) == (f"cgroup:{cgroup.path}", "cgroup")
        assert arbiter.mapping(os.getpid()) is None
        # the daemon, as the server's user, cannot move itself out
        moved = subprocess.run(
            [
                "/usr/bin/python3",
                "-c",
                f"open({str(directory.parent / 'cgroup.procs')!r}, 'w').write('{daemon}')",
            ],
            preexec_fn=lambda: (os.setgid(65534), os.setgroups([]), os.setuid(65534)),
            capture_output=True,
            text=True,
        )
        assert "PermissionError" in moved.stderr, moved.stderr
        assert cgroup.holds(cgroups.of(daemon))
    finally:
        server_cgroup.kill_all(directory)
    wait_for(lambda: not peers.alive(daemon) or _zombie(daemon), 10, f"daemon {daemon} to be ended")


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_allowlist_names_programs_root_owns_and_cgroups(tmp_path):
    sleeper = subprocess.Popen(["sleep", "60"])
    impostor_path = tmp_path / "nvidia-smi"
    shutil.copy(shutil.which("sleep"), impostor_path)
    if os.geteuid() == 0:  # a user's copy, as a user would make it
        os.chown(impostor_path, 65534, 65534)
    impostor = subprocess.Popen([str(impostor_path), "60"])
    try:
        strict = Arbiter(ArbiterApp(registrars="none", allowed_executables=["nvidia-smi"]))
        assert strict.allowed(os.getpid()), "the arbiter itself is never denied"
        assert strict.allowed(os.getppid()), "nor whoever started it (the Hub)"
        assert not strict.allowed(sleeper.pid)
        assert not strict.allowed(impostor.pid), "a copy named like an allowed program is not it"
        real = os.path.realpath(shutil.which("sleep"))
        by_name = Arbiter(ArbiterApp(registrars="none", allowed_executables=[os.path.basename(real)]))
        assert by_name.allowed(sleeper.pid), "a program of that name where only root writes"
        by_path = Arbiter(ArbiterApp(registrars="none", allowed_executables=[real]))
        assert by_path.allowed(sleeper.pid)
        assert not by_path.allowed(impostor.pid)
        mine = cgroups.of(sleeper.pid)
        if V2 in mine:
            by_cgroup = Arbiter(
                ArbiterApp(registrars="none", allowed_executables=[], allowed_cgroups=[mine[V2]])
            )
            assert by_cgroup.allowed(sleeper.pid)
            elsewhere = Arbiter(ArbiterApp(registrars="none", allowed_cgroups=["/no-such-cgroup"]))
            assert not elsewhere.allowed(sleeper.pid)
    finally:
        for p in (sleeper, impostor):
            p.kill()
            p.wait()


def test_unowned_policy_follows_over_budget_unless_set():
    assert ArbiterApp().unowned_policy == "report"
    assert ArbiterApp(over_budget="kill").unowned_policy == "kill"
    assert ArbiterApp(over_budget="kill", unowned_policy="report").unowned_policy == "report"
    assert "nvidia-cuda-mps-server" in ArbiterApp().allowed_executables
    assert ArbiterApp().managed_gpus == ["all"]


def test_a_trusted_client_registers_a_server_by_its_cgroup(tmp_path):
    from jupyter_vgpu.host.arbiter_control import ControlError
    from jupyter_vgpu.testing.arbiter_process import ArbiterProcess

    arbiter = ArbiterProcess(tmp_path).start()
    try:
        with arbiter.control() as c:
            c.register(os.getpid() + 10**6, "ada", "", SLICE, cgroup="pids:/jupyter-vgpu/ada-default-1a2b")
            c.register(os.getpid() + 10**6 + 1, "bob", "", SLICE)
            with pytest.raises(ControlError, match="absolute path"):
                c.register(1, "eve", "", SLICE, cgroup="../escape")
            servers = {s["user"]: s for s in c.books()["servers"]}
        assert servers["ada"]["key"] == "ada/"
        assert servers["ada"]["cgroup"] == "pids:/jupyter-vgpu/ada-default-1a2b"
        assert servers["bob"]["cgroup"] is None
        assert "eve" not in servers
    finally:
        arbiter.stop()


def test_the_hub_page_warns_where_users_share_an_account():
    import logging
    from types import SimpleNamespace

    from traitlets.config import Config

    from hub_spawner import isolation
    from hub_spawner.demo.spawner import DemoSpawner
    from hub_spawner.spawner import VGPUSimpleSpawner, VGPUSpawner

    log = logging.getLogger("test")
    parent = f"{TEST_CGROUP}/page-{os.getpid()}"  # where a probe may make its parent
    config = Config({"Spawner": {"cgroup_parent": parent}})
    assert isolation.summary(VGPUSpawner, config, [], log)["warning"] is None
    assert "run as one Unix account" in isolation.summary(VGPUSimpleSpawner, config, [], log)["warning"]
    assert isolation.summary(DemoSpawner, config, [], log)["warning"]
    per_user = Config({"Spawner": {"cgroup_parent": parent}, "DemoSpawner": {"accounts_per_user": True}})
    assert isolation.summary(DemoSpawner, per_user, [], log)["warning"] is None
    # two users' servers seen running as one account (this process's): named in the warning
    running = [(SimpleNamespace(name=n), SimpleNamespace(pid=os.getpid())) for n in ("ada", "bob")]
    found = isolation.summary(VGPUSpawner, config, running, log)
    assert [s["users"] for s in found["shared"]] == [["ada", "bob"]]
    assert "ada, bob" in found["warning"]
    assert found["root"] == (["ada", "bob"] if os.geteuid() == 0 else [])
    cgroup_state = found["cgroups"]
    assert (cgroup_state["describe"] is None) != (cgroup_state["problem"] is None)
    for mount in cgroups.mounts():
        directory = mount.directory(parent)
        if directory is not None and directory.is_dir():
            directory.rmdir()
