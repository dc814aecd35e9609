"""The README's benchmark figures are the results files' (benchmarks/readme_figures.py)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def figures():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "benchmarks" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def test_every_table_and_figure_of_the_readme_is_its_results_files(figures):
    found = figures.problems(README)
    assert not found, "\n".join(found)


def test_a_figure_that_drifts_is_named_with_both_values(figures):
    claim = next(c for c in figures.CLAIMS if c.name == "Hub usage")
    want = claim.rendered()
    assert want in README
    drifted = README.replace(want, want.replace(claim.values()["median"], "2.5"))
    found = figures.problems(drifted)
    assert len(found) == 1, found
    assert "Hub usage" in found[0]
    assert "2.5 ms median" in found[0]
    assert f"{claim.values()['median']} ms median" in found[0]
    assert "hub-usage.json" in found[0]


def test_a_table_row_that_drifts_is_named(figures):
    row = next(line for line in figures.sessions_table() if line.startswith("| 32, seed 7 (at 02c8666) |"))
    drifted = README.replace(row, row.replace("+48%", "+33%"))
    assert drifted != README
    found = figures.problems(drifted)
    assert len(found) == 1, found
    assert found[0].startswith("table sessions differs from sessions-h100.json")
    assert "+33%" in found[0]
    assert "+48%" in found[0]


def test_the_percentile_rule_is_stated():
    assert "numpy.percentile" in README


def test_every_results_file_the_readme_names_exists():
    named = set(re.findall(r"`(?:benchmarks/results/)?([\w.-]+\.(?:json|jsonl|log))`", README))
    named -= {"package.json", "sources.json", "cluster.json"}
    assert named, "the README names results files"
    missing = sorted(n for n in named if not (ROOT / "benchmarks" / "results" / n).exists())
    assert not missing, missing
