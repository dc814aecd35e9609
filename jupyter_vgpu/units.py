"""Human units for what users and admins read (sizes in powers of 1024). Pure Python."""

from __future__ import annotations


def format_bytes(size: int | float | None) -> str:
    """``size`` bytes as ``"3.1 GiB"``; ``"—"`` for None."""
    if size is None:
        return "—"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"
