"""Identical paused pieces held once across kernels: the arbiter's store of shared pieces.

When a class fine-tunes one model, every kernel holds the same frozen base weights, byte
for byte, and its pause stores the same compressed pieces (the device codec is
deterministic: the same bytes at the same offsets of a range give the same chunks and
the same CRC-32s). This store lets the host keep each such piece once.

A kernel offers a piece as a **sealed memfd** holding exactly the piece's stored bytes
(``memfd_create`` with ``MFD_ALLOW_SEALING``, written, then sealed against writing,
shrinking, growing and further sealing), with a **key** computed from what the GPU
already reported about it (:func:`jupyter_vgpu.host.pieces.piece_key`: its length,
layout and every chunk's size, kind and CRC-32). The key only finds candidates; two
pieces are the same piece only once the arbiter has compared their bytes, all of them,
itself (:meth:`SharedPieces.offer`).
So a key collision, or a kernel that lies about its key, can never hand one kernel
another's data: a kernel receives a piece only where it has shown the arbiter the same
bytes. What sharing does reveal is that identical bytes exist: a kernel whose offer is
answered "shared" learns that another kernel in its scope held the same piece. The scope
is the admin's (``all`` users, ``same-user``, ``off``).

The seals are checked on the received descriptor (``F_GET_SEALS``), never believed: a
piece whose holder could still write it would let that holder change what others read.
Sizes are bounded (:data:`MAX_PIECE_BYTES`), and each holder's offers count against a
cap in bytes the caller gives (its paused bytes), so a kernel's word cannot grow the
arbiter's memory beyond what the kernel itself paused.

References are counted per holder: a kernel that ends releases only its own
(:meth:`SharedPieces.release`), and a piece goes when its last holder does. A kernel
moving to disk asks which of its pieces others reference too (:meth:`SharedPieces.others`),
keeps reading those, and releases the rest by key. The pages of
a memfd are charged to the memory cgroup of the process that first wrote them (the
first holder's); the arbiter's books attribute a shared piece's bytes to each holder in
equal parts (:meth:`SharedPieces.figures`).

Bytes are compared in windows of :data:`COMPARE_WINDOW` through read-only mappings; the
caller runs :meth:`SharedPieces.offer` off its event loop (a comparison of 8 MiB takes
milliseconds, of a whole model's pieces a fraction of a second).
"""

from __future__ import annotations

import dataclasses
import fcntl
import mmap
import os
import stat
import threading
from collections.abc import Hashable

import numpy as np

from jupyter_vgpu.host.pieces import MAX_PIECE_BYTES, OFF, SEALS, piece_key

__all__ = ["MAX_PIECE_BYTES", "SCOPES", "SEALS", "Offer", "PieceRefused", "SharedPieces", "piece_key"]

#: The admin's choices of who may share a piece (``ArbiterApp.share_pieces``).
SCOPES = ("all", "same-user", "off")
#: Bytes compared at a time.
COMPARE_WINDOW = 1 * 2**20


class PieceRefused(ValueError):
    """An offer the store does not take; the message says why (the kernel keeps its own
    copy, nothing is lost)."""


@dataclasses.dataclass
class _Piece:
    key: bytes
    scope: str | None  # the user for ``same-user``, None for ``all``
    size: int
    fd: int
    holders: dict[Hashable, int]  # holder -> references


@dataclasses.dataclass(frozen=True)
class Offer:
    """What became of an offered piece.

    Attributes:
        shared: another holder in the scope had the same bytes: the offering kernel may
            drop its own copy and read the piece from ``fd``.
        fd: a descriptor of the piece the kernel now holds a reference to (the caller
            sends it and closes it); None when the store kept the kernel's own memfd
            (``shared`` False: nobody else holds it yet) or refused it.
        size: the piece's bytes.
    """

    shared: bool
    fd: int | None
    size: int


