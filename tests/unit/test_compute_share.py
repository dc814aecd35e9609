"""The compute-sharing model the sessions benchmark sets its latencies against."""

from __future__ import annotations

import math

import pytest

from jupyter_vgpu.testing.compute_share import (
    ONE_AT_A_TIME,
    expected,
    latencies_of,
    load_rates,
    of_cells,
    simulate,
    speed,
    summary,
)


def by_session(done):
    return {session: latency for session, _, latency in done}


def test_cells_apart_take_their_time_alone():
    assert by_session(simulate([0.0, 5.0, 2.0], 1.0)) == {0: 1.0, 1: 1.0, 2: 1.0}


def test_two_cells_sent_together_take_twice_as_long():
    assert by_session(simulate([3.0, 3.0], 1.0)) == pytest.approx({0: 2.0, 1: 2.0})


def test_a_cell_half_way_through_when_the_second_comes():
    # 0.5 s alone, then both at half speed: the first ends at 1.5 s, the second has done
    # 0.5 s of its work by then and ends alone at 2.0 s
    assert by_session(simulate([0.0, 0.5], 1.0)) == pytest.approx({0: 1.5, 1: 1.5})


def test_one_at_a_time_delays_only_the_second():
    assert by_session(simulate([0.0, 0.5], 1.0, discipline=ONE_AT_A_TIME)) == pytest.approx({0: 1.0, 1: 1.5})
    assert by_session(simulate([0.0, 0.0, 0.0], 1.0, discipline=ONE_AT_A_TIME)) == pytest.approx(
        {0: 1.0, 1: 2.0, 2: 3.0}
    )


def test_cells_past_the_most_at_once_wait_for_one_to_end():
    # two share from 0 and end at 2 s; the third waits, then runs alone
    assert by_session(simulate([0.0, 0.0, 0.0], 1.0, at_once=2)) == pytest.approx({0: 2.0, 1: 2.0, 2: 3.0})
    # the group ends when it would have shared the card whole: the tail is no longer
    assert max(by_session(simulate([0.0, 0.1, 0.2, 0.3], 1.0, at_once=2)).values()) <= max(
        by_session(simulate([0.0, 0.1, 0.2, 0.3], 1.0)).values()
    )
    assert by_session(simulate([0.0, 0.0, 0.0], 1.0, at_once=1)) == by_session(
        simulate([0.0, 0.0, 0.0], 1.0, discipline=ONE_AT_A_TIME)
    )
    assert by_session(simulate([0.0, 0.5], 1.0, at_once=5)) == by_session(simulate([0.0, 0.5], 1.0))


def test_cells_taking_turns_wait_for_the_running_one_up_to_the_limit():
    # the second waits for the first to end (2 s is enough), then runs alone
    assert by_session(simulate([0.0, 0.1], 1.0, turn_wait=2.0)) == pytest.approx({0: 1.0, 1: 1.9})
    # with 0.5 s it joins at 0.5 s, as the first has run 0.5 s (a long cell: its own wait
    # would end at 0.6 s): the first has 0.5 s of work left, at half speed, and ends at
    # 1.5 s; the second has 0.5 s left then, alone, and ends at 2.0 s
    assert by_session(simulate([0.0, 0.1], 1.0, turn_wait=0.5)) == pytest.approx({0: 1.5, 1: 1.9})
    # sent once the first has run its 0.5 s, it waits for nothing: the two share from 0.6 s
    assert by_session(simulate([0.0, 0.6], 1.0, turn_wait=0.5)) == by_session(simulate([0.0, 0.6], 1.0))
    # a long cell holds nobody up, a young one does: cells of 3 s; the second, sent at
    # 1.0 s, runs at once beside the first (long since 0.5 s); the third, sent at 1.2 s,
    # waits for the second to turn long (1.5 s), not its own 0.5 s. From 1.5 s the three
    # share in thirds: the first (1.75 s of work left) ends at 6.75 s, the second (1.0 s
    # left then) at 8.75 s, the third (0.25 s left, alone) at 9.0 s
    assert by_session(simulate([0.0, 1.0, 1.2], 3.0, turn_wait=0.5)) == pytest.approx(
        {0: 6.75, 1: 7.75, 2: 7.8}
    )
    # in the order sent: the third waits behind the second, not only for the first
    assert by_session(simulate([0.0, 0.1, 0.2], 1.0, turn_wait=5.0)) == pytest.approx(
        {0: 1.0, 1: 1.9, 2: 2.8}
    )
    # no line, or one without a limit, are the two disciplines
    starts = [0.0, 0.1, 0.2, 1.5, 1.6, 4.0]
    assert by_session(simulate(starts, 1.0, turn_wait=0.0)) == by_session(simulate(starts, 1.0))
    assert by_session(simulate(starts, 1.0, turn_wait=math.inf)) == pytest.approx(
        by_session(simulate(starts, 1.0, discipline=ONE_AT_A_TIME))
    )
    assert (
        of_cells([{"start": s, "session": i} for i, s in enumerate(starts)], 1, 1.0, turn_wait=2.0)[
            "p50_cell_s"
        ]
        < of_cells([{"start": s, "session": i} for i, s in enumerate(starts)], 1, 1.0)["p50_cell_s"]
    )


