"""Ways a kernel's code leaves a process outside the kernel's process tree, for the tests
of the server's cgroup (``tests/integration/test_server_cgroups.py``, ``test_demo.py``).

Each value of :data:`FROM_A_KERNEL` is a cell's code: it leaves a process that sleeps
600 s outside the kernel's tree and prints ``PID=<pid>`` of it.
"""

from __future__ import annotations


def _print_pid_from(path: str) -> str:
    """Kernel code printing ``PID=<pid>`` once the pid file ``path`` holds one (up to 5 s)."""
    return f"""
for _ in range(100):
    try:
        print(f"PID={{int(open(os.path.expanduser({path!r})).read())}}")
        break
    except (FileNotFoundError, ValueError):
        time.sleep(0.05)
"""


FROM_A_KERNEL = {
    "double fork": """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(f"PID={os.getpid()}", flush=True)
        time.sleep(600)
    os._exit(0)
os.wait()
time.sleep(0.3)
""",
    "setsid -f": """
import os, subprocess, time
subprocess.run(["setsid", "-f", "sh", "-c", "echo $$ > ~/setsid.pid; exec sleep 600"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
"""
    + _print_pid_from("~/setsid.pid"),
    "nohup and disown": """
import os, subprocess, time
subprocess.run(["bash", "-c", "nohup sh -c 'echo $$ > ~/nohup.pid; exec sleep 600' >/dev/null 2>&1 & disown"],
               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""
    + _print_pid_from("~/nohup.pid"),
    "a daemonizing tool (start-stop-daemon)": """
import os, subprocess, time
subprocess.run(["start-stop-daemon", "--start", "--background", "--make-pidfile",
                "--pidfile", os.path.expanduser("~/ssd.pid"), "--exec", "/bin/sleep", "--", "600"])
"""
    + _print_pid_from("~/ssd.pid"),
    "re-parented to init through a subreaper that exits": """
import ctypes, os, time
if os.fork() == 0:
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    if os.fork() == 0:
        if os.fork() == 0:
            print(f"PID={os.getpid()}", flush=True)
            time.sleep(600)
        os._exit(0)
    time.sleep(0.5)
    os._exit(0)
os.wait()
""",
}
