"""A paused kernel's pieces offered to the node's pieces held once, the kernel's side
(:mod:`jupyter_vgpu.kernel.pause.sharing`): real kernels on a simulated card and a real
arbiter. The device codec's pieces are stood in for by pieces of the same layout in
slabs of CPU memory (the GPU test, ``tests/gpu/test_piece_sharing_gpu.py``, pauses real
CUDA memory): two kernels with the same weights hold them once, each piece then reads
its bytes from the mapping (the padding between chunks zeroed, the chunks intact), a
slab whose pieces all moved goes back, and letting go drops the references."""

from __future__ import annotations

from pathlib import Path

import pytest

from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena
from jupyter_vgpu.kernel.pause.sharing import clean_copy
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for
from jupyter_vgpu.units import format_bytes
from tests.unit.test_arbiter import start_kernel

MiB, GiB = 2**20, 2**30
ROOMY = Slice("GPU-sim-sharing", 0, "Simulated card", 8 * GiB, GiB, 50, simulated=True, idle_seconds=3600)
HOLD = "import torch\nx = torch.zeros(64 * 2**20 // 4)\n"
# pieces laid out as the device codec lays them: chunks at 16-byte offsets of a span in a
# slab, the padding between them garbage (here: a kernel's own random bytes)
SETUP = """
import dataclasses, os, threading, numpy as np, torch
from jupyter_vgpu.host.pieces import socket_beside
from jupyter_vgpu.kernel.codec.device import Piece, ANS, RAW
from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena
from jupyter_vgpu.kernel.pause.piece_client import PieceClient
from jupyter_vgpu.kernel.pause.sharing import PieceSharing
arena = PinnedArena(torch, slab_bytes=4 * 2**20, pin=lambda n: torch.empty(n, dtype=torch.uint8))
noise = np.random.default_rng(os.getpid())
pieces, chunks = [], []
for k in range(6):  # weights: the same in every kernel (seed k); 3 pieces a slab
    rng = np.random.default_rng(k)
    sizes = rng.integers(100_000, 400_000, 4)
    offsets = np.zeros(4, dtype=np.int64)
    np.cumsum(-(-sizes[:-1] // 16) * 16, out=offsets[1:])
    span = int(offsets[-1] + -(-sizes[-1] // 16) * 16)
    slab, start = arena.reserve(span)
    view = arena.slabs[slab][start : start + span].numpy()
    view[:] = noise.integers(0, 256, span, dtype=np.uint8)
    data = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in sizes]
    for at, d in zip(offsets, data):
        view[at : at + len(d)] = d
    chunks.append(data)
    pieces.append(Piece(k * 2**20, 2**20, 1, np.array([ANS, RAW, ANS, ANS], np.uint8), sizes.astype(np.int64),
                        np.array([k, 1, 2, 3], np.uint32), np.zeros(4, np.uint8), slab, start, offsets, span,
                        int(sizes.sum()), True))
held_before, slabs_before = arena.held_bytes, [p.slab for p in pieces]
todo = [(pieces, i) for i in range(6)]  # every piece, as the engine lists them
sharing = PieceSharing(lambda: PieceClient(socket_beside(os.environ["JUPYTER_VGPU_ARBITER"])))
lock = threading.Lock()
def intact(n=6):  # the first n pieces
    for p, data in zip(pieces[:n], chunks[:n]):
        at = arena.address(p.slab, p.start)
        span = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * p.span).from_address(at))
        for at, d in zip(p.offsets, data):
            if not np.array_equal(span[at : at + len(d)], d):
                return False
    return True
"""


#: The row ``%vgpu status`` shows on pieces held once, from the kernel's figures.
STATUS_ROW = "from jupyter_vgpu.kernel.status import _held_once\nprint(_held_once(sharing.figures()))"


