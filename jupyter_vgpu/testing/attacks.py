"""Every attack on the root arbiter we know of, each run for real and judged.

Each :class:`Attack` runs in a fresh :class:`~.security_scene.SecurityScene` (a root
arbiter, real accounts) and returns an :class:`Outcome`: whether it was refused and
nothing changed, and what the arbiter said. ``tests/security`` asserts every one is
refused; ``benchmarks/attacks.py`` writes them all to ``benchmarks/results/attacks-cpu.json``.
The numbers in the names are those of the review that found them (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from jupyter_vgpu.node import allowlist

from .security_scene import (
    SCENE_TRIES,
    SLICE,
    SYSTEM_PYTHON,
    GiB,
    MiB,
    SecurityScene,
    python_sleeping,
    take_pid,
)
from .waiting import wait_for


@dataclasses.dataclass
class Outcome:
    """What came of one attack.

    Attributes:
        refused: the attack failed and nothing it aimed at changed.
        message: what the arbiter (or the system) said, or what was observed.
    """

    refused: bool
    message: str


@dataclasses.dataclass(frozen=True)
class Attack:
    """One attack: a name, the surface it goes through, the review's severity, and how to
    run it (``run(scene) -> Outcome``, with the scene not yet started) with the
    arbiter's extra settings."""

    name: str
    surface: str
    severity: str
    run: Callable[[SecurityScene], Outcome]
    args: tuple[str, ...] = ()
    disk_under_var_tmp: bool = False

    def __call__(self) -> Outcome:
        disk = f"/var/tmp/jupyter-vgpu-sec-{os.getpid()}-{self.name}" if self.disk_under_var_tmp else None
        scene = SecurityScene(*self.args, disk_dir=disk)
        try:
            return self.run(scene)
        finally:
            scene.close()
            if disk:
                with contextlib.suppress(OSError):  # what the attacker left under /var/tmp
                    shutil.rmtree(disk)


def hello(
    state: str = "idle", resident: int = 0, paused: int = 0, host: int = 0, idle: float = 0.0, **more
) -> dict:
    """A version-2 hello's fields (the peer adds type and version), and ``more`` of a
    later version's (``cached_bytes``)."""
    return {
        "kernel_id": "k", "state": state, "resident": resident, "paused_bytes": paused,
        "host_bytes": host, "disk_bytes": 0, "budget": None, "idle_seconds": idle, **more,
    }  # fmt: skip


def state(state: str, resident: int = 0, paused: int = 0, host: int = 0, disk: int = 0, **more) -> dict:
    return {
        "state": state,
        "resident": resident,
        "paused_bytes": paused,
        "host_bytes": host,
        "disk_bytes": disk,
        **more,
    }


def _owner_mode(path: Path) -> tuple[int, int]:
    info = os.lstat(path)
    return info.st_uid, stat.S_IMODE(info.st_mode)


def _kernel_of(scene: SecurityScene, who: str, version: int = 2, **plan):
    """A peer of ``who`` registered as the root of a server of its own (the Hub's part:
    root registers it, with the account's uid), its hello (of protocol ``version``) sent
    once it is registered."""
    peer = scene.peer(who, hello=None, **{k: v for k, v in plan.items() if k != "hello"})
    scene.register(peer.pid, who, scene.slice, uid=scene.account(who).pw_uid)
    peer.command({"send": {"type": "hello", "version": version, **plan.get("hello", hello())}})
    peer.received("welcome", where=lambda m: m.get("slice") is not None)
    return peer


# -- 1. the disk tier --------------------------------------------------------------------


