"""Real processes that only sleep, for tests whose arbiter checks that a kernel's process
exists and is who it says (its pid and start time: :class:`jupyter_vgpu.host.procs.Identity`)."""

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def sleeping(n: int):
    """``n`` processes sleeping for a minute; yields their pids, and ends them after."""
    started = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(n)]
    try:
        yield [p.pid for p in started]
    finally:
        for p in started:
            p.kill()
            p.wait()
