"""The arbiter's second socket, ``pieces.sock`` beside ``arbiter.sock``: where kernels
hand paused pieces to the store of pieces held once (:mod:`.shared_pieces`).

A descriptor cannot travel in the JSON lines of the arbiter's socket (asyncio's streams
carry no ancillary data), so pieces have a socket of their own, ``SOCK_SEQPACKET``: one
message is one datagram, its descriptor attached (``SCM_RIGHTS``). Each message is one
JSON object of at most :data:`MAX_MESSAGE` bytes:

- ``{"type": "offer", "key": "<64 hex digits>"}`` with exactly one descriptor, a sealed
  memfd of the piece's stored bytes. Answer: ``{"type": "outcome", "shared": bool,
  "size": int}``, with the shared piece's descriptor attached when ``shared``.
- ``{"type": "others", "keys": [<key>, ...]}`` (at most
  :data:`~jupyter_vgpu.host.pieces.KEYS_PER_MESSAGE`): which of the pieces of those keys
  this kernel references another kernel references too (asked before the kernel moves
  its paused data to disk: it keeps reading those from the node's copy). Answer:
  ``{"type": "others", "held": [bool, ...]}``, one per key, in order.
- ``{"type": "release"}``: drop every reference this kernel holds (its pieces came back
  to its own memory); ``{"type": "release", "keys": [...]}``: one reference for each key
  (pieces it wrote to its own file). Answer: ``{"type": "released", "bytes": <no longer
  held by anyone>}``.

Any message may be answered ``{"type": "refused", "message": "<why>"}``. Both directions
are contracts (``to-pieces``, ``from-pieces`` in :mod:`jupyter_vgpu.contracts`), checked
where received without jsonschema (:mod:`jupyter_vgpu.contracts.lean`).

Who offers comes from the Linux kernel, never from what a client says: the peer's
credentials and :class:`~jupyter_vgpu.host.procs.Identity` as it connected, which must be
a kernel the arbiter admitted (same PID, same start time). Anything else is answered
with a refusal and hung up on. A client gets :data:`IDLE_SECONDS` between messages.
Comparisons run in a worker thread, never on the arbiter's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from jupyter_vgpu.contracts import ContractError, lean
from jupyter_vgpu.host import procs
from jupyter_vgpu.host.pieces import SOCKET_NAME

from .shared_pieces import PieceRefused, SharedPieces

if TYPE_CHECKING:
    from .arbiter import Arbiter
    from .books import Kernel

log = logging.getLogger("jupyter_vgpu.node")

#: The socket's name, in the arbiter's socket directory.
NAME = SOCKET_NAME
#: Bytes of one message at most.
MAX_MESSAGE = 4096
#: Seconds a connected client may stay silent.
IDLE_SECONDS = 60.0


class PieceSocket:
    """Serves ``pieces.sock`` on the arbiter's event loop.

    Args:
        arbiter: whose admitted kernels may offer (:attr:`.arbiter.Arbiter.kernels`).
        store: the pieces held once.
    """

    def __init__(self, arbiter: Arbiter, store: SharedPieces):
        self.arbiter = arbiter
        self.store = store
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        # the store's work (comparisons of up to 16 MiB, under its one lock) on a thread
        # of its own: queued in the event loop's default executor, offers of many kernels
        # at once would delay what the arbiter reads there (the cards, for room)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="jupyter-vgpu-pieces")

    def start(self, path: Path) -> None:
        """Listen on ``path`` (in the arbiter's checked socket directory; anyone may
        connect, who they are comes from the Linux kernel), from the running event loop."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.setblocking(False)
        sock.bind(str(path))
        os.chmod(path, 0o666)
        sock.listen(64)
        self._sock = sock
        self._spawn(self._accept())

    def close(self) -> None:
        """Stop listening, hang up on every client, close every piece."""
        for task in list(self._tasks):
            task.cancel()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._worker.shutdown(wait=True, cancel_futures=True)
        self.store.close()

    def release(self, kernel: Kernel) -> None:
        """Drop ``kernel``'s references (it left)."""
        if kernel.identity is not None:
            self.store.release(_holder(kernel))

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._sock)
            conn.setblocking(False)
            self._spawn(self._serve(conn))

    def _kernel_of(self, conn: socket.socket) -> Kernel | None:
        """The admitted kernel at the other end of ``conn``, or None."""
        try:
            pid, _, identity = procs.Identity.of_peer(conn)
        except OSError:
            return None
        if identity is None:
            return None
        try:
            for kernel in self.arbiter.kernels:
                mine = kernel.identity
                if kernel.pid == pid and mine is not None and mine.start == identity.start:
                    return kernel
            return None
        finally:
            identity.close()

    async def _serve(self, conn: socket.socket) -> None:
        try:
            kernel = self._kernel_of(conn)
            while True:
                try:
                    data, fds = await asyncio.wait_for(_receive(conn), IDLE_SECONDS)
                except TimeoutError:
                    return
                if not data and not fds:
                    return  # hung up
                if kernel is None:  # answered after its first message, read: no reset
                    for fd in fds:
                        os.close(fd)
                    await _send(conn, _refused("only a kernel the arbiter admitted may offer pieces"))
                    return
                answer, out = await self._answer(kernel, data, fds)
                await _send(conn, answer, out)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            conn.close()

    async def _answer(self, kernel: Kernel, data: bytes, fds: list[int]) -> tuple[dict, int | None]:
        """What to say to one message of ``kernel``'s (and the descriptor to attach);
        every descriptor received is taken (kept by the store, or closed)."""
        try:
            try:
                msg = json.loads(data)
                lean.validate_message("to-pieces", msg)
            except (ValueError, RecursionError) as e:  # ContractError is a ValueError
                return _refused(str(e) if isinstance(e, ContractError) else "not a JSON object"), None
            loop = asyncio.get_running_loop()
            if msg["type"] in ("others", "release"):
                keys = None  # a release of every reference (``others`` always names keys)
                if "keys" in msg:
                    try:
                        keys = [bytes.fromhex(k) for k in msg["keys"]]
                    except ValueError:
                        return _refused(f"{msg['type']}.keys: each is 64 hexadecimal digits"), None
                holder, user = _holder(kernel), kernel.server.user
                if msg["type"] == "others":
                    held = await loop.run_in_executor(self._worker, self.store.others, holder, user, keys)
                    return {"type": "others", "held": held}, None
                freed = await loop.run_in_executor(self._worker, self.store.release, holder, keys, user)
                return {"type": "released", "bytes": freed}, None
            if len(fds) != 1:
                return _refused("an offer comes with one descriptor, the piece's memfd"), None
            try:
                key = bytes.fromhex(msg["key"])
            except ValueError:
                return _refused("offer.key: must be 64 hexadecimal digits"), None
            fd = fds.pop()
            try:
                outcome = await loop.run_in_executor(
                    self._worker, self.store.offer, _holder(kernel), kernel.server.user, key, fd, _cap(kernel)
                )
            except PieceRefused as e:
                return _refused(str(e)), None
            return {"type": "outcome", "shared": outcome.shared, "size": outcome.size}, outcome.fd
        finally:
            for fd in fds:
                os.close(fd)


