"""A real node arbiter in its own process, for tests and benchmarks (``python -m jupyter_vgpu.node``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from jupyter_vgpu.host.arbiter_control import Control

from .waiting import wait_for


class ArbiterProcess:
    """Starts ``python -m jupyter_vgpu.node`` on a socket in ``directory``.

    Args:
        directory: where the socket and the log go.
        args: more command-line settings, e.g. ``["--queue-timeout=3"]``; one that names
            ``--registrars`` or ``--ArbiterApp.poll_seconds`` replaces the tests' default.
        env: more environment variables for the arbiter (``JUPYTER_VGPU_FAILPOINTS``).
    """

    def __init__(self, directory: Path, *args: str, env: dict[str, str] | None = None):
        self.socket = directory / "arbiter" / "arbiter.sock"
        self.log_path = directory / "arbiter.log"
        defaults = {"--registrars": "same-user", "--ArbiterApp.poll_seconds": "0.5"}
        given = {a.split("=", 1)[0] for a in args}
        self.args = [f"{k}={v}" for k, v in defaults.items() if k not in given] + list(args)
        self.env = dict(env or {})
        self.process: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> ArbiterProcess:
        """Start the arbiter and (``wait``) wait until it listens."""
        # no Hub to read slices from, and never the pausable allocator (kernels only)
        env = {k: v for k, v in os.environ.items() if not k.startswith("JUPYTERHUB_") and k != "LD_PRELOAD"}
        env.update(self.env)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "jupyter_vgpu.node", f"--socket={self.socket}", *self.args],
            stdout=open(self.log_path, "ab"),  # noqa: SIM115 - the process owns it
            stderr=subprocess.STDOUT,
            env=env,
        )
        if not wait:
            return self

        def listening() -> bool:
            assert self.process.poll() is None, f"the arbiter exited: {self.log_path.read_text()[-2000:]}"
            with socket.socket(socket.AF_UNIX) as s:
                return s.connect_ex(str(self.socket)) == 0

        wait_for(listening, 30, f"the arbiter to listen on {self.socket}")
        return self

    def control(self) -> Control:
        return Control(str(self.socket))

    def start_kernel(self, directory: Path, user: str, slice_, args: tuple[str, ...] = ()):
        """A kernel of server ``user/``, registered here with ``slice_``: started in
        ``directory`` with the pausable allocator preloaded, the slice's environment
        (``CUDA_VISIBLE_DEVICES``) and the extension loaded; ``args`` are its own
        command-line settings (``--VGPUKernel.pause=False``). Returns the
        :class:`~.kernel_runner.Kernel`; the caller shuts it down."""
        from .kernel_runner import Kernel
        from .preloaded import environment

        env = environment(JUPYTER_VGPU_ARBITER=str(self.socket), **slice_.environment())
        kernel = Kernel(directory, env, load_extension=True, args=args)
        with self.control() as c:
            c.register(kernel.pid, user, "", slice_)
        return kernel

    def books(self) -> dict:
        with self.control() as c:
            return c.books()

    def kernel(self, pid: int) -> dict | None:
        """The arbiter's entry for kernel ``pid``, or None."""
        return next((k for k in self.books()["kernels"] if k["pid"] == pid), None)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(15)
                raise AssertionError(
                    f"the arbiter ignored SIGTERM: {self.log_path.read_text()[-2000:]}"
                ) from None