class SharedPieces:
    """The arbiter's pieces held once across kernels.

    Args:
        scope: who may share a piece, one of :data:`SCOPES`.
        max_pieces: distinct pieces held at most, or None (each keeps a descriptor open:
            :func:`.limits.pieces_within` leaves room for the arbiter's other files).

    Every method may be called from any thread (one lock; comparisons run under it, each
    of at most :data:`MAX_PIECE_BYTES`).
    """

    def __init__(self, scope: str = "all", max_pieces: int | None = None):
        if scope not in SCOPES:
            raise ValueError(f"share_pieces must be one of {', '.join(SCOPES)}, not {scope!r}")
        self.scope = scope
        self._lock = threading.Lock()
        self._by_key: dict[tuple[str | None, bytes], list[_Piece]] = {}
        self._offered: dict[Hashable, int] = {}  # holder -> bytes it references
        self._held = 0  # bytes of distinct pieces
        self._count = 0  # distinct pieces, each one open descriptor
        #: distinct pieces held at most (each keeps a descriptor open): offers of new
        #: bytes past it are refused; None: no cap
        self.max_pieces = max_pieces

    def offer(self, holder: Hashable, user: str, key: bytes, fd: int, cap: int) -> Offer:
        """Take a kernel's piece: share it with an identical piece of the scope, or keep
        it for the next kernel that has the same bytes.

        Args:
            holder: who offers (the kernel's identity: PID and start time), hashable.
            user: the kernel's user (the scope ``same-user`` shares within it).
            key: :func:`piece_key` of the piece, 32 bytes.
            fd: a sealed memfd holding exactly the piece's stored bytes; the store takes
                it (kept, or closed) whatever the outcome.
            cap: bytes ``holder`` may reference in all (its paused bytes).

        Returns:
            :class:`Offer`.

        Raises:
            PieceRefused: sharing is off, the descriptor is no sealed memfd of at most
                :data:`MAX_PIECE_BYTES`, the key is malformed, or the holder's offers
                would pass ``cap``. The descriptor is closed; the kernel keeps its copy.
        """
        kept = False
        try:
            if self.scope == "off":
                raise PieceRefused(OFF)
            if not isinstance(key, bytes) or len(key) != 32:
                raise PieceRefused("a piece's key is 32 bytes")
            size = _sealed_size(fd)
            scope = self._scope_of(user)
            with self._lock:
                if self._offered.get(holder, 0) + size > cap:
                    raise PieceRefused(
                        f"offers of {self._offered.get(holder, 0) + size} bytes would pass this kernel's "
                        f"{cap} paused bytes"
                    )
                for piece in self._by_key.get((scope, key), []):
                    if piece.size == size and _same_bytes(piece.fd, fd, size):
                        piece.holders[holder] = piece.holders.get(holder, 0) + 1
                        self._offered[holder] = self._offered.get(holder, 0) + size
                        return Offer(True, os.dup(piece.fd), size)
                if self.max_pieces is not None and self._count >= self.max_pieces:
                    raise PieceRefused(
                        f"the node holds {self._count} distinct pieces, its most (one open file each)"
                    )
                self._held += size
                self._by_key.setdefault((scope, key), []).append(_Piece(key, scope, size, fd, {holder: 1}))
                self._count += 1
                self._offered[holder] = self._offered.get(holder, 0) + size
                kept = True
                return Offer(False, None, size)
        finally:
            if not kept:
                os.close(fd)

    def others(self, holder: Hashable, user: str, keys: list[bytes]) -> list[bool]:
        """For each of ``keys``: whether a piece of that key that ``holder`` references is
        referenced by another holder too (False where ``holder`` references none of that
        key). A kernel asks before it moves its paused data to disk: those pieces stay in
        host memory for the others anyway, so it keeps reading them from there, and writes
        only the rest to its own file (then :meth:`release` of their keys)."""
        scope = self._scope_of(user)
        with self._lock:
            return [
                any(holder in p.holders and len(p.holders) > 1 for p in self._by_key.get((scope, key), ()))
                for key in keys
            ]

    def release(self, holder: Hashable, keys: list[bytes] | None = None, user: str = "") -> int:
        """Drop ``holder``'s references: every one (a kernel that ended or resumed), or one
        for each of ``keys`` (pieces it wrote to its own file in the disk tier; ``user``
        names the scope under ``same-user``; a key it references none of is passed over).
        A piece without holders goes.

        Returns:
            Bytes no longer held by anyone.
        """
        freed = 0
        with self._lock:
            if keys is None:
                self._offered.pop(holder, None)
                for where, pieces in list(self._by_key.items()):
                    for piece in list(pieces):
                        if piece.holders.pop(holder, None) is not None:
                            freed += self._forget_if_unheld(where, piece)
                return freed
            scope = self._scope_of(user)
            for key in keys:
                piece = next((p for p in self._by_key.get((scope, key), ()) if holder in p.holders), None)
                if piece is None:
                    continue
                piece.holders[holder] -= 1
                if not piece.holders[holder]:
                    del piece.holders[holder]
                left = self._offered.get(holder, 0) - piece.size
                if left > 0:
                    self._offered[holder] = left
                else:
                    self._offered.pop(holder, None)
                freed += self._forget_if_unheld((scope, key), piece)
        return freed

    def _scope_of(self, user: str) -> str | None:
        """Where ``user``'s pieces are looked for: their own under ``same-user``, else
        everyone's (None)."""
        return user if self.scope == "same-user" else None

    def _forget_if_unheld(self, where: tuple, piece: _Piece) -> int:  # under the lock
        """Close ``piece`` if nobody holds it any more; its bytes, or 0."""
        if piece.holders:
            return 0
        os.close(piece.fd)
        pieces = self._by_key[where]
        pieces.remove(piece)
        if not pieces:
            del self._by_key[where]
        self._held -= piece.size
        self._count -= 1
        return piece.size

    def saving(self) -> int:
        """Host bytes sharing saves now: what every holder references (each counts its
        pieces whole in the host bytes it reports) less what is held."""
        with self._lock:
            return self._saving()

    def _saving(self) -> int:  # under the lock
        return sum(self._offered.values()) - self._held

    def accounting(self) -> tuple[int, dict[Hashable, int]]:
        """``(saving, with_others)``, read together: :meth:`saving`, and by holder the
        bytes of its pieces that other holders reference too (what its release would
        leave held)."""
        with self._lock:
            with_others: dict[Hashable, int] = {}
            for pieces in self._by_key.values():
                for p in pieces:
                    if len(p.holders) > 1:
                        for h in p.holders:
                            with_others[h] = with_others.get(h, 0) + p.size
            return self._saving(), with_others

    def figures(self) -> dict:
        """``{"pieces": int, "held_bytes": int, "referenced_bytes": int, "by_holder":
        {holder: bytes}}``: distinct pieces and their bytes, what their references add
        up to (the host memory sharing saves is the difference), and each holder's
        share (a piece's bytes split equally between its holders)."""
        with self._lock:
            pieces = [p for ps in self._by_key.values() for p in ps]
            by_holder: dict[Hashable, float] = {}
            for p in pieces:
                for h in p.holders:
                    by_holder[h] = by_holder.get(h, 0.0) + p.size / len(p.holders)
            return {
                "pieces": len(pieces),
                "held_bytes": sum(p.size for p in pieces),
                "referenced_bytes": sum(p.size * len(p.holders) for p in pieces),
                "by_holder": {h: round(v) for h, v in by_holder.items()},
            }

    def close(self) -> None:
        """Close every piece (the arbiter stops)."""
        with self._lock:
            for pieces in self._by_key.values():
                for p in pieces:
                    os.close(p.fd)
            self._by_key.clear()
            self._offered.clear()
            self._held = self._count = 0


