"""What sharing a card's compute alone costs the cells of several sessions.

Cells of different kernels that run on one card at the same time share its compute: the
driver time-slices between their CUDA contexts, so while ``k`` cells run each advances
at ``1/k`` of its speed alone (processor sharing). On the H100 two MLP cells of 1.05 s
that met took 1.9-2.0 s each (``benchmarks/results/sessions-h100.json``, the runs at 32
sessions). No memory policy changes this: with nothing paused, resumed or waited for,
these latencies remain. The sharing is even between contexts of one kind, not between a
context the driver restored after a suspend and one that never left the card: steps of
the restored one took 0.201 s at the median beside the other's 0.661 s, 0.147 s alone
(``steps_by_pair`` of ``benchmarks/results/cell-tails-h100.json``, eleven runs of 48 MLP
sessions; docs/design.md, the eleventh try); the model keeps even sharing, so that
unevenness counts as the memory path's. ``benchmarks/sessions.py`` sets every run's
measured latencies beside the latencies this model gives the same cells at the same send
times, so that what the memory path costs is read as the difference;
``benchmarks/compute_share.py`` gives the model's expectation for sessions at random
phases (the sessions benchmark's duty cycle), the floor the benchmark's latency goals
meet.

The model takes a cell as ``cell_s`` seconds of work on an empty card, all of it shared
(the few milliseconds a cell spends in messages count as shared work too), and cells of
different cards as independent.

``discipline="one at a time"`` runs a card's cells one after the other in the order they
were sent instead: not what the card does, but the lower bound of the tail for cells of
one length, since sharing can only delay the first of two cells that meet and a queue
delays only the second.

Even sharing leaves out what time-slicing itself costs: the driver's switches between
contexts are time in which no context advances. Two, three and four processes running
the MLP sessions' steps on an H200 each advanced at 0.460, 0.305 and 0.229 of their speed
alone, the card's total 0.92 each time (``benchmarks/time_slicing.py``,
``benchmarks/results/time-slicing-h200.json``); two fp32 workers, at 0.448 each
(``restore-fairness-h200.json``, ``neither restored``). ``rates`` gives the model those
speeds, so that the difference between a run and the model is the memory path's alone;
without them the model shares evenly, and the switches count as the memory path's.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path

from jupyter_vgpu.testing.percentiles import percentile

SHARE = "share"
ONE_AT_A_TIME = "one at a time"
DISCIPLINES = (SHARE, ONE_AT_A_TIME)


def simulate(
    first_starts: Sequence[float],
    cell_s: float,
    *,
    think_s: float = 0.0,
    cycles: int = 1,
    discipline: str = SHARE,
    at_once: int | None = None,
    rates: Mapping[int, float] | None = None,
    turn_wait: float | None = None,
) -> list[tuple[int, float, float]]:
    """Cells of sessions on one card, each ``cell_s`` seconds of work alone.

    Args:
        first_starts: when each session sends its first cell (seconds, any origin); one
            entry per session.
        cell_s: a cell's seconds on an empty card (> 0).
        think_s: seconds a session waits after a cell's reply before it sends the next
            (>= 0), as in the sessions benchmark's duty cycle.
        cycles: cells per session (>= 1).
        discipline: ``"share"`` (cells that meet advance at ``1/k`` of their speed each)
            or ``"one at a time"`` (in the order they were sent).
        at_once: with ``"share"``, the most cells that run together (the first sent);
            a later one waits for one of them to end (a card whose memory holds that
            many running cells, the rest waiting rather than taking room by suspends).
            None: no limit. ``"one at a time"`` is ``at_once`` 1.
        rates: with ``"share"``, each cell's speed (its work seconds per second, 1.0 being
            alone on the card) while ``k`` cells share it, by ``k`` (2, 3, ...: each
            number up to the largest given); past the largest the card's total stays
            that of the largest (``k * rate`` held). None: ``1/k`` (even sharing, no
            cost of its own). See :func:`speed`; :func:`check_rates` says what is refused.
        turn_wait: with ``"share"``, cells take turns (``ArbiterApp.turn_wait``): a cell
            sent while others wait, or while a cell runs that began less than
            ``turn_wait`` seconds before, waits in line, in the order sent, until it is
            first and no cell that began less than ``turn_wait`` before runs (then it
            runs alone, or beside long cells), or for ``turn_wait`` seconds (then it
            shares the card with those running). A cell that has run ``turn_wait``
            seconds is long: nobody waits for it (:mod:`jupyter_vgpu.node.turns`). None:
            no line, as 0 is. A line with no limit (``math.inf``) is ``"one at a time"``.

    Returns:
        ``(session, start, latency)`` for every cell, in the order they ended; seconds.

    Raises:
        ValueError: ``cell_s`` <= 0, ``think_s`` < 0, ``cycles`` < 1, an unknown
            ``discipline``, or ``rates`` that :func:`check_rates` refuses.
    """
    if not cell_s > 0 or think_s < 0 or cycles < 1:
        raise ValueError(f"cell_s must be > 0, think_s >= 0, cycles >= 1: {cell_s}, {think_s}, {cycles}")
    if at_once is not None and at_once < 1:
        raise ValueError(f"at_once must be >= 1 or None: {at_once}")
    if discipline not in DISCIPLINES:
        raise ValueError(f"discipline must be one of {DISCIPLINES}, not {discipline!r}")
    if turn_wait is not None and not (turn_wait >= 0 and discipline == SHARE):
        raise ValueError(f"turn_wait must be >= 0 or None, and only with {SHARE!r}: {turn_wait}")
    check_rates(rates)  # before any cell
    pending = [(float(start), session, 0) for session, start in enumerate(first_starts)]
    heapq.heapify(pending)
    running: dict[tuple[int, int], float] = {}  # (session, cycle) -> seconds of work left; in send order
    started: dict[tuple[int, int], float] = {}
    began: dict[tuple[int, int], float] = {}  # when each running cell began to run
    line: list[tuple[int, int]] = []  # with turn_wait: cells waiting their turn, in send order
    done: list[tuple[int, float, float]] = []
    now = 0.0

    def run(key: tuple[int, int]) -> None:
        running[key], began[key] = cell_s, now

    def young() -> list[float]:
        """When each running cell that began less than ``turn_wait`` ago turns long."""
        if not turn_wait:
            return []
        return [began[key] + turn_wait for key in running if began[key] + turn_wait > now]

    while pending or running or line:
        if line and not young():  # nothing runs but long cells: the first in line runs
            run(line.pop(0))
            continue
        active = list(running)[:at_once]  # those that share the card ("share"), in send order
        if running:
            if discipline == SHARE:
                nxt = min(active, key=running.__getitem__)
                finish = now + running[nxt] / speed(len(active), rates)
            else:
                nxt = next(iter(running))
                finish = now + running[nxt]
        else:
            nxt, finish = None, math.inf
        arrival = pending[0][0] if pending else math.inf
        # the first in line (sent first) joins those running once its wait is over, or
        # once the last young cell running turns long
        turn = min(started[line[0]] + turn_wait, max(young())) if line else math.inf
        elapsed = min(arrival, finish, turn) - now
        if running and elapsed > 0:
            if discipline == SHARE:
                step = elapsed * speed(len(active), rates)
                for key in active:
                    running[key] -= step
            else:
                running[nxt] -= elapsed
        now = min(arrival, finish, turn)
        if turn <= min(arrival, finish):
            run(line.pop(0))
            continue
        if arrival <= finish:
            start, session, cycle = heapq.heappop(pending)
            started[(session, cycle)] = start
            if line or young():
                line.append((session, cycle))
            else:
                run((session, cycle))
            continue
        del running[nxt]  # ended: its work is exactly done, whatever rounding left
        session, cycle = nxt
        done.append((session, started[nxt], now - started[nxt]))
        if cycle + 1 < cycles:
            heapq.heappush(pending, (now + think_s, session, cycle + 1))
    return done


def check_rates(rates: Mapping[int, float] | None) -> None:
    """Refuse :func:`simulate`'s ``rates`` unless given for 2, 3, ... up to their largest,
    each a speed in (0, 1]; None (even sharing) passes.

    Raises:
        ValueError: ``rates`` empty, keyed below 2, missing a number between 2 and its
            largest, or holding a speed outside (0, 1].
    """
    if rates is None:
        return
    if not rates or min(rates) < 2 or sorted(rates) != list(range(2, max(rates) + 1)):
        raise ValueError(f"rates must be given for 2, 3, ... with none missing: {sorted(rates or ())}")
    if not all(0 < r <= 1 for r in rates.values()):
        raise ValueError(f"rates must lie in (0, 1]: {dict(rates)}")


def speed(k: int, rates: Mapping[int, float] | None = None) -> float:
    """Each cell's speed while ``k`` (>= 1) cells share a card (1.0: alone), by
    :func:`simulate`'s ``rates`` (as :func:`check_rates` accepts them, unchecked here):
    ``rates[k]`` where given, ``1/k`` where ``rates`` is None, and past the largest ``k``
    given, that one's total speed split ``k`` ways."""
    if rates is None:
        return 1.0 / k
    if k == 1:
        return 1.0
    if k in rates:
        return rates[k]
    top = max(rates)
    return top * rates[top] / k


