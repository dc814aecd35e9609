"""Ports for local single-user servers, from a range the OS never hands out by itself.

JupyterHub's local spawners pick a server's port by binding port 0 and closing the
socket (``jupyterhub.utils.random_port``); the server binds it a moment later. Port 0
draws from the OS's ephemeral range (Linux: ``/proc/sys/net/ipv4/ip_local_port_range``,
32768-60999 by default), the same range every kernel's ZeroMQ sockets draw from, and on
a host that runs many kernels one of them can take the port in between: the server
then cannot bind it (``jupyterhub-singleuser`` sets ``port_retries = 0``), and the Hub,
polling that port, meets the kernel's ZeroMQ greeting instead of HTTP. Ports from a
range outside the ephemeral one are never handed out for port 0, so no kernel, nor any
outgoing connection, can take them; within the range a port is tried by binding it,
and a port handed out stays reserved for :data:`HOLD_SECONDS` so two spawns starting at
once never get the same one.
"""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

#: Where Linux says which ports it hands out for port 0.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Linux's default ephemeral range, used where the file cannot be read.
LINUX_DEFAULT_EPHEMERAL = (32768, 60999)
#: The ports local servers get by default (``LocalPortsMixin.port_range``): below Linux's
#: default ephemeral range.
SERVER_RANGE = (20000, 29999)
#: Seconds a port handed out stays reserved for the server it was picked for.
HOLD_SECONDS = 120.0


class NoFreePort(RuntimeError):
    """Every port of the range is in use or reserved; the message names the range."""


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The OS's range for port 0, ``(low, high)`` inclusive; Linux's default where ``path``
    cannot be read or parsed."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT_EPHEMERAL
    return low, high


def check_range(low: int, high: int) -> None:
    """Raise ValueError unless ``[low, high]`` is a non-empty range of unprivileged ports."""
    if not 1024 <= low <= high <= 65535:
        raise ValueError(f"port range {low}-{high}: expected 1024 <= low <= high <= 65535")


def overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """Whether two inclusive port ranges share a port."""
    return a[0] <= b[1] and b[0] <= a[1]


class PortPicker:
    """Hands out free ports of ``[low, high]`` (inclusive), each at most once per
    ``hold_seconds``; thread-safe.

    Raises:
        ValueError: the range is empty or outside 1024-65535.
    """

    def __init__(self, low: int, high: int, hold_seconds: float = HOLD_SECONDS):
        check_range(low, high)
        self.low, self.high, self.hold_seconds = low, high, hold_seconds
        self._handed: dict[int, float] = {}  # port -> when it was handed out (monotonic)
        self._lock = threading.Lock()

    def pick(self, ip: str = "127.0.0.1") -> int:
        """A port of the range that nothing on ``ip`` holds now and that was not handed out
        in the last ``hold_seconds``.

        Raises:
            NoFreePort: none is left.
        """
        with self._lock:
            now = time.monotonic()
            self._handed = {p: t for p, t in self._handed.items() if now - t < self.hold_seconds}
            ports = [p for p in range(self.low, self.high + 1) if p not in self._handed]
            random.shuffle(ports)
            for port in ports:
                if _bindable(ip, port):
                    self._handed[port] = now
                    return port
        raise NoFreePort(
            f"no free port in {self.low}-{self.high} on {ip or 'all interfaces'} "
            f"({len(self._handed)} handed out in the last {self.hold_seconds:.0f} s)"
        )


def _bindable(ip: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET  # "" and "0.0.0.0": every IPv4 address
    with socket.socket(family) as s:
        try:
            s.bind((ip, port))
        except OSError:
            return False
    return True


_pickers: dict[tuple[int, int], PortPicker] = {}
_pickers_lock = threading.Lock()


def picker(low: int, high: int) -> PortPicker:
    """The process's one picker for ``[low, high]``, shared by every spawner using it."""
    with _pickers_lock:
        if (low, high) not in _pickers:
            _pickers[(low, high)] = PortPicker(low, high)
        return _pickers[(low, high)]
