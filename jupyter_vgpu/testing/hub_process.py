"""A real JupyterHub for the tests: the demo config, the real proxy, real servers.

The Hub runs as a subprocess on loopback with its own state directory; everything is
reached over HTTP exactly as a browser or an admin script would. The state directory
is a new one under the system's temporary directory (pytest's own is private to its
user, and demo servers run as accounts of their own when the tests run as root); its
servers' cgroups go under a cgroup of its own (``/jupyter-vgpu-tests/<state>``), removed
with it, as are the system accounts it made for its users; the Hub's log is kept in
``test-artifacts/``. Its users' servers keep running when the Hub is stopped
(``JUPYTER_VGPU_DEMO_KEEP_SERVERS``), so that a Hub started again adopts them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import requests

from hub_spawner import ports
from jupyter_vgpu.testing.server_process import TEST_CGROUP, free_port, worker_share, xdist_worker
from jupyter_vgpu.testing.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "hub_spawner" / "demo" / "jupyterhub_config.py"
ARTIFACTS = ROOT / "test-artifacts"
PASSWORD = "test-password"


def account_prefix() -> str:
    """The prefix of the system accounts this test process's Hubs make for their users
    (``JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX``): ``vgpu<N>-`` in pytest-xdist's worker ``gw<N>``,
    ``vgpu-`` elsewhere. Hubs of two workers then never share an account: each removes the
    accounts it made when it is shut down, while the other's servers may run as them."""
    from hub_spawner.demo.system_user import PREFIX

    worker = xdist_worker()
    return PREFIX if worker is None else f"{PREFIX[:-1]}{worker}-"


