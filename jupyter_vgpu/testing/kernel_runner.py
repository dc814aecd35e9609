"""Real IPython kernels for tests and benchmarks, started with jupyter_client as a server would."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
import weakref
from pathlib import Path

from jupyter_client import KernelManager

from .output_text import output_text


class Kernel:
    """A real ipykernel in its own process; ``run`` executes code and returns its text.

    Its channels are Unix sockets (ZeroMQ's ``ipc`` transport) in a directory of its
    own, not TCP ports: jupyter_client picks a TCP port by binding port 0 and letting it
    go, and the kernel binds it again later, so any process on the host (another test
    worker's kernel) may take it between the two and the kernel dies at start ("Address
    already in use"). A path of its own cannot be taken. The directory is short (under
    ``/tmp``, whatever ``runtime`` is) because a Unix socket's path is at most 107 bytes;
    it is removed when the kernel object is collected or the process exits."""

    def __init__(
        self,
        runtime: Path,
        env: dict[str, str],
        *,
        load_extension: bool = False,
        ready_timeout: float = 60,
        log: Path | None = None,
        args: tuple[str, ...] = (),
    ):
        """``load_extension`` loads the kernel hook explicitly (``--ext``), for checkouts
        run without installing the package (whose IPython config loads it);
        ``ready_timeout`` is how long the kernel may take to start, seconds; ``log`` is a
        file for the kernel's stdout and stderr (default: this process's); ``args`` are
        more command-line settings of the kernel (``--VGPUKernel.resume_timeout=5``)."""
        self.id = str(uuid.uuid4())
        sockets = tempfile.mkdtemp(prefix="vgpu-kernel-", dir="/tmp")
        weakref.finalize(self, shutil.rmtree, sockets, ignore_errors=True)
        self.manager = KernelManager(
            kernel_name="python3",
            connection_file=str(runtime / f"kernel-{self.id}.json"),
            transport="ipc",
            ip=os.path.join(sockets, "channel"),
        )
        self.manager.kernel_spec.argv[0] = sys.executable
        if load_extension:
            self.manager.kernel_spec.argv.append("--ext=jupyter_vgpu")
        self.manager.kernel_spec.argv.extend(args)
        output = {}
        if log is not None:
            output["stdout"] = output["stderr"] = open(log, "ab")  # noqa: SIM115 - the kernel owns it
        self.manager.start_kernel(env={**os.environ, **env}, **output)
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=ready_timeout)

    @property
    def pid(self) -> int:
        """The kernel's process id."""
        return self.manager.provisioner.pid

    def run(self, code: str, timeout: float = 120) -> str:
        """Execute ``code``; return stdout, results and error text together."""
        parts: list[str] = []

        def hook(msg):
            text = output_text(msg["header"]["msg_type"], msg["content"], traceback=True)
            if text is not None:
                parts.append(text)

        self.client.execute_interactive(code, output_hook=hook, timeout=timeout)
        return "".join(parts)

    def shutdown(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)
