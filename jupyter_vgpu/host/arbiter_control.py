"""A trusted client of the arbiter: registering process trees and reading its books.

For programs the arbiter trusts to name slices: the arbiter's own user or root, outside
every registered server, and only where ``ArbiterApp.registrars`` allows it (a
standalone arbiter, a benchmark, tests; under a Hub the slices come from the Hub).
The arbiter's answers are checked against their contract (``from-arbiter``).
"""

from __future__ import annotations

import json
import socket

from jupyter_vgpu.contracts import ContractError, lean
from jupyter_vgpu.slice import Slice


class ControlError(RuntimeError):
    """The arbiter refused (the message is its answer), or answered outside its contract."""


class Control:
    """A connection to the arbiter's socket at ``path``."""

    def __init__(self, path: str, timeout: float = 30.0):
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._sock.connect(path)
        self._reader = self._sock.makefile("rb")

    def _ask(self, msg: dict) -> dict:
        self._sock.sendall(json.dumps(msg).encode() + b"\n")
        answer = json.loads(self._reader.readline())
        try:
            lean.validate_message("from-arbiter", answer)
        except ContractError as e:
            raise ControlError(f"the arbiter's answer breaks its contract: {e}") from None
        if answer["type"] != "ok":
            raise ControlError(answer.get("message", str(answer)))
        return answer

    def register(
        self,
        pid: int,
        user: str,
        server: str,
        slice_: Slice,
        cgroup: str | None = None,
        start: int | None = None,
        uid: int | None = None,
    ) -> None:
        """Give the process tree rooted at ``pid`` the slice ``slice_``; with ``cgroup``
        (``PATH`` in the unified hierarchy, or ``HIERARCHY:PATH``), every process in that
        cgroup and below. ``start``: the start time of ``pid`` when the server started
        (clock ticks after boot; read by the arbiter where not given); ``uid``: the
        account the server runs as (its kernels must be of it).

        Raises:
            ControlError: the arbiter refused.
        """
        msg = {"type": "register", "pid": pid, "user": user, "server": server, "slice": slice_.to_dict()}
        for key, value in (("cgroup", cgroup), ("start", start), ("uid", uid)):
            if value is not None:
                msg[key] = value
        self._ask(msg)

    def unregister(self, pid: int) -> None:
        self._ask({"type": "unregister", "pid": pid})

    def refresh(self) -> None:
        """Make the arbiter read the Hub's slices now (after a quota change)."""
        self._ask({"type": "refresh"})

    def books(self) -> dict:
        """The arbiter's view: ``servers``, ``kernels`` and recent ``decisions``."""
        return self._ask({"type": "books"})["books"]

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
