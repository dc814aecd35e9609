"""The sessions-per-GPU curve as an SVG for the README, from ``benchmarks/sessions.py``'s JSON.

x: sessions on the card, as a multiple of static partitioning's count (each workload's
own); y: cell latency p50 and p95 over the same cell on an empty card (1.0 = solo), for
the runs at the document's think time under its arbiter rule, one pair of lines per
workload (the MLP, and the transformer where the document has its calibration). A dashed
line marks the goal (+10% at p50); dotted lines, each run's ``compute_share`` p95 (what
its own cells would have taken had memory cost nothing, cells that met sharing the card's
compute: ``jupyter_vgpu/testing/compute_share.py``). Plain SVG, no plotting library.

Usage: ``python benchmarks/plot_sessions.py benchmarks/results/sessions-h100.json docs/sessions-h100.svg``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

W, H, LEFT, RIGHT, TOP, BOTTOM = 560, 320, 60, 20, 30, 50


def curves(doc: dict) -> dict[str, tuple[list[float], list[float], str, bool]]:
    """``{label: (xs, ys, colour, dotted)}``: p50 and p95 over solo for each workload's runs at the
    document's think time, under its arbiter rule, with no edit replay. x is sessions over
    that workload's static count (``doc`` for the MLP, ``doc["transformer"]`` for the
    transformer); each run is set against its own solo cell; of two runs of one size, the
    later; and, dotted, the p95 of the runs that carry ``compute_share``."""
    think = doc["think_s"]
    rule = doc["arbiter"].get("background_pauses")  # runs under an earlier arbiter rule are left out
    gpus = doc.get("gpus", 1)
    out = {}
    colours = {"mlp": ("#1f77b4", "#ff7f0e"), "transformer": ("#2ca02c", "#d62728")}
    for workload, (c50, c95) in colours.items():
        calibration = doc if workload == "mlp" else doc.get(workload)
        if not calibration:
            continue
        static = calibration["static_sessions"] * gpus  # static partitioning of every card

        def on_curve(r: dict, workload=workload) -> bool:
            return (
                r.get("workload", "mlp") == workload
                and r.get("think_s", think) == think
                and r.get("background_pauses") == rule
                and not r.get("edit_before_s")
            )

        latest = {r["sessions"]: r for r in filter(on_curve, doc["runs"])}  # runs are in time order
        runs = [latest[n] for n in sorted(latest)]
        if not runs:
            continue
        xs = [r["sessions"] / static for r in runs]
        solo = [r.get("solo_p50_cell_s", calibration["solo_cell_s"]) for r in runs]
        name = "MLP" if workload == "mlp" else "transformer"
        out[f"{name} p50"] = (xs, [r["p50_cell_s"] / s for r, s in zip(runs, solo, strict=True)], c50, False)
        out[f"{name} p95"] = (xs, [r["p95_cell_s"] / s for r, s in zip(runs, solo, strict=True)], c95, False)
        floor = [
            (x, r["compute_share"]["p95_over_solo"])
            for x, r in zip(xs, runs, strict=True)
            if "compute_share" in r
        ]
        if floor:
            out[f"{name} p95, compute sharing alone"] = (
                [x for x, _ in floor],
                [y for _, y in floor],
                c95,
                True,
            )
    return out


def svg(doc: dict) -> str:
    think = doc["think_s"]
    series = curves(doc)
    xs = [x for x_list, *_ in series.values() for x in x_list]
    x_max = max([4.0, *xs]) * 1.05
    y_max = max([1.6, *(y for _, ys, *_ in series.values() for y in ys)]) * 1.05

    def px(x: float) -> float:
        return LEFT + x / x_max * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (y - 0.8) / (y_max - 0.8) * (H - TOP - BOTTOM)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="18" text-anchor="middle">Sessions per H100: cell latency over solo '
        f"(think {think:g} s)</text>",
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{py(1.1)}" x2="{W - RIGHT}" y2="{py(1.1)}" '
        'stroke="gray" stroke-dasharray="4 4"/>',
        f'<text x="{LEFT + 60}" y="{py(1.1) - 6}" fill="gray">goal: p50 within +10%</text>',
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">sessions / static partitioning</text>',
        f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" '
        'text-anchor="middle">latency / solo</text>',
    ]
    for k in range(0, int(x_max) + 1):
        out.append(f'<text x="{px(k)}" y="{H - BOTTOM + 16}" text-anchor="middle">{k}x</text>')
    step = 0.2 if y_max < 2.5 else 0.5 if y_max < 6 else 1.0
    y = 0.8 if step == 0.2 else 1.0
    while y <= y_max:
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4}" text-anchor="end">{y:.1f}</text>')
        y += step
    for i, (name, (xs, ys, color, dotted)) in enumerate(series.items()):
        points = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, ys, strict=True))
        dash = ' stroke-dasharray="2 3"' if dotted else ""
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, v in zip(xs, ys, strict=True):
            r = 2.5 if dotted else 3.5
            fill = "white" if dotted else color
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="{r}" fill="{fill}" stroke="{color}"/>')
        out.append(f'<text x="{LEFT + 10}" y="{TOP + 16 + 16 * i}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a sessions output (benchmarks/results/sessions-h100.json)")
    parser.add_argument("target", type=Path, help="the SVG to write (docs/sessions-h100.svg)")
    args = parser.parse_args()
    if not args.source.is_file():
        parser.error(f"no such file: {args.source}")
    args.target.write_text(svg(json.loads(args.source.read_text())))


if __name__ == "__main__":
    main()
