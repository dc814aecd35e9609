"""What a look at a card says about a move: :func:`jupyter_vgpu.node.cards.let_go`."""

from jupyter_vgpu.node.cards import Reading, let_go

GiB = 1 << 30
CONTEXT = 700 * 2**20  # what a paused kernel keeps on the card


def test_a_pause_is_seen_by_the_kernels_own_bytes_while_another_kernel_grows():
    before = Reading(80 * GiB, 40 * GiB, {11: 3 * GiB, 12: 10 * GiB})
    # the kernel let 2.3 GiB go while a running cell took 4 GiB: the card holds more than before
    after = Reading(80 * GiB, 41 * GiB + CONTEXT, {11: CONTEXT, 12: 14 * GiB})
    assert after.used > before.used
    assert let_go(before, after, [11])
    # not yet let go: the card's total fell (the other kernel freed), its own bytes did not
    early = Reading(80 * GiB, 36 * GiB, {11: 3 * GiB, 12: 6 * GiB})
    assert not let_go(before, early, [11])


def test_a_suspend_is_seen_once_its_whole_group_left_the_card():
    before = Reading(80 * GiB, 20 * GiB, {21: CONTEXT, 22: GiB, 30: 5 * GiB})
    assert let_go(before, Reading(80 * GiB, 22 * GiB, {30: 7 * GiB}), [22, 21])
    assert let_go(before, Reading(80 * GiB, 21 * GiB, {21: CONTEXT, 30: 7 * GiB}), [22, 21])
    assert not let_go(before, Reading(80 * GiB, 20 * GiB, {21: CONTEXT, 22: GiB, 30: 5 * GiB}), [22, 21])


def test_without_figures_per_process_the_cards_memory_in_use_decides():
    # NVML lists no process (a container that hides them, a MIG slice): the card's total
    before = Reading(80 * GiB, 20 * GiB, {})
    assert let_go(before, Reading(80 * GiB, 18 * GiB, {}), [11])
    assert not let_go(before, Reading(80 * GiB, 20 * GiB, {}), [11])