def disk_made_first(scene: SecurityScene) -> Outcome:
    """The attacker makes the disk tier's directory under /var/tmp before the arbiter, its
    own directory there a link to a root-owned one, and claims paused bytes so that a
    spill is planned: the arbiter must take none of it."""
    target = scene.state_root / "target"  # stands for /etc
    target.mkdir(parents=True, mode=0o755)
    before = _owner_mode(target)
    attacker = scene.attacker
    made = scene.run_as(
        "attacker", SYSTEM_PYTHON, "-c",
        "import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777); "
        "os.symlink(sys.argv[2], os.path.join(sys.argv[1], sys.argv[3]))",
        scene.disk_dir, str(target), str(attacker.pw_uid),
    )  # fmt: skip
    if made.wait(30) != 0:
        return Outcome(False, "the attacker could not make the directory first (the scene is wrong)")
    scene.start()
    _kernel_of(
        scene, "attacker", hello=hello("paused", paused=500 * MiB, host=500 * MiB, idle=3600),
        answers={"spill": {"do": "ok", "after": state("paused", paused=500 * MiB, disk=500 * MiB)}},
    )  # fmt: skip
    wait_for(lambda: "disk tier" in scene.log(), 20, "the arbiter to say what became of its disk tier")
    time.sleep(3)  # the background spills every poll (0.5 s): let it try
    after = _owner_mode(target)
    problem = scene.books()["node"]["disk_problem"] or ""
    refused = after == before and "belongs to uid" in problem
    return Outcome(refused, problem or f"target {before} -> {after}")


def disk_kernel_dir_link(scene: SecurityScene) -> Outcome:
    """In their own directory of the disk tier, the attacker makes a "kernel directory"
    of an ended process that is a link to a root-owned directory: the sweep removes the
    link, never what it leads to."""
    target = scene.state_root / "target"
    target.mkdir(parents=True, mode=0o755)
    (target / "precious").write_text("root's")
    scene.args.append("--ArbiterApp.host_memory_limit=100M")
    scene.start()
    peer = _kernel_of(
        scene, "attacker", hello=hello("paused", paused=200 * MiB, host=200 * MiB, idle=3600),
        answers={"spill": {"do": "ok", "after": state("paused", paused=200 * MiB, disk=200 * MiB)}},
    )  # fmt: skip
    peer.received("spill", timeout=30)
    mine = Path(scene.disk_dir) / str(scene.attacker.pw_uid)
    wait_for(mine.exists, 20, "the attacker's directory of the disk tier")
    link = mine / "kernel-99999999-1"
    link_it = "import os, sys; os.symlink(sys.argv[1], sys.argv[2])"
    made = scene.run_as("attacker", SYSTEM_PYTHON, "-c", link_it, str(target), str(link))
    made.wait(30)
    wait_for(lambda: not os.path.lexists(link), 30, "the sweep to remove the link")
    kept = (target / "precious").exists() and _owner_mode(target) == (0, 0o755)
    freed = [d["message"] for d in scene.decisions("disk tier freed")]
    return Outcome(kept, f"the link went, its target stayed: {freed[-1] if freed else ''}")


def disk_root_is_the_arbiters(scene: SecurityScene) -> Outcome:
    """The attacker tries to put something of theirs into the disk tier's root (a
    directory for another uid, or a link), or to move their own directory away."""
    scene.start()
    _kernel_of(scene, "victim")  # the arbiter made its root at start
    root = scene.disk_dir
    tries = scene.run_as(
        "attacker", SYSTEM_PYTHON, "-c",
        "import os, sys\nok = []\n"
        "for f in (lambda: os.mkdir(os.path.join(sys.argv[1], '0')),\n"
        "          lambda: os.symlink('/etc', os.path.join(sys.argv[1], '1'))):\n"
        "    try:\n        f(); ok.append(1)\n    except OSError:\n        pass\n"
        "sys.exit(len(ok))",
        root,
    )  # fmt: skip
    done = tries.wait(30)
    owner, mode = _owner_mode(Path(root))
    return Outcome(
        done == 0 and (owner, mode) == (0, 0o711),
        f"{root}: uid {owner}, mode {mode:04o}; {done} writes got in",
    )


# -- 2. processes, not PIDs --------------------------------------------------------------


