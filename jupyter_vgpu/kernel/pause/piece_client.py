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
from jupyter_vgpu.host.pieces import SEALS

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

    def release(self) -> int:
        """Drop every reference this kernel holds (its pieces are back in its own
        memory); returns bytes no longer held by anyone.

        Raises:
            PieceError: no answer.
        """
        self.sock.sendall(json.dumps({"type": "release"}).encode())
        answer, fds = self._answer()
        for extra in fds:
            os.close(extra)
        if answer["type"] != "released":
            raise PieceError(f"the arbiter refused the release: {answer.get('message')}")
        return answer["bytes"]

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
