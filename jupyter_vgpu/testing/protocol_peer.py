"""A client of the node arbiter that says exactly what it is told to: a kernel's side of
the protocol, as an honest kernel or as an attacker, for the security tests.

It uses nothing but the standard library and imports nothing of this package, so that
it runs as any account with the system's Python (``python3 protocol_peer.py PLAN``)
from a copy in a directory every user can read. ``PLAN`` is a JSON object:

- ``socket``: the arbiter's socket;
- ``hello``: the hello to send (a version-2 hello's fields; ``null``: none), or
  ``connect_only`` true to connect and say nothing;
- ``answers``: how to answer each request type (``pause``, ``suspend``, ``spill``,
  ``trim``, ``release``): ``"ok"`` (with ``"after"``: the figures of the state message sent first),
  ``"refuse"`` (with ``"message"``), or ``"silent"``;
- ``commands``: read from standard input, one JSON object a line: ``{"send": {...}}``
  sends a message as it is; ``{"room": "run"}`` asks for room; ``{"hand_over": true}``
  forks a child that keeps the connection and makes this process exit (the child's
  PID is printed first: ``{"event": "handed", "pid": N}``); ``{"flood": {...},
  "count": N}`` sends a message N times as fast as the socket takes them.

Everything received is printed as a JSON line (``{"event": "received", "msg": ...}``),
and so are the peer's own events, so that a test reads what happened in order.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading

_print_lock = threading.Lock()


def say(event: str, **fields) -> None:
    with _print_lock:
        sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
        sys.stdout.flush()


class Peer:
    def __init__(self, plan: dict):
        self.plan = plan
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(plan["socket"])
        self.lock = threading.Lock()
        self.next_room = 1

    def send(self, msg: dict) -> None:
        with self.lock:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def answer(self, msg: dict) -> None:
        how = self.plan.get("answers", {}).get(msg["type"], {"do": "ok"})
        if how.get("do") == "silent":
            return
        if how.get("do") == "refuse":
            self.send(
                {"type": "reply", "id": msg["id"], "ok": False, "message": how["message"], "released": None}
            )
            return
        if how.get("after"):
            self.send({"type": "state", "resume_seconds": None, **how["after"]})
        self.send(
            {"type": "reply", "id": msg["id"], "ok": True, "message": "done", "released": how.get("released")}
        )

    def flood(self, msg: dict, count: int) -> None:
        line = (json.dumps(msg) + "\n").encode()
        for start in range(0, count, 1000):
            with self.lock:
                self.sock.sendall(line * min(1000, count - start))

    def read(self) -> None:
        for line in self.sock.makefile("rb"):
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            say("received", msg=msg)
            if isinstance(msg, dict) and msg.get("type") in ("pause", "suspend", "spill", "trim", "release"):
                self.answer(msg)
        say("closed")

    def command(self, cmd: dict) -> None:
        if "send" in cmd:
            self.send(cmd["send"])
        elif "room" in cmd:
            self.send({"type": "room", "id": self.next_room, "for": cmd["room"]})
            self.next_room += 1
        elif "flood" in cmd:  # the same message, count times, as fast as the socket takes them
            threading.Thread(target=self.flood, args=(cmd["flood"], cmd["count"]), daemon=True).start()
        elif cmd.get("hand_over"):
            child = os.fork()
            if child:
                say("handed", pid=child)
                os._exit(0)
            threading.Thread(target=self.read, daemon=True).start()  # the child's own reader


def main() -> None:
    plan = json.loads(sys.argv[1])
    peer = Peer(plan)
    say("connected", pid=os.getpid(), uid=os.getuid())
    if plan.get("hello") is not None and not plan.get("connect_only"):
        peer.send({"type": "hello", "version": 2, **plan["hello"]})
    threading.Thread(target=peer.read, daemon=True).start()
    for line in sys.stdin:
        if line.strip():
            peer.command(json.loads(line))
    say("done")


if __name__ == "__main__":
    main()