def _stale_connection(scene: SecurityScene, plan: dict):
    """An attacker's connection whose process has ended: it connected, handed the socket
    to a child and exited (reaped). Returns (the peer, the freed PID)."""
    peer = scene.peer("attacker", **plan)
    freed = peer.pid
    peer.command({"hand_over": True})
    peer.expect("handed")
    peer.process.wait(10)  # reaped: the PID is free
    return peer, freed


def pid_reuse_hello(scene: SecurityScene) -> Outcome:
    """A connection kept after its process ended says hello once a victim's kernel has
    its PID: it must not join as that kernel, and the victim's own connection stays."""
    scene.start()
    for _ in range(SCENE_TRIES):  # a freed PID another process took first: set it again
        stale, freed = _stale_connection(scene, {"hello": None})
        victim = take_pid(freed, lambda: scene.peer("victim", hello=None))
        if victim is not None:
            break
    else:
        return Outcome(False, f"PID {freed} could not be given to the victim (the scene is wrong)")
    scene.register(victim.pid, "victim", uid=scene.victim.pw_uid)
    victim.command({"send": {"type": "hello", "version": 2, **hello()}})
    victim.received("welcome", where=lambda m: m.get("slice") is not None)
    stale.command({"send": {"type": "hello", "version": 2, **hello()}})
    said = stale.received("error")["message"]
    kernel = scene.kernel(freed)
    with contextlib.suppress(AssertionError):
        victim.expect("closed", timeout=1)  # the arbiter once closed the victim's own connection here
    closed = any(e.get("event") == "closed" for e in victim.seen)
    ok = "ended" in said and kernel is not None and kernel["server"] == "victim/" and not closed
    return Outcome(ok, said)


def pid_reuse_suspend(scene: SecurityScene) -> Outcome:
    """An attacker's kernel, once admitted, hands its connection to a child and ends; a
    victim's process takes its PID; the attacker then answers the arbiter as a paused
    kernel idle past ``suspend_after``: the arbiter must hand nothing to the driver."""
    scene.args.append("--ArbiterApp.suspend_after=1")
    scene.start()
    answers = {"pause": {"do": "ok"}, "suspend": {"do": "ok", "after": state("suspended")}}
    for _ in range(SCENE_TRIES):  # a freed PID another process took first: set it again
        peer = scene.peer("attacker", hello=None, answers=answers)
        scene.register(peer.pid, "attacker", uid=scene.attacker.pw_uid)
        peer.command({"send": {"type": "hello", "version": 2, **hello("idle", resident=100 * MiB)}})
        peer.received("welcome", where=lambda m: m.get("slice") is not None)
        freed = peer.pid
        peer.command({"hand_over": True})
        peer.expect("handed")
        peer.process.wait(10)
        victim = take_pid(freed, lambda: scene.run_as("victim", *python_sleeping()))
        if victim is not None:
            break
    else:
        return Outcome(False, f"PID {freed} could not be given to the victim (the scene is wrong)")
    # now a paused kernel, idle past suspend_after in a second: the arbiter suspends "it"
    peer.command({"send": {"type": "state", "resume_seconds": None, **state("paused", resident=100 * MiB)}})
    decided = wait_for(
        lambda: [d for d in scene.decisions() if d["what"] in ("suspend", "suspend failed")],
        30,
        "the arbiter's suspend of the stale kernel",
    )
    handed = [c for c in scene.checkpoint_calls() if freed in c["pids"]]
    if handed:
        return Outcome(False, f"handed to the driver: {handed}")
    return Outcome(decided[-1]["what"] == "suspend failed", decided[-1].get("message", ""))