def test_three_cells_share_in_thirds():
    # all three from 0: each ends at 3 s
    assert sorted(by_session(simulate([0.0, 0.0, 0.0], 1.0)).values()) == pytest.approx([3.0, 3.0, 3.0])


def test_the_next_cell_comes_think_seconds_after_the_reply():
    done = simulate([0.0, 0.0], 1.0, think_s=10.0, cycles=2)
    starts = sorted(start for _, start, _ in done)
    assert starts == pytest.approx([0.0, 0.0, 12.0, 12.0])  # both replied at 2.0 s
    assert [lat for _, _, lat in done] == pytest.approx([2.0] * 4)


def test_cells_of_different_cards_do_not_meet():
    assert latencies_of([0.0, 0.0, 0.0], [0, 1, 0], 1.0) == pytest.approx([2.0, 1.0, 2.0])


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda: simulate([0.0], 0.0), "cell_s must be > 0"),
        (lambda: simulate([0.0], 1.0, think_s=-1.0), "think_s >= 0"),
        (lambda: simulate([0.0], 1.0, cycles=0), "cycles >= 1"),
        (lambda: simulate([0.0], 1.0, discipline="fifo"), "discipline must be one of"),
        (lambda: simulate([0.0], 1.0, at_once=0), "at_once must be >= 1"),
        (lambda: simulate([0.0], 1.0, turn_wait=-1.0), "turn_wait must be >= 0"),
        (lambda: simulate([0.0], 1.0, discipline=ONE_AT_A_TIME, turn_wait=1.0), "only with 'share'"),
        (lambda: latencies_of([0.0], [0, 1], 1.0), "1 starts for 2 cards"),
        (lambda: expected(0, 1.0, 10.0), "must be >= 1"),
        (lambda: summary([], 1.0), "no values"),
    ],
)
def test_bad_arguments_are_refused(call, says):
    with pytest.raises(ValueError, match=says):
        call()


def test_the_expectation_grows_with_sessions_and_a_queue_bounds_sharing():
    few = expected(4, 1.0, 180.0, draws=200)
    many = expected(32, 1.0, 180.0, draws=200)
    queue = expected(32, 1.0, 180.0, draws=200, discipline=ONE_AT_A_TIME)
    assert few["met_another"] < many["met_another"]
    assert few["p95_over_solo"] < many["p95_over_solo"]
    assert queue["p95_over_solo"] < many["p95_over_solo"]
    # the chance that one of 31 other cells of 1 s, each sent at a uniform time in a
    # 181 s cycle, was sent within 1 s of a given one: 1 - (1 - 2/181) ** 31 = 0.29
    assert many["met_another"] == pytest.approx(0.29, abs=0.04)
    lo, mid, hi = many["p95_over_solo_by_run"]
    assert lo <= mid <= hi
    assert few["runs_within_p95_goal"] > many["runs_within_p95_goal"]
    assert expected(32, 1.0, 180.0, draws=50, p95_goal=100.0)["runs_within_p95_goal"] == 1.0


def test_two_cards_halve_what_a_card_sees():
    one = expected(16, 1.0, 180.0, draws=200, seed=1)
    two = expected(32, 1.0, 180.0, gpus=2, draws=200, seed=1)
    assert two["met_another"] == pytest.approx(one["met_another"], abs=0.04)


def test_a_runs_cells_are_modelled_on_their_own_cards():
    cells = [{"start": 0.0, "session": 0}, {"start": 0.0, "session": 1}, {"start": 0.5, "session": 2}]
    one = of_cells(cells, 1, 1.0)
    two = of_cells(cells, 2, 1.0)  # sessions 0 and 2 on card 0, session 1 alone on card 1
    assert one["met_another"] == 1.0
    assert two["met_another"] == pytest.approx(2 / 3)
    assert two["p50_cell_s"] == pytest.approx(1.5)
    epoch = [{**c, "start": c["start"] + 1_795_701_571.261243} for c in cells]  # as time.time() gives
    assert of_cells(epoch, 2, 1.0)["met_another"] == pytest.approx(2 / 3)
    assert of_cells(epoch[:1], 1, 1.0)["met_another"] == 0
    with pytest.raises(ValueError, match="no cells"):
        of_cells([], 1, 1.0)


