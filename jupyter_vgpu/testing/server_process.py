"""A real single-user Jupyter server in a subprocess, for tests and benchmarks."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import requests

from hub_spawner import ports

from .waiting import wait_for

#: Enables JupyterLab's terminals (a server extension) even where its config file is not
#: installed, as on a checkout on PYTHONPATH.
TERMINALS_ON = '--ServerApp.jpserver_extensions={"jupyter_server_terminals": True}'
#: Enables the project's server extension the same way.
VGPU_ON = '--ServerApp.jpserver_extensions={"jupyter_vgpu": True}'
#: The kernel hook's IPython config in a checkout (installs put it in etc/ipython).
KERNEL_CONFIG = Path(__file__).resolve().parents[2] / "jupyter-config/ipython/ipython_kernel_config.json"


#: Ports of the tests' own servers, Hubs and proxies: outside the OS's ephemeral range,
#: which kernels' ZeroMQ sockets draw from, and the local spawners' default range.
TEST_PORTS = (30000, 32767)
#: The cgroup every test's cgroups go under (Hubs' servers, probes, escapes). It stays
#: while tests run (a worker removing it when it looked empty raced another making a
#: cgroup under it); ``tests/conftest.py`` removes it once, at the end of the run.
TEST_CGROUP = "/jupyter-vgpu-tests"


def xdist_worker() -> int | None:
    """This process's number as a pytest-xdist worker (``PYTEST_XDIST_WORKER``, ``gw<N>``),
    or None where it is none."""
    worker = re.fullmatch(r"gw(\d{1,4})", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(worker.group(1)) if worker else None


def worker_share(low: int, high: int) -> tuple[int, int]:
    """This test process's share of the ports ``low``-``high`` (inclusive): in pytest-xdist's
    worker ``gw<N>`` of ``PYTEST_XDIST_WORKER_COUNT``, the N-th of that many equal parts,
    so that two workers never pick one port between choosing it and binding it (each
    process's picker knows only its own); elsewhere, all of them."""
    worker = xdist_worker()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if worker is None or count <= 1:
        return low, high
    size = (high - low + 1) // count
    first = low + worker % count * size
    return first, first + size - 1


def free_port() -> int:
    """A free port on loopback that no kernel can take before its server binds it
    (:mod:`hub_spawner.ports`), of this test process's share (:func:`worker_share`)."""
    return ports.picker(*worker_share(*TEST_PORTS)).pick("127.0.0.1")


class JupyterServer:
    """``jupyter server`` (or ``jupyter lab``) on loopback with a token, in ``root``.

    ``vgpu``: the project's server extension and its kernels' hook are on even where their
    config files are not installed (a checkout on PYTHONPATH, as on the GPU machine): the
    extension by :data:`VGPU_ON`, the hook by an IPython profile in ``root`` holding
    :data:`KERNEL_CONFIG` (where both are installed too, loading them twice is harmless).
    """

    def __init__(self, root: Path, env: dict[str, str], app: str = "jupyter_server", args=(), vgpu=False):
        """Start the server and wait (60 s) until it answers ``/api/status``.

        Its kernels' channels are Unix sockets (``KernelManager.transport=ipc``) in a
        short runtime directory of its own under ``/tmp``, removed by :meth:`stop`, for
        the reason :class:`.kernel_runner.Kernel`'s are: a TCP port jupyter_client picks
        can be taken by another process before the kernel binds it.

        Raises:
            ValueError: ``env`` sets ``JUPYTER_RUNTIME_DIR`` (the server's is its own:
                :attr:`runtime`, where its kernels' connection files are).
            AssertionError: the server exited or did not answer in time.
        """
        if "JUPYTER_RUNTIME_DIR" in env:
            raise ValueError("a test server's runtime directory is its own (JupyterServer.runtime)")
        self.root = Path(root)
        self.runtime = Path(tempfile.mkdtemp(prefix="vgpu-rt-", dir="/tmp"))
        env = {**env, "JUPYTER_RUNTIME_DIR": str(self.runtime)}
        args = [*args, "--KernelManager.transport=ipc"]
        self.root.mkdir(parents=True, exist_ok=True)
        if vgpu:
            args = [*args, VGPU_ON]
            if KERNEL_CONFIG.exists():
                profile = self.root / ".ipython" / "profile_default"
                profile.mkdir(parents=True, exist_ok=True)
                shutil.copy(KERNEL_CONFIG, profile / KERNEL_CONFIG.name)
                env = {"IPYTHONDIR": str(profile.parent), **env}
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.root / "server.log"
        cmd = [
            sys.executable,
            "-m",
            app,
            "--no-browser",
            f"--ServerApp.port={self.port}",
            "--ServerApp.ip=127.0.0.1",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--ServerApp.allow_root=True",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=open(self.log_path, "w"),  # noqa: SIM115 - the child writes it
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def started():
            if self.proc.poll() is not None:
                raise AssertionError(f"jupyter server exited:\n{self.log_path.read_text()[-3000:]}")
            return self.get("api/status").status_code == 200

        what = f"jupyter server on port {self.port} to answer /api/status (log: {self.log_path})"
        try:
            wait_for(started, 60, what)
        except BaseException:
            self.stop()  # no caller holds it yet
            raise

    def request(self, method: str, path: str, **kwargs) -> requests.Response:
        headers = {"Authorization": f"token {self.token}", **kwargs.pop("headers", {})}
        return requests.request(method, f"{self.url}/{path}", headers=headers, timeout=30, **kwargs)

    def get(self, path: str, **kwargs) -> requests.Response:
        return self.request("GET", path, **kwargs)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 15 s) and remove its runtime
        directory."""
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(15)
        shutil.rmtree(self.runtime, ignore_errors=True)
