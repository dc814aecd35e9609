"""A kernel's side of the pieces held once across kernels: offering a paused piece to the
node arbiter (its ``pieces.sock``, :mod:`jupyter_vgpu.node.piece_socket`).

:meth:`PieceClient.offer` puts a piece's stored bytes into a memfd, seals it against
writing, shrinking, growing and further sealing, and hands it to the arbiter with the
piece's key (:func:`jupyter_vgpu.host.pieces.piece_key`). The answer is a
read-only mapping of the bytes the kernel now reads the piece from: the arbiter's shared
copy, which the arbiter compared byte for byte with the kernel's own, or the kernel's
own memfd, kept by the arbiter for whoever offers the same bytes next. Either way the
kernel may let its own copy (a pinned slab's span) go. A refusal (sharing off, the cap
of the kernel's paused bytes reached) leaves everything as it was: the kernel keeps its
copy.

Nothing here runs during a pause or a resume: offers are made in the background after a
pause, and a resume reads the mapping as it would read a slab.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import mmap
import os
import socket
from pathlib import Path

from jupyter_vgpu.contracts import ContractError, lean
from jupyter_vgpu.host.pieces import KEYS_PER_MESSAGE, SEALS

#: Bytes of one answer at most.
MAX_ANSWER = 4096


class PieceError(RuntimeError):
    """The arbiter refused an offer, or could not be reached; the message says which.
    The kernel keeps its own copy of the piece."""


class Refused(PieceError):
    """The arbiter answered, and refused (sharing off, a cap reached): the connection
    stays good. Any other :class:`PieceError` leaves it unusable (an answer that comes
    late would be taken for the next one's): close it.

    Attributes:
        why: the arbiter's reason, as it gave it.
    """

    def __init__(self, why: str):
        super().__init__(f"the arbiter refused the piece: {why}")
        self.why = why


@dataclasses.dataclass
class Held:
    """A piece the kernel now reads from a mapping instead of its own memory.

    Attributes:
        view: the piece's stored bytes, read-only (an ``mmap``; close it to let go).
        shared: the bytes are another kernel's copy, equal to this kernel's (the
            arbiter compared them); False: this kernel's own memfd, kept by the arbiter.
        size: bytes.
    """

    view: mmap.mmap
    shared: bool
    size: int


class PieceClient:
    """One connection to the arbiter's ``pieces.sock``.

    Args:
        path: the socket (``pieces.sock`` beside the arbiter's socket).
        timeout: seconds to wait for an answer.

    Raises:
        PieceError: the socket cannot be reached.
    """

    def __init__(self, path: str | os.PathLike, timeout: float = 30.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(str(Path(path)))
        except FileNotFoundError:  # an arbiter whose share_pieces is off listens on none
            self.sock.close()
            raise PieceError(
                f"the node arbiter takes no paused pieces: there is no pieces socket {path} "
                "(its share_pieces is off, or it is not running)"
            ) from None
        except OSError as e:
            self.sock.close()
            raise PieceError(f"cannot reach the arbiter's pieces socket {path}: {e.strerror or e}") from None

    def offer(self, key: bytes, data) -> Held:
        """Offer one piece.

        Args:
            key: the piece's key, 32 bytes.
            data: its stored bytes (any buffer: a slab's span as a memoryview or numpy
                array of uint8).

        Returns:
            :class:`Held`: where the kernel reads the piece from now on.

        Raises:
            PieceError: refused (the message is the arbiter's), or no answer.
        """
        view = memoryview(data).cast("B")
        fd = os.memfd_create("vgpu-piece", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
        try:
            written = 0
            while written < view.nbytes:
                written += os.write(fd, view[written:])
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            # our own read-only mapping, taken before the descriptor goes: kept if the
            # arbiter keeps it too
            own = mmap.mmap(fd, view.nbytes, prot=mmap.PROT_READ) if view.nbytes else None
            message = json.dumps({"type": "offer", "key": key.hex()}).encode()
            try:
                try:
                    socket.send_fds(self.sock, [message], [fd])
                except ConnectionError:
                    raise PieceError("the arbiter hung up") from None
                answer, fds = self._answer()
            except BaseException:
                if own is not None:
                    own.close()
                raise
        finally:
            os.close(fd)
        if answer["type"] != "outcome":
            if own is not None:
                own.close()
            for extra in fds:
                os.close(extra)
            why = answer.get("message", f"it answered {answer['type']}")
            raise Refused(why)
        size = int(answer["size"])
        if not answer.get("shared"):
            return Held(own, False, size)
        own.close()
        if len(fds) != 1:
            raise PieceError("the arbiter said shared but sent no piece")
        try:
            shared = mmap.mmap(fds[0], size, prot=mmap.PROT_READ)
        finally:
            os.close(fds[0])
        return Held(shared, True, size)

    def others(self, keys: list[bytes]) -> list[bool]:
        """For each of ``keys`` (32 bytes each), whether another kernel references the
        piece of that key this kernel references (False where it references none), asked
        :data:`~jupyter_vgpu.host.pieces.KEYS_PER_MESSAGE` keys at a time.

        Raises:
            PieceError: refused, or no answer, or an answer of another length.
        """
        held: list[bool] = []
        for at in range(0, len(keys), KEYS_PER_MESSAGE):
            batch = [k.hex() for k in keys[at : at + KEYS_PER_MESSAGE]]
            answer = self._ask({"type": "others", "keys": batch})
            if answer["type"] != "others" or len(answer["held"]) != len(batch):
                why = answer.get("message", answer)
                raise PieceError(f"the arbiter did not say which pieces others read: {why}")
            held += answer["held"]
        return held

    def release(self, keys: list[bytes] | None = None) -> int:
        """Drop this kernel's references: every one (its pieces are back in its own
        memory), or one for each of ``keys`` (pieces it wrote to its own file), sent
        :data:`~jupyter_vgpu.host.pieces.KEYS_PER_MESSAGE` at a time. Returns bytes no
        longer held by anyone.

        Raises:
            PieceError: refused, or no answer.
        """
        messages = (
            [{"type": "release"}]
            if keys is None
            else [
                {"type": "release", "keys": [k.hex() for k in keys[at : at + KEYS_PER_MESSAGE]]}
                for at in range(0, len(keys), KEYS_PER_MESSAGE)
            ]
        )
        freed = 0
        for message in messages:
            answer = self._ask(message)
            if answer["type"] != "released":
                raise PieceError(f"the arbiter refused the release: {answer.get('message')}")
            freed += answer["bytes"]
        return freed

    def _ask(self, message: dict) -> dict:
        """Send one message that carries no descriptor; its answer (descriptors closed)."""
        try:
            self.sock.sendall(json.dumps(message).encode())
        except ConnectionError:
            raise PieceError("the arbiter hung up") from None
        answer, fds = self._answer()
        for extra in fds:
            os.close(extra)
        return answer

    def close(self) -> None:
        self.sock.close()

    def _answer(self) -> tuple[dict, list[int]]:
        try:
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_ANSWER, 1)
        except TimeoutError:
            raise PieceError("the arbiter did not answer") from None
        except ConnectionError:
            raise PieceError("the arbiter hung up") from None
        if not data:
            raise PieceError("the arbiter hung up")
        try:
            answer = json.loads(data)
            lean.validate_message("from-pieces", answer)
        except (ValueError, RecursionError) as e:  # ContractError is a ValueError
            for extra in fds:
                os.close(extra)
            why = str(e) if isinstance(e, ContractError) else "no JSON object"
            raise PieceError(f"the arbiter's answer breaks its contract: {why}") from None
        return answer, list(fds)
