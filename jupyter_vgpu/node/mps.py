"""MPS control daemons for the ``mps`` isolation backend: one per GPU, run by the arbiter.

NVIDIA's Multi-Process Service makes the compute share and the budget hard limits for
its clients: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` caps the SMs a client's kernels may
use and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` the device memory it may allocate (both
set by the spawner from the slice, :meth:`jupyter_vgpu.slice.Slice.environment`). They
apply only to clients of a running control daemon, which this module starts, watches
and stops: one per GPU, with ``CUDA_VISIBLE_DEVICES`` set to that GPU alone and private
pipe and log directories (:func:`.socket_path.mps_pipe_directory`), so that daemons of
different cards never meet. Daemons outlive the arbiter: its restart must not end the
kernels connected to them (a new arbiter finds them answering). To stop one, as the
arbiter's user: ``echo quit | CUDA_MPS_PIPE_DIRECTORY=<pipe> nvidia-cuda-mps-control``.

The limits in a client's environment are the user's to clear: MPS only lets them
lower the daemon's. So the daemon itself is given a ceiling (:func:`ceiling`,
:meth:`MPSDaemons.set_limits`): the largest compute share and budget among the card's
``mps`` slices, as the default of every MPS server it starts and as the limit of those
running. No client of the card passes it whatever its environment says; where every
slice of a card is alike, that is each slice's own. The arbiter's NVML watch holds each
server to its own budget besides (docs/design.md, "MPS clients are processes too").

What MPS changes (NVIDIA's "Multi-Process Service" guide, sections "Limitations" and
"Memory protection and error containment"):

- the pinned memory limit is read when a client starts: a quota raise reaches a running
  kernel only after it restarts (the status and the panel say so); the daemon's
  limits, likewise, hold for clients that connect after they are set;
- a fatal GPU error in one client ends every client of that GPU's server;
- one MPS server serves one Linux user at a time: with a system account per Hub user
  (``LocalProcessSpawner``), clients of a second user wait until the first user's
  clients are gone. MPS suits hubs whose servers run as one account (containers).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from jupyter_vgpu.host.socket_path import mps_pipe_directory
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.units import parse_bytes

log = logging.getLogger("jupyter_vgpu.node")

#: NVIDIA's control program (``nvidia-cuda-mps-control``, shipped with the driver).
CONTROL = "nvidia-cuda-mps-control"
#: The longest pipe directory a daemon can use: its Unix sockets (``control``,
#: ``control_privileged``, ...) must fit ``sun_path`` (108 bytes with the final NUL).
MAX_PIPE_DIRECTORY = 80


class MPSUnavailable(RuntimeError):
    """No control daemon could be started for a GPU, or it did not take its limits; the
    message says why."""


def ceiling(slices: Iterable[Slice], gpu_uuid: str) -> tuple[int, int] | None:
    """The limits of every client of ``gpu_uuid``'s daemon: ``(percent, bytes)``, the
    largest compute share (percent of the card's SMs) and budget (bytes) among the
    ``mps`` slices of ``slices`` on that card, simulated ones left out; None where
    there is none."""
    on = [s for s in slices if s.isolation == "mps" and not s.simulated and gpu_uuid in s.gpu_uuids]
    if not on:
        return None
    return max(s.compute_share for s in on), max(s.memory_limit for s in on)


#: A figure the control daemon prints: a number and an optional unit (``25.0``, ``2048M``).
_FIGURE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)", re.IGNORECASE)


def _read_back(threads: str, memory: str) -> tuple[float, int] | None:
    """The defaults in the control daemon's answers to ``get_default_active_thread_percentage``
    and ``get_default_device_pinned_mem_limit``: ``(percent, bytes)``, each its answer's
    last figure (after any device number, as in ``0=2048M``; a bare size is in MiB), or
    None where either has no figure, or no positive size."""
    percent, size = _FIGURE.findall(threads), _FIGURE.findall(memory)
    if not percent or not size:
        return None
    number, unit = size[-1]
    try:
        return float(percent[-1][0]), parse_bytes(number + (unit.upper() or "M"))
    except ValueError:
        return None


class MPSDaemons:
    """The control daemons of one arbiter, keyed by GPU UUID.

    Args:
        socket: the arbiter's socket; pipe and log directories go beside it.
        control: the control program (a path, or a name found on ``PATH``).
    """

    def __init__(self, socket: str, control: str = CONTROL):
        self.socket = socket
        self.control = control
        self.started: set[str] = set()

    def directories(self, gpu_uuid: str) -> tuple[Path, Path]:
        """``(pipe, log)`` directories of ``gpu_uuid``'s daemon."""
        pipe = Path(mps_pipe_directory(self.socket, gpu_uuid))
        return pipe, pipe.parent / "log"

    def _environment(self, gpu_uuid: str) -> dict[str, str]:
        pipe, logs = self.directories(gpu_uuid)
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": gpu_uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(logs),
        }

    def _ask(self, gpu_uuid: str, command: str, timeout: float = 10) -> subprocess.CompletedProcess:
        return subprocess.run(
            [self.control],
            input=command + "\n",
            env=self._environment(gpu_uuid),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def running(self, gpu_uuid: str) -> bool:
        """Whether ``gpu_uuid``'s control daemon answers (``get_server_list``)."""
        if shutil.which(self.control) is None or not (self.directories(gpu_uuid)[0] / "control").exists():
            return False
        try:
            return self._ask(gpu_uuid, "get_server_list").returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    def ensure(self, gpu_uuid: str) -> None:
        """Start ``gpu_uuid``'s control daemon unless it answers already.

        Raises:
            MPSUnavailable: the control program is missing or the daemon did not start.
        """
        if self.running(gpu_uuid):
            self.started.add(gpu_uuid)
            return
        pipe, logs = self.directories(gpu_uuid)
        if len(str(pipe).encode()) > MAX_PIPE_DIRECTORY:
            raise MPSUnavailable(
                f"the MPS pipe directory {pipe} is longer than {MAX_PIPE_DIRECTORY} bytes, too long for the "
                "daemon's Unix sockets: give the arbiter a socket in a shorter directory"
            )
        if shutil.which(self.control) is None:
            raise MPSUnavailable(f"{self.control} is not on PATH (it comes with the NVIDIA driver)")
        for directory in (pipe, logs):
            directory.mkdir(parents=True, exist_ok=True)
        os.chmod(pipe, 0o755)  # clients connect; only the arbiter's user writes
        try:
            result = subprocess.run(
                [self.control, "-d"],
                env=self._environment(gpu_uuid),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MPSUnavailable(f"starting {self.control} -d for {gpu_uuid} failed: {e}") from None
        if result.returncode != 0:
            said = result.stderr.strip()[-300:] or _tail(logs / "control.log")
            raise MPSUnavailable(f"{self.control} -d for {gpu_uuid} exited {result.returncode}: {said}")
        self.started.add(gpu_uuid)
        log.info("MPS control daemon started for %s (pipes in %s)", gpu_uuid, pipe)

    def servers(self, gpu_uuid: str) -> list[int]:
        """The PIDs of the MPS servers ``gpu_uuid``'s daemon runs (``get_server_list``).
        Raises MPSUnavailable where the control program failed."""
        return [int(word) for word in self._said(gpu_uuid, "get_server_list").split() if word.isdigit()]

    def set_limits(self, gpu_uuid: str, percent: int, limit_bytes: int) -> str:
        """Give ``gpu_uuid``'s daemon limits no client of it passes: ``percent`` of the
        card's SMs (``set_default_active_thread_percentage``) and ``limit_bytes`` of
        device memory, rounded down to MiB (``set_default_device_pinned_mem_limit``),
        as the default of the servers it starts and as the limit of each one running
        (``set_active_thread_percentage``, ``set_device_pinned_mem_limit``), then read
        the defaults back. Commands from NVIDIA's MPS guide, "Legacy MPS v2 Interface";
        device 0 is the card (the daemon sees it alone). Returns what the daemon read
        back, as one line.

        Raises:
            MPSUnavailable: the control program failed, or read back other defaults.
        """
        mib = max(1, limit_bytes // 2**20)
        commands = [
            f"set_default_active_thread_percentage {percent}",
            f"set_default_device_pinned_mem_limit 0 {mib}M",
        ]
        for pid in self.servers(gpu_uuid):
            commands += [
                f"set_active_thread_percentage {pid} {percent}",
                f"set_device_pinned_mem_limit {pid} 0 {mib}M",
            ]
        for command in commands:
            self._said(gpu_uuid, command)
        threads = self._said(gpu_uuid, "get_default_active_thread_percentage")
        memory = self._said(gpu_uuid, "get_default_device_pinned_mem_limit 0")
        read = _read_back(threads, memory)
        if read is None or abs(read[0] - percent) > 0.5 or abs(read[1] - mib * 2**20) >= 2**20:
            raise MPSUnavailable(
                f"the MPS daemon of {gpu_uuid} read back {threads!r} and {memory!r} after being set to "
                f"{percent}% and {mib} MiB"
            )
        return f"{threads}; {memory}"

    def _said(self, gpu_uuid: str, command: str) -> str:
        """The daemon's answer to ``command``, stripped. Raises MPSUnavailable where the
        control program failed or the daemon answered with an error."""
        try:
            answer = self._ask(gpu_uuid, command)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise MPSUnavailable(f"{command!r} to the MPS daemon of {gpu_uuid} failed: {e}") from None
        said = (answer.stdout + answer.stderr).strip()
        if answer.returncode != 0 or re.search(r"\b(error|invalid|unknown|fail)", said, re.IGNORECASE):
            raise MPSUnavailable(
                f"{command!r} to the MPS daemon of {gpu_uuid} exited {answer.returncode}: {said[-300:]}"
            )
        return said

    def stop(self, gpu_uuid: str) -> None:
        """Ask ``gpu_uuid``'s control daemon to quit (its clients lose the GPU with it)."""
        if shutil.which(self.control) is not None:
            self._ask(gpu_uuid, "quit")
        self.started.discard(gpu_uuid)


def _tail(path: Path, limit: int = 300) -> str:
    """The end of a daemon's log, or a note that it has none."""
    try:
        return path.read_text(errors="replace").strip()[-limit:] or f"({path} is empty)"
    except OSError:
        return f"(no {path})"
