"""A node as an attacker meets it: a root arbiter, real accounts, peers speaking its protocol.

For ``tests/security`` and ``benchmarks/attacks.py``, as root (CI runs as root). The
arbiter runs as root as an admin would run it: its socket in a directory of root's,
its disk tier at a path it makes itself (``/var/lib/jupyter-vgpu-sec-<random>/disk``),
the driver's checkpoint replaced by a stand-in that records which processes it would
have been handed (:mod:`.checkpoint_standin`; no GPU here). Slices are registered over
the socket by root, the trusted party that stands for the Hub (registrations by users
are refused, and tested). Two system accounts, ``vgpu-sec-victim`` and
``vgpu-sec-attacker``, run their processes: peers of the protocol
(:mod:`.protocol_peer`, copied where they can read it, run with the system's Python),
and whatever an attack needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import queue
import secrets
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from jupyter_vgpu.host.arbiter_control import Control
from jupyter_vgpu.slice import Slice

from . import checkpoint_standin, protocol_peer
from .arbiter_process import ArbiterProcess
from .waiting import wait_for

#: The accounts the scene makes (and removes).
VICTIM, ATTACKER = "vgpu-sec-victim", "vgpu-sec-attacker"
#: A Python every account can run (the peers use the standard library alone).
SYSTEM_PYTHON = "/usr/bin/python3"
MiB, GiB = 2**20, 2**30
#: A 1 GiB simulated card; budgets of 600 MiB, so that two kernels pass the card.
SLICE = Slice("GPU-sim-sec", 0, "Simulated card", GiB, 600 * MiB, 50, simulated=True, idle_seconds=3600)


def unavailable() -> str | None:
    """Why the scene cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (real accounts and a root arbiter)"
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        return f"needs {SYSTEM_PYTHON} for the accounts' processes"
    if not shutil.which("useradd"):
        return "needs useradd"
    return None


#: The accounts this process made (:func:`ensure_account`), the only ones it removes
#: (:func:`remove_made`): in pytest-xdist, another worker may be using them still.
MADE: list[str] = []