def hub_page_part(books: dict) -> str:
    """The Hub page's sentence on pieces held once (``/hub/vgpu``), rendered from
    ``books`` with the page's own template."""
    import jinja2

    templates = Path(__file__).resolve().parents[2] / "hub_spawner" / "templates"
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates), autoescape=True)
    return env.get_template("vgpu_shared_pieces.html").render(arbiter=books, size=format_bytes)


@pytest.fixture
def arbiter(tmp_path):
    process = ArbiterProcess(tmp_path, "--ArbiterApp.share_pieces=all").start()
    yield process
    process.stop()


def test_the_same_weights_in_two_kernels_are_held_once_and_read_back_intact(tmp_path, arbiter):
    kernels = [start_kernel(tmp_path, arbiter, u, ROOMY) for u in ("ada", "bob")]
    try:
        for k in kernels:
            k.run(HOLD + SETUP)
            wait_for(
                lambda k=k: (arbiter.kernel(k.pid) or {}).get("resident", 0) >= 64 * MiB, 30, "64 MiB held"
            )
        ada, bob = kernels
        for k in kernels:
            out = k.run(
                "n = len(arena.slabs)\n"
                "released = sharing.share(todo, arena, lock, lambda: True)\n"
                "print(released == held_before > 0, arena.held_bytes, intact(),"
                " [p.slab for p in pieces] == list(range(n, n + 6)))"
            )
            # every slab's pieces moved: all went back; each piece reads from a slab the
            # arena adopted for its mapping, its chunks intact
            assert out.strip() == "True 0 True True", out
        spans = ada.run("print(sum(p.span for p in pieces))").strip()
        figures = arbiter.books()["shared_pieces"]
        assert (figures["pieces"], figures["held_bytes"], figures["referenced_bytes"]) == (
            6,
            int(spans),
            2 * int(spans),
        )
        # the Hub's page says so, from these books
        page = hub_page_part(arbiter.books())
        held = format_bytes(int(spans))
        assert 'data-scope="all"' in page
        assert f'6 pieces, <span class="vgpu-shared-held">{held}</span> held for' in page
        assert f"{format_bytes(2 * int(spans))} referenced by 2 kernels" in page
        assert f'<span class="vgpu-shared-saved">{held}</span> saved' in page
        # what %vgpu status says of it, from the kernel's own figures
        row = bob.run(STATUS_ROW)
        assert row.startswith(f"{held} of its paused data read from the node's copies now;"), row
        assert f"6 pieces offered: {held} found identical to another kernel's" in row, row
        assert row.rstrip().endswith("0 B kept by the node for others"), row
        ada_f = eval(ada.run("print(sharing.figures())").strip())  # a dict the kernel printed
        bob_f = eval(bob.run("print(sharing.figures())").strip())
        assert (ada_f["kept_bytes"], ada_f["shared_bytes"]) == (int(spans), 0)
        assert (bob_f["kept_bytes"], bob_f["shared_bytes"]) == (0, int(spans))
        assert (bob_f["mapped_bytes"], bob_f["unregistered"]) == (int(spans), 6)  # no driver here
        # resumed: bob's mappings are read no more. A cell begins before any is closed:
        # they all wait, his references with them
        out = bob.run("sharing.retire(); print(sharing.close_retired(lambda: False), sharing.retired)")
        assert out.strip() == "0 True", out
        assert arbiter.books()["shared_pieces"]["referenced_bytes"] == 2 * int(spans)
        # a pause that comes first (a prefetch brought him back and no cell ran) begins its
        # round of offers by closing them and dropping his references (his alone)
        assert (
            bob.run("sharing.share([], arena, lock, lambda: True)\nprint(sharing.retired)").strip() == "False"
        )
        figures = arbiter.books()["shared_pieces"]
        assert (figures["held_bytes"], figures["referenced_bytes"]) == (int(spans), int(spans))
        assert "referenced by 1 kernel;" in hub_page_part(arbiter.books())
        assert ada.run("print(intact())").strip() == "True"
    finally:
        for k in kernels:
            k.shutdown()


