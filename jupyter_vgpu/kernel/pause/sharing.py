"""A paused kernel's stored pieces held once across kernels: the kernel's side of the work
(issue 42; the arbiter's side is :mod:`jupyter_vgpu.node.shared_pieces`).

After a pause, a thread of the kernel's (:meth:`PieceSharing.share`) offers each piece the
device codec stored in a pinned slab (:class:`..codec.device.Piece`) to the node
arbiter (:class:`.piece_client.PieceClient`): its stored bytes go into a sealed memfd,
the padding between its chunks zeroed (the chunks lie at 16-byte offsets, and what lies
between them is whatever the codec's scratch held: left as it is, equal pieces of two
kernels would differ there), and the arbiter answers with a read-only mapping of the
bytes the kernel reads the piece from now on: another kernel's copy, equal to this one
(compared byte for byte by the arbiter), or the kernel's own memfd, kept for whoever
offers the same bytes next. The mapping is registered with the driver as pinned memory
(``cudaHostRegister`` with ``cudaHostRegisterReadOnly``: the pages are read-only), so
that a resume copies from it as fast as from a slab; the piece then points at it (a slab
of the arena adopted for it, :meth:`..codec.pinned_arena.PinnedArena.adopt`), and a slab
whose pieces all moved goes back to the system (:meth:`~..codec.pinned_arena.PinnedArena.release`).

Nothing here runs inside a pause or a resume. The thread takes the engine's lock one
piece at a time and stops at the next piece when the kernel is wanted back (a resume
waits for at most one piece's offer); a piece is only ever moved while the engine is
paused and still holds it where it was. After a resume the mappings are no longer read:
:meth:`PieceSharing.retire` sets them aside at no cost, and :meth:`PieceSharing.let_go`
unregisters and closes them and drops the kernel's references at the arbiter, in the
background. A spill to the disk tier first asks the arbiter which mapped pieces other
kernels reference too (:meth:`PieceSharing.read_by_others`): those stay mapped, read
from the node's copy on the way back (the others' references keep it in host memory
anyway), and only the rest are written to the kernel's file, retired and released by key.

Where the driver cannot register a read-only mapping, the piece is read from the
mapping as it is (pageable memory: the copy to the device is slower, the bytes the
same), and the figures say so (``unregistered``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from jupyter_vgpu.host.pieces import OFF, piece_key
from jupyter_vgpu.units import format_bytes

from .piece_client import Held, PieceClient, PieceError, Refused

log = logging.getLogger("jupyter_vgpu")
#: One line per piece offered (debug): where in its range, its key, what became of it.
pieces_log = logging.getLogger("jupyter_vgpu.pieces")

#: ``cudaHostRegisterReadOnly`` (CUDA runtime API, ``cudaHostRegister``'s flags): the
#: device only reads the memory, so read-only pages may be registered.
HOST_REGISTER_READ_ONLY = 0x08


@dataclasses.dataclass
class _Mapped:
    key: bytes  # the piece's key, as offered: a release by key names it
    held: Held
    array: np.ndarray | None  # a view of held.view (its address); dropped before closing it
    address: int
    registered: bool


class Pinning:
    """Registers host memory with the driver as pinned, through PyTorch's CUDA runtime
    bindings (``torch.cuda.cudart()``'s ``cudaHostRegister`` and ``cudaHostUnregister``).

    Args:
        torch: the torch module.
        device: the CUDA ordinal whose context registers (the calling thread's device
            is set to it for each call).
    """

    def __init__(self, torch, device: int):
        self.torch, self.device = torch, device

    def register(self, address: int, nbytes: int) -> bool:
        """Register ``nbytes`` of read-only host memory at ``address``; False where the
        driver refuses (the memory stays usable, pageable)."""
        with self.torch.cuda.device(self.device):
            err = self.torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_READ_ONLY)
        return int(err) == 0

    def unregister(self, address: int) -> None:
        """Undo :meth:`register` (errors are logged: the mapping is closed next anyway)."""
        with self.torch.cuda.device(self.device):
            err = self.torch.cuda.cudart().cudaHostUnregister(address)
        if int(err) != 0:
            log.info("jupyter-vgpu: cudaHostUnregister of a shared piece answered %s", err)


class PieceSharing:
    """One engine's pieces held once: offered after a pause, let go after a resume.

    Args:
        connect: returns a :class:`PieceClient` connected to the arbiter's
            ``pieces.sock`` (called once, at the first offer).
        pinning: registers mappings as pinned (:class:`Pinning`), or None (the host
            stand-in, tests: mappings are read as they are).

    Figures (:meth:`figures`): ``offered`` pieces and ``offered_bytes``, of them
    ``shared_bytes`` (read from another kernel's copy) and ``kept_bytes`` (the kernel's
    own memfd, kept by the arbiter), ``mapped_bytes`` held now, ``unregistered`` pieces
    (read pageable), ``slabs_released_bytes`` (pinned slabs given back), ``refused``
    (why the last offer was refused, or None) and ``seconds`` (the last round's).
    """

    def __init__(self, connect: Callable[[], PieceClient], pinning: Pinning | None = None):
        self._connect = connect
        self.pinning = pinning
        self._client: PieceClient | None = None  # during a round of offers only
        #: why the last round's connection failed (no answer, a hang-up, an answer that
        #: breaks its contract, no socket), or None; the next round connects anew
        self.broken: str | None = None
        self._referenced = False  # the arbiter may hold references of this kernel's
        #: whether the node took offers at the last look (True until a round could not
        #: reach it or was told it shares nothing, ``share_pieces`` ``off``); the engine
        #: lays its pieces out on each unit's grid only while it does (:func:`.ranges.spans`)
        self.may_share = True
        self._told: str | None = None  # the last reason logged for pieces kept
        self._lock = threading.Lock()  # guards the lists; offers are serialised by the caller
        self._mapped: list[_Mapped] = []  # read by the paused engine now
        self._retired: list[_Mapped] = []  # read no more: to let go
        self._closed: list[bytes] = []  # keys of mappings closed, references not dropped yet
        counts = ("offered", "offered_bytes", "shared_bytes", "kept_bytes", "unregistered")
        self._figures: dict = {**dict.fromkeys(counts, 0), "slabs_released_bytes": 0}
        self._figures.update(refused=None, seconds=None)

    # -- offering ----------------------------------------------------------------------

    def share(self, pieces: list[tuple[list, int]], arena, lock, still_paused: Callable[[], bool],
              keep_going: Callable[[], bool] = lambda: True) -> int:  # fmt: skip
        """Offer ``pieces`` (``(list holding the piece, its index)`` pairs, pieces of the
        device codec in ``arena``'s slabs) one at a time, each under ``lock`` while
        ``still_paused()`` and ``keep_going()`` hold and the piece is still where it was;
        point each piece offered at its mapping and give back every slab whose pieces
        all moved. Returns the bytes of pinned slabs given back (the caller empties
        PyTorch's pinned-memory cache for them to reach the system).

        A refusal (sharing off on the node, the cap of the kernel's paused bytes, the
        node's most pieces) stops the round: the pieces not offered stay in their slabs.
        A connection that fails (no answer in time, a hang-up) stops the round too
        (:attr:`broken` says why): an answer that came late would be read as the next
        offer's. Each round has a connection of its own, closed when it ends: a kernel
        is paused for minutes between two rounds, longer than the arbiter keeps a silent
        client (:data:`jupyter_vgpu.node.piece_socket.IDLE_SECONDS`).
        """
        t0 = time.perf_counter()
        # what an earlier pause left: mappings not closed yet (the let-go waits for the end
        # of a cell, and a prefetch brings a kernel back with none) and their references.
        # A paused kernel runs no cell: both go now, or the references would count against
        # this round's cap at the arbiter
        self.let_go()
        left: dict[int, int] = {}  # slab -> its pieces not moved yet
        for holder, i in pieces:
            left[holder[i].slab] = left.get(holder[i].slab, 0) + 1
        released = 0
        self.broken = None
        before = self.figures()
        try:
            for holder, i in pieces:
                if not keep_going():
                    break
                with lock:
                    piece = holder[i]
                    if not still_paused() or piece.slab < 0 or piece.slab not in left:
                        break  # resumed, spilled or moved meanwhile: the round is over
                    mapped = self._offer(piece, arena)
                    if mapped is None:
                        break
                    holder[i] = dataclasses.replace(piece, slab=arena.adopt(mapped.address), start=0)
                    left[piece.slab] -= 1
                    if left[piece.slab] == 0:
                        released += arena.release(piece.slab)
        finally:
            self._hang_up()
        with self._lock:
            self._figures["slabs_released_bytes"] += released
            self._figures["seconds"] = round(time.perf_counter() - t0, 4)
            f = dict(self._figures)
        log.info(
            "jupyter-vgpu: offered %d of %d paused pieces in %.1f s: %s found identical to another "
            "kernel's, %s kept by the node; %s of pinned slabs given back%s",
            f["offered"] - before["offered"],
            len(pieces),
            f["seconds"],
            format_bytes(f["shared_bytes"] - before["shared_bytes"]),
            format_bytes(f["kept_bytes"] - before["kept_bytes"]),
            format_bytes(released),
            f"; stopped: {f['refused']}" if f["refused"] else "",
        )
        return released

    def _offer(self, piece, arena) -> _Mapped | None:
        """Offer one piece; its mapping, or None when refused (the figures say why)."""
        data = clean_copy(piece, arena.address(piece.slab, piece.start))
        try:
            if self._client is None:
                self._client = self._connect()
            key = piece_key(piece.length, piece.planes, piece.kinds, piece.sizes, piece.crcs, piece.fills)
            held = self._client.offer(key, data)
        except PieceError as e:
            with self._lock:
                self._figures["refused"] = str(e)
            if isinstance(e, Refused):
                self.may_share = e.why != OFF  # or a cap was reached: the node shares
            else:  # a late answer would be read as the next one's
                self.broken = str(e)
                self.may_share = False
                self._hang_up()
            if str(e) != self._told:  # once per reason: a node that shares nothing says so each round
                self._told = str(e)
                log.info("jupyter-vgpu: paused pieces stay the kernel's own: %s", e)
            return None
        self._referenced = True
        self.may_share = True
        pieces_log.debug(
            "piece at +%d of its range, %d bytes (%d stored), key %s: %s",
            piece.offset,
            piece.length,
            held.size,
            key[:8].hex(),
            "shared" if held.shared else "kept",
        )
        array = np.frombuffer(held.view, dtype=np.uint8)
        address = array.ctypes.data
        registered = self.pinning is not None and self.pinning.register(address, held.size)
        mapped = _Mapped(key, held, array, address, registered)
        with self._lock:
            self._mapped.append(mapped)
            f = self._figures
            f["offered"] += 1
            f["offered_bytes"] += held.size
            f["shared_bytes" if held.shared else "kept_bytes"] += held.size
            f["unregistered"] += 0 if registered else 1
            f["refused"] = None
        return mapped

    # -- letting go --------------------------------------------------------------------

    def retire(self, keep: frozenset[int] = frozenset()) -> None:
        """The engine reads its mappings no more (resumed: the bytes are on the device;
        or spilled: they are on disk), but for those at the addresses in ``keep`` (pieces
        a spill left in the node's copies, :meth:`read_by_others`): set them aside for
        :meth:`let_go`. No call is made."""
        with self._lock:
            self._retired.extend(m for m in self._mapped if m.address not in keep)
            self._mapped = [m for m in self._mapped if m.address in keep]

    def read_by_others(self, addresses) -> frozenset[int]:
        """Of the pieces the engine reads from mappings at ``addresses``, those another
        kernel references too, as the node arbiter says (``others`` on its pieces
        socket): a spill leaves them where they are, since the others' references keep
        the node's copy in host memory anyway, and writes the rest to the kernel's own
        file. Nothing (everything is written) where the node cannot be asked; the message
        is logged. Addresses that are no mapping are passed over."""
        wanted = set(addresses)  # an iterable, read once
        with self._lock:
            asked = [m for m in self._mapped if m.address in wanted]
        if not asked:
            return frozenset()
        client = None
        try:
            client = self._connect()
            held = client.others([m.key for m in asked])
        except (PieceError, OSError) as e:
            log.info("jupyter-vgpu: every paused piece goes to this kernel's own file: %s", e)
            return frozenset()
        finally:
            if client is not None:
                client.close()
        return frozenset(m.address for m, others in zip(asked, held, strict=True) if others)

    def unpin(self) -> None:
        """Unregister the mappings still read (before the driver's checkpoint takes the
        process: it is not told about memory registered this way); they stay mapped and
        are read as pageable memory."""
        with self._lock:
            mapped = [m for m in self._mapped if m.registered]
            for m in mapped:
                m.registered = False
                self._figures["unregistered"] += 1
        for m in mapped:
            if self.pinning is not None:
                self.pinning.unregister(m.address)

    def let_go(self) -> int:
        """:meth:`close_retired`, then :meth:`drop_references`; returns the bytes of
        mappings closed."""
        closed = self.close_retired()
        self.drop_references()
        return closed

    def close_retired(self, keep_going: Callable[[], bool] = lambda: True) -> int:
        """Unregister and close the retired mappings (no piece reads them: the caller
        needs no engine lock), one at a time while ``keep_going()`` holds; those left
        stay retired for the next call. Returns the bytes closed.

        ``cudaHostUnregister`` unpins the pages and takes the driver's locks of the
        process, so the kernel calls this between cells, never beside one
        (:meth:`..host_memory.HostMemory.let_go_shared`)."""
        closed = 0
        while keep_going():
            with self._lock:
                if not self._retired:
                    break
                m = self._retired.pop()
            if m.registered and self.pinning is not None:
                self.pinning.unregister(m.address)
            m.array = None
            m.held.view.close()
            closed += m.held.size
            with self._lock:
                self._closed.append(m.key)
        return closed

    def drop_references(self) -> None:
        """Drop this kernel's references at the arbiter, on a connection of its own, once
        no retired mapping waits to be closed: all of them when no mapping is read now,
        else one for each mapping closed since (a spill that left pieces others read in
        the node's copies). The caller holds the engine's lock, so that no round of
        offers begins meanwhile (its references would go too)."""
        with self._lock:
            if self._retired or not self._referenced:
                return
            keys = None if not self._mapped else list(self._closed)
        if keys == []:
            return
        client = None
        try:
            client = self._connect()
            client.release(keys)
            with self._lock:
                if keys is None:
                    self._referenced = False
                    self._closed.clear()
                else:
                    del self._closed[: len(keys)]
        except (PieceError, OSError) as e:  # the arbiter drops them when the kernel ends
            log.info("jupyter-vgpu: the arbiter did not take back this kernel's pieces: %s", e)
        finally:
            if client is not None:
                client.close()

    @property
    def retired(self) -> bool:
        """Whether mappings wait for :meth:`let_go`."""
        with self._lock:
            return bool(self._retired)

    def mapped_bytes(self) -> int:
        """Bytes of pieces the engine reads from mappings now (shared or its own memfd)."""
        with self._lock:
            return sum(m.held.size for m in self._mapped)

    def figures(self) -> dict:
        with self._lock:
            return {**self._figures, "mapped_bytes": sum(m.held.size for m in self._mapped)}

    def close(self) -> None:
        """Let go of everything (the engine closes)."""
        self.retire()
        self.let_go()
        self._hang_up()

    def _hang_up(self) -> None:
        """Close the round's connection, if one is open."""
        if self._client is not None:
            self._client.close()
            self._client = None


def clean_copy(piece, address: int) -> np.ndarray:
    """``piece``'s span at ``address`` (host memory), copied, with every byte outside its
    chunks zeroed (the padding up to each chunk's 16-byte offset): uint8, ``piece.span``
    bytes. Equal pieces of two kernels are then equal byte for byte."""
    span = np.ctypeslib.as_array((ctypes.c_uint8 * piece.span).from_address(address)).copy()
    ends = np.asarray(piece.offsets, dtype=np.int64) + np.asarray(piece.sizes, dtype=np.int64)
    starts = np.append(np.asarray(piece.offsets, dtype=np.int64)[1:], piece.span)
    for end, start in zip(ends.tolist(), starts.tolist(), strict=True):
        if start > end:
            span[end:start] = 0
    return span
