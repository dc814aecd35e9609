"""This kernel's link to the node arbiter (:mod:`jupyter_vgpu.node`), over its Unix socket.

The socket's path comes from ``JUPYTER_VGPU_ARBITER`` (set by the spawner). A thread of
this package connects, says hello with where the kernel's memory is (so that an arbiter
that started after the kernel, after a crash or an upgrade, has it in its books), and
from then on:

- adopts the slice the arbiter sends (the only authority on limits once connected:
  ``server.json`` and the environment are ignored);
- tells the arbiter every change of the kernel's state, with its figures;
- answers the arbiter's requests to pause, to prepare a suspension, to move its paused
  memory to the disk tier;
- asks for room before the first message that runs code (:meth:`ArbiterClient.room`,
  called by the gate), waiting while the arbiter makes it or queues the request, and
  showing what it waits for in the cell's output (:class:`~.progress.Progress`);
- where the arbiter's welcome says it grants growth on demand (``grow``), hands its
  socket's path to the pausable allocator (:attr:`ArbiterClient.grow_channel`), which
  asks for room to grow over a connection of its own when an allocation of the running
  cell finds none on the card, without a word of Python.

When the link breaks, the thread connects again on its own, with backoff (from 50 ms,
doubling, at most :data:`MAX_BACKOFF` seconds), for as long as the kernel lives. While
there is no arbiter, :meth:`ArbiterClient.room` raises :class:`ArbiterUnavailable` and
the kernel decides for itself (:mod:`.pausing`: a resident kernel runs, a paused one
comes back if the card has room). What the arbiter says in protocol words (an ``error``
message) is kept for ``%vgpu status`` and the kernel's log, never printed into a cell.

Every line the arbiter sends is checked against its contract (``from-arbiter``, with
:mod:`jupyter_vgpu.contracts.lean`: no jsonschema in a kernel) before anything acts on
it; one that breaks it is logged and dropped, and the link stays up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable

from jupyter_vgpu import failpoints
from jupyter_vgpu.contracts import ContractError, lean

log = logging.getLogger("jupyter_vgpu")

_STATES = {"busy": "active", "idle": "idle", "pausing": "idle", "paused": "paused"}
_STATES.update(suspending="paused", suspended="suspended", resuming="active")
#: The longest wait between two attempts to connect, seconds: a restarted arbiter has
#: every kernel back within about this long after it listens.
MAX_BACKOFF = 1.0
#: Protocol version of the hello this client sends first (an arbiter that refuses it is
#: spoken to in the version below, and so on down to 1).
HELLO_VERSION = 6
#: The version from which a request for room says whether it is for a cell the user ran
#: (``cell``; ``jupyter_vgpu.node.protocol.CELL_VERSION``).
CELL_VERSION = 6
#: Answers that end a request for room (``gone``: this client's own, the link dropped);
#: an answer after one of them is not taken.
FINAL_ANSWERS = ("grant", "deny", "gone", "failed")


class ArbiterUnavailable(RuntimeError):
    """No node arbiter answers for this kernel now (none runs, it is restarting, or it
    does not know the kernel's server); the message says which."""


class ArbiterClient:
    """One kernel's connection.

    Args:
        path: the arbiter's socket.
        kernel_id: this kernel's id (a figure for the arbiter's books).
        adopt_slice: called with the slice dict (or None) the arbiter gives.
        figures: returns the kernel's figures now: a dict with ``state`` (one of the
            protocol's states), ``resident``, ``paused_bytes``, ``host_bytes``,
            ``disk_bytes``, ``budget`` (bytes or None), ``idle_seconds`` and
            ``resume_seconds`` (the last resume's, once, else None).
        pausing: the kernel's :class:`~.pausing.PauseControl`.
        say: shows text in the running cell's output: ``say(text, end="\\n")``.
    """

    def __init__(
        self,
        path: str,
        kernel_id: str,
        adopt_slice: Callable[[dict | None], None],
        figures: Callable[[], dict],
        pausing,
        say: Callable[..., None],
    ):
        self.path, self.kernel_id = path, kernel_id
        self.adopt_slice, self.figures, self.pausing, self.say = adopt_slice, figures, pausing, say
        self.connected = threading.Event()
        self.managed = False  # the arbiter knows our server and sent a slice
        self.grows = False  # the arbiter grants growth on demand (its welcome said so)
        #: called with the arbiter's socket path where its welcome says ``grow``, else None:
        #: the pausable allocator's grow channel (:meth:`.memory_path.MemoryPath.grow_with`)
        self.grow_channel: Callable[[str | None], object] | None = None
        self.disk_dir: str | None = None  # our directory of the node's disk tier
        self.node: dict | None = None  # the node's host and disk figures, as last told
        self.last_error: str | None = None  # the arbiter's last protocol error (status, logs)
        self.lost_at: float | None = None  # monotonic seconds the link broke (None: up, or never was)
        self.reconnects = 0
        #: seconds a request for room may go without a word from the arbiter before it is
        #: given up (an arbiter that hangs): the kernel then decides for itself
        self.patience = 60.0
        self._hello_version = HELLO_VERSION
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        #: held while the arbiter's pause, suspend, spill or trim of this kernel is made: one at a time
        self._moving = threading.Lock()
        self._move: str | None = None
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
        self._hang_up()

    def _hang_up(self) -> None:
        """End the session now: its reader sees the end of the stream and returns (a
        ``close`` alone leaves the descriptor open under the reader's file object, and the
        reader waiting for the arbiter's next line)."""
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def unavailable(self) -> str | None:
        """Why there is no arbiter for this kernel now, in words (None: there is)."""
        if self.connected.is_set() and self.managed:
            return None
        if self.connected.is_set():
            return "the node arbiter does not know this kernel's server"
        if self.lost_at is None:
            return f"the node arbiter at {self.path} cannot be reached"
        return f"the node arbiter went away {time.monotonic() - self.lost_at:.0f} s ago and is not back"

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

    def send_state(self, gate_state: str | None = None) -> None:
        """Tell the arbiter the kernel's state and figures (a gate listener)."""
        if gate_state is not None and gate_state not in _STATES:
            return
        if not self.connected.is_set():
            return
        f = self.figures()
        msg = {"type": "state", "state": f["state"], **self._bytes(f), "resume_seconds": f["resume_seconds"]}
        self._send(msg)

    def _bytes(self, f: dict) -> dict:
        """The byte figures of a hello or state, as far as the version spoken has them
        (``disk_bytes`` from version 2, ``pausable_bytes`` from 3 and ``cached_bytes`` from
        5, where known)."""
        out = {k: int(f[k]) for k in ("resident", "paused_bytes", "host_bytes")}
        if self._hello_version >= 2:
            out["disk_bytes"] = int(f["disk_bytes"])
        if self._hello_version >= 3 and f.get("pausable_bytes") is not None:
            out["pausable_bytes"] = int(f["pausable_bytes"])
        if self._hello_version >= 5 and f.get("cached_bytes") is not None:
            out["cached_bytes"] = int(f["cached_bytes"])
        return out

    def _hello(self) -> dict:
        if self._hello_version < 2:
            return {"type": "hello", "version": 1, "kernel_id": self.kernel_id}
        f = self.figures()
        msg = {"type": "hello", "version": self._hello_version, "kernel_id": self.kernel_id}
        msg.update(state=f["state"], **self._bytes(f), budget=f["budget"])
        msg["idle_seconds"] = round(max(0.0, f["idle_seconds"]), 3)
        return msg

    # -- room --------------------------------------------------------------------------

    def room(self, purpose: str, progress=None, cell: bool = False) -> None:
        """Ask for room before the kernel runs code; blocks until granted.

        Args:
            purpose: ``run``, ``resume`` (the kernel is paused) or ``restore`` (suspended).
            progress: the cell's :class:`~.progress.Progress`: it shows what the arbiter
                says it is doing (pausing someone, queueing) and keeps the line alive.
            cell: the room is for a cell the user ran, said to an arbiter of protocol
                version 6 or later (``cell``: it takes its turn on the card).

        Raises:
            MemoryError: the arbiter refused (no room before its timeout); the message
                is the arbiter's.
            ArbiterUnavailable: there is no arbiter for this kernel now, it went away
                while the request waited, or it could not decide (``failed``: a fault of
                its own, which the message names).
        """
        why = self.unavailable()
        if why:
            raise ArbiterUnavailable(why)
        with self._room_cond:
            rid = self._next
            self._next += 1
            self._rooms[rid] = {"type": None, "seq": 0}
        msg = {"type": "room", "id": rid, "for": purpose}
        if cell and self._hello_version >= CELL_VERSION:
            msg["cell"] = True
        if not self._send(msg):
            with self._room_cond:
                self._rooms.pop(rid, None)
            raise ArbiterUnavailable("the node arbiter went away as this kernel asked it for room")
        seen = 0
        heard = time.monotonic()
        try:
            while True:
                with self._room_cond:
                    if self._rooms[rid]["seq"] == seen:
                        self._room_cond.wait(0.25)
                    answer = dict(self._rooms[rid])
                if answer["seq"] != seen:
                    heard = time.monotonic()
                elif time.monotonic() - heard > self.patience:
                    raise ArbiterUnavailable(f"the node arbiter has not answered for {self.patience:.0f} s")
                seen = answer["seq"]
                kind = answer.get("type")
                if kind in FINAL_ANSWERS:
                    break
                if progress is not None:
                    if kind == "wait":
                        progress.update(str(answer.get("message", ""))[:500])
                    progress.tick()
        finally:
            with self._room_cond:
                self._rooms.pop(rid, None)
        if kind == "deny":
            raise MemoryError(answer.get("message") or "no room on the GPU")
        if kind == "gone":
            raise ArbiterUnavailable("the node arbiter went away while this cell waited for room")
        if kind == "failed":  # a fault of the arbiter's own, named: as without an arbiter, at once
            why = str(answer.get("message") or "the node arbiter could not decide")[:1000]
            self.say(f"jupyter-vgpu: {why}; going on without it")  # said even when it came at once
            raise ArbiterUnavailable(why)

    def _answer(self, msg: dict) -> None:
        with self._room_cond:
            was = self._rooms.get(msg.get("id"))
            if was is not None:
                if was.get("type") not in FINAL_ANSWERS:
                    self._rooms[msg["id"]] = {**msg, "seq": was["seq"] + 1}
                    self._room_cond.notify_all()
                return
        if msg.get("type") == "grant":  # a request given up (interrupted): set the books right
            self.send_state()

    # -- receiving -------------------------------------------------------------------

    def _run(self) -> None:
        with self.pausing.own_calls():  # the figures it sends are this package's own look
            self._connect_for_good()

    def _connect_for_good(self) -> None:
        delay = 0.05
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self._session()
            except OSError as e:
                log.debug("jupyter-vgpu: arbiter link: %s", e)
            if self.connected.is_set() or self.managed:
                self.lost_at = time.monotonic()
            self.connected.clear()
            self.managed = False
            with self._room_cond:  # requests in flight are answered: the arbiter is gone
                for rid, was in self._rooms.items():
                    self._rooms[rid] = {"type": "gone", "seq": was["seq"] + 1}
                self._room_cond.notify_all()
            if time.monotonic() - t0 > 5:
                delay = 0.05  # it was up a while: a restart, come back quickly
            self._stop.wait(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, MAX_BACKOFF)

    def _session(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        try:
            self._send(self._hello())
            reader = sock.makefile("rb")
            for line in reader:
                msg = self._received(line)
                if msg is not None:
                    self._handle(msg)
        finally:
            self._sock = None
            sock.close()

    @staticmethod
    def _received(line: bytes) -> dict | None:
        """The arbiter's message in ``line``, checked against the ``from-arbiter`` contract;
        None (logged) when it is not JSON or breaks the contract."""
        try:
            msg = json.loads(line)
        except (ValueError, RecursionError):
            log.warning("jupyter-vgpu: the node arbiter sent a line that is not JSON; dropped")
            return None
        try:
            lean.validate_message("from-arbiter", msg)
        except ContractError as e:
            log.warning(
                "jupyter-vgpu: the node arbiter sent a message that breaks its contract, dropped: %s", e
            )
            return None
        return msg

    def _handle(self, msg: dict) -> None:
        """Act on one message of the arbiter's (checked: :meth:`_received`)."""
        kind = msg["type"]
        if kind == "welcome":
            self.managed = msg["slice"] is not None
            self.disk_dir = msg.get("disk_dir") or None  # absent from an arbiter before version 2
            self.grows = bool(msg.get("grow"))  # absent from an arbiter before version 4
            if self.grow_channel is not None:
                try:
                    self.grow_channel(self.path if self.grows else None)
                except Exception as e:  # the allocator goes on without asking, as before
                    log.warning("jupyter-vgpu: the allocator's grow channel was not set: %s", e)
            self.adopt_slice(msg["slice"])
            if self.lost_at is not None:
                self.reconnects += 1
                log.info(
                    "jupyter-vgpu: back with the node arbiter after %.1f s", time.monotonic() - self.lost_at
                )
            self.lost_at = None
            self.connected.set()
            self.send_state()
        elif kind == "slice":
            self.adopt_slice(msg["slice"])
        elif kind in ("grant", "wait", "deny", "failed"):
            self._answer(msg)
        elif kind in ("pause", "suspend", "spill", "trim", "release"):
            threading.Thread(target=self._obey, args=(msg,), name="jupyter-vgpu-pause", daemon=True).start()
        elif kind == "notice":
            self.pausing.last_notice = msg["message"][:1000]
            self.say(f"jupyter-vgpu: {self.pausing.last_notice}")
        elif kind == "node":
            self.node = {k: msg[k] for k in ("host_used", "host_limit", "disk_used")}
        elif kind == "error":
            self.last_error = msg["message"][:1000]
            log.debug("jupyter-vgpu: the arbiter refused a message: %s", self.last_error)
            if self._hello_version > 1 and "hello" in self.last_error and "version" in self.last_error:
                self._hello_version -= 1  # an arbiter older than this kernel: a version down
                self._hang_up()

    def _obey(self, msg: dict) -> None:
        """Make the arbiter's move ``msg`` (a thread each), refusing it while another is
        under way: a suspend (the driver's lock on every CUDA call) midway through a spill
        or a trim would freeze that move until the restore. The arbiter makes one move of a
        kernel at a time itself (``Kernel.moving``); this holds whatever it sends.

        The move is let go before its reply is sent: the arbiter may send this kernel's
        next move as soon as it reads the reply, and that move must not find this one
        still under way."""
        if not self._moving.acquire(blocking=False):
            why = f"Refused: this kernel's {self._move or 'move'} is under way"
            self._send({"type": "reply", "id": msg["id"], "released": None, "ok": False, "message": why})
            return
        try:
            self._move = msg["type"]
            with self.pausing.own_calls():
                reply = self._do(msg)
        finally:
            self._move = None
            self._moving.release()
        self._send(reply)

    def _do(self, msg: dict) -> dict:
        """Make the move ``msg`` and return its reply (not yet sent)."""
        t0 = time.monotonic()
        reply = {"type": "reply", "id": msg["id"], "released": None}
        try:
            if msg["type"] == "pause":
                outcome = self.pausing.pause().get("pause")
                # device bytes the pause gave back (0: nothing to release, e.g. no CUDA
                # memory yet), so the arbiter knows whether to wait for NVML to drop
                reply["released"] = outcome.segment_bytes if outcome is not None else 0
            elif msg["type"] == "spill":
                self.pausing.spill(str(msg.get("dir") or self.disk_dir or ""))
            elif msg["type"] == "trim":
                reply["released"] = self.pausing.trim()
            elif msg["type"] == "release":
                reply["released"] = self.pausing.release_cache()
            else:
                self.pausing.prepare_suspend()
            ok, message = True, f"done in {time.monotonic() - t0:.3f} s"
        except Exception as e:
            ok, message = False, f"{type(e).__name__}: {e}"
        self.send_state()  # the figures after it, before the answer
        if msg["type"] == "pause":
            failpoints.hit("kernel.pause.reply")
        elif msg["type"] == "suspend":
            failpoints.hit("kernel.suspend.prepared")
        return {**reply, "ok": ok, "message": message[:4000]}
