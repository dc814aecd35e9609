"""The arbiter's socket protocol: one JSON object per line, both ways, version 1.

Kernels (any user) may send:

- ``{"type": "hello", "version": 1, "kernel_id": str}`` once, first. The arbiter
  answers ``{"type": "welcome", "slice": <slice> | null, "server": "user/name"}``.
- ``{"type": "state", "state": "active"|"idle"|"paused"|"suspended", "resident": int,
  "paused_bytes": int, "host_bytes": int, "resume_seconds": number | null}``: figures
  only; ``resident`` (bytes on the card) counts only on a simulated GPU, where NVML has
  nothing to say; ``resume_seconds`` is the last resume's duration, once.
- ``{"type": "room", "id": int, "for": "run"|"resume"|"restore"}``: may I run? The
  arbiter answers ``{"type": "grant", "id": int}``, possibly after
  ``{"type": "wait", "id": int, "message": str}`` (shown in the cell's output), or
  ``{"type": "deny", "id": int, "message": str}`` after its queue timeout.
- ``{"type": "reply", "id": int, "ok": bool, "message": str, "released": int | null}``:
  the answer to a request; ``released`` is the device memory a pause gave back (bytes;
  null for a suspend), a figure only: 0 spares the arbiter its wait for NVML to drop,
  and what the card has free is still read from NVML before any room is granted.

The arbiter sends kernels requests: ``{"type": "pause", "id": int}``, ``{"type":
"suspend", "id": int}`` (pause if needed, hold every message, answer; the arbiter then
checkpoints the process), and notices: ``{"type": "slice", "slice": <slice>}``,
``{"type": "notice", "message": str}``.

Trusted clients (the arbiter's own user, or root: the Hub's spawner, a benchmark) may
also send ``{"type": "register", "pid": int, "user": str, "server": str, "slice":
<slice>}`` (the process tree rooted at ``pid`` has that slice; with an optional
``"cgroup": str``, every process in that cgroup, ``PATH`` or ``HIERARCHY:PATH``), ``{"type":
"unregister", "pid": int}``, ``{"type": "books"}`` (the arbiter's view, for tests and
the Hub's page) and ``{"type": "refresh"}`` (the Hub's slices changed: read them now,
sent by the Hub after a quota change); each is answered ``{"type": "ok", ...}`` or
``{"type": "error", "message": str}``.

Everything received is checked here before anything acts on it: unknown types, missing
or extra fields, wrong types and out-of-range numbers are refused with a message, and
a line longer than :data:`MAX_LINE` bytes ends the connection.
"""

from __future__ import annotations

import json
from typing import Any

VERSION = 1
#: The longest line accepted, bytes.
MAX_LINE = 64 * 1024
STATES = ("active", "idle", "paused", "suspended")
ROOM_FOR = ("run", "resume", "restore")
_MAX_INT = 2**62


class ProtocolError(ValueError):
    """A received message is malformed; the message says what is wrong."""


def _int(msg: dict, key: str, *, lo: int = 0) -> int:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= _MAX_INT:
        raise ProtocolError(f"{msg.get('type')}: {key} must be an integer >= {lo}")
    return value


def _str(msg: dict, key: str, limit: int = 256) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or len(value) > limit:
        raise ProtocolError(f"{msg.get('type')}: {key} must be a string of at most {limit} characters")
    return value


_FIELDS = {
    "hello": {"type", "version", "kernel_id"},
    "state": {"type", "state", "resident", "paused_bytes", "host_bytes", "resume_seconds"},
    "room": {"type", "id", "for"},
    "reply": {"type", "id", "ok", "message", "released"},
    "register": {"type", "pid", "user", "server", "slice"},
    "unregister": {"type", "pid"},
    "books": {"type"},
    "refresh": {"type"},
}
TRUSTED = frozenset({"register", "unregister", "books", "refresh"})
#: Fields a message may leave out.
_OPTIONAL = {"register": {"cgroup"}}


def decode(line: bytes) -> dict[str, Any]:
    """The message in one received line, checked.

    Raises:
        ProtocolError: not JSON, not an object, an unknown type, or a bad field.
    """
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("not a JSON object") from None
    if not isinstance(msg, dict):
        raise ProtocolError("not a JSON object")
    kind = msg.get("type")
    fields = _FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(f"unknown message type {kind!r}")
    optional = _OPTIONAL.get(kind, set())
    extra, missing = set(msg) - fields - optional, fields - set(msg)
    if extra or missing:
        raise ProtocolError(f"{kind}: fields {sorted(fields)} expected, got {sorted(msg)}")
    if kind == "hello":
        if msg["version"] != VERSION:
            raise ProtocolError(f"hello: protocol version {VERSION} expected, got {msg['version']!r}")
        _str(msg, "kernel_id", 128)
    elif kind == "state":
        if msg["state"] not in STATES:
            raise ProtocolError(f"state: state must be one of {', '.join(STATES)}")
        for key in ("resident", "paused_bytes", "host_bytes"):
            _int(msg, key)
        seconds = msg["resume_seconds"]
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < 1e6
        ):
            raise ProtocolError("state: resume_seconds must be null or a number of seconds")
    elif kind == "room":
        _int(msg, "id")
        if msg["for"] not in ROOM_FOR:
            raise ProtocolError(f"room: for must be one of {', '.join(ROOM_FOR)}")
    elif kind == "reply":
        _int(msg, "id")
        if not isinstance(msg["ok"], bool):
            raise ProtocolError("reply: ok must be true or false")
        _str(msg, "message", 4096)
        if msg["released"] is not None:
            _int(msg, "released")
    elif kind in ("register", "unregister"):
        _int(msg, "pid", lo=1)
        if kind == "register":
            _str(msg, "user")
            _str(msg, "server")
            if not isinstance(msg["slice"], dict):
                raise ProtocolError("register: slice must be a slice object")
            if "cgroup" in msg and msg["cgroup"] is not None:
                _str(msg, "cgroup", 4096)
    return msg


def encode(msg: dict[str, Any]) -> bytes:
    """One line for ``msg`` (compact JSON and a newline)."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"