def server_pid_reuse(scene: SecurityScene) -> Outcome:
    """A victim's server (known by its process tree) ends while the Hub still lists it;
    an attacker's process takes its PID and connects as a kernel: no slice."""
    scene.start()
    for _ in range(SCENE_TRIES):  # a freed PID another process took first: set it again
        server = scene.run_as("victim", *python_sleeping())
        scene.register(server.pid, "victim")  # no uid: the start time alone must hold
        server.kill()
        server.wait(10)
        attacker = take_pid(server.pid, lambda: scene.peer("attacker", hello=None))
        if attacker is not None:
            break
    else:
        return Outcome(False, f"PID {server.pid} could not be given to the attacker (the scene is wrong)")
    attacker.command({"send": {"type": "hello", "version": 2, **hello()}})
    welcome = attacker.received("welcome")
    ok = welcome.get("slice") is None and scene.kernel(attacker.pid) is None
    return Outcome(ok, "welcomed without a slice" if ok else f"given {welcome.get('server')}'s slice")


def kernel_of_another_uid(scene: SecurityScene) -> Outcome:
    """An attacker's process inside a victim's server's tree (its child, as a setuid or
    shared-account mistake would put it) asks to join as the victim's kernel."""
    scene.start()
    server = scene.run_as("victim", *python_sleeping())
    scene.register(server.pid, "victim", uid=scene.victim.pw_uid)
    attacker = scene.peer("attacker", hello=None)
    scene.register(attacker.pid, "victim", uid=scene.victim.pw_uid)  # a Hub mistaken about whose it is
    attacker.command({"send": {"type": "hello", "version": 2, **hello()}})
    said = attacker.received("error")["message"]
    return Outcome("uid" in said and scene.kernel(attacker.pid) is None, said)


# -- 3. figures --------------------------------------------------------------------------


def false_host_figure(scene: SecurityScene) -> Outcome:
    """A paused kernel claims 12 GiB of host memory and refuses every spill, so that the
    node's host budget reads full: another user's cell must still get its room."""
    scene.args += ["--ArbiterApp.host_memory_limit=1G", "--queue-timeout=20"]
    scene.start()
    _kernel_of(
        scene, "attacker", hello=hello("paused", paused=600 * MiB, host=12 * 1024 * MiB, idle=3600),
        answers={"spill": {"do": "refuse", "message": "RuntimeError: no"}},
    )  # fmt: skip
    paused = state("paused", paused=700 * MiB, host=700 * MiB)
    _kernel_of(
        scene, "victim", hello=hello("idle", resident=700 * MiB, idle=600),
        answers={"pause": {"do": "ok", "released": 0, "after": paused}},
    )  # fmt: skip
    runner = _kernel_of(scene, "victim", hello=hello("idle"))
    runner.command({"room": "run"})
    runner.received("grant", timeout=40)  # AssertionError (the attack worked) when it never comes
    capped = [d for d in scene.decisions("figure capped") if d["server"] == "attacker/"]
    return Outcome(bool(capped), capped[-1]["message"] if capped else "granted, but no figure was capped")


def false_cached_figure(scene: SecurityScene) -> Outcome:
    """An idle kernel says 600 MiB of its 700 are cached free blocks (protocol version 5)
    so that the arbiter asks it for a release instead of a pause, then says it gave them
    back and gives nothing: another user's cell must still get its room, the liar
    paused for it, and asked for a release once only."""
    scene.args += ["--ArbiterApp.release_first=True", "--queue-timeout=20"]
    scene.start()
    liar = _kernel_of(
        scene, "attacker", version=5,
        hello=hello("idle", resident=700 * MiB, idle=600, cached_bytes=600 * MiB),
        answers={
            "release": {"do": "ok", "released": 600 * MiB},  # and its figures as they were
            "pause": {"do": "ok", "released": 0, "after": state("paused", paused=700 * MiB)},
        },
    )  # fmt: skip
    runner = _kernel_of(scene, "victim", version=5, hello=hello("idle"))
    runner.command({"room": "run"})
    runner.received("grant", timeout=40)  # AssertionError (the attack worked) when it never comes
    asked = [e["msg"]["type"] for e in liar.drain() if e.get("event") == "received"]
    released = [d for d in scene.decisions("release") if d["server"] == "attacker/"]
    paused = [d for d in scene.decisions("pause") if d["server"] == "attacker/"]
    return Outcome(
        asked.count("release") == 1 and len(released) == 1 and len(paused) == 1,
        f"asked {asked}; paused for: {paused[-1]['reason'] if paused else 'never paused'}",
    )


