"""The arbiter's books: what a kernel needs freed before it runs."""

from jupyter_vgpu.node import books
from jupyter_vgpu.slice import Card, Slice

GiB = 1 << 30


def kernel(pid: int, budget: int, total: int = 80 * GiB, **fields) -> books.Kernel:
    s = Slice("GPU-0", 0, "test card", total, budget, 100)
    return books.Kernel(pid, books.Server(pid, f"user{pid}", "", s), **fields)


def test_a_budget_the_card_cannot_give_is_capped_at_what_it_could():
    # 80 GiB card, 0.5 GiB held by the driver and a process not ours: 79.5 GiB free
    whole_card = kernel(1, budget=80 * GiB)
    assert books.ceiling(whole_card, 79 * GiB + GiB // 2, []) == 79 * GiB + GiB // 2
    assert books.shortfall(whole_card, 79 * GiB + GiB // 2, []) == 0
    # the same kernel beside an idle one holding 20 GiB: that one must go first
    idle = kernel(2, budget=40 * GiB, resident=20 * GiB)
    assert books.shortfall(whole_card, 59 * GiB + GiB // 2, [idle]) == 20 * GiB


def test_a_running_kernel_keeps_the_growth_it_was_granted():
    running = kernel(2, budget=40 * GiB, resident=10 * GiB, state=books.ACTIVE, granted=40 * GiB)
    asking = kernel(1, budget=30 * GiB)
    # 70 GiB free: 30 promised to the running kernel, 30 wanted, 10 to spare
    assert books.shortfall(asking, 70 * GiB, [running]) == 0
    assert books.shortfall(asking, 50 * GiB, [running]) == 10 * GiB


def test_victims_suspend_long_paused_kernels_first_and_never_when_suspending_is_off():
    now = 1000.0
    context = 700 * 2**20  # what a paused kernel keeps on the card
    long_paused = kernel(2, budget=8 * GiB, resident=context, state=books.PAUSED, since=now - 600)
    just_paused = kernel(3, budget=8 * GiB, resident=context, state=books.PAUSED, since=now - 5)
    never_on_card = kernel(7, budget=8 * GiB, state=books.PAUSED, since=now - 900)  # no CUDA context
    idle_long = kernel(4, budget=8 * GiB, resident=GiB, since=now - 300)
    idle_short = kernel(5, budget=8 * GiB, resident=GiB, since=now - 10)
    running = kernel(6, budget=8 * GiB, resident=GiB, state=books.ACTIVE)
    asking = kernel(1, budget=8 * GiB)
    card = [asking, running, idle_short, just_paused, idle_long, long_paused, never_on_card]
    order = [(k.pid, action) for k, action in books.victims(card, asking, suspend_after=60, now=now)]
    assert order == [(2, "suspend"), (4, "pause"), (5, "pause"), (3, "suspend")], "7 holds nothing to free"
    # ArbiterApp.suspend_after = 0: never suspend; the idle kernels are paused, the paused stay so
    order = [(k.pid, action) for k, action in books.victims(card, asking, suspend_after=0, now=now)]
    assert order == [(4, "pause"), (5, "pause")]


def test_suspends_for_one_room_are_made_together_until_their_contexts_cover_it():
    now = 1000.0
    context = 700 * 2**20
    paused = [kernel(10 + i, 8 * GiB, resident=context, state=books.PAUSED, since=now - 9) for i in range(12)]
    idle = kernel(4, 8 * GiB, resident=GiB, since=now - 300)
    order = [(k, "suspend") for k in paused[:3]] + [(idle, "pause")] + [(k, "suspend") for k in paused[3:]]
    # 2 GiB short: three contexts of 700 MiB cover it; the pause behind them is not reached
    assert books.suspends_together(order, 2 * GiB) == paused[:3]
    assert books.suspends_together(order, GiB) == paused[:2]
    # the head a pause: none together (the pause goes alone, then the card is read again)
    assert books.suspends_together(order[3:], 2 * GiB) == []
    # many short: at most one checkpoint worker's worth each
    many = [(k, "suspend") for k in paused]
    assert len(books.suspends_together(many, 100 * GiB)) == books.SUSPENDS_AT_ONCE


def test_a_prefetch_fits_in_free_memory_beside_the_promises_or_waits_for_the_cell():
    paused = kernel(7, 40 * GiB, state=books.PAUSED, paused_bytes=10 * GiB)
    # running, it may grow by 10 GiB more: promised
    running = kernel(8, 40 * GiB, state=books.ACTIVE, resident=20 * GiB, granted=30 * GiB)
    free = 40 * GiB
    assert books.prefetch_short(paused, free, [running]) == 0
    # the running kernel's promise leaves 30 GiB; 35 GiB paused do not fit
    paused.paused_bytes = 35 * GiB
    assert books.prefetch_short(paused, free, [running]) == 5 * GiB
    # an idle kernel's bytes are no promise: what it holds is counted in use already
    idle = kernel(10, 40 * GiB, resident=20 * GiB)
    assert books.prefetch_short(paused, free, [idle]) == 0
    # a suspended kernel needs what the driver's checkpoint took, too
    suspended = kernel(9, 40 * GiB, state=books.SUSPENDED, checkpoint_bytes=41 * GiB)
    assert books.prefetch_short(suspended, free, []) == GiB


def test_a_prefetch_pauses_idle_kernels_past_their_idle_seconds_for_its_bytes_and_the_promises():
    # 80 GiB card, watermark 0.9 (72 GiB). A running cell holds 4 GiB and was promised 20;
    # four kernels idle past their 5 s hold 10 GiB each; one idle 2 s holds 10 GiB more
    now, total, watermark = 1000.0, 80 * GiB, 0.9
    running = kernel(1, 20 * GiB, state=books.ACTIVE, resident=4 * GiB, granted=20 * GiB)
    idle = [kernel(10 + i, 20 * GiB, resident=10 * GiB, since=now - 60 + i) for i in range(4)]
    recent = kernel(20, 20 * GiB, resident=10 * GiB, since=now - 2)
    for k in (*idle, recent):
        k.server.slice = k.server.slice.replace(idle_seconds=5)
    back = kernel(7, 20 * GiB, state=books.PAUSED, paused_bytes=3 * GiB)
    others = [running, *idle, recent]
    used = 62 * GiB  # 8 GiB of it the driver's and the kernels' contexts
    free = total - used
    # 62 GiB in use and 3 coming back are under the mark: the background look owes nothing,
    # yet beside the running cell's 16 GiB still to come, 18 GiB free are 1 short of room
    assert books.ahead_of_time(others, used + 3 * GiB, total, watermark, now) == []
    assert books.prefetch_short(back, free, others) == GiB
    # counted with the promises (81 GiB), the longest idle kernel goes, and the 3 fit
    owed = books.prefetch_owed(back, used, total, others, watermark, now)
    assert [(k.pid, action) for k, action in owed] == [(10, "pause")]
    assert books.prefetch_short(back, free + 10 * GiB, others[2:]) == 0
    # more to bring back: longest idle first, and never the kernel within its idle_seconds
    back.paused_bytes = 30 * GiB
    owed = books.prefetch_owed(back, used, total, others, watermark, now)
    assert [k.pid for k, _ in owed] == [10, 11, 12, 13]


def test_a_kernel_of_several_cards_is_counted_on_each_card_by_what_it_holds_there():
    pair_slice = Slice(
        "GPU-0", 0, "test card", 80 * GiB, 30 * GiB, 100, more_gpus=(Card("GPU-1", 1, 80 * GiB),)
    )
    pair = books.Kernel(9, books.Server(9, "pair", "", pair_slice), resident=26 * GiB)
    pair.on_cards = {"GPU-0": 24 * GiB, "GPU-1": 2 * GiB}
    assert books.held(pair, "GPU-0") == 24 * GiB
    assert books.held(pair, "GPU-1") == 2 * GiB
    assert books.held(pair, None) == 26 * GiB  # all its cards: what a suspend takes to host memory
    # on GPU-1 it holds 2 GiB of its 30 and needs 28 more: 20 are free, an idle kernel holds 10
    idle = kernel(2, budget=40 * GiB, resident=10 * GiB)
    assert books.shortfall(pair, 20 * GiB, [idle], "GPU-1") == 8 * GiB
    # on GPU-0 it holds 24: 6 more, and 20 are free
    assert books.shortfall(pair, 20 * GiB, [idle], "GPU-0") == 0
    # counted by its whole 26 GiB, it would have seemed to need only 4 more on GPU-1
    assert books.shortfall(pair, 20 * GiB, [idle]) == 0
    # as another's neighbour on GPU-1, it holds 2 GiB there, not 26
    asking = kernel(1, budget=40 * GiB)
    assert books.ceiling(asking, 30 * GiB, [pair], "GPU-1") == 32 * GiB


def test_a_prefetch_of_a_kernel_of_several_cards_is_judged_on_each_card():
    pair_slice = Slice(
        "GPU-0", 0, "test card", 80 * GiB, 30 * GiB, 100, more_gpus=(Card("GPU-1", 1, 80 * GiB),)
    )
    pair = books.Kernel(9, books.Server(9, "pair", "", pair_slice), state=books.PAUSED, paused_bytes=24 * GiB)
    pair.peak_on_cards = {"GPU-0": 18 * GiB, "GPU-1": 6 * GiB}  # before its pause: three quarters on GPU-0
    assert books.paused_on(pair, "GPU-0") == 18 * GiB
    assert books.paused_on(pair, "GPU-1") == 6 * GiB
    assert books.paused_on(pair) == 24 * GiB
    # 10 GiB free on each card: GPU-1 takes its 6 GiB back, GPU-0 is 8 GiB short of its 18
    assert books.prefetch_short(pair, 10 * GiB, [], card="GPU-1") == 0
    assert books.prefetch_short(pair, 10 * GiB, [], card="GPU-0") == 8 * GiB
    # counted whole on each card, it would have seemed 14 GiB short on both
    assert books.prefetch_short(pair, 10 * GiB, []) == 14 * GiB
    # suspended: what the driver's checkpoint took off each card, on that card
    pair.checkpoint_need = {"GPU-0": GiB, "GPU-1": 5 * GiB}
    assert books.prefetch_short(pair, 10 * GiB, [], card="GPU-1") == GiB
    # nothing known of how it held its memory: all of it counts on its first card
    pair.peak_on_cards, pair.checkpoint_need = {}, {}
    assert books.paused_on(pair, "GPU-0") == 24 * GiB
    assert books.paused_on(pair, "GPU-1") == 0


def test_background_pauses_count_a_kernel_of_several_cards_by_what_it_frees_on_the_card():
    pair_slice = Slice(
        "GPU-0", 0, "test card", 80 * GiB, 30 * GiB, 100, more_gpus=(Card("GPU-1", 1, 80 * GiB),),
        idle_seconds=1,
    )  # fmt: skip
    pair = books.Kernel(9, books.Server(9, "pair", "", pair_slice), resident=26 * GiB, since=0.0)
    pair.on_cards = {"GPU-0": 24 * GiB, "GPU-1": 2 * GiB}
    other = kernel(2, budget=40 * GiB, resident=10 * GiB, since=1.0)
    other.server.slice = other.server.slice.replace(gpu_uuid="GPU-1", idle_seconds=1)
    # GPU-1 holds 70 of 80 GiB, watermark 0.6 (48 GiB): the pair frees 2 GiB there, not 26
    todo = books.ahead_of_time([pair, other], 70 * GiB, 80 * GiB, 0.6, now=100.0, card="GPU-1")
    assert [(k.pid, action) for k, action in todo] == [(9, "pause"), (2, "pause")]


def test_a_prefetch_makes_its_cells_room_from_kernels_past_their_idle_seconds_and_paused_ones():
    now = 1000.0
    context = 700 * 2**20
    asking = kernel(1, budget=20 * GiB, state=books.PAUSED, paused_bytes=2 * GiB, resident=context)
    paused = [kernel(10 + i, 8 * GiB, resident=context, state=books.PAUSED, since=now - 9) for i in range(12)]
    just_ran = kernel(4, 30 * GiB, resident=20 * GiB, since=now - 1)  # within its slice's idle_seconds
    running = kernel(6, 40 * GiB, resident=10 * GiB, state=books.ACTIVE, granted=40 * GiB)
    others = [just_ran, running, *paused]
    free = 80 * GiB - (context + 20 * GiB + 10 * GiB + 12 * context)
    # the cell's room: its budget less its context, beside the 30 GiB promised to the
    # running cell: twelve contexts short
    short, ahead = books.room_ahead(asking, free, others, suspend_after=3600, now=now)
    assert short == books.shortfall(asking, free, others) == 12 * context
    # the paused kernels' contexts, as many as cover it; never the one that ran a moment ago
    assert [(k.pid, action) for k, action in ahead] == [(10 + i, "suspend") for i in range(12)]
    _, ahead = books.room_ahead(asking, free + 5 * context, others, suspend_after=3600, now=now)
    assert len(ahead) == 7
    # idle past its idle_seconds (the slice's 300 s by default): its pause comes first, and covers it
    just_ran.since = now - 400
    _, ahead = books.room_ahead(asking, free, others, suspend_after=3600, now=now)
    assert ahead == [(just_ran, "pause")]
    # room enough: nobody
    assert books.room_ahead(asking, free + short, others, suspend_after=3600, now=now) == (0, [])


def test_the_room_a_prefetch_holds_counts_for_another_prefetchs_room_ahead_not_for_a_cell():
    now = 1000.0
    context = 700 * 2**20
    # brought back by its prefetch a moment ago, its cell not started: 20 GiB held for it
    back = kernel(
        2, budget=20 * GiB, resident=2 * GiB, since=now - 1, room_held=20 * GiB, room_held_until=now + 4
    )
    asking = kernel(1, budget=10 * GiB, state=books.PAUSED, paused_bytes=GiB, resident=context)
    paused = [kernel(10 + i, 8 * GiB, resident=context, state=books.PAUSED, since=now - 9) for i in range(30)]
    others = [back, *paused]
    free = 20 * GiB  # the room made ahead of back's cell, and 2 GiB more
    assert back.holding(now) == 20 * GiB
    # a cell's own room takes what is free (its user pressed run)...
    assert books.shortfall(asking, free, others) == 0
    # ...another prefetch's room ahead counts back's 18 GiB still to come
    short, ahead = books.room_ahead(asking, free, others, suspend_after=3600, now=now)
    assert short == 10 * GiB - context - (free - 18 * GiB)
    assert ahead
    assert all(action == "suspend" and k in paused for k, action in ahead)
    # the hold ends with its time: nothing left to make
    back.room_held_until = now - 1
    assert books.room_ahead(asking, free, others, suspend_after=3600, now=now) == (0, [])
    # while it comes back (active, granted what it brings back) the hold counts too
    back.state, back.granted, back.room_held_until = books.ACTIVE, 2 * GiB, 0.0
    assert back.holding(now) == 20 * GiB
    assert books.promised(others, holds=True, now=now) == 18 * GiB
    assert books.promised(others) == 0


def test_a_kernel_whose_prefetch_holds_room_is_the_last_idle_one_taken_off():
    now = 1000.0
    back = kernel(
        2, budget=20 * GiB, resident=2 * GiB, since=now - 400, room_held=20 * GiB, room_held_until=now + 4
    )
    idle = kernel(3, budget=8 * GiB, resident=GiB, since=now - 5)
    paused = kernel(4, budget=8 * GiB, resident=GiB, state=books.PAUSED, since=now - 9)
    asking = kernel(1, budget=10 * GiB)
    order = books.victims([back, idle, paused], asking, suspend_after=3600, now=now)
    assert [(k.pid, action) for k, action in order] == [(3, "pause"), (4, "suspend"), (2, "pause")]
    back.room_held_until = now - 1  # its hold over: the longest idle goes first again
    order = books.victims([back, idle, paused], asking, suspend_after=3600, now=now)
    assert [(k.pid, action) for k, action in order] == [(2, "pause"), (3, "pause"), (4, "suspend")]


def test_a_hold_is_timed_once_its_kernel_is_back_carried_into_a_cell_that_begins_within_it_and_else_ended():
    now = 1000.0  # monotonic seconds
    k = kernel(2, budget=20 * GiB, resident=2 * GiB, since=now)
    k.hold_room(18 * GiB)
    k.state = books.IDLE  # back from its prefetch
    k.hold_after(books.ACTIVE, 18 * GiB, 5.0)
    assert (k.room_held_until, k.holding(now + 4.9), k.holding(now + 5.1)) == (now + 5.0, 18 * GiB, 0)
    held = k.holding(now + 1)
    k.state = books.ACTIVE  # its cell began within the hold
    k.hold_after(books.IDLE, held, 5.0)
    assert (k.granted, k.room_held) == (18 * GiB, 0)
    k.hold_room(18 * GiB)
    k.state, k.granted = books.PAUSED, 0  # taken off the card: the hold goes with it
    k.hold_after(books.ACTIVE, 18 * GiB, 5.0)
    assert (k.granted, k.room_held, k.holding()) == (0, 0, 0)