def load_rates(path: str | Path) -> dict[int, float]:
    """:func:`simulate`'s ``rates`` from a ``benchmarks/time_slicing.py`` output (its
    ``rates``: each context's speed by how many share the card, keyed by that number as
    a string in JSON).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not JSON, has no ``rates``, or :func:`check_rates` refuses them.
    """
    try:
        measured = json.loads(Path(path).read_text())["rates"]
        rates = {int(k): float(v) for k, v in measured.items()}
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: no time-slicing rates ({e!r})") from e
    check_rates(rates)
    return rates


def latencies_of(
    starts: Sequence[float],
    cards: Sequence[int],
    cell_s: float,
    discipline: str = SHARE,
    rates: Mapping[int, float] | None = None,
    turn_wait: float | None = None,
) -> list[float]:
    """The model's latency of cells sent at ``starts`` (seconds), cell ``i`` on card
    ``cards[i]``, in the order of ``starts``; ``rates`` and ``turn_wait`` as
    :func:`simulate`'s. Raises ValueError as :func:`simulate`, and if the two sequences
    differ in length."""
    if len(starts) != len(cards):
        raise ValueError(f"{len(starts)} starts for {len(cards)} cards")
    origin = min(starts, default=0.0)  # epoch seconds would cost the sums their last digits
    starts = [start - origin for start in starts]
    out = [0.0] * len(starts)
    for card in set(cards):
        index = [i for i, c in enumerate(cards) if c == card]
        cells = simulate(
            [starts[i] for i in index], cell_s, discipline=discipline, rates=rates, turn_wait=turn_wait
        )
        for j, _, latency in cells:
            out[index[j]] = latency
    return out


