"""The arbiter's store of pieces held once across kernels (:mod:`jupyter_vgpu.node.shared_pieces`):
real sealed memfds, sent between processes over a Unix socket as a kernel sends them;
a key finds candidates and the bytes decide; a forged key, an unsealed or foreign
descriptor, a scope and a holder's cap each refused or kept apart; a holder's end
releases only its references."""

from __future__ import annotations

import fcntl
import mmap
import multiprocessing
import os
import socket

import numpy as np
import pytest

from jupyter_vgpu.node.shared_pieces import (
    MAX_PIECE_BYTES,
    SEALS,
    PieceRefused,
    SharedPieces,
    piece_key,
)

MiB = 2**20


def sealed(data: bytes, seals: int = SEALS) -> int:
    """A memfd holding ``data``, sealed as a kernel seals a piece it offers."""
    fd = os.memfd_create("vgpu-piece", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def contents(fd: int, size: int) -> bytes:
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
        return bytes(m)


def file_of(fd: int) -> tuple[int, int]:
    """The open file behind ``fd``: its device and inode."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def is_open(fd: int, file: tuple[int, int]) -> bool:
    """Whether ``fd`` still refers to ``file`` (:func:`file_of`, taken while it was open): a
    closed number may be handed out again at once to a file another thread opens (the
    whole suite runs in one process), so the number alone does not say."""
    try:
        return file_of(fd) == file
    except OSError:
        return False


def weights(seed: int, size: int = 3 * MiB + 17) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


KEY = b"k" * 32


def test_the_same_bytes_are_held_once_and_each_holder_reads_them():
    store = SharedPieces()
    base = weights(1)
    first = store.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    assert (first.shared, first.fd) == (False, None)  # kept for whoever has the same bytes
    second = store.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB)
    assert second.shared
    assert second.size == len(base)
    assert contents(second.fd, second.size) == base
    os.close(second.fd)
    f = store.figures()
    assert (f["pieces"], f["held_bytes"], f["referenced_bytes"]) == (1, len(base), 2 * len(base))
    assert len(f["by_holder"]) == 2  # each holder answers for half of it
    assert all(abs(v - len(base) / 2) <= 1 for v in f["by_holder"].values())
    store.close()


def test_a_forged_key_never_hands_over_anothers_bytes():
    """A kernel that names another's key with bytes of its own (a collision, or a lie)
    gets no descriptor: the bytes differ by one byte, and the store keeps both apart."""
    store = SharedPieces()
    secret = weights(2)
    store.offer(("ada", 1), "ada", KEY, sealed(secret), cap=64 * MiB)
    guess = bytearray(secret)
    guess[-1] ^= 1
    forged = store.offer(("eve", 9), "eve", KEY, sealed(bytes(guess)), cap=64 * MiB)
    assert (forged.shared, forged.fd) == (False, None)
    assert store.figures()["pieces"] == 2  # side by side under one key, never merged
    store.close()


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (
            lambda: sealed(b"x" * 4096, seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW),
            "sealed against writing",
        ),
        (lambda: os.memfd_create("unsealable", os.MFD_CLOEXEC), "against writing"),
        (lambda: os.pipe()[0], "sealed memfd"),
        (lambda: sealed(b""), "1 to"),
    ],
    ids=["writable", "no sealing", "pipe", "empty"],
)
def test_anything_but_a_sealed_memfd_is_refused_and_closed(make, why):
    store = SharedPieces()
    fd = make()
    file = file_of(fd)
    with pytest.raises(PieceRefused, match=why):
        store.offer(("eve", 9), "eve", KEY, fd, cap=64 * MiB)
    assert not is_open(fd, file)  # taken and closed: nothing left behind in the arbiter
    assert store.figures()["pieces"] == 0


def test_a_piece_larger_than_a_piece_is_refused(tmp_path):
    store = SharedPieces()
    fd = sealed(b"\0" * (MAX_PIECE_BYTES + 1))
    with pytest.raises(PieceRefused, match="1 to"):
        store.offer(("eve", 9), "eve", KEY, fd, cap=1 << 40)


def test_offers_past_the_holders_paused_bytes_are_refused():
    store = SharedPieces()
    store.offer(("eve", 9), "eve", KEY, sealed(weights(3, MiB)), cap=2 * MiB)
    with pytest.raises(PieceRefused, match="would pass this kernel's"):
        store.offer(("eve", 9), "eve", b"j" * 32, sealed(weights(4, 2 * MiB)), cap=2 * MiB)
    assert store.figures()["held_bytes"] == MiB
    store.close()


def test_the_scope_decides_who_shares():
    base = weights(5)
    same_user = SharedPieces("same-user")
    same_user.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    assert not same_user.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB).shared
    again = same_user.offer(("ada", 3), "ada", KEY, sealed(base), cap=64 * MiB)
    assert again.shared
    os.close(again.fd)
    same_user.close()
    off = SharedPieces("off")
    fd = sealed(base)
    file = file_of(fd)
    with pytest.raises(PieceRefused, match="off on this node"):
        off.offer(("ada", 1), "ada", KEY, fd, cap=64 * MiB)
    assert not is_open(fd, file)
    with pytest.raises(ValueError, match="must be one of all, same-user, off"):
        SharedPieces("everyone")


def test_a_holder_that_ends_releases_only_its_references():
    store = SharedPieces()
    base, own = weights(6), weights(7)
    store.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    shared = store.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB)
    os.close(shared.fd)
    store.offer(("ada", 1), "ada", b"o" * 32, sealed(own), cap=64 * MiB)
    assert store.saving() == len(base)  # both count the shared piece whole: once too many
    # what each one's release would leave held: the piece the other reads too
    assert store.accounting() == (len(base), {("ada", 1): len(base), ("bob", 2): len(base)})
    assert store.release(("ada", 1)) == len(own)  # her own piece goes, the shared one stays
    f = store.figures()
    assert (f["pieces"], f["held_bytes"], f["by_holder"]) == (1, len(base), {("bob", 2): len(base)})
    assert store.saving() == 0
    assert store.accounting() == (0, {})  # bob alone reads it: his release frees it
    assert store.release(("bob", 2)) == len(base)
    assert (store.figures()["pieces"], store.saving()) == (0, 0)


def test_a_holder_moving_to_disk_learns_which_pieces_others_read_and_releases_the_rest_by_key():
    """Before its spill a kernel asks which of its pieces others reference too (those stay
    in host memory for them anyway: it keeps reading them), writes the rest to its own
    file and releases those by key; the pieces others read stay, its own go."""
    store = SharedPieces()
    base, own, twice = weights(8), weights(9), weights(10)
    store.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    shared = store.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB)
    os.close(shared.fd)
    store.offer(("ada", 1), "ada", b"o" * 32, sealed(own), cap=64 * MiB)
    store.offer(("ada", 1), "ada", b"t" * 32, sealed(twice), cap=64 * MiB)  # two pieces of her
    again = store.offer(("ada", 1), "ada", b"t" * 32, sealed(twice), cap=64 * MiB)  # own, equal
    os.close(again.fd)
    keys = [KEY, b"o" * 32, b"t" * 32, b"n" * 32]  # the last: none of hers
    assert store.others(("ada", 1), "ada", keys) == [True, False, False, False]
    assert store.others(("eve", 3), "eve", keys) == [False] * 4  # references none of them
    # she writes her own pieces to disk and lets them go; one reference a key named
    assert store.release(("ada", 1), [b"o" * 32, b"t" * 32, b"n" * 32], "ada") == len(own)
    assert store.release(("ada", 1), [b"t" * 32], "ada") == len(twice)  # its second reference
    f = store.figures()
    assert (f["pieces"], f["held_bytes"], f["referenced_bytes"]) == (1, len(base), 2 * len(base))
    assert store.accounting() == (len(base), {("ada", 1): len(base), ("bob", 2): len(base)})
    # what she may still offer counts only what she still references
    more = store.offer(("ada", 1), "ada", b"p" * 32, sealed(weights(11)), cap=len(base) + len(own))
    assert more.shared is False
    # bob leaves: she reads the base alone now, and her release of it frees it
    store.release(("bob", 2))
    assert store.others(("ada", 1), "ada", [KEY]) == [False]
    assert store.release(("ada", 1), [KEY], "ada") == len(base)


def test_under_same_user_others_and_release_look_in_the_holders_scope():
    store = SharedPieces("same-user")
    base = weights(12)
    store.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    store.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB)  # bob's own copy
    assert store.others(("ada", 1), "ada", [KEY]) == [False]
    assert store.release(("ada", 1), [KEY], "bob") == 0  # not in her scope: nothing named
    assert store.release(("ada", 1), [KEY], "ada") == len(base)
    assert store.figures()["pieces"] == 1  # bob's


def _kernel(conn: socket.socket, data: bytes) -> None:
    """Another process, as a kernel: makes and seals its piece and sends the descriptor."""
    fd = sealed(data)
    socket.send_fds(conn, [b"piece"], [fd])
    os.close(fd)


def test_a_piece_sent_by_another_process_is_checked_on_the_descriptor_received():
    base = weights(8)
    store = SharedPieces()
    for holder in (("ada", 1), ("bob", 2)):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child = multiprocessing.get_context("fork").Process(target=_kernel, args=(theirs, base))
        child.start()
        msg, fds, _, _ = socket.recv_fds(ours, 16, 1)
        child.join(30)
        ours.close(), theirs.close()
        assert msg == b"piece"
        assert len(fds) == 1
        outcome = store.offer(holder, holder[0], KEY, fds[0], cap=64 * MiB)
    assert outcome.shared
    assert contents(outcome.fd, outcome.size) == base
    os.close(outcome.fd)
    store.close()


def test_the_key_is_the_pieces_layout_and_every_chunks_crc():
    kinds, sizes = np.array([0, 1, 2], np.uint8), np.array([4000, 65536, 0], np.int64)
    crcs, fills = np.array([7, 8, 0], np.uint32), np.array([0, 0, 255], np.uint8)
    key = piece_key(8 * MiB, 4, kinds, sizes, crcs, fills)
    assert len(key) == 32
    assert key == piece_key(8 * MiB, 4, kinds.copy(), sizes.copy(), crcs.copy(), fills.copy())
    other = crcs.copy()
    other[1] ^= 1
    assert piece_key(8 * MiB, 4, kinds, sizes, other, fills) != key
    assert piece_key(8 * MiB, 1, kinds, sizes, crcs, fills) != key
    assert piece_key(8 * MiB - 1, 4, kinds, sizes, crcs, fills) != key
    with pytest.raises(ValueError, match="one per chunk"):
        piece_key(8 * MiB, 4, kinds, sizes[:2], crcs, fills)


def test_past_its_most_pieces_the_node_refuses_new_bytes_but_still_shares_what_it_holds():
    from jupyter_vgpu.node.limits import pieces_within

    assert (pieces_within(4096), pieces_within(1024), pieces_within(1 << 20)) == (1024, 0, (1 << 19) - 1024)
    store = SharedPieces(max_pieces=1)
    base = weights(8)
    store.offer(("ada", 1), "ada", KEY, sealed(base), cap=64 * MiB)
    with pytest.raises(PieceRefused, match="the node holds 1 distinct pieces, its most"):
        store.offer(("ada", 1), "ada", b"o" * 32, sealed(weights(9)), cap=64 * MiB)
    assert store.saving() == 0  # the refused piece is held by nobody, and counted so
    shared = store.offer(("bob", 2), "bob", KEY, sealed(base), cap=64 * MiB)  # held already: shared
    os.close(shared.fd)
    assert shared.shared
    assert store.release(("ada", 1)) == 0
    assert store.release(("bob", 2)) == len(base)
    store.offer(("eve", 3), "eve", b"o" * 32, sealed(weights(9)), cap=64 * MiB)  # room again
    assert store.figures()["pieces"] == 1
