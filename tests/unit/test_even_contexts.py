"""``ArbiterApp.even_contexts``: each paused kernel's context goes through the driver's
checkpoint and straight back once (:meth:`.moves.Moves.even`), through the arbiter's own
path (its background step, books, rooms and moves), with NVML's reading and the driver's
checkpoint stood in by the model of one card of ``test_room_ahead`` (a suspend takes a
process's bytes off it, a restore puts them back). The same driver calls on the real card:
``benchmarks/sessions.py --even-contexts`` and ``benchmarks/restore_fairness.py``
(docs/design.md, the twelfth try)."""

import asyncio
import time

import pytest

from jupyter_vgpu.host.checkpoint import CheckpointError, NoRoom
from jupyter_vgpu.node import books

from .answering import Answering
from .sleepers import sleeping
from .test_room_ahead import CARD, CONTEXT, decided, node


@pytest.fixture
def processes():
    """Six real processes, for the card model's six kernels."""
    with sleeping(6) as pids:
        yield pids


def evening(arbiter) -> None:
    """One background step of ``arbiter``, and the context it took through the driver, if any."""

    async def step():
        await arbiter.tick()
        if arbiter._evening is not None:
            await arbiter._evening

    asyncio.run(step())


def even_node(pids: list[int]):
    arbiter, card, kernels = node(pids[:6], short_contexts=0)
    arbiter.config.even_contexts = True
    return arbiter, card, kernels


def test_every_paused_kernel_goes_through_the_driver_once_longest_idle_first_and_stays_paused(processes):
    arbiter, card, kernels = even_node(processes)
    paused = kernels[:5]
    for i, k in enumerate(paused):
        k.since = time.monotonic() - 60 - 10 * i  # kernels[4] idle longest
    for _ in range(7):
        evening(arbiter)
    evened = decided(arbiter, "evened")
    assert [d["pid"] for d in evened] == [k.pid for k in reversed(paused)]
    assert all(k.restored_context and k.state == books.PAUSED for k in paused)
    assert all(card.held[k.pid] == CONTEXT for k in paused), "each context back on the card"
    assert [k.checkpoint_bytes for k in paused] == [0] * 5
    # each a suspend of its own process with its footprint, then nothing more
    assert [call[0] for call in arbiter.checkpoint.calls] == [[k.pid] for k in reversed(paused)]
    assert not kernels[5].restored_context, "an idle kernel that was never paused is left"
    series = {"gpu": CARD, "outcome": "evened"}
    assert arbiter.metrics.registry.get_sample_value("jupyter_vgpu_contexts_evened_total", series) == 5


def test_nothing_goes_through_the_driver_with_the_setting_off(processes):
    arbiter, _, _ = node(processes[:6], short_contexts=0)
    assert arbiter.config.even_contexts is False
    evening(arbiter)
    assert arbiter.checkpoint.calls == []
    assert decided(arbiter, "evened") == []


def test_a_kernel_restored_from_a_suspend_is_not_taken_again(processes):
    arbiter, _, kernels = even_node(processes)
    for k in kernels[1:5]:
        k.restored_context = True
    evening(arbiter)
    evening(arbiter)
    assert [d["pid"] for d in decided(arbiter, "evened")] == [kernels[0].pid]


def test_while_its_context_is_off_the_card_its_bytes_stay_promised(processes):
    """What the checkpoint took is counted against every other kernel's room, whatever NVML
    shows meanwhile: the restore needs it back."""
    _, card, kernels = node(processes[:6], short_contexts=3.5)
    other = kernels[0]
    reading = asyncio.run(card.read(CARD))
    before = books.shortfall(other, reading.free, kernels[1:], CARD)
    assert before > 0
    kernels[1].moving = books.EVEN
    kernels[1].checkpoint_bytes, kernels[1].checkpoint_need = CONTEXT, {CARD: CONTEXT}
    del card.held[kernels[1].pid]  # off the card: NVML shows it free
    reading = asyncio.run(card.read(CARD))
    assert books.shortfall(other, reading.free, kernels[1:], CARD) == before
    assert kernels[1].host_held == CONTEXT, "held by the driver in host memory meanwhile"


def test_a_prefetch_of_a_kernel_being_taken_through_the_driver_is_refused_with_why(processes):
    arbiter, _, kernels = even_node(processes)
    kernels[1].moving = books.EVEN
    conn = arbiter.conns[kernels[1].pid]
    asyncio.run(arbiter.rooms.prefetch(conn, 4))
    assert conn.told[0]["type"] == "deny"
    assert "taking this kernel's context off the GPU and back" in conn.told[0]["message"]
    assert arbiter.checkpoint.calls == []