def test_measured_rates_slow_cells_that_meet_and_only_those():
    rates = {2: 0.45, 3: 0.3}
    # apart: alone, whatever the rates
    assert by_session(simulate([0.0, 5.0], 1.0, rates=rates)) == {0: 1.0, 1: 1.0}
    # together: 1/0.45 s each where even sharing gives 2 s
    assert by_session(simulate([0.0, 0.0], 1.0, rates=rates)) == pytest.approx({0: 1 / 0.45, 1: 1 / 0.45})
    # 0.5 s alone, then both at 0.45: the first's last 0.5 s take 0.5 / 0.45; the second
    # has done 0.5 of its work by then and ends its last 0.5 alone
    first = 0.5 + 0.5 / 0.45
    assert by_session(simulate([0.0, 0.5], 1.0, rates=rates)) == pytest.approx({0: first, 1: first})
    three = by_session(simulate([0.0, 0.0, 0.0], 1.0, rates=rates))
    assert three == pytest.approx({i: 1 / 0.3 for i in range(3)})


def test_rates_past_the_largest_keep_its_total():
    rates = {2: 0.45, 3: 0.3}
    assert speed(1, rates) == 1.0
    assert speed(2, rates) == 0.45
    assert speed(6, rates) == pytest.approx(0.9 / 6)
    assert speed(4) == 0.25  # no rates: even
    assert by_session(simulate([0.0] * 4, 1.0, rates=rates)) == pytest.approx({i: 4 / 0.9 for i in range(4)})


@pytest.mark.parametrize(
    ("rates", "says"),
    [
        ({}, "with none missing"),
        ({1: 1.0, 2: 0.5}, "with none missing"),
        ({2: 0.45, 4: 0.2}, "with none missing"),
        ({2: 0.0}, "in \\(0, 1\\]"),
        ({2: 1.2}, "in \\(0, 1\\]"),
    ],
)
def test_bad_rates_are_refused(rates, says):
    with pytest.raises(ValueError, match=says):
        simulate([0.0], 1.0, rates=rates)


def test_a_runs_cells_with_rates_are_slower_where_they_met():
    cells = [{"start": 0.0, "session": 0}, {"start": 0.0, "session": 1}, {"start": 9.0, "session": 2}]
    even = of_cells(cells, 1, 1.0)
    sliced = of_cells(cells, 1, 1.0, rates={2: 0.4})
    # latencies 2.5, 2.5 and 1.0 s against 2, 2 and 1: the p95 lies between the two met
    assert (even["p95_cell_s"], sliced["p95_cell_s"]) == pytest.approx((2.0, 2.5))
    assert sliced["met_another"] == even["met_another"] == pytest.approx(2 / 3)


def test_rates_load_from_a_time_slicing_output_and_bad_ones_are_refused(tmp_path):
    good = tmp_path / "slicing.json"
    good.write_text('{"rates": {"2": 0.46, "3": 0.305}, "solo_p50_step_s": 0.15}')
    assert load_rates(good) == {2: 0.46, 3: 0.305}
    bad = [
        ("{}", "no time-slicing rates"),
        ("[1]", "no time-slicing rates"),
        ("{", "no time-slicing rates"),
        ('{"rates": {"3": 0.3}}', "with none missing"),
    ]
    for text, says in bad:
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=says):
            load_rates(tmp_path / "bad.json")


def test_the_expectation_with_time_slicings_cost_has_the_longer_tail():
    even = expected(8, 1.0, 10.0, draws=100)
    sliced = expected(8, 1.0, 10.0, draws=100, rates={2: 0.45, 3: 0.3})
    assert sliced["p95_over_solo"] > even["p95_over_solo"]
    assert sliced["p50_over_solo"] >= even["p50_over_solo"]


def test_turns_over_random_phases_lie_between_sharing_and_a_queue():
    share = expected(48, 1.0, 180.0, draws=200)
    turns = expected(48, 1.0, 180.0, draws=200, turn_wait=2.0)
    queue = expected(48, 1.0, 180.0, draws=200, discipline=ONE_AT_A_TIME)
    endless = expected(48, 1.0, 180.0, draws=200, turn_wait=math.inf)
    assert queue["p95_over_solo"] <= turns["p95_over_solo"] < share["p95_over_solo"]
    assert endless["p95_over_solo"] == pytest.approx(queue["p95_over_solo"])  # the same draws, one seed
    assert turns["p50_over_solo_by_run"][2] <= share["p50_over_solo_by_run"][2]