def _refused(why: str) -> dict:
    return {"type": "refused", "message": why[:1000]}


def _cap(kernel: Kernel) -> int:
    """Bytes ``kernel`` may offer in all: the most of what it paused, what the arbiter
    saw it hold on its cards and what it holds there now, never more than its budget on
    every card of its slice (a kernel's word cannot pass that)."""
    held = max(kernel.paused_bytes, kernel.measured or 0, kernel.resident)
    return min(held, kernel.slice.memory_limit * len(kernel.slice.gpu_uuids))


def _holder(kernel: Kernel) -> tuple[int, int]:
    """A kernel as the store knows it: PID and start time (a reused PID is another)."""
    return kernel.pid, kernel.identity.start


async def _ready(conn: socket.socket, *, write: bool = False) -> None:
    """Wait until ``conn`` can be read (or written)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = conn.fileno()
    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)


async def _receive(conn: socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors attached to it (at most 4 are taken)."""
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 4)
        except BlockingIOError:
            await _ready(conn)
            continue
        return data, list(fds)


async def _send(conn: socket.socket, answer: dict, fd: int | None = None) -> None:
    """One answer, ``fd`` attached (and closed here) where given."""
    try:
        payload = json.dumps(answer).encode()
        while True:
            try:
                socket.send_fds(conn, [payload], [fd] if fd is not None else [])
                return
            except BlockingIOError:
                await _ready(conn, write=True)
    finally:
        if fd is not None:
            os.close(fd)
