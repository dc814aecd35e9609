"""This kernel's link to the node arbiter (:mod:`jupyter_vgpu.node`), over its Unix socket.

The socket's path comes from ``JUPYTER_VGPU_ARBITER`` (set by the spawner). A thread of
this package connects, says hello, and from then on:

- adopts the slice the arbiter sends (the only authority on limits once connected:
  ``server.json`` and the environment are ignored);
- tells the arbiter every change of the kernel's state, with its figures;
- answers the arbiter's requests to pause or to prepare a suspension;
- asks for room before the first message that runs code (:meth:`ArbiterClient.room`,
  called by the gate), waiting while the arbiter makes it or queues the request, and
  showing the arbiter's reason in the cell's output.

When the arbiter cannot be reached the kernel runs as if there were none (its budget
still applies) and keeps trying to connect; a request for room then passes at once.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("jupyter_vgpu")

_STATES = {"busy": "active", "idle": "idle", "pausing": "idle", "paused": "paused"}
_STATES.update(suspending="paused", suspended="suspended")


class ArbiterClient:
    """One kernel's connection.

    Args:
        path: the arbiter's socket.
        kernel_id: this kernel's id (a figure for the arbiter's books).
        adopt_slice: called with the slice dict (or None) the arbiter gives.
        figures: returns ``(resident, paused_bytes, host_bytes, resume_seconds)`` now.
        pausing: the kernel's :class:`~.pausing.PauseControl`.
        say: shows a line in the running cell's output.
    """

    def __init__(
        self,
        path: str,
        kernel_id: str,
        adopt_slice: Callable[[dict | None], None],
        figures: Callable[[], tuple],
        pausing,
        say: Callable[[str], None],
    ):
        self.path, self.kernel_id = path, kernel_id
        self.adopt_slice, self.figures, self.pausing, self.say = adopt_slice, figures, pausing, say
        self.connected = threading.Event()
        self.managed = False  # the arbiter knows our server and sent a slice
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._rooms: dict[int, dict] = {}
        self._room_cond = threading.Condition()
        self._next = 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="jupyter-vgpu-arbiter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        sock = self._sock
        if sock is not None:
            sock.close()

    # -- sending -----------------------------------------------------------------------

    def _send(self, msg: dict) -> bool:
        sock = self._sock
        if sock is None:
            return False
        data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        try:
            with self._send_lock:
                sock.sendall(data)
            return True
        except OSError:
            return False

    def send_state(self, gate_state: str) -> None:
        """Tell the arbiter the kernel's state and figures (a gate listener)."""
        state = _STATES.get(gate_state)
        if state is None or not self.connected.is_set():
            return
        resident, paused, host, resume_seconds = self.figures()
        self._send(
            {
                "type": "state",
                "state": state,
                "resident": int(resident),
                "paused_bytes": int(paused),
                "host_bytes": int(host),
                "resume_seconds": resume_seconds,
            }
        )

    # -- room --------------------------------------------------------------------------

    def room(self, purpose: str) -> None:
        """Ask for room before the kernel runs code; blocks until granted.

        Args:
            purpose: ``run``, ``resume`` (the kernel is paused) or ``restore`` (suspended).

        Raises:
            MemoryError: the arbiter refused (no room before its timeout); the message
                is the arbiter's.
        """
        if not (self.connected.is_set() and self.managed):
            if purpose == "restore":
                raise MemoryError(
                    "the kernel is suspended and the node arbiter cannot be reached to restore it"
                )
            return
        with self._room_cond:
            rid = self._next
            self._next += 1
            self._rooms[rid] = {}
        if not self._send({"type": "room", "id": rid, "for": purpose}):
            self._rooms.pop(rid, None)
            return
        told = False
        with self._room_cond:
            while True:
                answer = self._rooms[rid]
                kind = answer.get("type")
                if kind in ("grant", "deny", "gone"):
                    break
                if kind == "wait" and not told:
                    told = True
                    self._room_cond.release()
                    try:
                        self.say(f"jupyter-vgpu: {answer['message']}")
                    finally:
                        self._room_cond.acquire()
                self._room_cond.wait(1.0)
            del self._rooms[rid]
        if kind == "deny":
            raise MemoryError(answer.get("message") or "no room on the GPU")

    def _answer(self, msg: dict) -> None:
        with self._room_cond:
            if msg.get("id") in self._rooms:
                self._rooms[msg["id"]] = msg
                self._room_cond.notify_all()

    # -- receiving -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._session()
            except OSError as e:
                log.debug("jupyter-vgpu: arbiter link: %s", e)
            self.connected.clear()
            with self._room_cond:  # requests in flight are answered: the arbiter is gone
                for rid in self._rooms:
                    self._rooms[rid] = {"type": "gone"}
                self._room_cond.notify_all()
            self._stop.wait(2.0)

    def _session(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(self.path)
        self._sock = sock
        try:
            self._send({"type": "hello", "version": 1, "kernel_id": self.kernel_id})
            reader = sock.makefile("rb")
            for line in reader:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                self._handle(msg)
        finally:
            self._sock = None
            sock.close()

    def _handle(self, msg: dict) -> None:
        kind = msg.get("type")
        if kind == "welcome":
            self.managed = msg.get("slice") is not None
            self.adopt_slice(msg.get("slice"))
            self.connected.set()
            self.send_state(self.pausing.gate.state)
        elif kind == "slice":
            self.adopt_slice(msg.get("slice"))
        elif kind in ("grant", "wait", "deny"):
            self._answer(msg)
        elif kind in ("pause", "suspend"):
            threading.Thread(target=self._obey, args=(msg,), name="jupyter-vgpu-pause", daemon=True).start()
        elif kind == "notice":
            self.pausing.last_notice = str(msg.get("message"))[:1000]
            self.say(f"jupyter-vgpu: {self.pausing.last_notice}")
        elif kind == "error":
            log.warning("jupyter-vgpu: the arbiter says: %s", msg.get("message"))

    def _obey(self, msg: dict) -> None:
        t0 = time.monotonic()
        reply = {"type": "reply", "id": msg["id"], "released": None}
        try:
            if msg["type"] == "pause":
                outcome = self.pausing.pause().get("pause")
                # device bytes the pause gave back (0: nothing to release, e.g. no CUDA
                # memory yet), so the arbiter knows whether to wait for NVML to drop
                reply["released"] = outcome.segment_bytes if outcome is not None else 0
            else:
                self.pausing.prepare_suspend()
            ok, message = True, f"done in {time.monotonic() - t0:.3f} s"
        except Exception as e:
            ok, message = False, f"{type(e).__name__}: {e}"
        self._send({**reply, "ok": ok, "message": message[:4000]})
