"""Running code in a fresh Python process whose cudaMalloc is the pausable allocator's,
as a kernel started by a jupyter-vgpu server is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from jupyter_vgpu.kernel.pause import vmm

ROOT = Path(__file__).resolve().parents[2]  # the folder holding this jupyter_vgpu


def environment(**extra: str) -> dict[str, str]:
    """The environment of a preloaded process (the folder holding this ``jupyter_vgpu``, a
    checkout, first on ``PYTHONPATH``)."""
    env = vmm.preload_environment(dict(os.environ))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def run(code: str, timeout: float = 300, **extra: str) -> dict:
    """Run ``code`` (dedented) in a preloaded process; return the JSON object it printed
    last. Fails with the process's output when it exits non-zero."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=environment(**extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])