def test_a_kernel_moving_to_disk_keeps_reading_what_others_read_and_lets_go_of_the_rest(tmp_path, arbiter):
    """Before a spill the kernel asks the node which of its mapped pieces other kernels
    read too; those it keeps reading from the node's copies (they stay in host memory
    for the others anyway), the rest it lets go of, its references with them, by key."""
    kernels = [start_kernel(tmp_path, arbiter, u, ROOMY) for u in ("ada", "bob")]
    try:
        for k in kernels:
            k.run(HOLD + SETUP)
        ada, bob = kernels
        ada.run("sharing.share(todo, arena, lock, lambda: True)")
        bob.run("sharing.share(todo[:3], arena, lock, lambda: True)")  # bob offers half
        spans = [int(x) for x in ada.run("print(*[p.span for p in pieces])").split()]
        # the node's answer: bob reads the first three too; the last three are ada's alone
        ask = "at = [arena.address(p.slab, p.start) for p in pieces]\n"
        ask += "keep = sharing.read_by_others(iter(at))\n"
        assert ada.run(ask + "print([a in keep for a in at])").strip() == str([True] * 3 + [False] * 3)
        # her spill writes the last three to her file: their mappings and references go
        spill = "sharing.retire(keep)\nsharing.let_go()\n"
        out = ada.run(spill + "print(sharing.mapped_bytes(), sharing.retired)")
        assert out.strip() == f"{sum(spans[:3])} False", out
        figures = arbiter.books()["shared_pieces"]
        assert (figures["pieces"], figures["held_bytes"], figures["referenced_bytes"]) == (
            3,
            sum(spans[:3]),
            2 * sum(spans[:3]),
        )
        assert ada.run("print(intact(3))").strip() == "True"  # the first three, still read
        # bob goes: the node drops his references, and nobody else reads hers now
        bob.shutdown()
        kernels.remove(bob)
        left = sum(spans[:3])
        wait_for(lambda: arbiter.books()["shared_pieces"]["referenced_bytes"] == left, 30, "bob's gone")
        assert ada.run(ask + "print(len(keep))").strip() == "0"
        # back: she lets go of the rest, every reference with it
        ada.run("sharing.retire()\nsharing.let_go()")
        assert arbiter.books()["shared_pieces"]["pieces"] == 0
    finally:
        for k in kernels:
            k.shutdown()


def test_a_round_stops_when_the_kernel_is_wanted_back_and_leaves_the_rest_in_their_slabs(tmp_path, arbiter):
    k = start_kernel(tmp_path, arbiter, "ada", ROOMY)
    try:
        k.run(HOLD + SETUP)
        out = k.run(
            "asked = iter([True, True, False])\n"
            "released = sharing.share(todo, arena, lock, lambda: True, lambda: next(asked))\n"
            "n, first = len(arena.slabs), slabs_before[0]\n"
            "whole = slabs_before.count(first) == 2  # the first slab held just those two\n"
            "print(released == (4 * 2**20 if whole else 0), [p.slab for p in pieces][:2] == [n - 2, n - 1],"
            " [p.slab for p in pieces][2:] == slabs_before[2:], intact())"
        )
        # two pieces moved, the others stay where they were; a slab goes only once empty
        assert out.strip() == "True True True True", out
    finally:
        k.shutdown()


def test_clean_copy_zeroes_only_the_padding():
    import numpy as np
    import torch

    from jupyter_vgpu.kernel.codec.device import ANS, FILL, Piece

    arena = PinnedArena(torch, slab_bytes=MiB, pin=lambda n: torch.empty(n, dtype=torch.uint8))
    sizes = np.array([17, 0, 33], np.int64)  # a FILL chunk stores nothing
    offsets = np.array([0, 32, 32], np.int64)
    slab, start = arena.reserve(80)
    arena.slabs[slab][start : start + 80] = 7
    piece = Piece(0, 96, 1, np.array([ANS, FILL, ANS], np.uint8), sizes, np.zeros(3, np.uint32),
                  np.zeros(3, np.uint8), slab, start, offsets, 80, 50, False)  # fmt: skip
    got = clean_copy(piece, arena.address(slab, start))
    expect = np.zeros(80, np.uint8)
    expect[0:17] = 7
    expect[32:65] = 7
    assert np.array_equal(got, expect)
    assert bytes(arena.slabs[slab][start : start + 80].numpy()) == bytes([7]) * 80  # the slab is untouched


