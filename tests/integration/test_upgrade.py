"""An upgrade as docs/admin.md does it, on a machine without a GPU: the node arbiter
(its own process, as its systemd unit runs it) and the Hub are stopped and started
again on new code, one after the other, while ten kernels of two users are paused, and
nothing is lost: the new arbiter's books hold every kernel, still paused, and each
kernel's next cell reads its data back bit for bit.

The kernels hold real bytes (segments of the pausable allocator's host backend, as the
fault-injection tests make them), which a pause stores compressed in the kernel's host
memory and a resume writes back; "new code" is a fresh copy of the packages in a folder
of its own, first on the new processes' ``PYTHONPATH``, as ``pip install --upgrade``
puts new files where the old ones were."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
from pathlib import Path

from jupyter_vgpu.testing import fault_scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.hub_process import ROOT, HubProcess
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.waiting import wait_for

MiB = 2**20
KERNELS_PER_USER = 5
USERS = ("ada", "bob")
HOLD = 8 * MiB  # real bytes each kernel holds


def new_code(folder: Path) -> Path:
    """A copy of this checkout's packages, as an upgrade's new files."""
    skip = shutil.ignore_patterns("__pycache__", "labextension", "*.pyc")
    for package in ("jupyter_vgpu", "hub_spawner"):
        shutil.copytree(ROOT / package, folder / package, ignore=skip)
    return folder


def arbiter(hub: HubProcess, token: str, code: Path | None = None) -> ArbiterProcess:
    """The node arbiter as its unit runs it: outside the Hub, with the Hub's API and its
    token, on the socket the Hub names to servers (its code from ``code`` when given)."""
    env = {"JUPYTERHUB_API_URL": f"http://127.0.0.1:{hub.env['JUPYTER_VGPU_DEMO_HUB_PORT']}/hub/api"}
    env["JUPYTERHUB_API_TOKEN"] = token
    if code is not None:
        # the new files first; not the test's working directory (the checkout), which
        # `python -m` would put before them (a unit runs it from /)
        env.update(PYTHONPATH=str(code), PYTHONSAFEPATH="1")
    return ArbiterProcess(hub.state_dir, f"--ArbiterApp.disk_dir={hub.state_dir / 'disk'}", env=env)


def books(process: ArbiterProcess) -> dict[int, dict]:
    return {k["pid"]: k for k in process.books()["kernels"]}


def test_an_upgrade_restarts_the_arbiter_and_the_hub_on_new_code_and_loses_no_paused_kernel(tmp_path):
    token = secrets.token_hex(32)
    hub = HubProcess("upgrade", {"JUPYTER_VGPU_DEMO_ARBITER_TOKEN": token})
    old = arbiter(hub, token)
    try:
        hub.start()
        old.start()
        kernels = []  # (lab, kernel id, pid, seed)
        for user in USERS:
            token_of_user = hub.user_token(user)  # the user exists once this returns
            lab = LabClient(hub.spawn(user), token=token_of_user)
            for _ in range(KERNELS_PER_USER):
                kernel = lab.start_kernel()
                seed = len(kernels) + 1
                out = lab.execute(kernel, fault_scene.hold_code(seed, HOLD) + "import os; print(os.getpid())")
                kernels.append((lab, kernel, int(out.strip().splitlines()[-1]), seed))
        for lab, kernel, _, _ in kernels:
            said = lab.execute(kernel, "%vgpu pause")
            assert "will be paused as soon as the cell ends" in said, said
        pids = {pid for _, _, pid, _ in kernels}

        def all_paused(process: ArbiterProcess) -> bool:
            seen = books(process)
            # paused into host memory, the bytes each holds moved there (compressed)
            return pids <= set(seen) and all(
                seen[p]["state"] == "paused"
                and seen[p]["tier"] == "host"
                and seen[p]["paused_bytes"] >= HOLD
                and seen[p]["host_bytes"] > 0
                for p in pids
            )

        wait_for(lambda: all_paused(old), 60, "every kernel paused into host memory")

        # the upgrade: the new files, then each process stopped and started on them
        code = new_code(tmp_path / "new-code")
        old.stop()  # systemctl restart jupyter-vgpu-arbiter
        new = arbiter(hub, token, code)
        new.start()
        hub.stop_hub()  # systemctl restart jupyterhub: the servers keep running
        hub.env["PYTHONPATH"] = str(code)
        hub.command = [*hub.command[:-1], str(code / "hub_spawner" / "demo" / "jupyterhub_config.py")]
        hub.start()

        # both run the new code, and the Hub adopted both servers
        assert f"code in {code / 'jupyter_vgpu'}" in new.log_path.read_text()
        assert f"code in {code / 'hub_spawner'}" in hub.log_tail(400)
        for user in USERS:
            assert f"{user} still running" in hub.log_tail(400)
        # the new arbiter's books: every kernel, still paused, from the kernels' own word
        wait_for(lambda: all_paused(new), 60, "every kernel in the new arbiter's books, still paused")

        for lab, kernel, pid, seed in kernels:
            out = lab.execute(kernel, fault_scene.BACK + fault_scene.DIGEST)
            assert out.splitlines()[-1] == fault_scene.digest(seed, HOLD), (pid, out)
        resumed = books(new)
        assert all(resumed[p]["tier"] == "gpu" for p in pids), resumed
        new.stop()
    finally:
        for process in (old, locals().get("new")):
            if process is not None and process.process is not None and process.process.poll() is None:
                os.kill(process.process.pid, signal.SIGKILL)
        hub.shutdown()
