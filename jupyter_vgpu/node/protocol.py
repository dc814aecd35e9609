"""The arbiter's socket protocol: one JSON object per line, both ways, version 2.

Kernels (any user) may send:

- ``{"type": "hello", "version": 2, "kernel_id": str, "state": <state>, "resident": int,
  "paused_bytes": int, "host_bytes": int, "disk_bytes": int, "budget": int | null,
  "idle_seconds": number}`` once, first: who it is and where its memory is, so that an
  arbiter started after the kernel (a restart, an upgrade) rebuilds its books from the
  kernels themselves. Figures only, like ``state``; ``budget`` is the budget the kernel
  applies (the slice's is the arbiter's). Version 1 (``{"type": "hello", "version": 1,
  "kernel_id": str}``, kernels started before an upgrade) is still accepted. The arbiter
  answers ``{"type": "welcome", "slice": <slice> | null, "server": "user/name" | null,
  "disk_dir": str | null}`` (``disk_dir``: where the kernel's disk tier lives).
- ``{"type": "state", "state": "active"|"idle"|"paused"|"suspended", "resident": int,
  "paused_bytes": int, "host_bytes": int, "disk_bytes": int, "resume_seconds": number |
  null}``: figures only; ``resident`` (bytes on the card) counts only on a simulated GPU,
  where NVML has nothing to say, and while suspended (what the driver's checkpoint took
  off the card, NVML's figure just before it: what the restore needs back);
  ``host_bytes`` is the host memory the kernel holds for its paused data, ``disk_bytes``
  what it keeps in the disk tier; ``resume_seconds`` is the last resume's duration,
  once. (``disk_bytes`` may be left out: version 1.)
- ``{"type": "room", "id": int, "for": "run"|"resume"|"restore"|"prefetch"}``: may I run?
  (``prefetch``: may I come back now, ahead of a cell the user is about to run? Answered
  at once, granted only where the card has room without taking anyone off it.) The
  arbiter answers ``{"type": "grant", "id": int}``, possibly after one or more
  ``{"type": "wait", "id": int, "message": str}`` (what it waits for and why, shown in
  the cell's output, the latest replacing the one before), or ``{"type": "deny", "id":
  int, "message": str}`` after its queue timeout.
- ``{"type": "reply", "id": int, "ok": bool, "message": str, "released": int | null}``:
  the answer to a request; ``released`` is the device memory a pause gave back, or the
  host memory a trim gave back (bytes; null for a suspend or a spill), a figure only: 0
  spares the arbiter its wait for NVML to drop, and what the card has free is still read
  from NVML before any room is granted.

The arbiter sends kernels requests: ``{"type": "pause", "id": int}``, ``{"type":
"suspend", "id": int}`` (pause if needed, hold every message, answer; the arbiter then
checkpoints the process), ``{"type": "spill", "id": int, "dir": str}`` (move the paused
data from host memory to files in ``dir``, the kernel's directory of the disk tier),
``{"type": "trim", "id": int}`` (an idle kernel lets go of the pinned host memory it
keeps warm for its next pause: the host needs it), and notices: ``{"type": "slice",
"slice": <slice>}``, ``{"type": "notice", "message": str}``, ``{"type": "node",
"host_used": int, "host_limit": int, "disk_used": int}`` (the host memory the node's
kernels hold for their GPU memory, its budget, and the disk tier's bytes; for ``%vgpu
status`` and the panel).

Trusted clients (the arbiter's own user, or root: the Hub's spawner, a benchmark) may
also send ``{"type": "register", "pid": int, "user": str, "server": str, "slice":
<slice>}`` (the process tree rooted at ``pid`` has that slice; with an optional
``"cgroup": str``, every process in that cgroup, ``PATH`` or ``HIERARCHY:PATH``; with an
optional ``"start": int``, the start time of process ``pid`` when the server started, and
``"uid": int``, the account it runs as: see :meth:`.arbiter.Arbiter.register`), ``{"type":
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

VERSION = 2
#: Versions of ``hello`` accepted (1: kernels started before an upgrade).
VERSIONS = (1, 2)
#: The longest line accepted, bytes.
MAX_LINE = 64 * 1024
STATES = ("active", "idle", "paused", "suspended")
ROOM_FOR = ("run", "resume", "restore", "prefetch")
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


def _seconds(msg: dict, key: str) -> float:
    value = msg.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e9:
        raise ProtocolError(f"{msg.get('type')}: {key} must be a number of seconds")
    return value


def _figures(msg: dict) -> None:
    """The figures a hello and a state carry: ``state`` and byte counts."""
    if msg["state"] not in STATES:
        raise ProtocolError(f"{msg['type']}: state must be one of {', '.join(STATES)}")
    for key in ("resident", "paused_bytes", "host_bytes", "disk_bytes"):
        if key in msg:
            _int(msg, key)


_HELLO = {
    1: {"type", "version", "kernel_id"},
    2: {"type", "version", "kernel_id", "state", "resident", "paused_bytes", "host_bytes", "disk_bytes"}
    | {"budget", "idle_seconds"},
}
_FIELDS = {
    "hello": _HELLO[1],
    "state": {"type", "state", "resident", "paused_bytes", "host_bytes", "resume_seconds"},
    "room": {"type", "id", "for"},
    "reply": {"type", "id", "ok", "message", "released"},
    "register": {"type", "pid", "user", "server", "slice"},
    "unregister": {"type", "pid"},
    "books": {"type"},
    "refresh": {"type"},
}
#: Fields a message may leave out: those a version-1 kernel does not send, and a
#: registration's cgroup (a server without one is known by its process tree).
_OPTIONAL = {"state": {"disk_bytes"}, "register": {"cgroup", "start", "uid"}}
TRUSTED = frozenset({"register", "unregister", "books", "refresh"})


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
    if kind == "hello":
        version = msg.get("version")
        if isinstance(version, bool) or version not in VERSIONS:
            raise ProtocolError(
                f"hello: protocol version {' or '.join(map(str, VERSIONS))} expected, got {version!r}"
            )
        fields = _HELLO[version]
    optional = _OPTIONAL.get(kind, set())
    extra, missing = set(msg) - fields - optional, fields - set(msg)
    if extra or missing:
        raise ProtocolError(f"{kind}: fields {sorted(fields | optional)} expected, got {sorted(msg)}")
    if kind == "hello":
        _str(msg, "kernel_id", 128)
        if msg["version"] >= 2:
            _figures(msg)
            if msg["budget"] is not None:
                _int(msg, "budget")
            _seconds(msg, "idle_seconds")
    elif kind == "state":
        _figures(msg)
        if msg["resume_seconds"] is not None:
            _seconds(msg, "resume_seconds")
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
            for key in ("start", "uid"):
                if msg.get(key) is not None:
                    _int(msg, key)
    return msg


def encode(msg: dict[str, Any]) -> bytes:
    """One line for ``msg`` (compact JSON and a newline)."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"
