"""The node arbiter as the demo Hub runs it (a managed service), with real servers and
kernels on a simulated 1 GiB card: two users whose budgets sum past the card, the idle
one paused (the stand-in pause) so that the other gets room, and an arbiter that dies
and comes back with every slice from the Hub."""

import os
import signal

import psutil
import pytest

from jupyter_vgpu.host.arbiter_control import Control
from jupyter_vgpu.testing.hub_process import HubProcess
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

MiB = 2**20
QUOTA = {"memory_limit": "600M", "memory_request": "300M", "compute_share": 50}
HOLD_500 = "import torch\nx = torch.zeros(500 * 2**20 // 4)  # 500 MiB on the simulated card\n"


@pytest.fixture(scope="module")
def small_hub():
    hub = HubProcess("arbiter-hub", {"JUPYTER_VGPU_DEMO_GPU_MEMORY": "1G"})
    try:
        hub.start()
        yield hub
    finally:
        hub.shutdown()


def books(hub: HubProcess) -> dict:
    with Control(str(hub.state_dir / "arbiter" / "arbiter.sock")) as c:
        return c.books()


def kernel_of(hub: HubProcess, user: str) -> dict | None:
    return next((k for k in books(hub)["kernels"] if k["server"] == f"{user}/"), None)


def arbiter_pid(hub: HubProcess) -> int | None:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "jupyter_vgpu.node" in cmd and any(str(hub.state_dir) in a for a in cmd):
            return p.pid
    return None


@pytest.fixture(scope="module")
def two(small_hub):
    hub = small_hub
    labs = {}
    for user in ("ada", "bob"):
        token = hub.user_token(user)
        assert hub.api("PUT", f"/vgpu/quotas/users/{user}", json=QUOTA).status_code == 200
        lab = LabClient(hub.spawn(user), token=token)
        labs[user] = (lab, lab.start_kernel())
    slices = {s["user"]: s for s in hub.api("GET", "/vgpu/slices").json()}
    assert slices["ada"]["gpu_uuid"] == slices["bob"]["gpu_uuid"], "binpack puts both on one card"
    assert slices["ada"]["memory_limit"] + slices["bob"]["memory_limit"] > 2**30
    return labs


def test_the_hub_runs_the_arbiter_and_servers_find_it(small_hub, two):
    hub = small_hub
    entries = hub.api("GET", "/vgpu/slices").json()
    assert all(isinstance(e["pid"], int) and e["pid"] > 0 for e in entries)
    for user, (lab, kernel) in two.items():
        out = lab.execute(kernel, "import os\nprint(os.environ['JUPYTER_VGPU_ARBITER'])")
        assert out.strip() == str(hub.state_dir / "arbiter" / "arbiter.sock")
        wait_for(lambda u=user: kernel_of(hub, u), 30, f"{user}'s kernel in the arbiter's books")
    servers = {s["key"]: s for s in books(hub)["servers"]}
    assert servers["ada/"]["memory_limit"] == 600 * MiB  # from the Hub, not from the kernel
    for e in entries:  # ports from the spawner's range, which kernels' sockets never draw from
        listening = {
            c.laddr.port for c in psutil.Process(e["pid"]).net_connections("tcp") if c.status == "LISTEN"
        }
        assert listening, f"{e['user']}'s server listens on no port"
        assert all(20000 <= port <= 29999 for port in listening), (e["user"], listening)


def test_the_idle_user_is_paused_so_that_the_other_gets_room(small_hub, two):
    hub = small_hub
    (ada, ada_kernel), (bob, bob_kernel) = two["ada"], two["bob"]
    ada.execute(ada_kernel, HOLD_500)
    wait_for(lambda: (kernel_of(hub, "ada") or {}).get("resident") == 500 * MiB, 30, "ada's 500 MiB")
    assert bob.execute(bob_kernel, "print(1 + 1)").strip() == "2"
    assert kernel_of(hub, "ada")["state"] == "paused"
    assert kernel_of(hub, "ada")["tier"] == "host"
    # ada's own server says where her kernel's memory is, and what the node holds
    usage = wait_for(
        lambda: (u := ada.get("api/vgpu/usage").json())["kernels"][0]["tier"] == "host" and u,
        30,
        "ada's tier",
    )
    assert usage["node"]["host_limit"] > 0
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
    assert '<tr class="vgpu-kernel" data-tier="host">' in page
    assert "Host memory held by kernels (paused data" in page
    assert '<p class="mb-2 small vgpu-shared-pieces" data-scope="all"' in page  # the default
    # each kernel process's own host memory: its PSS, the breakdown on hover
    assert ">Host (process)</th>" in page
    assert 'class="text-end vgpu-process-bytes" title="PSS ' in page
    decisions = books(hub)["decisions"]
    assert any(d["what"] == "pause" and d["server"] == "ada/" and "bob/" in d["reason"] for d in decisions)
    assert ada.execute(ada_kernel, "print(x.numel() * 4 // 2**20)").strip() == "500"
    # the admin page shows who was paused for whom
    page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
    assert 'data-what="pause"' in page
    assert "room for bob/" in page


def test_an_arbiter_that_dies_comes_back_with_every_slice(small_hub, two):
    hub = small_hub
    pid = arbiter_pid(hub)
    assert pid is not None, "the Hub runs the arbiter"
    os.kill(pid, signal.SIGKILL)

    def back() -> bool:
        new = arbiter_pid(hub)
        if new is None or new == pid:
            return False
        try:
            return {s["key"] for s in books(hub)["servers"]} >= {"ada/", "bob/"}
        except OSError:
            return False

    wait_for(back, 60, "the Hub to restart the arbiter and the arbiter to read every slice")
    (ada, ada_kernel) = two["ada"]
    assert ada.execute(ada_kernel, "print('still here')").strip() == "still here"
    wait_for(lambda: kernel_of(hub, "ada"), 30, "ada's kernel to reconnect")


def arbiter_pids(hub: HubProcess) -> list[int]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "jupyter_vgpu.node" in cmd and any(str(hub.state_dir) in a for a in cmd):
            found.append(p.pid)
    return found


def test_a_hub_killed_and_started_again_leaves_one_arbiter_and_every_kernel(small_hub, two):
    # SIGKILL leaves the Hub's managed service running; the Hub started again starts a new
    # arbiter, which takes the socket over from the old one: never two at once
    hub = small_hub
    (ada, ada_kernel), (bob, bob_kernel) = two["ada"], two["bob"]
    ada.execute(ada_kernel, HOLD_500)
    wait_for(lambda: (kernel_of(hub, "ada") or {}).get("resident") == 500 * MiB, 30, "ada's 500 MiB")
    assert bob.execute(bob_kernel, "print(1 + 1)").strip() == "2"  # ada is paused for bob
    old = arbiter_pids(hub)
    assert len(old) == 1
    os.kill(hub.proc.pid, signal.SIGKILL)
    hub.proc.wait(30)
    assert arbiter_pids(hub) == old, "the arbiter outlives the Hub"
    hub.start()
    wait_for(lambda: (p := arbiter_pids(hub)) and p != old and len(p) == 1, 60, "one arbiter, the new one")
    wait_for(
        lambda: kernel_of(hub, "ada") and kernel_of(hub, "bob"), 30, "both kernels in the new arbiter's books"
    )
    assert ada.execute(ada_kernel, "print(x.numel() * 4 // 2**20)").strip() == "500"
    assert bob.execute(bob_kernel, "print('bob here')").strip() == "bob here"
