"""The sessions-per-GPU curve as an SVG for the README, from ``benchmarks/sessions.py``'s JSON.

x: sessions on the card, as a multiple of static partitioning's count; y: cell latency
p50 and p95 over the same cell on an empty card (1.0 = solo), for the runs at the
document's think time under its arbiter rule. A dashed line marks the goal (+10% at
p50). Plain SVG, no plotting library.

Usage: ``python benchmarks/plot_sessions.py benchmarks/results/sessions-h100.json docs/sessions-h100.svg``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

W, H, LEFT, RIGHT, TOP, BOTTOM = 560, 320, 60, 20, 30, 50


def svg(doc: dict) -> str:
    static = doc["static_sessions"] * doc.get("gpus", 1)  # static partitioning of every card
    solo, think = doc["solo_cell_s"], doc["think_s"]
    rule = doc["arbiter"].get("background_pauses")  # runs under an earlier arbiter rule are left out

    def on_curve(r: dict) -> bool:
        return r.get("think_s", think) == think and r.get("background_pauses") == rule

    runs = sorted(filter(on_curve, doc["runs"]), key=lambda r: r["sessions"])
    xs = [r["sessions"] / static for r in runs]
    series = {
        "p50": ([r["p50_cell_s"] / solo for r in runs], "#1f77b4"),
        "p95": ([r["p95_cell_s"] / solo for r in runs], "#ff7f0e"),
    }
    x_max = max([4.0, *xs]) * 1.05
    y_max = max([1.6, *(y for ys, _ in series.values() for y in ys)]) * 1.05

    def px(x: float) -> float:
        return LEFT + x / x_max * (W - LEFT - RIGHT)

    def py(y: float) -> float:
        return H - BOTTOM - (y - 0.8) / (y_max - 0.8) * (H - TOP - BOTTOM)

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="18" text-anchor="middle">Sessions per H100: cell latency over solo '
        f"(think {think:g} s, {static} static)</text>",
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
    y = 0.8
    while y <= y_max:
        out.append(f'<text x="{LEFT - 6}" y="{py(y) + 4}" text-anchor="end">{y:.1f}</text>')
        y += 0.2
    for i, (name, (ys, color)) in enumerate(series.items()):
        points = " ".join(f"{px(x):.1f},{py(v):.1f}" for x, v in zip(xs, ys, strict=True))
        out.append(f'<polyline points="{points}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, v in zip(xs, ys, strict=True):
            out.append(f'<circle cx="{px(x):.1f}" cy="{py(v):.1f}" r="3.5" fill="{color}"/>')
        out.append(f'<text x="{LEFT + 10}" y="{TOP + 16 + 16 * i}" fill="{color}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main() -> None:
    source, target = sys.argv[1], sys.argv[2]
    Path(target).write_text(svg(json.loads(Path(source).read_text())))


if __name__ == "__main__":
    main()
