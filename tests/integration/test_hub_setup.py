"""How the demo hub is set up: loopback only, each user's server as an account of their
own where the machine allows it, GPUs simulated only when asked, one quiet line about
extra_handlers."""

import os
import re
import socket

import psutil
import pytest

from hub_spawner import EXTRA_HANDLERS_NOTE
from jupyter_vgpu import nvml
from jupyter_vgpu.testing.hub_process import HubProcess
from jupyter_vgpu.testing.lab_client import LabClient


def listening(process: psutil.Process) -> set[str]:
    """The addresses the process and its children listen on."""
    found = set()
    for p in [process, *process.children(recursive=True)]:
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    found.add(c.laddr.ip)
        except psutil.Error:
            continue
    return found


def test_everything_listens_on_loopback_only(hub):
    """Issue 10, defect 8: the demo hands code execution to whoever has the password, so
    nothing of it may be reachable from another machine."""
    hub.user_token("lou")
    hub.spawn("lou")
    try:
        addresses = listening(psutil.Process(hub.proc.pid))
        assert addresses, "found no listening socket"
        assert addresses <= {"127.0.0.1"}, addresses
        outside = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
        outside = {a for a in outside if a and ":" not in a and not a.startswith("127.")}
        for address in outside:
            with socket.socket() as s:
                s.settimeout(2)
                assert s.connect_ex((address, hub.port)) != 0, f"the demo answers on {address}"
    finally:
        hub.stop_server("lou")


def test_servers_run_unprivileged_where_the_machine_allows_it(hub):
    """As root, each user's server runs as a system account of that user's own, which
    cannot read the Hub's cookie secret or database; where other accounts cannot run this
    Python, the Hub says so in its log, with the reason."""
    token = hub.user_token("una")
    lab = LabClient(hub.spawn("una"), token=token)
    kernel = lab.start_kernel()
    try:
        who = lab.execute(kernel, "import os, pwd; print(pwd.getpwuid(os.geteuid()).pw_name)").strip()
        log = hub.log_path.read_text()
        if os.geteuid() != 0:
            assert who == psutil.Process().username()
            return
        if "each user's server runs as a system account of that user's own" in log:
            assert who == hub.account_name("una")
            for secret in ("jupyterhub_cookie_secret", "jupyterhub.sqlite"):
                out = lab.execute(kernel, f"open({str(hub.state_dir / secret)!r}, 'rb').read()")
                assert "PermissionError" in out, out
        else:
            warning = re.search(
                r"servers run as root, because other accounts cannot run this Python: (.+)\.", log
            )
            assert warning, "the Hub runs servers as root without saying why"
            assert warning.group(1).strip()
            assert who == "root"
    finally:
        lab.shutdown_kernel(kernel)
        hub.stop_server("una")


def test_simulation_is_asked_for_and_said(hub):
    log = hub.log_path.read_text()
    assert "vGPU inventory: simulating 2 GPU(s) (GPUInventory.simulate = True)" in log


def test_the_extra_handlers_deprecation_is_one_info_line(hub):
    """Issue 10, defect 9: every Hub start warned about extra_handlers."""
    lines = [line for line in hub.log_path.read_text().splitlines() if "extra_handlers" in line]
    assert lines
    assert all(line.startswith("[I ") and EXTRA_HANDLERS_NOTE in line for line in lines), lines
    assert len(lines) == len(
        [line for line in hub.log_path.read_text().splitlines() if "Running JupyterHub version" in line]
    )


@pytest.mark.skipif(nvml.available(), reason="this host has an NVIDIA driver")
def test_a_host_whose_nvml_fails_says_so_and_refuses_spawns():
    """Issue 10, defect 6: an NVML failure placed real users on two invented H100s."""
    hub = HubProcess("no-gpu-hub", {"JUPYTER_VGPU_DEMO_SIMULATE": "0"})
    try:
        hub.start()
        hub.user_token("nora")
        quotas = hub.api("GET", "/vgpu/quotas").json()
        assert quotas["problems"][0].startswith("NVML failed on this host")
        assert quotas["max_memory_limit"] == 0
        assert hub.api("PUT", "/vgpu/quotas/users/nora", json={"memory_limit": "4G"}).status_code == 200
        events = hub.spawn_events("nora")
        assert events[-1].get("failed"), events
        assert "This hub cannot place vGPU slices: NVML failed on this host" in events[-1]["message"]
        page = hub.login("nora").get(f"{hub.url}/hub/spawn-pending/nora")
        assert "This hub cannot place vGPU slices" in page.text
        assert "Traceback" not in page.text
        admin_page = hub.login("admin").get(f"{hub.url}/hub/vgpu").text
        assert "NVML failed on this host" in admin_page
        assert "No GPU can take a slice" in admin_page
        assert "simulated" not in hub.api("GET", "/vgpu/usage").json()["gpus"].__repr__()
        assert "No vGPU slice can be placed" in hub.log_path.read_text()
    finally:
        hub.shutdown()