def summary(latencies: Sequence[float], solo_s: float) -> dict:
    """``{"p50_cell_s", "p95_cell_s", "p99_cell_s"}`` (seconds) and the same over
    ``solo_s`` (``"p50_over_solo"``: 1.0 is the cell alone). Percentiles by
    :func:`jupyter_vgpu.testing.percentiles.percentile` (linear interpolation). Raises
    ValueError on no latencies."""
    p50, p95, p99 = (percentile(latencies, q) for q in (50, 95, 99))
    return {
        "p50_cell_s": p50,
        "p95_cell_s": p95,
        "p99_cell_s": p99,
        "p50_over_solo": p50 / solo_s,
        "p95_over_solo": p95 / solo_s,
        "p99_over_solo": p99 / solo_s,
    }


def of_cells(
    cells: Sequence[dict],
    gpus: int,
    solo_s: float,
    rates: Mapping[int, float] | None = None,
    turn_wait: float | None = None,
) -> dict:
    """The model's latencies for the cells of a sessions run: each a dict with ``"start"``
    (its send time, seconds) and ``"session"`` (session ``i`` is on card ``i % gpus``),
    each ``solo_s`` seconds alone; ``rates`` and ``turn_wait`` as :func:`simulate`'s. Returns
    :func:`summary` of them plus ``"met_another"``, the fraction of cells that shared the
    card for any part of their time. Raises ValueError on no cells, and as
    :func:`simulate`."""
    if not cells:
        raise ValueError("no cells")
    latencies = latencies_of(
        [c["start"] for c in cells],
        [c["session"] % gpus for c in cells],
        solo_s,
        rates=rates,
        turn_wait=turn_wait,
    )
    return {**summary(latencies, solo_s), "met_another": _met(latencies, solo_s)}


