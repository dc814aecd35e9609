"""Kernels hand pieces to the arbiter over its pieces socket
(:mod:`jupyter_vgpu.node.piece_socket`, :mod:`jupyter_vgpu.kernel.pause.piece_client`):
real kernels on a simulated card and a real arbiter. Two kernels with the same bytes
hold them once and each reads them back; a kernel that names the same key with other
bytes gets nothing of theirs; a process that is no kernel is refused; what a kernel may
offer is capped by what it holds; a kernel that ends releases only its references."""

from __future__ import annotations

import json
import socket

import pytest

from jupyter_vgpu.host.pieces import socket_beside
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for
from tests.unit.test_arbiter import start_kernel

MiB, GiB = 2**20, 2**30
#: Room for everyone: nothing here is paused; each kernel holds 64 MiB.
ROOMY = Slice("GPU-sim-pieces", 0, "Simulated card", 8 * GiB, GiB, 50, simulated=True, idle_seconds=3600)
HOLD = "import torch\nx = torch.zeros(64 * 2**20 // 4)\n"
OFFER = """
import numpy as np, os
from jupyter_vgpu.host.pieces import socket_beside
from jupyter_vgpu.kernel.pause.piece_client import PieceClient, PieceError
client = PieceClient(socket_beside(os.environ["JUPYTER_VGPU_ARBITER"]))
def offer(seed, flip=False, size=3 * 2**20 + 5):
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    if flip:
        data[-1] ^= 1
    try:
        held = client.offer(b"k" * 32, data)
    except PieceError as e:
        return f"refused: {e}"
    same = bytes(held.view) == data.tobytes()
    return f"shared={held.shared} size={held.size} same={same}"
"""


@pytest.fixture
def arbiter(tmp_path):
    process = ArbiterProcess(tmp_path, "--ArbiterApp.share_pieces=all").start()
    yield process
    process.stop()


def shared(arbiter) -> dict:
    return arbiter.books()["shared_pieces"]


def test_kernels_hold_the_same_bytes_once_and_a_forged_key_gets_nothing(tmp_path, arbiter):
    kernels = {u: start_kernel(tmp_path, arbiter, u, ROOMY) for u in ("ada", "bob", "eve")}
    try:
        for k in kernels.values():
            k.run(HOLD + OFFER)
            wait_for(lambda k=k: (arbiter.kernel(k.pid) or {}).get("resident") == 64 * MiB, 30, "64 MiB held")
        ada, bob, eve = kernels.values()
        size = 3 * MiB + 5
        assert ada.run("print(offer(1))").strip() == f"shared=False size={size} same=True"  # kept, hers
        assert bob.run("print(offer(1))").strip() == f"shared=True size={size} same=True"  # ada's copy
        # eve names the same key with her own bytes, one bit off: she keeps hers, reads no one's
        assert eve.run("print(offer(1, flip=True))").strip() == f"shared=False size={size} same=True"
        figures = shared(arbiter)
        assert (figures["pieces"], figures["held_bytes"]) == (2, 2 * size)
        assert figures["referenced_bytes"] == 3 * size
        assert set(figures["by_pid"]) == {str(k.pid) for k in kernels.values()}
        # more than a kernel holds (64 MiB here) is refused, and says why
        out = eve.run("print(offer(2, size=15 * 2**20)); print(offer(3, size=15 * 2**20)); " * 3)
        assert "refused: the arbiter refused the piece: offers of" in out
        # bob ends: ada's piece stays for ada; his references alone go
        bob.shutdown()
        wait_for(
            lambda: shared(arbiter)["referenced_bytes"] < 3 * size + 6 * 15 * MiB, 30, "bob's references gone"
        )
        assert shared(arbiter)["by_pid"][str(ada.pid)] == size
    finally:
        for k in kernels.values():
            k.shutdown()


def test_a_process_that_is_no_kernel_is_refused(tmp_path, arbiter):
    from jupyter_vgpu.kernel.pause.piece_client import PieceClient, PieceError

    client = PieceClient(socket_beside(arbiter.socket))
    try:
        with pytest.raises(PieceError, match="only a kernel the arbiter admitted may offer pieces"):
            client.offer(b"k" * 32, b"\0" * 4096)
    finally:
        client.close()
    assert shared(arbiter)["pieces"] == 0


def test_with_sharing_off_there_is_no_pieces_socket(tmp_path):
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.share_pieces=off").start()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s, pytest.raises(FileNotFoundError):
            s.connect(str(socket_beside(arbiter.socket)))
        assert shared(arbiter)["pieces"] == 0
    finally:
        arbiter.stop()


