"""The host's memory, as the kernel's ``/proc/meminfo`` tells it."""

from __future__ import annotations


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``MemTotal``, ``MemAvailable``, ...); empty where it is
    missing (not Linux, or ``/proc`` not mounted)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out