class Waiting(Answering):
    """A kernel's connection that says when it was told to wait (``waiting``)."""

    def __init__(self, kernel):
        super().__init__(kernel)
        self.waiting = asyncio.Event()

    async def send(self, msg: dict) -> None:
        await super().send(msg)
        if msg["type"] == "wait":
            self.waiting.set()


def test_a_cell_waits_for_its_context_to_come_back_then_runs(processes):
    arbiter, _, kernels = even_node(processes)
    kernel = kernels[1]
    kernel.moving = books.EVEN
    conn = arbiter.conns[kernel.pid] = Waiting(kernel)

    async def cell():
        asked = asyncio.ensure_future(arbiter.rooms.room(conn, 9, "resume"))
        await asyncio.wait_for(conn.waiting.wait(), 10)
        waited = conn.told[0]
        kernel.moving = None
        await arbiter.notify()
        await asked
        return waited

    waited = asyncio.run(cell())
    assert waited["type"] == "wait"
    assert "bring this kernel's context back" in waited["message"]
    assert conn.told[-1] == {"type": "grant", "id": 9}


class Refusing:
    """The card model's driver, refusing a checkpoint (CUDA IPC, say; ``at`` ``suspend``),
    giving it up past its deadline (``deadline``), or refusing a restore (no room:
    ``restore``)."""

    Timeout = TimeoutError

    def __init__(self, checkpoint, at: str):
        self.inner, self.at, self.calls = checkpoint, at, []

    def suspend(self, pids, nbytes):
        self.calls.append("suspend")
        if self.at == "deadline":
            raise TimeoutError("cuCheckpointProcessCheckpoint given up after 31 s")
        if self.at == "suspend":
            raise CheckpointError("cuCheckpointProcessCheckpoint failed: CUDA_ERROR_NOT_SUPPORTED")
        return self.inner.suspend(pids, nbytes)

    def restore(self, pids, need=None):
        self.calls.append("restore")
        raise NoRoom("the GPU has 0.10 GiB free where the restore needs 1.18 GiB")


def first_alone_with(processes, at: str):
    """:func:`even_node` with only its first kernel's context left to take through the
    driver, the driver failing as ``at`` says (:class:`Refusing`), after one background
    step."""
    arbiter, card, kernels = even_node(processes)
    for k in kernels[1:5]:
        k.restored_context = True
    arbiter.checkpoint = Refusing(arbiter.checkpoint, at=at)
    evening(arbiter)
    return arbiter, card, kernels


def test_a_checkpoint_the_driver_refuses_leaves_the_kernel_as_it_was_and_is_not_tried_again_soon(processes):
    arbiter, card, kernels = first_alone_with(processes, at="suspend")
    [refused] = decided(arbiter, "even refused")
    assert "CUDA_ERROR_NOT_SUPPORTED" in refused["message"]
    grower = kernels[0]
    assert grower.state == books.PAUSED
    assert not grower.restored_context
    assert grower.checkpoint_bytes == 0
    assert card.held[grower.pid] == CONTEXT
    evening(arbiter)
    assert arbiter.checkpoint.calls == ["suspend"], "not asked again within the minute"


def test_a_restore_without_room_leaves_the_kernel_suspended_for_its_next_cell(processes):
    arbiter, card, kernels = first_alone_with(processes, at="restore")
    [waits] = decided(arbiter, "even: restore waits")
    assert "0.10 GiB free" in waits["message"]
    kernel = kernels[0]
    assert kernel.state == books.SUSPENDED
    assert kernel.tier == "suspended"
    assert kernel.group == [kernel.pid]
    assert kernel.checkpoint_need == {CARD: CONTEXT}, "what its restore needs back"
    assert kernel.moving is None
    assert kernel.pid not in card.held


def test_a_checkpoint_given_up_past_its_deadline_leaves_the_kernel_for_its_next_cells_restore(processes):
    """The driver may hold it locked or checkpointed: the books say suspended, so that its
    next cell's restore unlocks or restores it (one still running it leaves as it is)."""
    arbiter, _, kernels = first_alone_with(processes, at="deadline")
    [waits] = decided(arbiter, "even: restore waits")
    assert "given up" in waits["message"]
    assert kernels[0].state == books.SUSPENDED
    assert kernels[0].group == [kernels[0].pid]
    assert decided(arbiter, "even refused") == []