#: Valid messages both ways, and a broken variant of each with what the checker says.
TO_PIECES = [
    {"type": "offer", "key": "ab" * 32},
    {"type": "others", "keys": ["ab" * 32, "cd" * 32]},
    {"type": "release"},
    {"type": "release", "keys": ["ab" * 32]},
]
FROM_PIECES = [
    {"type": "outcome", "shared": True, "size": 3 * MiB},
    {"type": "others", "held": [True, False]},
    {"type": "released", "bytes": 0},
    {"type": "refused", "message": "sharing paused pieces is off on this node"},
]
BROKEN = [
    ("to-pieces", {"type": "offer", "key": "ab"}, "offer.key: must be at least 64 character(s) long"),
    ("to-pieces", {"type": "offer", "key": "ab" * 32, "size": 1}, 'offer: unknown field(s): "size"'),
    ("to-pieces", {"type": "take"}, "type: must be one of"),
    ("to-pieces", {"type": "others"}, "others: missing field(s): keys"),
    ("to-pieces", {"type": "others", "keys": ["ab" * 32] * 49}, "others.keys: must have at most 48 items"),
    ("to-pieces", {"type": "release", "keys": ["ab" * 32, "ab"]}, "release.keys[1]: must be at least 64"),
    ("from-pieces", {"type": "others", "held": [True, 1]}, "others.held[1]: must be true or false"),
    ("from-pieces", {"type": "outcome", "shared": True}, "outcome: missing field(s): size"),
    ("from-pieces", {"type": "released", "bytes": -1}, "released.bytes: must be at least 0; got -1"),
    ("from-pieces", {}, "missing field(s): type"),
]


@pytest.mark.parametrize(
    ("name", "message"), [("to-pieces", m) for m in TO_PIECES] + [("from-pieces", m) for m in FROM_PIECES]
)
def test_every_message_keeps_its_contract_by_both_checkers(name, message):
    import jsonschema

    from jupyter_vgpu import contracts
    from jupyter_vgpu.contracts import lean

    lean.validate_message(name, message)
    jsonschema.Draft202012Validator(contracts.schema(name)).validate(message)


@pytest.mark.parametrize(("name", "message", "words"), BROKEN)
def test_a_broken_message_is_refused_by_both_checkers_in_words(name, message, words):
    import jsonschema

    from jupyter_vgpu import contracts
    from jupyter_vgpu.contracts import ContractError, lean

    with pytest.raises(ContractError) as e:
        lean.validate_message(name, message)
    assert words in str(e.value)
    assert not jsonschema.Draft202012Validator(contracts.schema(name)).is_valid(message)


def test_the_arbiter_refuses_a_message_that_breaks_the_contract_and_names_the_field(tmp_path, arbiter):
    kernel = start_kernel(tmp_path, arbiter, "ada", ROOMY)
    try:
        out = kernel.run(
            "import json, os, socket\n"
            "from jupyter_vgpu.host.pieces import socket_beside\n"
            "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
            "s.connect(str(socket_beside(os.environ['JUPYTER_VGPU_ARBITER'])))\n"
            "s.send(json.dumps({'type': 'offer', 'key': 'zz'}).encode())\n"
            "print(s.recv(4096).decode())\n"
            "s.send(json.dumps({'type': 'offer', 'key': 'zz' * 32}).encode())\n"
            "print(s.recv(4096).decode())\n"
            "s.send(json.dumps({'type': 'others', 'keys': ['ab' * 32, 'zz' * 32]}).encode())\n"
            "print(s.recv(4096).decode())\n"
            "s.send(json.dumps({'type': 'others', 'keys': ['ab' * 32]}).encode())\n"
            "print(s.recv(4096).decode())\n"
        )
        first, second, third, fourth = (json.loads(line) for line in out.strip().splitlines())
        assert first == {
            "type": "refused",
            "message": "offer.key: must be at least 64 character(s) long; got 'zz'",
        } or (first["type"] == "refused" and first["message"].startswith("offer.key: must be at least 64"))
        assert second == {
            "type": "refused",
            "message": "an offer comes with one descriptor, the piece's memfd",
        }
        assert third == {"type": "refused", "message": "others.keys: each is 64 hexadecimal digits"}
        assert fourth == {"type": "others", "held": [False]}  # she references no piece of it
    finally:
        kernel.shutdown()