def false_disk_error(scene: SecurityScene) -> Outcome:
    """A kernel answers the arbiter's spill with a made-up disk error: the disk tier must
    not be taken for failing, and another kernel's spill goes on."""
    scene.args.append("--ArbiterApp.host_memory_limit=250M")  # the victim alone is over the spill mark
    scene.start()
    _kernel_of(
        scene, "attacker", hello=hello("paused", paused=300 * MiB, host=300 * MiB, idle=7200),
        answers={"spill": {"do": "refuse", "message": "OSError: [Errno 28] No space left on device"}},
    )  # fmt: skip
    victim = _kernel_of(
        scene, "victim", hello=hello("paused", paused=300 * MiB, host=300 * MiB, idle=3600),
        answers={"spill": {"do": "ok", "after": state("paused", paused=300 * MiB, disk=300 * MiB)}},
    )  # fmt: skip
    victim.received("spill", timeout=30)
    wait_for(lambda: scene.decisions("spill"), 30, "the victim's spill")
    problem = scene.books()["node"]["disk_problem"]
    failed = scene.decisions("spill failed")
    return Outcome(problem is None, failed[0]["message"] if failed else "no failure recorded")


def silent_kernel(scene: SecurityScene) -> Outcome:
    """An idle kernel never answers a pause: the cell that needed the room waits once,
    never twice, for its silence."""
    scene.args += ["--ArbiterApp.pause_timeout=2", "--queue-timeout=6"]
    scene.start()
    attacker = _kernel_of(scene, "attacker", hello=hello("idle", resident=700 * MiB, idle=600),
                          answers={"pause": {"do": "silent"}})  # fmt: skip
    runner = _kernel_of(scene, "victim", hello=hello("idle"))
    for _ in range(2):
        runner.command({"room": "run"})
        runner.received("deny", timeout=30)
    asked = [e for e in attacker.drain() if e.get("event") == "received" and e["msg"].get("type") == "pause"]
    said = scene.decisions("kernel unresponsive")
    return Outcome(
        len(asked) == 1 and bool(said), said[-1]["message"] if said else f"asked {len(asked)} times"
    )


# -- 4. limits ---------------------------------------------------------------------------


