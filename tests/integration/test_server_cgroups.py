"""Every process of a server is its server's, by cgroup: the demo Hub (the local spawner)
puts each server in a cgroup of its own; processes started by a kernel and by a terminal
in every way that leaves the process tree are still mapped to their server by the
arbiter's own code (reading the Hub's slices as the arbiter does); a process outside
every server is unowned and the watchdog's default deny reports it; a stopped server
leaves nothing behind; and the demo's users, each an account of their own, cannot signal
or read each other's kernels."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess

import pytest

from jupyter_vgpu.host import cgroups, peers
from jupyter_vgpu.host.arbiter_control import Control
from jupyter_vgpu.node.app import ArbiterApp, HubLink
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.node.watchdog import Watchdog, owners
from jupyter_vgpu.testing.kernel_escapes import FROM_A_KERNEL
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
# Typed into a terminal (spelt apart so that the echoed command does not match)
FROM_A_TERMINAL = {
    "setsid -f in a terminal": 'setsid -f sh -c \'echo PI""D=$$ E""ND; exec sleep 600\'',
    # then the terminal is closed: its shell exits, and the process goes on under init
    "nohup & disown in a terminal": 'nohup sleep 600 >/dev/null 2>&1 & echo PI""D=$! E""ND; disown; exit',
    "the terminal's shell": 'echo PI""D=$$ E""ND',
    # a terminal multiplexer's server daemonizes itself (where tmux is installed)
    "tmux's server": (
        "tmux -S ~/tmux.sock new -d 'sleep 600'; "
        'echo PI""D=$(tmux -S ~/tmux.sock display -p \'#{pid}\') E""ND'
    ),
}


def arbiter_of(hub) -> Arbiter:
    """An arbiter's books filled from the Hub's slices, as the Hub's own arbiter fills them."""
    arbiter = Arbiter(ArbiterApp(registrars="none"))

    async def read():
        await HubLink(arbiter, f"{hub.url}/hub/api", hub.admin_token).refresh()

    asyncio.run(read())
    return arbiter


def slice_of(hub, user: str) -> dict:
    return next(s for s in hub.api("GET", "/vgpu/slices").json() if s["user"] == user)


def pids_in(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"PID=(\d+)", text)]


@pytest.fixture(scope="module")
def cara(hub):
    token = hub.user_token("cara")
    lab = LabClient(hub.spawn("cara"), token=token)
    kernel = lab.start_kernel()
    yield lab, kernel
    hub.stop_server("cara")


def test_the_local_spawner_gives_each_server_a_cgroup_or_says_why_not(hub, cara):
    entry = slice_of(hub, "cara")
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
    if os.geteuid() != 0:
        assert entry["cgroup"] is None
        assert "not root" in entry["cgroup_problem"]
        assert "No per-server cgroups on this host" in page
        return
    assert entry["cgroup_problem"] is None
    assert entry["cgroup_hierarchy"] in ("cgroup2", "pids", "name=systemd", "freezer", "cpu", "memory")
    where = cgroups.Cgroup(entry["cgroup_hierarchy"], entry["cgroup"])
    assert where.holds(cgroups.of(entry["pid"])), "the server's own process is in it"
    directory = cgroups.find_mount(where.hierarchy).directory(where.path)
    assert os.stat(directory).st_uid == 0
    assert os.stat(directory / "cgroup.procs").st_mode & 0o022 == 0, "only root may move processes in"
    assert "Per-server cgroups: each server runs in a cgroup of its own" in page


@pytest.mark.skipif(os.geteuid() != 0, reason="per-server cgroups need a root Hub")
def test_every_way_out_of_the_process_tree_stays_in_the_servers_cgroup(hub, cara):
    lab, kernel = cara
    found: dict[str, int] = {}
    for how, code in FROM_A_KERNEL.items():
        if "start-stop-daemon" in how and not shutil.which("start-stop-daemon"):
            continue
        out = lab.execute(kernel, code)
        assert pids_in(out), f"{how}: {out}"
        found[how] = pids_in(out)[-1]
    for how, typed in FROM_A_TERMINAL.items():
        if how.startswith("tmux") and not shutil.which("tmux"):
            continue
        _, out = lab.terminal(typed, until=" END")
        found[how] = pids_in(out)[-1]
    entry = slice_of(hub, "cara")
    arbiter = arbiter_of(hub)
    key = f"cgroup:{entry['cgroup']}"
    assert key in arbiter.servers
    for how, pid in found.items():
        if how != "the terminal's shell":
            wait_for(
                lambda pid=pid: entry["pid"] not in peers.ancestors(pid),
                10,
                f"{how}: {pid} to leave the tree",
            )
        assert arbiter.mapping(pid) == (key, "cgroup"), (how, pid, cgroups.of(pid))
    tree_only = arbiter_of(hub)
    tree_only.mappers = [m for m in tree_only.mappers if m[0] == "tree"]
    lost = [how for how, pid in found.items() if tree_only.mapping(pid) is None]
    assert len(lost) >= len(FROM_A_KERNEL) - 1, f"the process tree alone should lose the daemons: {lost}"