def _met(latencies: Sequence[float], cell_s: float) -> float:
    """The fraction of ``latencies`` longer than ``cell_s`` by more than rounding (1 us)."""
    return sum(lat > cell_s + 1e-6 for lat in latencies) / len(latencies)


def expected(
    sessions: int,
    cell_s: float,
    think_s: float,
    *,
    cycles: int = 1,
    gpus: int = 1,
    draws: int = 400,
    seed: int = 0,
    discipline: str = SHARE,
    p95_goal: float = 1.5,
    rates: Mapping[int, float] | None = None,
    turn_wait: float | None = None,
) -> dict:
    """The model's latencies for the sessions benchmark's duty cycle, over ``draws``
    random draws of its phases: session ``i`` on card ``i % gpus`` sends its first cell
    at a uniform time in ``[0, think_s + cell_s)``, then one ``think_s`` seconds after
    each reply, ``cycles`` cells in all; ``rates`` and ``turn_wait`` as :func:`simulate`'s.

    Returns:
        :func:`summary` of every cell of every draw (the distribution of one cell), plus
        ``"p50_over_solo_by_run"`` and ``"p95_over_solo_by_run"``: the 10th, 50th and 90th
        percentiles over draws of one run's own p50 and p95 (a run of 32 cells is a small
        sample); ``"runs_within_p95_goal"``: the fraction of draws whose own p95 is at
        most ``p95_goal`` times ``cell_s`` (1.5: the sessions issue's +50%); and
        ``"met_another"``: the fraction of cells that shared the card for any part of
        their time (or, one at a time, waited).

    Raises:
        ValueError: ``sessions``, ``gpus`` or ``draws`` < 1, and as :func:`simulate`.
    """
    if sessions < 1 or gpus < 1 or draws < 1:
        raise ValueError(f"sessions, gpus and draws must be >= 1: {sessions}, {gpus}, {draws}")
    rng = random.Random(seed)
    pooled: list[float] = []
    p50s: list[float] = []
    p95s: list[float] = []
    for _ in range(draws):
        run: list[float] = []
        for card in range(gpus):
            n = len(range(card, sessions, gpus))
            firsts = [rng.uniform(0, think_s + cell_s) for _ in range(n)]
            done = simulate(
                firsts, cell_s, think_s=think_s, cycles=cycles, discipline=discipline, rates=rates,
                turn_wait=turn_wait,
            )  # fmt: skip
            run += [latency for _, _, latency in done]
        pooled += run
        p50s.append(percentile(run, 50) / cell_s)
        p95s.append(percentile(run, 95) / cell_s)
    deciles = (10, 50, 90)
    return {
        **summary(pooled, cell_s),
        "p50_over_solo_by_run": [percentile(p50s, q) for q in deciles],
        "p95_over_solo_by_run": [percentile(p95s, q) for q in deciles],
        "runs_within_p95_goal": sum(p <= p95_goal for p in p95s) / len(p95s),
        "met_another": _met(pooled, cell_s),
    }