def _sealed_size(fd: int) -> int:
    """The bytes of ``fd``, a memfd that nobody can write, shrink, grow or unseal.

    Raises:
        PieceRefused: anything else (a file, a pipe, an unsealed memfd), or too large.
    """
    try:
        info = os.fstat(fd)
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as e:  # EINVAL: a descriptor that takes no seals (no memfd)
        raise PieceRefused(f"a piece comes as a sealed memfd ({e.strerror})") from None
    if not stat.S_ISREG(info.st_mode) or seals & SEALS != SEALS:
        raise PieceRefused("a piece comes as a memfd sealed against writing, shrinking, growing and sealing")
    if not 0 < info.st_size <= MAX_PIECE_BYTES:
        raise PieceRefused(f"a piece has 1 to {MAX_PIECE_BYTES} bytes, not {info.st_size}")
    return info.st_size


def _same_bytes(a: int, b: int, size: int) -> bool:
    """Whether the first ``size`` bytes of descriptors ``a`` and ``b`` are equal, read
    through read-only mappings, :data:`COMPARE_WINDOW` at a time (a mismatch ends it).
    Compared as NumPy arrays: ``memoryview`` equality goes item by item, and cost 33 ms
    for 6 MiB where NumPy took 5 ms, page faults included (measured on a 2-core VM)."""
    with (
        mmap.mmap(a, size, prot=mmap.PROT_READ) as x,
        mmap.mmap(b, size, prot=mmap.PROT_READ) as y,
    ):
        ax, ay = np.frombuffer(x, dtype=np.uint8), np.frombuffer(y, dtype=np.uint8)
        try:
            return all(
                np.array_equal(ax[i : i + COMPARE_WINDOW], ay[i : i + COMPARE_WINDOW])
                for i in range(0, size, COMPARE_WINDOW)
            )
        finally:
            del ax, ay  # the mappings close only once nothing exports them