def test_a_process_outside_every_server_is_unowned(hub, cara):
    outsider = subprocess.Popen(["sleep", "60"])
    try:
        arbiter = arbiter_of(hub)
        assert arbiter.servers, "the Hub's slices were read"
        assert arbiter.mapping(outsider.pid) is None
        assert not arbiter.allowed(outsider.pid)
        actions = Watchdog("report", unowned_policy="kill").step(
            0.0, {outsider.pid: GiB}, owners(arbiter.servers.values(), arbiter.mapping), arbiter.allowed
        )
        assert [(a.kind, a.pid, a.mapped_by) for a in actions] == [("warn", outsider.pid, "unowned")]
    finally:
        outsider.kill()
        outsider.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="per-server cgroups need a root Hub")
def test_a_stopped_server_leaves_nothing_behind(hub):
    token = hub.user_token("dora")
    lab = LabClient(hub.spawn("dora"), token=token)
    kernel = lab.start_kernel()
    daemon = pids_in(lab.execute(kernel, FROM_A_KERNEL["double fork"]))[-1]
    entry = slice_of(hub, "dora")
    where = cgroups.Cgroup(entry["cgroup_hierarchy"], entry["cgroup"])
    directory = cgroups.find_mount(where.hierarchy).directory(where.path)
    assert directory.is_dir()
    hub.stop_server("dora")
    wait_for(lambda: not peers.alive(daemon), 15, f"the daemon {daemon} to be ended with its server")
    wait_for(lambda: not directory.exists(), 15, f"{directory} to be removed")


def accounts_per_user(hub) -> bool:
    return "each user's server runs as a system account of that user's own" in hub.log_path.read_text()


def test_users_cannot_signal_or_read_each_others_kernels(hub, cara):
    if not accounts_per_user(hub):
        pytest.skip("this Hub runs every server as one account (not root, or no Python others can run)")
    lab, kernel = cara
    token = hub.user_token("eve")
    eve = LabClient(hub.spawn("eve"), token=token)
    eve_kernel = eve.start_kernel()
    try:
        with Control(str(hub.state_dir / "arbiter" / "arbiter.sock")) as c:
            wait_for(lambda: any(k["server"] == "cara/" for k in c.books()["kernels"]), 30, "cara's kernel")
            target = next(k["pid"] for k in c.books()["kernels"] if k["server"] == "cara/")
        who = eve.execute(eve_kernel, "import os, pwd; print(pwd.getpwuid(os.geteuid()).pw_name)").strip()
        cara_who = lab.execute(kernel, "import os, pwd; print(pwd.getpwuid(os.geteuid()).pw_name)").strip()
        assert who == hub.account_name("eve")
        assert cara_who == hub.account_name("cara")
        probe = (
            "import os\n"
            f"for what, do in [('kill -0', lambda: os.kill({target}, 0)),\n"
            f"                 ('mem', lambda: open('/proc/{target}/mem', 'rb').read(1)),\n"
            f"                 ('environ', lambda: open('/proc/{target}/environ', 'rb').read()),\n"
            f"                 ('cwd', lambda: os.listdir('/proc/{target}/cwd'))]:\n"
            "    try:\n        do()\n        print(what, 'ALLOWED')\n"
            "    except PermissionError:\n        print(what, 'denied')\n"
        )
        out = eve.execute(eve_kernel, probe)
        assert out.split() == [
            "kill",
            "-0",
            "denied",
            "mem",
            "denied",
            "environ",
            "denied",
            "cwd",
            "denied",
        ], out
        own = lab.execute(kernel, f"import os; os.kill({target}, 0); print('own', 'fine')")
        assert "own fine" in own, "a user may still signal their own kernel"
        page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
        assert "Several users&#39; servers run as one Unix account" not in page
        assert "run as one Unix account" not in page
    finally:
        hub.stop_server("eve")
