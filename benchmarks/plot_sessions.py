"""The sessions-per-GPU plot for the README, from ``benchmarks/sessions.py``'s JSON.

x: sessions on the card, as a multiple of static partitioning's count (each workload's
own); y: cell latency p50 (circles) and p95 (triangles) over the same cell on an empty
card (1.0 = solo). **Every run** at the document's think time under its arbiter rule
without an edit replay is drawn, one marker per run, labelled with its seed (``no seed``:
a run from before ``--seed``) and its ``host_memory_limit`` where it set one (a density's
only run with neither goes unlabelled); the lines join,
at each density, the median of its runs' p50 and of their p95, so where runs of one
density disagree the markers show the spread about the line. Hollow markers on a dotted
line: each run's ``compute_share`` p95 (what its own cells would have taken had memory
cost nothing, cells that met sharing the card's compute:
``jupyter_vgpu/testing/compute_share.py``). A dashed line marks the goal (+10% at p50).
One workload per colour pair: the MLP, and the transformer where the document has its
calibration. Plain SVG, no plotting library.

Usage: ``python benchmarks/plot_sessions.py benchmarks/results/sessions-h100.json docs/sessions-h100.svg``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout, not an installed copy

from jupyter_vgpu.testing.percentiles import percentile

W, H, LEFT, RIGHT, TOP, BOTTOM = 720, 400, 60, 200, 46, 50
COLOURS = {"mlp": ("#1f77b4", "#ff7f0e"), "transformer": ("#2ca02c", "#d62728")}
NAMES = {"mlp": "MLP", "transformer": "transformer"}


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of one workload: where it is drawn and what it is labelled."""

    workload: str
    x: float  # sessions over static partitioning's count
    p50: float  # over solo
    p95: float
    share_p95: float | None  # compute_share's p95 over solo, where the run carries it
    label: str  # its seed and its host_memory_limit, where it recorded them


def label_of(run: dict) -> str:
    """``seed 7``, ``no seed, 96G``, ``seed 7, 96G``: the run's seed (``no seed``: it
    recorded none) and its ``host_memory_limit`` where it set one."""
    parts = [f"seed {run['seed']}" if run.get("seed") is not None else "no seed"]
    if run.get("host_memory_limit"):
        parts.append(run["host_memory_limit"])
    return ", ".join(parts)


def points(doc: dict) -> list[Point]:
    """Every run drawn (see the module's doc), in the document's order."""
    think = doc["think_s"]
    rule = doc["arbiter"].get("background_pauses")  # runs under an earlier arbiter rule are left out
    gpus = doc.get("gpus", 1)
    out = []
    for run in doc["runs"]:
        workload = run.get("workload", "mlp")
        calibration = doc if workload == "mlp" else doc.get(workload)
        if not calibration or workload not in COLOURS:
            continue
        if (
            run.get("think_s", think) != think
            or run.get("background_pauses") != rule
            or run.get("edit_before_s")
        ):
            continue
        solo = run.get("solo_p50_cell_s", calibration["solo_cell_s"])
        share = run.get("compute_share", {}).get("p95_over_solo")
        out.append(
            Point(
                workload,
                run["sessions"] / (calibration["static_sessions"] * gpus),
                run["p50_cell_s"] / solo,
                run["p95_cell_s"] / solo,
                share,
                label_of(run),
            )
        )
    return out


def medians(pts: list[Point], key: str) -> tuple[list[float], list[float]]:
    """``(xs, ys)``: at each density of ``pts``, the median of their ``key`` (a field of
    :class:`Point`; runs without it are left out)."""
    xs = sorted({p.x for p in pts if getattr(p, key) is not None})
    ys = [
        percentile([getattr(p, key) for p in pts if p.x == x and getattr(p, key) is not None], 50) for x in xs
    ]
    return xs, ys


def svg(doc: dict) -> str:
    pts = points(doc)
    x_max = max([4.0, *(p.x for p in pts)]) * 1.05
    y_max = max([1.6, *(v for p in pts for v in (p.p95, p.share_p95 or 0))]) * 1.05

    def px(x: float) -> float:
        return LEFT + x / x_max * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (y - 0.8) / (y_max - 0.8) * (H - TOP - BOTTOM)

    right = W - RIGHT
    mid = W / 2
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{mid}" y="16" text-anchor="middle">Sessions per H100: cell latency over '
        f"solo (think {doc['think_s']:g} s)</text>",
        f'<text x="{mid}" y="32" text-anchor="middle" font-size="10" fill="#444">every run drawn, with its '
        "seed and host_memory_limit where it set them (a lone run with neither unlabelled); "
        "lines: each density's median</text>",
        f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{right}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{H - BOTTOM}" stroke="black"/>',
        f'<line x1="{LEFT}" y1="{py(1.1):.1f}" x2="{right}" y2="{py(1.1):.1f}" '
        'stroke="gray" stroke-dasharray="4 4"/>',
        f'<text x="{px(6.5):.1f}" y="{py(1.1) + 14:.1f}" text-anchor="middle" fill="gray" font-size="10">'
        "goal: p50 within +10%</text>",
        f'<text x="{mid}" y="{H - 12}" text-anchor="middle">sessions / static partitioning</text>',
        f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" '
        'text-anchor="middle">latency / solo</text>',
    ]
    for k in range(int(x_max) + 1):
        out.append(f'<text x="{px(k):.1f}" y="{H - BOTTOM + 16}" text-anchor="middle">{k}x</text>')
    step = 0.2 if y_max < 2.5 else 0.5 if y_max < 6 else 1.0
    y = 0.8 if step == 0.2 else 1.0
    while y <= y_max:
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.1f}</text>')
        y += step
    legend = []
    for workload, (c50, c95) in COLOURS.items():
        mine = [p for p in pts if p.workload == workload]
        if not mine:
            continue
        name = NAMES[workload]
        for key, colour, dash, what in (
            ("p50", c50, "", "p50"),
            ("p95", c95, "", "p95"),
            ("share_p95", c95, ' stroke-dasharray="2 3"', "p95, sharing alone"),
        ):
            xs, ys = medians(mine, key)
            if not xs:
                continue
            line = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, ys, strict=True))
            out.append(f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="2"{dash}/>')
            legend.append((f"{name} {what}", colour, key))
        for p in mine:
            x = px(p.x)
            out.append(f'<circle cx="{x:.1f}" cy="{py(p.p50):.1f}" r="3.5" fill="{c50}" stroke="{c50}"/>')
            y95 = py(p.p95)
            corners = f"{x:.1f},{y95 - 4.5:.1f} {x - 4:.1f},{y95 + 3:.1f} {x + 4:.1f},{y95 + 3:.1f}"
            out.append(f'<polygon points="{corners}" fill="{c95}"/>')
            if p.share_p95 is not None:
                out.append(
                    f'<circle cx="{x:.1f}" cy="{py(p.share_p95):.1f}" r="2.5" fill="white" stroke="{c95}"/>'
                )
            if sum(q.x == p.x for q in mine) > 1 or not p.label.startswith("no seed"):
                out.append(
                    f'<text x="{x + 6:.1f}" y="{y95 + 4:.1f}" font-size="9" fill="{c95}">{p.label}</text>'
                )
    for i, (text, colour, key) in enumerate(legend):
        y = TOP + 12 + 16 * i
        mark = {"p50": "●", "p95": "▲", "share_p95": "○"}[key]
        out.append(f'<text x="{right + 10}" y="{y}" fill="{colour}" font-size="11">{mark} {text}</text>')
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
