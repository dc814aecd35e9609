"""Where the time of a sessions run's cells went, beside the compute-sharing model: the
figures behind "the ninth try" in docs/design.md. No GPU needed: it reads the runs that
``benchmarks/sessions.py`` wrote (their ``cells_detail`` and the arbiter's ``decisions``).

For each run chosen (``--commits``: the runs of those commits, by prefix):

- ``prefetched_cells``: cells whose kernel's prefetch was granted in the 4 s before the
  cell was sent, or while it waited; ``waited_for_room_at_start``: those among them
  that waited, once sent, for a pause or suspend made then for their room (the decision
  ``room for <server>`` ending after the send and before the cell's code began), with
  how long they waited outside their code (``outside_s``, seconds: ``cell_s`` less
  ``inner_s``), how many waited over 0.4 s, and how many had no step of a room ahead
  (``room ahead for <server>``) in that window;
- ``inner_excess_s``: each cell's time in its own code (``inner_s``) less the
  compute-sharing model's latency for it (``jupyter_vgpu/testing/compute_share.py``,
  with the card's own solo cell, ``solo_here``; without turns, so that in a run whose
  cells took turns it reads low: ``cell_excess_s`` below is that run's), p50 and p95
  (seconds);
  ``driver_overlap_r``: Pearson's r between that excess and the seconds of the driver's
  suspends and restores (``suspend``, ``restored``: the decision's end less its
  ``seconds``) within the cell's code;
- ``pauses_by_cells_running``: the pauses that released device memory after the first
  cell was sent, by how many cells were in their code meanwhile (0, 1, 2 or more): how
  many, their seconds at p50 and p90, and each; pooled over all the runs chosen too;
- ``pauses_by_slabs``: the same pauses by whether the kernel's pinned slabs were warm
  (``warm``) or had been let go since its last pause, by a ``trim`` that gave pinned
  memory back or by a ``spill`` (``pinned_again``: the pause pinned its slabs anew);
  pooled too. A trim or spill before the first decision kept is not seen, so a run with
  ``cells_not_covered`` may count some pauses that pinned again as warm.
- ``steps_by_pair``: the cells' steps (``step_s``, laid end to end from the start of the
  cell's code) that ran beside exactly one other cell's code for at least 95% of their
  length and beside no third, grouped by both cells' state when they were edited
  (``state_at_edit``: ``paused`` where only the memory went, ``suspended`` where the
  context went too and was restored for the cell), as ``"<own> beside <other>"``; and
  ``alone``, steps that met no other cell. Their number and seconds at p10, p50 and p90;
  pooled too. Two cells sharing the card evenly take twice a step alone each.
- ``slowest_cells``: the cells from the one just below the run's p95 up (the fourth
  slowest of 48 and the three above it), slowest first: their seconds in and outside
  their code and the model's latency for them; whether they waited for a running cell
  (a ``queued`` decision after the send, ``ArbiterApp.suspend_wait``, or a ``turn``,
  ``ArbiterApp.turn_wait``); the pauses and
  suspends made for their room (``pinned_again`` as above); their own restore's seconds;
  a suspend of their own kernel as room ahead for another's cell in the window before
  the send, and refused prefetches; and the seconds of their steps that ran beside a
  kernel restored from a suspend while theirs was only paused.

And ``memory_path_points``: the run's p95 less the compute-sharing model's p95, in
points of the calibration's solo cell (the host-memory issue's "memory path's own share
of the tail"): ``even`` with the model as every run carries it (``compute_share``: even
sharing, the driver's switches between contexts counted as the memory path's) and, with
``--time-slicing FILE`` (``benchmarks/time_slicing.py``'s output, measured on the card
the runs ran on), ``time_slicing``: the model with the measured speed of each number of
contexts together (``compute_share.simulate``'s ``rates``); ``inner_excess_s`` then uses
those rates too. Runs of the two backends want each its own measurement: ``--isolation
mps`` keeps the runs made under MPS (``sessions.py --isolation mps``), to be read with
``time_slicing.py --mps``'s output, whose key stays ``time_slicing``.

A run whose cells took turns (``sessions.py --turn-wait``: the arbiter's ``turn_wait``)
is read against the model with the same turns too: ``memory_path_points`` gains
``turns`` (that model, with ``--time-slicing``'s rates where given) and ``turns_here``
(the same with the card's own solo cell, ``solo_here``, in points of it: the runs ran on
an H200 whose solo cell is not the calibration's); the slowest cells' ``model_s`` is that
model's. ``cell_excess_s``, for every run: each cell's whole time (``cell_s``: its wait
for room and for its turn, and its code) less the model's latency for it (the run's own
model, turns included, with the card's own solo cell), p50 and p95 (seconds): what the
arbiter's path added to a cell beyond compute sharing.

Percentiles by NumPy's rule (linear interpolation). A decision is known by its end time
(``time``) and length (``seconds``); a run keeps its last ``decisions_kept`` decisions,
and a cell sent before the first of them kept is left out (``cells_not_covered``).

Usage::

    python benchmarks/sessions_tail.py --sessions benchmarks/results/sessions-h100.json \\
        --commits 777869e,b101c5c --out benchmarks/results/cell-tails-h100.json \\
        [--time-slicing benchmarks/results/time-slicing-h200.json] [--isolation time-slicing]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402

from jupyter_vgpu.testing.compute_share import latencies_of, load_rates, of_cells  # noqa: E402
from jupyter_vgpu.testing.percentiles import RULE  # noqa: E402

#: Seconds before a cell's send in which its kernel's prefetch counts as its own (the
#: benchmark's edit comes 2 s before; a suspended kernel's restore adds about 1 s).
PREFETCH_WINDOW_S = 4.0
#: Seconds outside its code past which a cell's wait is counted as long.
LONG_WAIT_S = 0.4
#: Slack for the order of a decision's end and a cell's first step, seconds.
SLACK_S = 0.05
#: The part of a step another cell's code must cover for the step to count as shared
#: with it (``steps_by_pair``).
PAIR_COVER = 0.95


def _window(cell: dict) -> tuple[float, float, float]:
    """``(sent, code begins, ends)`` of a cell, seconds (the run's clock)."""
    sent = cell["start"]
    outside = cell["cell_s"] - cell["inner_s"]
    return sent, sent + outside, sent + cell["cell_s"]


def _span(d: dict) -> tuple[float, float]:
    return d["time"] - d.get("seconds", 0.0), d["time"]


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _steps(cell: dict) -> list[tuple[float, float]]:
    """A cell's steps as ``(begins, ends)``, laid end to end from the start of its code."""
    t = _window(cell)[1]
    spans = []
    for seconds in cell.get("step_s", []):
        spans.append((t, t + seconds))
        t += seconds
    return spans


def _pairs(cell: dict, cells: list[dict]) -> list[tuple[str, float]]:
    """``(pair, seconds)`` of each step of ``cell`` that ran alone or beside exactly one
    other cell of ``cells`` (``steps_by_pair`` above); steps beside more are left out."""
    out = []
    code = [(_window(c)[1:], c) for c in cells if c is not cell]  # the others' code, once
    for span in _steps(cell):
        met = [(_overlap(span, w), c) for w, c in code if _overlap(span, w) > 0]
        if not met:
            out.append(("alone", span[1] - span[0]))
        elif len(met) == 1 and met[0][0] >= PAIR_COVER * (span[1] - span[0]):
            out.append((f"{cell['state_at_edit']} beside {met[0][1]['state_at_edit']}", span[1] - span[0]))
    return out


def steps_by_pair(cells: list[dict]) -> dict[str, list[float]]:
    """Step seconds of ``cells`` by the pair of states that met (``steps_by_pair`` above)."""
    found: dict[str, list[float]] = {}
    for cell in cells:
        for key, seconds in _pairs(cell, cells):
            found.setdefault(key, []).append(seconds)
    return dict(sorted(found.items()))


def slowest(cells: list[dict], model: list[float], decisions: list[dict], cold: set[float]) -> list[dict]:
    """The cells from the one below the p95 up (``slowest_cells`` above), slowest first:
    ``cells`` in send order, ``model`` their compute-sharing latencies, ``cold`` the end
    times of the pauses that pinned their slabs again."""
    order = sorted(range(len(cells)), key=lambda i: cells[i]["cell_s"])
    out = []
    for i in reversed(order[int(0.95 * (len(cells) - 1)) :]):
        cell = cells[i]
        server = f"user{cell['session']}/"
        sent, code, _ = _window(cell)
        mine = [
            d for d in decisions if d.get("server") == server and sent - PREFETCH_WINDOW_S < d["time"] <= code
        ]
        room = [
            {
                "what": d["what"],
                "server": d["server"],
                "seconds": d.get("seconds"),
                "released": d.get("released"),  # bytes: a pause's or a release's
                "pinned_again": d["time"] in cold,
            }
            for d in decisions
            if d.get("reason") == f"room for {server}" and sent < d["time"] <= code + SLACK_S
        ]
        beside = [seconds for key, seconds in _pairs(cell, cells) if key == "paused beside suspended"]
        out.append(
            {
                "session": cell["session"],
                "cell_s": cell["cell_s"],
                "inner_s": cell["inner_s"],
                "outside_s": code - sent,
                "model_s": model[i],
                "state_at_edit": cell.get("state_at_edit"),
                "waited_for_a_running_cell": any(
                    d["what"] in ("queued", "turn") and d["time"] >= sent for d in mine
                ),
                "room_made_for_it": room,
                "own_restore_s": next((d["seconds"] for d in mine if d["what"] == "restored"), None),
                "own_suspend_ahead_of_another": [
                    d["reason"]
                    for d in mine
                    if d["what"] == "suspend" and d["time"] > sent - PREFETCH_WINDOW_S
                ],
                "prefetch_refused": [d.get("message") for d in mine if d["what"] == "prefetch refused"],
                "steps_beside_a_restored_kernel_s": beside,
            }
        )
    return out


def _spread(values: list[float]) -> dict:
    return {"steps": len(values), **{f"p{q}_s": _pct(values, q) for q in (10, 50, 90)}}


def turn_wait_of(run: dict) -> float | None:
    """The ``turn_wait`` (seconds) the run's arbiter had, None where cells did not take
    turns (0, or a run from before the setting)."""
    return (run.get("arbiter") or {}).get("turn_wait") or None


def memory_path_points(run: dict, solo_s: float, rates: dict[int, float] | None = None) -> dict:
    """The run's p95 cell less the compute-sharing model's p95 for its cells, in points
    of ``solo_s`` (the calibration's solo cell, seconds): ``even`` (the model as the run
    carries it, computed again) and, where ``rates`` are given, ``time_slicing``; where
    the run's cells took turns (:func:`turn_wait_of`), ``turns`` (the model with those
    turns and ``rates``) and, where the run has ``solo_here``, ``turns_here`` (the same
    with the card's own solo cell, in points of it). Raises KeyError where the run has no
    ``cells_detail`` or ``p95_cell_s``."""
    gpus = run.get("gpus", 1)
    turn_wait = turn_wait_of(run)
    models = {"even": (solo_s, None, None), **({"time_slicing": (solo_s, rates, None)} if rates else {})}
    if turn_wait:
        models["turns"] = (solo_s, rates, turn_wait)
        if run.get("solo_here"):
            models["turns_here"] = (run["solo_here"]["solo_p50_cell_s"], rates, turn_wait)
    return {
        name: (
            run["p95_cell_s"]
            - of_cells(run["cells_detail"], gpus, solo, rates=r, turn_wait=wait)["p95_cell_s"]
        )
        / solo
        * 100
        for name, (solo, r, wait) in models.items()
    }


def of_run(run: dict, rates: dict[int, float] | None = None, calibration_solo_s: float | None = None) -> dict:
    """The figures above for one run of a sessions output; ``rates`` as
    ``compute_share.simulate``'s, ``calibration_solo_s`` the output's ``solo_cell_s``
    (``memory_path_points`` left out without it). Raises KeyError where the run has no
    ``cells_detail``, ``decisions`` or ``solo_here``."""
    cells = sorted(run["cells_detail"], key=lambda c: c["start"])
    decisions = run["decisions"]
    first_kept = min(d["time"] for d in decisions)
    covered = [c for c in cells if c["start"] - PREFETCH_WINDOW_S >= first_kept]
    solo = run["solo_here"]["solo_p50_cell_s"]
    starts, cards = [c["start"] for c in cells], [c["session"] % run.get("gpus", 1) for c in cells]
    model = latencies_of(starts, cards, solo, rates=rates)
    # the run's own model: with its turns where its cells took them (a cell's wait in line included)
    turn_wait = turn_wait_of(run)
    own = latencies_of(starts, cards, solo, rates=rates, turn_wait=turn_wait) if turn_wait else model

    prefetched, waited = 0, []
    for cell in covered:
        server = f"user{cell['session']}/"
        sent, code, _ = _window(cell)
        if not any(
            d["what"] == "prefetch" and d["server"] == server and sent - PREFETCH_WINDOW_S < d["time"] < code
            for d in decisions
        ):
            continue
        prefetched += 1
        made_then = [
            d
            for d in decisions
            if d.get("reason") == f"room for {server}" and sent < d["time"] <= code + SLACK_S
        ]
        if not made_then:
            continue
        ahead = [
            d
            for d in decisions
            if d.get("reason") == f"room ahead for {server}" and sent - PREFETCH_WINDOW_S < d["time"] <= code
        ]
        waited.append({"session": cell["session"], "outside_s": code - sent, "room_ahead_steps": len(ahead)})

    driver = [_span(d) for d in decisions if d["what"] in ("suspend", "restored") and d.get("seconds")]
    excess, in_driver = [], []
    for cell, latency in zip(cells, model, strict=True):
        _, code, end = _window(cell)
        excess.append(cell["inner_s"] - latency)
        in_driver.append(sum(_overlap((code, end), span) for span in driver))
    r = float(np.corrcoef(in_driver, excess)[0, 1]) if np.std(in_driver) > 0 else None

    running_spans = [_window(c)[1:] for c in cells]
    by_running: dict[str, list[float]] = {"0": [], "1": [], "2+": []}
    for d in decisions:
        if d["what"] != "pause" or not d.get("released") or d["time"] < cells[0]["start"]:
            continue
        span = _span(d)
        running = sum(1 for s in running_spans if _overlap(span, s) > 0)
        by_running[str(running) if running < 2 else "2+"].append(d["seconds"])

    by_slabs: dict[str, list[float]] = {"warm": [], "pinned_again": []}
    cold: set[float] = set()  # end times of the pauses that pinned again
    let_go: set[str] = set()  # kernels whose slabs went since their last pause
    for d in sorted(decisions, key=lambda d: d["time"]):
        key = f"{d.get('server')}{d.get('pid')}"
        if d["what"] == "spill" or (d["what"] == "trim" and not d.get("message", "").startswith("0 B")):
            let_go.add(key)
        elif d["what"] == "pause" and d.get("released"):
            if d["time"] >= cells[0]["start"]:
                by_slabs["pinned_again" if key in let_go else "warm"].append(d["seconds"])
            if key in let_go:
                cold.add(d["time"])
            let_go.discard(key)

    outside = [w["outside_s"] for w in waited]
    beyond = [c["cell_s"] - m for c, m in zip(cells, own, strict=True)]  # a cell's whole time, past its model
    return {
        "commit": run["commit"],
        "seed": run.get("seed"),
        "cells": len(cells),
        "cells_not_covered": len(cells) - len(covered),
        "prefetched_cells": prefetched,
        "waited_for_room_at_start": {
            "cells": len(waited),
            "over_0_4_s": sum(1 for s in outside if s > LONG_WAIT_S),
            "without_room_ahead": sum(1 for w in waited if w["room_ahead_steps"] == 0),
            "outside_s_min": min(outside) if outside else None,
            "outside_s_max": max(outside) if outside else None,
            "each": waited,
        },
        "memory_path_points": (
            memory_path_points(run, calibration_solo_s, rates) if calibration_solo_s else None
        ),
        "inner_excess_s": {"p50": _pct(excess, 50), "p95": _pct(excess, 95)},
        "turn_wait": turn_wait,
        "cell_excess_s": {"p50": _pct(beyond, 50), "p95": _pct(beyond, 95)},
        "driver_overlap_r": r,
        "pauses_by_cells_running": {
            k: {"pauses": len(v), "p50_s": _pct(v, 50), "p90_s": _pct(v, 90), "seconds": v}
            for k, v in by_running.items()
        },
        "pauses_by_slabs": {
            k: {"pauses": len(v), "p50_s": _pct(v, 50), "p90_s": _pct(v, 90), "seconds": v}
            for k, v in by_slabs.items()
        },
        "steps_by_pair": {k: {**_spread(v), "seconds": v} for k, v in steps_by_pair(cells).items()},
        "slowest_cells": slowest(cells, own, decisions, cold),
    }


def _r(r: float | None) -> str:
    """Pearson's r as printed: none where the run made no suspend or restore."""
    return "none (no suspend or restore)" if r is None else f"{r:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", required=True, help="a benchmarks/sessions.py output")
    parser.add_argument(
        "--commits", required=True, help="the runs of these commits (prefixes, comma-separated)"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--time-slicing", help="benchmarks/time_slicing.py's output: the model with its measured rates too"
    )
    parser.add_argument(
        "--isolation",
        choices=("time-slicing", "mps"),
        help="only the runs of this backend (a run without the field ran time-sliced); give "
        "--time-slicing the same backend's measurement (time_slicing.py --mps for mps)",
    )
    args = parser.parse_args()
    record = provenance.record()
    prefixes = tuple(args.commits.split(","))
    try:
        rates = load_rates(args.time_slicing) if args.time_slicing else None
    except (OSError, ValueError) as e:
        parser.error(f"--time-slicing: {e}")
    sessions = json.loads(Path(args.sessions).read_text())
    runs = [
        of_run(run, rates, sessions.get("solo_cell_s"))
        for run in sessions["runs"]
        if str(run.get("commit", "")).startswith(prefixes)
        and run.get("decisions")
        and run.get("solo_here")
        and args.isolation in (None, run.get("isolation", "time-slicing"))
    ]
    if not runs:
        of = f" under {args.isolation}" if args.isolation else ""
        raise SystemExit(
            f"no run of {args.commits}{of} with cells, decisions and solo_here in {args.sessions}"
        )
    for run in runs:
        w = run["waited_for_room_at_start"]
        print(
            f"{run['commit'][:7]} seed {run['seed']}: {w['cells']} of {run['prefetched_cells']} prefetched "
            f"cells waited for room at their start ({w['over_0_4_s']} over {LONG_WAIT_S} s, "
            f"{w['without_room_ahead']} with no room ahead); inner excess p95 "
            f"{run['inner_excess_s']['p95']:.3f} s; r with the driver's calls "
            f"{_r(run['driver_overlap_r'])}; cell excess p50 {run['cell_excess_s']['p50']:.3f} s, "
            f"p95 {run['cell_excess_s']['p95']:.3f} s; memory path's points of p95: "
            f"{ {k: round(v, 1) for k, v in (run['memory_path_points'] or {}).items()} }"
        )
        for c in run["slowest_cells"]:
            made = [
                (m["what"], m["server"], m["seconds"], m.get("released"), m["pinned_again"])
                for m in c["room_made_for_it"]
            ]
            print(
                f"  user{c['session']}/: {c['cell_s']:.3f} s ({c['inner_s']:.3f} in its code, model "
                f"{c['model_s']:.3f}), {c['state_at_edit']} at its edit; waited for a running cell: "
                f"{c['waited_for_a_running_cell']}; room made for it: {made}; "
                f"own restore {c['own_restore_s']} s; beside a restored kernel: "
                f"{[round(s, 3) for s in c['steps_beside_a_restored_kernel_s']]}"
            )
    pooled = {
        k: [s for run in runs for s in run["pauses_by_cells_running"][k]["seconds"]] for k in ("0", "1", "2+")
    }
    for k, v in pooled.items():
        print(f"pauses with {k} cell(s) running, all these runs: {len(v)}, p50 {_pct(v, 50)} s")
    slabs = {
        k: [s for run in runs for s in run["pauses_by_slabs"][k]["seconds"]] for k in ("warm", "pinned_again")
    }
    for k, v in slabs.items():
        print(f"pauses with slabs {k}, all these runs: {len(v)}, p50 {_pct(v, 50)} s")
    pairs: dict[str, list[float]] = {}
    for run in runs:
        for k, v in run["steps_by_pair"].items():
            pairs.setdefault(k, []).extend(v["seconds"])
    for k, v in sorted(pairs.items()):
        print(f"steps {k}, all these runs: {len(v)}, p50 {_pct(v, 50):.3f} s, p90 {_pct(v, 90):.3f} s")
    out = {
        **record,
        "percentiles": RULE,
        "sessions": args.sessions,
        "prefetch_window_s": PREFETCH_WINDOW_S,
        "time_slicing": {"file": args.time_slicing, "rates": rates} if rates else None,
        "isolation": args.isolation,
        "runs": runs,
        "pauses_by_cells_running": {
            k: {"pauses": len(v), "p50_s": _pct(v, 50), "p90_s": _pct(v, 90)} for k, v in pooled.items()
        },
        "pauses_by_slabs": {
            k: {"pauses": len(v), "p50_s": _pct(v, 50), "p90_s": _pct(v, 90)} for k, v in slabs.items()
        },
        "steps_by_pair": {k: _spread(v) for k, v in sorted(pairs.items())},
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
