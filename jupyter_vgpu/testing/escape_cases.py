"""Ways a process walks away from its server's process tree while holding GPU memory,
shared by ``tests/gpu/test_escapes_cgroup.py`` and ``benchmarks/escapes.py``.

Each case is code run in a kernel: it leaves behind a process (a double fork, ``setsid``,
``nohup … & disown``, a daemonizing tool, re-parenting to init through a subreaper
that exits) that takes :data:`HOLD` bytes on the GPU, writes ``took <wall-clock time>``
to a file once it holds them, and keeps them. The kernel waits for that file and
prints it.

:func:`server_cgroup` puts a process (a kernel, or a terminal's server) in a cgroup of its
own as the local spawner does, where this machine lets root make one.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from hub_spawner import server_cgroup as spawner_cgroup
from jupyter_vgpu.host import cgroups
from jupyter_vgpu.testing.server_process import TEST_CGROUP

GiB = 1 << 30
HOLD = 4 * GiB
#: The process left behind: {took} is the file it writes once it holds the memory.
DAEMON = (
    "import time, torch\n"
    f"x = torch.empty({HOLD}, dtype=torch.uint8, device='cuda')\n"
    "torch.cuda.synchronize()\n"
    "open({took!r}, 'w').write(f'took {{time.time()}}')\n"
    "time.sleep(12)\n"
)
#: Kernel code that waits for the daemon's file and prints it.
WAIT = (
    "import time\n"
    "for _ in range(600):\n"
    "    try:\n        text = open({took!r}).read()\n        if text: print(text, flush=True); break\n"
    "    except FileNotFoundError: pass\n"
    "    time.sleep(0.05)\n"
)
CASES = {
    "double fork (setsid between)": (
        "import os, sys\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', {daemon!r}])\n    os._exit(0)\n"
        "os.wait()\n"
    ),
    "setsid -f": (
        "import subprocess, sys\n"
        "subprocess.Popen(['setsid', '-f', sys.executable, '-c', {daemon!r}], start_new_session=True,\n"
        "                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).wait()\n"
    ),
    "nohup … & disown": (
        "import shlex, subprocess, sys\n"
        "py, code = shlex.quote(sys.executable), shlex.quote({daemon!r})\n"
        "subprocess.run(['bash', '-c', f'nohup {{py}} -c {{code}} >/dev/null 2>&1 & disown'])\n"
    ),
    "a daemonizing tool (start-stop-daemon --background)": (
        "import subprocess, sys\n"
        "subprocess.run(['start-stop-daemon', '--start', '--background', '--make-pidfile',\n"
        "                '--pidfile', {pidfile!r}, '--exec', sys.executable, '--', '-c', {daemon!r}])\n"
    ),
    "re-parented to init through a subreaper that exits": (
        "import ctypes, os, sys, time\n"
        "if os.fork() == 0:\n    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)\n"
        "    if os.fork() == 0:\n        os.execv(sys.executable, [sys.executable, '-c', {daemon!r}])\n"
        "    time.sleep(0.5)\n    os._exit(0)\n"
        "os.wait()\n"
    ),
}


def kernel_code(case: str, took: Path) -> str:
    """The kernel code of ``case``: leave the daemon behind, then print its ``took`` line."""
    daemon = DAEMON.format(took=str(took))
    return CASES[case].format(daemon=daemon, pidfile=f"{took}.pid") + WAIT.format(took=str(took))


def terminal_command(took: Path) -> str:
    """Typed into a terminal: a ``setsid -f`` daemon that holds the memory; the shell
    then prints its ``took`` line (``while`` until the file has it)."""
    daemon = DAEMON.format(took=str(took)).replace("'", '"')
    return (
        f"setsid -f python3 -c '{daemon}' >/dev/null 2>&1; "
        f"while [ ! -s {took} ]; do sleep 0.05; done; cat {took}; echo"
    )


def took_time(output: str) -> float | None:
    """The wall-clock time an escape printed after ``took``."""
    match = re.search(r"took (\d+\.\d+)", output)
    return float(match.group(1)) if match else None


def server_cgroup(pid: int, parent: str = f"{TEST_CGROUP}/gpu") -> tuple[cgroups.Cgroup | None, str]:
    """Move ``pid`` (before any user code of it runs) into a new cgroup under ``parent``,
    as the local spawner would have started it there: ``(cgroup, "")``, or ``(None, why
    not)`` where this machine lets no cgroup be made (not root, read-only hierarchies)."""
    try:
        host = spawner_cgroup.probe("cgroupfs", parent)
    except spawner_cgroup.CgroupUnavailable as e:
        return None, str(e)
    cgroup = cgroups.Cgroup(host.hierarchy, f"{host.parent}/server-{secrets.token_hex(4)}")
    directory = host.mount.directory(cgroup.path)
    directory.mkdir(mode=0o755)
    (directory / "cgroup.procs").write_text(str(pid))
    return cgroup, ""


def remove_cgroup(cgroup: cgroups.Cgroup | None) -> None:
    """End what is left in ``cgroup`` and remove it."""
    if cgroup is None:
        return
    directory = cgroups.find_mount(cgroup.hierarchy).directory(cgroup.path)
    spawner_cgroup.kill_all(directory)
    for _ in range(100):
        if cgroups.try_remove(directory):
            return
        spawner_cgroup.kill_all(directory, rounds=1)
