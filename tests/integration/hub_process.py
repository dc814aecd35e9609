"""A real JupyterHub for the tests: the demo config, the real proxy, real servers.

The Hub runs as a subprocess on loopback with its own state directory; everything is
reached over HTTP exactly as a browser or an admin script would.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "hub_spawner" / "demo" / "jupyterhub_config.py"
PASSWORD = "test-password"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class HubProcess:
    """The demo Hub with two simulated 80 GiB GPUs, in ``state_dir``."""

    def __init__(self, state_dir: Path, extra_env: dict[str, str] | None = None):
        self.state_dir = Path(state_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.state_dir / "hub.log"
        self.env = {
            **os.environ,
            "JUPYTER_VGPU_DEMO_DIR": str(self.state_dir),
            "JUPYTER_VGPU_DEMO_PORT": str(self.port),
            "JUPYTER_VGPU_DEMO_PROXY_PORT": str(free_port()),
            "JUPYTER_VGPU_DEMO_HUB_PORT": str(free_port()),
            "JUPYTER_VGPU_DEMO_PASSWORD": PASSWORD,
            "JUPYTER_VGPU_DEMO_SIMULATE": "1",
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.admin_token = ""

    # -- process ---------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a")  # noqa: SIM115 - the child process writes to it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "jupyterhub", "-f", str(CONFIG)],
            cwd=self.state_dir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the Hub exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.url}/hub/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        else:
            raise RuntimeError(f"the Hub did not answer within {timeout} s:\n{self.log_tail()}")
        if not self.admin_token:
            self.admin_token = self.create_token(self.login("admin"), "admin")

    def stop_hub(self) -> None:
        """Stop the Hub (and its proxy); users' servers keep running."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def restart(self) -> None:
        self.stop_hub()
        self.start()

    def shutdown(self) -> None:
        """Stop the Hub and kill every process it left (servers, kernels, proxy)."""
        self.stop_hub()
        state = str(self.state_dir)
        victims = []
        for p in psutil.process_iter(["pid", "cwd", "environ"]):
            try:
                env = p.info["environ"] or {}
                if (p.info["cwd"] or "").startswith(state) or env.get("JUPYTER_VGPU_DEMO_DIR") == state:
                    victims.append(p)
            except (psutil.Error, TypeError):
                continue
        for p in victims:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(victims, timeout=10)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        except FileNotFoundError:
            return "(no hub log)"

    # -- HTTP ------------------------------------------------------------------

    def api(self, method: str, path: str, token: str | None = None, **kwargs) -> requests.Response:
        """A Hub REST call; ``path`` is relative to ``/hub/api``; admin token by default."""
        headers = {"Authorization": f"token {token or self.admin_token}", **kwargs.pop("headers", {})}
        return requests.request(method, f"{self.url}/hub/api{path}", headers=headers, timeout=30, **kwargs)

    def login(self, username: str, password: str | None = None) -> requests.Session:
        """Log in through the real login form; the session carries the Hub's cookies.

        Raises:
            AssertionError: the form refused the login.
        """
        session = requests.Session()
        page = session.get(f"{self.url}/hub/login", timeout=30)
        match = re.search(r'name="_xsrf"\s+value="([^"]+)"', page.text)
        data = {"username": username, "password": password or PASSWORD}
        if match:
            data["_xsrf"] = match.group(1)
        r = session.post(f"{self.url}/hub/login?next=", data=data, allow_redirects=False, timeout=30)
        assert r.status_code == 302, f"login as {username} failed: {r.status_code} {r.text[:300]}"
        return session

    def create_token(self, session: requests.Session, username: str) -> str:
        """An API token for ``username``, created with its logged-in ``session``."""
        xsrf = session.cookies.get("_xsrf", path="/hub/")
        r = session.post(
            f"{self.url}/hub/api/users/{username}/tokens",
            json={"note": "tests", "expires_in": 3600},
            headers={"X-XSRFToken": xsrf or "", "Referer": f"{self.url}/hub/token"},
            timeout=30,
        )
        assert r.status_code == 201, f"token for {username}: {r.status_code} {r.text}"
        return r.json()["token"]

    def user_token(self, username: str) -> str:
        """An API token for ``username`` (who exists once this returns)."""
        return self.create_token(self.login(username), username)

    def spawn(self, username: str, timeout: float = 90) -> str:
        """Start ``username``'s default server through the REST API and wait until ready.

        Returns:
            The server's URL, ``{url}/user/{name}/``.

        Raises:
            AssertionError: the spawn failed (with the Hub's message) or timed out.
        """
        r = self.api("POST", f"/users/{username}/server")
        assert r.status_code in (201, 202, 400), f"spawn {username}: {r.status_code} {r.text}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            model = self.api("GET", f"/users/{username}").json()
            server = model.get("servers", {}).get("")
            if server and server.get("ready"):
                return f"{self.url}/user/{username}/"
            if not server and not model.get("pending"):
                progress = self.api("GET", f"/users/{username}/server/progress")
                raise AssertionError(f"spawn of {username} failed: {progress.text[-500:]}\n{self.log_tail()}")
            time.sleep(0.5)
        raise AssertionError(f"spawn of {username} timed out\n{self.log_tail()}")

    def stop_server(self, username: str, timeout: float = 30) -> None:
        r = self.api("DELETE", f"/users/{username}/server")
        assert r.status_code in (202, 204), f"stop {username}: {r.status_code} {r.text}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.api("GET", f"/users/{username}").json().get("servers"):
                return
            time.sleep(0.3)
        raise AssertionError(f"server of {username} did not stop")