def ensure_account(name: str) -> pwd.struct_passwd:
    """The system account ``name``, made (no home, no login shell) when missing."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
            check=True,
            capture_output=True,
        )
        MADE.append(name)
        return pwd.getpwnam(name)


def remove_made() -> None:
    """Remove the accounts this process made (:data:`MADE`), their processes first."""
    while MADE:
        remove_account(MADE.pop())


def remove_account(name: str) -> None:
    """Remove the account ``name`` (nothing when it is gone), its processes first."""
    with contextlib.suppress(KeyError):
        pwd.getpwnam(name)
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True, check=False)
        subprocess.run(["userdel", name], capture_output=True, check=False)


class PeerProcess:
    """A :mod:`.protocol_peer` running as an account; its events come back in order."""

    def __init__(self, scene: SecurityScene, account: pwd.struct_passwd, plan: dict):
        self.account = account
        self.process = subprocess.Popen(
            [SYSTEM_PYTHON, str(scene.peer_script), json.dumps({"socket": str(scene.socket), **plan})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            user=account.pw_uid,
            group=account.pw_gid,
            extra_groups=[],
            cwd="/",
            env={"PATH": "/usr/bin:/bin"},
        )
        self.events: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        threading.Thread(target=self._read, daemon=True).start()
        self.pid = self.expect("connected")["pid"]

    def _read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                self.events.put(json.loads(line))
        self.events.put({"event": "eof"})

    def command(self, cmd: dict) -> None:
        self.process.stdin.write(json.dumps(cmd) + "\n")
        self.process.stdin.flush()

    def expect(self, event: str, timeout: float = 20.0, where=None) -> dict:
        """The next event named ``event`` (and for which ``where(event)`` holds).

        Raises:
            AssertionError: none came within ``timeout`` seconds.
        """
        found: list[dict] = []

        def arrived() -> bool:
            while True:
                try:
                    e = self.events.get_nowait()
                except queue.Empty:
                    return False
                self.seen.append(e)
                if e.get("event") == event and (where is None or where(e)):
                    found.append(e)
                    return True
                if e.get("event") == "eof":
                    raise AssertionError(f"the peer ended before {event}: {self.seen[-5:]}")

        wait_for(arrived, timeout, f"the peer's {event}")
        return found[0]

    def drain(self) -> list[dict]:
        """Every event so far, those not yet looked at included (:attr:`seen`)."""
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                return self.seen

    def received(self, kind: str, timeout: float = 20.0, where=None) -> dict:
        """The next message of type ``kind`` the arbiter sent it."""
        event = self.expect(
            "received",
            timeout,
            lambda e: (
                isinstance(e.get("msg"), dict)
                and e["msg"].get("type") == kind
                and (where is None or where(e["msg"]))
            ),
        )
        return event["msg"]

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(10)


class SecurityScene:
    """One node for one attack: accounts, directories, a root arbiter (:meth:`start`).

    Args:
        arbiter_args: more settings for the arbiter (``--ArbiterApp.hello_timeout=1``).
        disk_dir: the disk tier's root, or None for a fresh path under ``/var/lib``.
    """

    def __init__(self, *arbiter_args: str, disk_dir: str | None = None):
        self.victim = ensure_account(VICTIM)
        self.attacker = ensure_account(ATTACKER)
        self.base = Path(tempfile.mkdtemp(prefix="jupyter-vgpu-sec-"))
        self.base.chmod(0o755)  # every account reaches the socket and the peer's code
        (self.base / "bin").mkdir(mode=0o755)
        self.peer_script = self.base / "bin" / "protocol_peer.py"
        shutil.copyfile(protocol_peer.__file__, self.peer_script)
        self.peer_script.chmod(0o644)
        self.socket = self.base / "arbiter" / "arbiter.sock"
        self.state_root = Path(f"/var/lib/jupyter-vgpu-sec-{secrets.token_hex(4)}")
        self.disk_dir = disk_dir or str(self.state_root / "disk")
        self.standin_log = self.base / "checkpoint.jsonl"
        # never suspend unless an attack asks: the stand-in would take paused kernels off
        self.args = [f"--ArbiterApp.disk_dir={self.disk_dir}", "--ArbiterApp.suspend_after=0", *arbiter_args]
        self.slice = SLICE  # the slice each server gets (an attack may set another)
        self.arbiter: ArbiterProcess | None = None
        self.peers: list[PeerProcess] = []
        self.processes: list[subprocess.Popen] = []

    def start(self, wait: bool = True) -> ArbiterProcess:
        """Start the root arbiter (``wait``: until it listens) with :attr:`args`, a later
        value of a setting replacing an earlier one."""
        settings = dict(arg.partition("=")[::2] for arg in self.args)
        self.arbiter = ArbiterProcess(
            self.base,
            *(f"{k}={v}" for k, v in settings.items()),
            env={checkpoint_standin.ENV: str(self.standin_log)},
        ).start(wait=wait)
        return self.arbiter

    def account(self, who: str) -> pwd.struct_passwd:
        return self.victim if who == "victim" else self.attacker

    def peer(self, who: str, **plan) -> PeerProcess:
        """A protocol peer as ``who`` (``victim`` or ``attacker``), following ``plan``."""
        peer = PeerProcess(self, self.account(who), plan)
        self.peers.append(peer)
        return peer

    def run_as(self, who: str, *argv: str, **kwargs) -> subprocess.Popen:
        """Start ``argv`` as ``who``'s account (killed at :meth:`close`)."""
        account = self.account(who)
        process = subprocess.Popen(
            list(argv), user=account.pw_uid, group=account.pw_gid, extra_groups=[], cwd="/", **kwargs
        )
        self.processes.append(process)
        return process

    def control(self) -> Control:
        return Control(str(self.socket))

    def register(self, pid: int, user: str, slice_: Slice = SLICE, **fields) -> None:
        """Register the process tree at ``pid`` as ``user``'s server (root, for the Hub)."""
        with self.control() as c:
            c.register(pid, user, "", slice_, **fields)

    def books(self) -> dict:
        with self.control() as c:
            return c.books()

    def kernel(self, pid: int) -> dict | None:
        return next((k for k in self.books()["kernels"] if k["pid"] == pid), None)

    def decisions(self, what: str | None = None) -> list[dict]:
        found = self.books()["decisions"]
        return [d for d in found if what is None or d["what"] == what]

    def checkpoint_calls(self) -> list[dict]:
        """What the arbiter handed to the driver's checkpoint (the stand-in's record)."""
        return checkpoint_standin.calls(str(self.standin_log))

    def log(self) -> str:
        return self.arbiter.log_path.read_text(errors="replace") if self.arbiter else ""

    def close(self) -> None:
        for peer in self.peers:
            peer.stop()
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(10)
        if self.arbiter is not None:
            self.arbiter.stop()
        shutil.rmtree(self.base, ignore_errors=True)
        shutil.rmtree(self.state_root, ignore_errors=True)


def take_pid(pid: int, start, tries: int = 50):
    """Start a process with ``start()`` (returning a ``Popen`` or a :class:`PeerProcess`)
    so that it gets the PID ``pid`` (free now), as a host cycling through its PIDs would
    hand it out: the last PID handed out is set to the one before
    (``/proc/sys/kernel/ns_last_pid``, root) and the process started at once; again when
    another process took it first. None when it never came, or when a process or thread
    of another (the arbiter's, the machine's) took ``pid`` itself between the two steps:
    it is then gone for as long as that one lives, and the caller sets its scene again
    with another PID (:data:`SCENE_TRIES`)."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        process = start()
        if process.pid == pid:
            return process
        if isinstance(process, PeerProcess):
            process.stop()
        else:
            process.kill()
            process.wait()
        if os.path.exists(f"/proc/{pid}"):  # taken by another: no try of ours can get it now
            return None
    return None


#: How many times an attack sets its PID-reuse scene (a PID freed, then handed to the
#: process it is about) before it says the scene could not be set. One CI run at 4558c36
#: failed so: 50 tries never got the freed PID, most likely held by then by a process or
#: thread that took it between a try's two steps (:func:`take_pid`); not shown.
SCENE_TRIES = 3


def python_sleeping() -> list[str]:
    """A command line of a process that waits (the system's Python, asleep)."""
    return [SYSTEM_PYTHON, "-c", "import time; time.sleep(300)"]