def test_each_round_of_offers_has_a_connection_of_its_own(tmp_path, arbiter):
    # A kernel stays paused for minutes between two rounds, longer than the arbiter keeps
    # a silent client (piece_socket.IDLE_SECONDS): a connection kept from the last round
    # would be hung up on, and the next round would share nothing.
    k = start_kernel(tmp_path, arbiter, "ada", ROOMY)
    try:
        k.run(HOLD + SETUP)
        out = k.run(
            "import logging\n"
            "said = []\n"
            "heard = logging.Handler(logging.DEBUG)\n"
            "heard.emit = lambda record: said.append((record.name, record.getMessage()))\n"
            "for name in ('jupyter_vgpu', 'jupyter_vgpu.pieces'):\n"
            "    logging.getLogger(name).setLevel(logging.DEBUG)\n"
            "logging.getLogger('jupyter_vgpu').addHandler(heard)\n"
            "asked = iter([True, True, True, False])\n"
            "sharing.share(todo, arena, lock, lambda: True, lambda: next(asked))\n"
            "first = (sharing.figures()['offered'], sharing._client is None)\n"
            "sharing.share(todo[3:], arena, lock, lambda: True)\n"
            "print(*first, sharing.figures()['offered'], sharing._client is None, sharing.broken, intact())"
        )
        assert out.strip() == "3 True 6 True None True", out
        # each piece offered, then the round, in the kernel's log
        said = eval(k.run("print(said)"))  # a list the kernel printed
        assert [name for name, _ in said].count("jupyter_vgpu.pieces") == 6, said
        assert all(m.endswith(": kept") and "key " in m for n, m in said if n == "jupyter_vgpu.pieces"), said
        rounds = [m for n, m in said if n == "jupyter_vgpu"]
        assert rounds[0].startswith("jupyter-vgpu: offered 3 of 6 paused pieces in "), rounds
        assert rounds[1].startswith("jupyter-vgpu: offered 3 of 3 paused pieces in "), rounds
        assert "0 B found identical to another kernel's" in rounds[0], rounds
        assert k.run("print(sharing.may_share)").strip() == "True"
        assert arbiter.books()["shared_pieces"]["pieces"] == 6
    finally:
        k.shutdown()


def test_a_kernel_that_cannot_reach_the_nodes_pieces_keeps_its_own_and_stops_offering(tmp_path):
    process = ArbiterProcess(tmp_path, "--ArbiterApp.share_pieces=off").start()  # no pieces socket
    k = start_kernel(tmp_path, process, "ada", ROOMY)
    try:
        assert "not held once (share_pieces is off)" in hub_page_part(process.books())
        k.run(HOLD + SETUP)
        out = k.run(
            "first = sharing.share(todo, arena, lock, lambda: True)\n"
            "print(first, [p.slab for p in pieces] == slabs_before, intact(), sharing.broken is not None,"
            " sharing.share(todo, arena, lock, lambda: True), sharing.figures()['offered'],"
            " sharing.may_share)"
        )
        # nothing moved, nothing lost; the second round tries anew, and fails the same way;
        # the engine stops laying its pieces out for sharing
        assert out.strip() == "0 True True True 0 0 False", out
        assert "the node arbiter takes no paused pieces: there is no pieces socket" in k.run(
            "print(sharing.broken)"
        )
        row = k.run(STATUS_ROW)  # what %vgpu status says: nothing held once, and why
        assert "0 pieces offered" in row, row
        assert "the last offer was refused: the node arbiter takes no paused pieces" in row, row
    finally:
        k.shutdown()
        process.stop()
