"""The committed results agree with the rules they claim: percentiles taken again from
the cells each run recorded, and every file's provenance."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jupyter_vgpu.testing.compute_share import of_cells
from jupyter_vgpu.testing.percentiles import RULE, percentile

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SESSIONS = sorted(RESULTS.glob("sessions-*.json"))


def runs_with_cells():
    for path in SESSIONS:
        doc = json.loads(path.read_text())
        for i, run in enumerate(doc["runs"]):
            if run.get("cells_detail"):
                yield pytest.param(doc, run, id=f"{path.name}:{i}:{run['sessions']}")


@pytest.mark.parametrize(("doc", "run"), list(runs_with_cells()))
def test_a_runs_percentiles_are_its_cells_by_the_one_rule(doc, run):
    latencies = [c["cell_s"] for c in run["cells_detail"]]
    assert run["cells"] == len(latencies)
    assert run["percentiles"] == RULE
    for q in (50, 95, 99):
        assert run[f"p{q}_cell_s"] == pytest.approx(percentile(latencies, q), rel=1e-12), q
    solo = run.get("solo_p50_cell_s", doc["solo_cell_s"])
    model = of_cells(run["cells_detail"], run.get("gpus", doc.get("gpus", 1)), solo)
    for key, value in model.items():
        assert run["compute_share"][key] == pytest.approx(value, rel=1e-12), key
    if "compute_share_here" in run:  # the same model with the card's own solo cell
        here = of_cells(
            run["cells_detail"], run.get("gpus", doc.get("gpus", 1)), run["solo_here"]["solo_p50_cell_s"]
        )
        for key, value in here.items():
            assert run["compute_share_here"][key] == pytest.approx(value, rel=1e-12), key


def test_a_run_without_cells_says_its_percentiles_were_not_taken_again():
    without = [r for p in SESSIONS for r in json.loads(p.read_text())["runs"] if not r.get("cells_detail")]
    assert without, "the earliest sessions runs recorded no cells"
    for run in without:
        assert run["percentiles"].startswith("not recomputed"), run["percentiles"]


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_results_file_says_which_commit_and_when_and_so_does_its_history(path):
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict), "a results file is an object with commit and date at its top"
    assert len(doc.get("commit") or "") == 40, doc.get("commit")
    assert doc.get("date"), "no date"
    for entry in doc.get("history", []):
        assert entry.get("commit"), entry
        assert entry.get("date"), entry
        assert entry.get("what"), entry
    for run in doc.get("runs", []) if isinstance(doc.get("runs"), list) else []:
        if "cells_detail" in run or "p50_cell_s" in run:  # a sessions run: its own record
            assert len(run.get("commit") or "") == 40, run.get("commit")
            assert run.get("date"), "a run without a date"
