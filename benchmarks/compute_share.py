"""The floor of the sessions benchmark's latencies: what sharing the card's compute alone costs.

``jupyter_vgpu/testing/compute_share.py`` models a card that time-slices the cells that
meet on it and has no memory cost at all (nothing paused, resumed or waited for). This
script gives, for N sessions at random phases in the sessions benchmark's duty cycle
(one cell of ``--cell-seconds``, then ``--think`` seconds, ``--cycles`` times), the
model's p50, p95 and p99 over solo, both as the card runs cells (sharing) and as a queue
would (one at a time, the least tail any order gives cells of one length), and how a
single run's own p95 spreads over draws. No GPU needed.

``--time-slicing FILE`` (``benchmarks/time_slicing.py``'s output) adds ``share_sliced``
to each row: the same draws with each number of cells together at its measured speed,
time-slicing's own cost in (``compute_share.simulate``'s ``rates``).

``--turn-wait SECONDS`` (several, comma-separated) adds ``turns_<SECONDS>`` to each row:
the same draws with cells taking turns, each waiting up to that long for the cells
running on its card (``ArbiterApp.turn_wait``; with ``--time-slicing``'s speeds where
given).

``--annotate FILE`` also adds to every run of a ``benchmarks/sessions.py`` output that
has its cells' send times the model's latencies for those very cells
(``compute_share``: what the run would have measured had memory cost nothing), where
that output has none yet.

Usage::

    python benchmarks/compute_share.py --sessions 4,8,12,16,20,32,44 --cell-seconds 1.046 \\
        --think 180 --annotate benchmarks/results/sessions-h100.json \\
        --out benchmarks/results/compute-share.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402

from jupyter_vgpu.testing.compute_share import (  # noqa: E402
    DISCIPLINES,
    SHARE,
    expected,
    load_rates,
    of_cells,
)
from jupyter_vgpu.testing.percentiles import RULE  # noqa: E402


def annotate(path: Path) -> int:
    """Add ``compute_share`` to the runs of a sessions output that have cells and none yet,
    and ``compute_share_here`` (the model with the card's own solo cell, ``solo_here``) to
    those that measured one and have none yet; returns how many it added."""
    doc = json.loads(path.read_text())
    added = 0
    for run in doc["runs"]:
        if not run.get("cells_detail"):
            continue
        solos = {"compute_share": run.get("solo_p50_cell_s", doc["solo_cell_s"])}
        if run.get("solo_here"):
            solos["compute_share_here"] = run["solo_here"]["solo_p50_cell_s"]
        for key, solo in solos.items():
            if key not in run:
                run[key] = {
                    **of_cells(run["cells_detail"], run.get("gpus", 1), solo),
                    "percentiles": RULE,
                    "added_by": provenance.run_record(),
                }
                added += 1
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return added


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default="4,8,12,16,20,32,44", help="N per card to model")
    parser.add_argument(
        "--cell-seconds", default="1.046", help="a cell alone on the card; several, comma-separated"
    )
    parser.add_argument("--think", type=float, default=180.0)
    parser.add_argument("--cycles", type=int, default=1)
    parser.add_argument("--draws", type=int, default=1000, help="random draws of the phases per N")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--annotate",
        nargs="*",
        default=[],
        help="sessions outputs to add compute_share (and compute_share_here) to",
    )
    parser.add_argument(
        "--time-slicing", help="benchmarks/time_slicing.py's output: each row also shared at its speeds"
    )
    parser.add_argument(
        "--turn-wait", default="", help="seconds, comma-separated: each row also with cells taking turns so"
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    try:
        waits = [float(v) for v in args.turn_wait.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--turn-wait: seconds, comma-separated, not {args.turn_wait!r}")
    if any(not w > 0 for w in waits):
        parser.error(f"--turn-wait: each must be > 0: {args.turn_wait!r}")
    try:
        rates = load_rates(args.time_slicing) if args.time_slicing else None
    except (OSError, ValueError) as e:
        parser.error(f"--time-slicing: {e}")
    record = provenance.record()
    rows = []
    for cell in (float(v) for v in args.cell_seconds.split(",")):
        for n in (int(v) for v in args.sessions.split(",")):
            row = {"sessions": n, "cell_s": cell}
            for discipline in DISCIPLINES:
                row[discipline] = expected(
                    n, cell, args.think, cycles=args.cycles, draws=args.draws, seed=args.seed,
                    discipline=discipline,
                )  # fmt: skip
            if rates is not None:
                row["share_sliced"] = expected(
                    n, cell, args.think, cycles=args.cycles, draws=args.draws, seed=args.seed,
                    discipline=SHARE, rates=rates,
                )  # fmt: skip
            for wait in waits:
                row[f"turns_{wait:g}"] = expected(
                    n, cell, args.think, cycles=args.cycles, draws=args.draws, seed=args.seed,
                    discipline=SHARE, rates=rates, turn_wait=wait,
                )  # fmt: skip
            rows.append(row)
            share, queue = row[DISCIPLINES[0]], row[DISCIPLINES[1]]
            spread = "/".join(f"{v:.2f}" for v in share["p95_over_solo_by_run"])
            print(
                f"cell {cell} s, {n:3d} sessions: share p50 {share['p50_over_solo']:.3f} p95 "
                f"{share['p95_over_solo']:.3f} p99 {share['p99_over_solo']:.3f} (a run's p95 {spread}), "
                f"one at a time p95 {queue['p95_over_solo']:.3f}; met another {share['met_another']:.2f}; "
                f"runs within p95 +50% {share['runs_within_p95_goal']:.3f}"
                + (f"; time-sliced p95 {row['share_sliced']['p95_over_solo']:.3f}" if rates else "")
                + "".join(
                    f"; turns of {w:g} s p50 {row[f'turns_{w:g}']['p50_over_solo']:.3f} "
                    f"p95 {row[f'turns_{w:g}']['p95_over_solo']:.3f}"
                    for w in waits
                ),
                flush=True,
            )
    out = {
        **record,
        "percentiles": RULE,
        "model": "jupyter_vgpu/testing/compute_share.py: cells that meet on a card share its compute "
        "equally (share), or run one after another in the order sent (one at a time), or take turns "
        "of up to turn_wait seconds (turns_<s>); no memory cost",
        "turn_wait": waits,
        "time_slicing": {"file": args.time_slicing, "rates": rates} if rates else None,
        "think_s": args.think,
        "cycles": args.cycles,
        "draws": args.draws,
        "seed": args.seed,
        "runs": rows,
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for name in args.annotate:
        print(f"{name}: {annotate(Path(name))} compute_share figures added")


if __name__ == "__main__":
    main()