class HubProcess:
    """The demo Hub with two simulated 80 GiB GPUs, in a new state directory.

    Args:
        name: names the Hub's log in ``test-artifacts/``.
        extra_env: more of the demo config's environment (``JUPYTER_VGPU_DEMO_MIG``...).
        config: the Hub's config file (default: the demo's).
        command: what starts the Hub (default: ``python -m jupyterhub -f <config>``; the
            demo's own ``bash scripts/demo``, in the tests of that script).
    """

    def __init__(
        self,
        name: str = "hub",
        extra_env: dict[str, str] | None = None,
        config: Path = CONFIG,
        command: list[str] | None = None,
    ):
        self.name = name
        self.config = config
        self.command = command or [sys.executable, "-m", "jupyterhub", "-f", str(config)]
        self.state_dir = Path(tempfile.mkdtemp(prefix=f"vgpu-{name}-"))
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
            "JUPYTER_VGPU_DEMO_CGROUP_PARENT": f"{TEST_CGROUP}/{self.state_dir.name}",
            # servers outlive a Hub the tests stop (restart() shows the Hub adopting them)
            "JUPYTER_VGPU_DEMO_KEEP_SERVERS": "1",
            "JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX": account_prefix(),
            "JUPYTER_VGPU_DEMO_SERVER_PORTS": "{}-{}".format(*worker_share(*ports.SERVER_RANGE)),
            **(extra_env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.admin_token = ""

    # -- process ---------------------------------------------------------------

    def start(self, timeout: float = 60) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "a")  # noqa: SIM115 - the child process writes to it
        self.proc = subprocess.Popen(
            self.command,
            cwd=self.state_dir,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def healthy():
            assert self.proc.poll() is None, f"the Hub exited with {self.proc.returncode}:\n{self.log_tail()}"
            return requests.get(f"{self.url}/hub/health", timeout=2).status_code == 200

        wait_for(healthy, timeout, f"the Hub at {self.url} to answer /hub/health (log: {self.log_path})")
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
        """Stop the Hub, kill every process it left (servers, kernels, proxy), keep its
        log in ``test-artifacts/`` and remove its state."""
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
        self.remove_cgroups()
        self.remove_accounts()
        ARTIFACTS.mkdir(exist_ok=True)
        if self.log_path.exists():
            shutil.copy(self.log_path, ARTIFACTS / f"{self.name}-{self.port}.log")
        shutil.rmtree(self.state_dir, ignore_errors=True)

    @property
    def cgroup_parent(self) -> str:
        """The cgroup its servers' cgroups go under: the tests' one
        (``JUPYTER_VGPU_DEMO_CGROUP_PARENT``), else the demo's own for its state directory."""
        from hub_spawner.demo import settings

        return self.env.get("JUPYTER_VGPU_DEMO_CGROUP_PARENT") or settings.cgroup_names(self.state_dir)[0]

    def remove_cgroups(self) -> None:
        """End whatever is left in this Hub's servers' cgroups and remove them."""
        from hub_spawner.server_cgroup import kill_all
        from jupyter_vgpu.host import cgroups

        parent = self.cgroup_parent
        assert parent.strip("/"), f"no cgroup parent to clean: {parent!r}"
        for mount in cgroups.mounts():
            top = mount.directory(parent)
            if top is None or not top.is_dir() or top == Path(mount.mountpoint):
                continue
            for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                kill_all(directory)
                wait_for(lambda d=directory: not cgroups.procs(d), 10, f"{directory} to empty")
                directory.rmdir()
            kill_all(top)
            top.rmdir()
            # the tests' top cgroup stays: another test worker may be making a cgroup
            # under it at this moment (its parent made, its own not yet), and removing
            # it then fails that worker's mkdir; tests/conftest.py removes it at the end

    def account_name(self, username: str) -> str:
        """The system account this Hub runs ``username``'s server as, when it runs as root
        (:func:`hub_spawner.demo.system_user.account_name`, with its prefix)."""
        from hub_spawner.demo import system_user

        return system_user.account_name(username, self.env["JUPYTER_VGPU_DEMO_ACCOUNT_PREFIX"])

    def remove_accounts(self) -> None:
        """Remove the system accounts this Hub made for its users (none is left behind)."""
        from hub_spawner.demo import settings, system_user

        system_user.remove(system_user.recorded(self.state_dir / settings.ACCOUNTS))

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

    def quotas(self) -> dict[tuple[str, str], dict]:
        """Every user's and group's stored vGPU quota, ``{(kind, name): fields}`` (``kind``
        ``"user"`` or ``"group"``; unset fields left out), from ``GET /vgpu/quotas``."""
        r = self.api("GET", "/vgpu/quotas")
        assert r.status_code == 200, r.text
        body = r.json()
        return {
            (kind[:-1], name): {f: v for f, v in fields.items() if v is not None}
            for kind in ("users", "groups")
            for name, fields in body[kind].items()
        }

    def restore_quotas(self, before: dict[tuple[str, str], dict]) -> None:
        """Put the quotas back as ``before`` (:meth:`quotas`): those set since are deleted,
        those changed are stored again (a group deleted since has none to put back).

        Raises:
            AssertionError: the Hub refused one (a running slice it would no longer fit,
                say), with its message.
        """
        now = self.quotas()
        for kind, name in sorted(now.keys() - before.keys()):
            r = self.api("DELETE", f"/vgpu/quotas/{kind}s/{name}")
            assert r.status_code in (204, 404), (
                f"deleting the {kind} quota of {name}: {r.status_code} {r.text}"
            )
        for (kind, name), fields in sorted(before.items()):
            if now.get((kind, name)) != fields:
                r = self.api("PUT", f"/vgpu/quotas/{kind}s/{name}", json=fields)
                gone = r.status_code == 404 and f"No such {kind}" in r.text
                assert r.status_code == 200 or gone, (
                    f"restoring the {kind} quota of {name}: {r.status_code} {r.text}"
                )

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

    def spawn(self, username: str, timeout: float = 90, options: dict | None = None) -> str:
        """Start ``username``'s default server through the REST API and wait until ready.

        Args:
            options: the spawner's ``user_options`` (``{"mig_profile": "1g.10gb"}``).

        Returns:
            The server's URL, ``{url}/user/{name}/``.

        Raises:
            AssertionError: the spawn failed (with the Hub's message) or timed out.
        """
        r = self.api("POST", f"/users/{username}/server", json=options or {})
        assert r.status_code in (201, 202, 400), f"spawn {username}: {r.status_code} {r.text}"

        def ready():
            model = self.api("GET", f"/users/{username}").json()
            server = model.get("servers", {}).get("")
            if not server and not model.get("pending"):
                progress = self.api("GET", f"/users/{username}/server/progress")
                raise AssertionError(f"spawn of {username} failed: {progress.text[-500:]}\n{self.log_tail()}")
            return bool(server and server.get("ready"))

        wait_for(ready, timeout, f"{username}'s server to be ready (log: {self.log_path})", interval=0.5)
        return f"{self.url}/user/{username}/"

    def progress(self, username: str) -> list[dict]:
        """The progress events of ``username``'s spawn in progress, as the spawn page follows
        them (server-sent events), until one says ready or failed."""
        events = []
        with self.api("GET", f"/users/{username}/server/progress", stream=True) as stream:
            for line in stream.iter_lines(decode_unicode=True):
                if line.startswith("data:"):
                    events.append(json.loads(line[len("data:") :]))
                    if events[-1].get("ready") or events[-1].get("failed"):
                        break
        return events

    def spawn_events(self, username: str, options: dict | None = None, timeout: float = 90) -> list[dict]:
        """Start ``username``'s default server and follow its progress as the spawn page
        does (``/hub/api/users/{name}/server/progress``, server-sent events) until it is
        ready or failed.

        Returns:
            The progress events, in order; the last one has ``ready`` or ``failed``.
        """
        r = self.api("POST", f"/users/{username}/server", json=options or {})
        assert r.status_code in (201, 202, 400), f"spawn {username}: {r.status_code} {r.text}"
        events = self.progress(username)
        if events and events[-1].get("ready"):
            self.spawn(username, timeout)  # and ready to use through the proxy
        return events

    def stop_server(self, username: str, timeout: float = 30) -> None:
        r = self.api("DELETE", f"/users/{username}/server")
        assert r.status_code in (202, 204), f"stop {username}: {r.status_code} {r.text}"
        wait_for(
            lambda: not self.api("GET", f"/users/{username}").json().get("servers"),
            timeout,
            f"{username}'s server to stop",
        )

    def server_token(self, lab, kernel_id: str) -> str:
        """The API token of a user's server, read where the user can read it: in the
        environment of a kernel of that server (``lab`` is a ``LabClient``)."""
        return lab.execute(kernel_id, "import os; print(os.environ['JUPYTERHUB_API_TOKEN'])").strip()
