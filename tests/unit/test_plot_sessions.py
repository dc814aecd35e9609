"""The sessions plot draws every run of a density, its seed visible, and the median."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_sessions", ROOT / "benchmarks" / "plot_sessions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def doc(runs):
    return {
        "think_s": 180.0,
        "arbiter": {"background_pauses": "on a quiet card"},
        "static_sessions": 4,
        "solo_cell_s": 1.0,
        "runs": runs,
    }


def run(sessions, p50, p95, **more):
    return {
        "sessions": sessions,
        "p50_cell_s": p50,
        "p95_cell_s": p95,
        "think_s": 180.0,
        "background_pauses": "on a quiet card",
        **more,
    }


def test_every_run_of_a_density_is_drawn_with_its_seed_and_the_line_is_their_median(plot):
    runs = [
        run(32, 2.0, 3.7),
        run(32, 1.3, 2.5, host_memory_limit="96G"),
        run(32, 1.05, 1.5, seed=7, host_memory_limit="96G"),
        run(32, 1.1, 1.6, seed=7, edit_before_s=2.0),  # an edit replay: not on this plot
        run(16, 1.05, 1.1, background_pauses="while cells run"),  # an earlier arbiter rule
        run(4, 1.04, 1.06),
    ]
    points = plot.points(doc(runs))
    assert sorted((p.x, p.label) for p in points) == [
        (1.0, "no seed"),
        (8.0, "no seed"),
        (8.0, "no seed, 96G"),
        (8.0, "seed 7, 96G"),
    ]
    assert plot.medians(points, "p95") == ([1.0, 8.0], [1.06, 2.5])
    drawn = plot.svg(doc(runs))
    assert drawn.count("<polygon") == 4  # one p95 marker per run
    assert ">seed 7, 96G</text>" in drawn
    assert ">no seed, 96G</text>" in drawn
    assert "each density's median" in drawn


def test_the_committed_plot_is_drawn_from_the_committed_runs(plot):
    source = json.loads((ROOT / "benchmarks" / "results" / "sessions-h100.json").read_text())
    assert (ROOT / "docs" / "sessions-h100.svg").read_text() == plot.svg(source)
