"""Human units for what users and admins read and write (sizes in powers of 1024)."""

from __future__ import annotations

from traitlets import TraitError, TraitType


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


_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(value: object) -> int:
    """Bytes for ``value`` with ``jupyterhub.traitlets.ByteSpecification`` semantics: an
    integer is bytes; a string is ASCII digits (with at most one decimal point) followed
    by K, M, G or T (powers of 1024), e.g. ``"512M"``, ``"1.5G"``.

    Raises:
        ValueError: anything else, or a size that is not positive.
    """
    accepted = "a positive number of bytes or a size like '512M', '4G' (K, M, G, T)"
    if isinstance(value, bool):
        raise ValueError(f"expected {accepted}, got {value!r}")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and value.strip().isascii():
        text = value.strip()
        number, unit = (text[:-1], text[-1].upper()) if text[-1:].upper() in _UNITS else (text, "")
        digits = number.replace(".", "", 1)
        if not digits.isdigit() or (not unit and "." in number):
            raise ValueError(f"expected {accepted}, got {value!r}")
        size = int(float(number) * _UNITS[unit]) if unit else int(number)
    else:
        raise ValueError(f"expected {accepted}, got {value!r}")
    if size <= 0:
        raise ValueError(f"expected {accepted}, got {value!r}")
    return size


class ByteSize(TraitType):
    """A size in bytes, given as an int or a string like ``"64M"`` (see :func:`parse_bytes`)."""

    info_text = "a size in bytes or a string like '64M' or '2G'"

    def validate(self, obj, value):
        if value is None and self.allow_none:
            return None
        try:
            return parse_bytes(value)
        except ValueError as e:
            raise TraitError(f"{self.name}: {e}") from None
