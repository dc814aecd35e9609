"""What a kernel and the node arbiter agree on about a paused piece held once across
kernels (issue 42): its key, the seals it travels with, its largest size, and the name
of the arbiter's socket for pieces. Below both (:mod:`jupyter_vgpu.node.shared_pieces`,
:mod:`jupyter_vgpu.kernel.pause.piece_client`), so neither imports the other.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import numpy as np

#: The seals a piece carries: nobody may write, shrink or grow it, or unseal it.
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: A piece's stored bytes at most (the device codec's pieces are 8 MiB before compression;
#: a stored piece is never larger than its raw bytes plus its chunks' alignment).
MAX_PIECE_BYTES = 16 * 2**20
#: Keys one message on the pieces socket names at most (``others``, ``release``): 48 keys
#: of 64 hex digits keep a message under the socket's 4096 bytes.
KEYS_PER_MESSAGE = 48
#: The arbiter's socket for pieces, in the directory of its main socket.
SOCKET_NAME = "pieces.sock"
#: The arbiter's refusal where its ``share_pieces`` is ``off``: a kernel told so stops
#: laying its pieces out for sharing (:attr:`jupyter_vgpu.kernel.pause.sharing.PieceSharing.may_share`).
OFF = "sharing paused pieces is off on this node"


def socket_beside(arbiter_socket: str | os.PathLike) -> Path:
    """The pieces socket of the arbiter listening on ``arbiter_socket``."""
    return Path(arbiter_socket).parent / SOCKET_NAME


def piece_key(length: int, planes: int, kinds, sizes, crcs, fills) -> bytes:
    """The key of a stored piece of the device codec (:class:`..kernel.codec.device.Piece`):
    BLAKE2b-256 of its length (bytes), its planes, and per chunk its kind (uint8), stored
    size (int64, bytes), CRC-32 of the stored bytes (uint32) and fill byte (uint8), each
    array little-endian. Finds candidates only: equal keys are never taken for equal
    bytes (:meth:`SharedPieces.offer` compares them).

    Raises:
        ValueError: the arrays differ in length.
    """
    arrays = [
        np.ascontiguousarray(a, dtype=t)
        for a, t in zip((kinds, sizes, crcs, fills), ("<u1", "<i8", "<u4", "<u1"), strict=True)
    ]
    if len({a.size for a in arrays}) != 1:
        raise ValueError("a piece's kinds, sizes, CRC-32s and fills are one per chunk")
    h = hashlib.blake2b(digest_size=32)
    h.update(int(length).to_bytes(8, "little") + int(planes).to_bytes(1, "little"))
    for a in arrays:
        h.update(a.tobytes())
    return h.digest()