def connection_flood(scene: SecurityScene) -> Outcome:
    """1,100 idle connections of one user: most are refused, the silent ones are hung up
    on, and a victim's kernel still joins; the log stays small."""
    scene.args.append("--ArbiterApp.hello_timeout=2")
    scene.start()
    size_before = scene.arbiter.log_path.stat().st_size
    flood = scene.run_as(
        "attacker", SYSTEM_PYTHON, "-c",
        "import socket, sys, time\nheld = []\nrefused = 0\n"
        "for _ in range(1100):\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try:\n        s.connect(sys.argv[1])\n        held.append(s)\n"
        "    except OSError:\n        refused += 1\n"
        "time.sleep(4)\nclosed = 0\n"
        "for s in held:\n    s.settimeout(0.5)\n"
        "    try:\n        while s.recv(65536):\n            pass\n        closed += 1\n"
        "    except OSError:\n        pass\n"
        "print(len(held), closed, flush=True)\n",
        str(scene.socket), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    out, _ = flood.communicate(timeout=120)
    held, closed = (int(x) for x in out.split())
    _kernel_of(scene, "victim")  # AssertionError (the attack worked) when it cannot join
    grown = scene.arbiter.log_path.stat().st_size - size_before
    logged = scene.log().count("connection refused")
    ok = closed == held == 1100 and 0 < logged <= 100 and grown < 2 * MiB
    return Outcome(ok, f"{held} connections made, {closed} hung up on (refused at once, or silent past the "
                       f"hello timeout); {logged} refusals logged, the log grew {grown} bytes")  # fmt: skip


def message_flood(scene: SecurityScene) -> Outcome:
    """A kernel sends 100,000 state messages and 10,000 requests for room as fast as it
    can (on a card where both users' budgets fit, so that the attacker's running holds
    no one's room): another user's cell still gets its answer, and the arbiter's memory
    stays bounded."""
    scene.args.append("--queue-timeout=10")
    scene.start()
    scene.slice = SLICE.replace(gpu_memory=4 * GiB)
    attacker = _kernel_of(scene, "attacker", hello=hello("idle"))
    attacker.command({"flood": {"type": "room", "id": 1, "for": "run"}, "count": 10_000})
    attacker.command({"flood": {"type": "state", "resume_seconds": None, **state("idle")}, "count": 100_000})
    runner = _kernel_of(scene, "victim", hello=hello("idle"))
    runner.command({"room": "run"})
    runner.received("grant", timeout=60)
    rss = _rss(scene.arbiter.process.pid)
    return Outcome(
        rss < 400 * MiB, f"the victim's cell was granted; the arbiter's memory {rss / MiB:.0f} MiB"
    )


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# -- 6. the allowlist --------------------------------------------------------------------


def _allowed_sleep(scene: SecurityScene, env: dict, argv0: str = "/usr/bin/sleep") -> tuple[bool, str]:
    process = scene.run_as("attacker", argv0, "300", env=env)
    try:
        wait_for(lambda: os.path.exists(f"/proc/{process.pid}/maps") and _mapped(process.pid, env), 20,
                 "the process to start")  # fmt: skip
        return allowlist.judge(process.pid, ["sleep"], [])
    finally:
        process.kill()
        process.wait()


def _mapped(pid: int, env: dict) -> bool:
    """The process has loaded what ``env`` preloads (its maps name it)."""
    want = env.get("LD_PRELOAD")
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False
    return "libc" in maps and (not want or want in maps)


def allowlist_preload(scene: SecurityScene) -> Outcome:
    """A root-owned program on the allowlist (``sleep`` here, ``nvidia-smi`` in life) run
    with the attacker's library in ``LD_PRELOAD``: judged by its code, not its name."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return Outcome(False, "no C compiler to build the attacker's library")
    home = Path(tempfile.mkdtemp(prefix="attacker-", dir=scene.base))
    source, library = home / "evil.c", home / "libevil.so"
    source.write_text("void __attribute__((constructor)) evil(void) {}\n")
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    os.chown(home, scene.attacker.pw_uid, -1)
    os.chown(library, scene.attacker.pw_uid, -1)
    home.chmod(0o755)
    plain, _ = _allowed_sleep(scene, {"PATH": "/usr/bin:/bin"})
    preloaded, why = _allowed_sleep(scene, {"PATH": "/usr/bin:/bin", "LD_PRELOAD": str(library)})
    return Outcome(plain and not preloaded, why)


def allowlist_copy(scene: SecurityScene) -> Outcome:
    """The attacker's own copy of an allowlisted program, under the same name."""
    home = Path(tempfile.mkdtemp(prefix="attacker-", dir=scene.base))
    home.chmod(0o755)
    copy = home / "sleep"
    shutil.copyfile("/usr/bin/sleep", copy)
    copy.chmod(0o755)
    os.chown(copy, scene.attacker.pw_uid, -1)
    allowed, why = _allowed_sleep(scene, {"PATH": "/usr/bin:/bin"}, argv0=str(copy))
    return Outcome(not allowed, why)


# -- 8. the socket's directory, and 9. the library ---------------------------------------


def socket_dir_writable(scene: SecurityScene) -> Outcome:
    """The socket's directory is one every user may write (a misconfiguration): the
    arbiter refuses to serve there rather than trust a lock file a user could plant."""
    directory = scene.socket.parent
    directory.mkdir(mode=0o777)
    directory.chmod(0o777)
    arbiter = scene.start(wait=False)
    code = arbiter.process.wait(60)
    said = next((line for line in scene.log().splitlines() if "writable by other users" in line), "")
    return Outcome(code != 0 and bool(said), said.strip()[-300:])


def library_readable(scene: SecurityScene) -> Outcome:
    """The pausable allocator's library, built with a strict umask, can be loaded by every
    user's kernels (mode 0755)."""
    from jupyter_vgpu.kernel.pause import vmm

    target = Path(tempfile.mkdtemp(prefix="lib-", dir=scene.base)) / "libjupyter_vgpu_vmm.so"
    target.parent.chmod(0o755)
    old = os.umask(0o077)
    try:
        vmm.build(target)
    finally:
        os.umask(old)
    mode = stat.S_IMODE(target.stat().st_mode)
    reader = scene.run_as(
        "victim", SYSTEM_PYTHON, "-c", "import sys; open(sys.argv[1], 'rb').read(4)", str(target)
    )
    return Outcome(mode == 0o755 and reader.wait(30) == 0, f"mode {mode:04o}")


# -- already refused: keep it so ---------------------------------------------------------


def protocol_abuse(scene: SecurityScene) -> Outcome:
    """A user registers a slice, reads the books, sends unknown, malformed, deeply nested
    and huge messages, and a budget of its own in its hello: each refused, its slice the
    Hub's."""
    scene.start()
    peer = _kernel_of(scene, "attacker", hello={**hello(), "budget": 80 * 1024 * MiB})
    sent = [
        {"type": "register", "pid": peer.pid, "user": "attacker", "server": "", "slice": {}},
        {"type": "books"},
        {"type": "pwn"},
        {"type": "state", "state": "idle", "resident": 2**80, "paused_bytes": 0, "host_bytes": 0,
         "resume_seconds": None},
    ]  # fmt: skip
    for msg in sent:
        peer.command({"send": msg})
    errors = [peer.received("error")["message"] for _ in sent]
    raw = socket.socket(socket.AF_UNIX)
    raw.connect(str(scene.socket))
    raw.sendall(b"[" * 100_000 + b"\n")
    raw.settimeout(10)
    answered = raw.recv(4096)
    raw.close()
    books = scene.books()
    limit = next(s["memory_limit"] for s in books["servers"] if s["pid"] == peer.pid)
    ok = len(errors) == len(sent) and b"error" in answered and limit == 600 * MiB
    return Outcome(ok, "; ".join(errors))


ALL = [
    Attack("disk-dir-made-first", "disk tier", "critical", disk_made_first,
           args=("--ArbiterApp.host_memory_limit=100M",), disk_under_var_tmp=True),
    Attack("disk-kernel-dir-link", "disk tier", "critical", disk_kernel_dir_link),
    Attack("disk-root-writes", "disk tier", "critical", disk_root_is_the_arbiters),
    Attack("pid-reuse-hello", "arbiter socket", "high", pid_reuse_hello),
    Attack("pid-reuse-suspend", "checkpoint", "high", pid_reuse_suspend),
    Attack("server-pid-reuse", "arbiter socket", "medium", server_pid_reuse),
    Attack("kernel-of-another-uid", "arbiter socket", "high", kernel_of_another_uid),
    Attack("false-host-figure", "arbiter socket", "high", false_host_figure),
    Attack("false-cached-figure", "arbiter socket", "medium", false_cached_figure),
    Attack("false-disk-error", "arbiter socket", "high", false_disk_error),
    Attack("silent-kernel", "arbiter socket", "high", silent_kernel),
    Attack("connection-flood", "arbiter socket", "high", connection_flood),
    Attack("message-flood", "arbiter socket", "high", message_flood),
    Attack("allowlist-ld-preload", "allowlist", "medium", allowlist_preload),
    Attack("allowlist-copied-program", "allowlist", "medium", allowlist_copy),
    Attack("socket-dir-writable", "state directory", "low", socket_dir_writable),
    Attack("library-readable", "preloaded library", "low", library_readable),
    Attack("protocol-abuse", "arbiter socket", "already refused", protocol_abuse),
]  # fmt: skip
