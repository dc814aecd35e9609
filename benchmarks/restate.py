"""Restate committed results by today's rules, from what they recorded.

- ``percentiles FILE...``: every run of a sessions output (``benchmarks/sessions.py``)
  that recorded its cells (``cells_detail``) gets its p50, p95 and p99 and its
  ``compute_share`` again from those cells, by the one percentile rule
  (:mod:`jupyter_vgpu.testing.percentiles`); a run without cells says so in its
  ``percentiles`` instead.
- ``provenance FILE...``: a results file without ``commit`` or ``date`` gets them from
  the git log of the file, and says so (``provenance``); what was merged into it by hand
  (notes, an earlier run, a later rerun) moves under ``history``, each entry with the
  commit and date of the version of the file that first held it as it is now. A file
  that is a list of rows becomes ``{..., "rows": [...]}``. Runs of a sessions output get
  their own ``commit`` (from the short one written by hand in ``code``, else from the git
  log: the first version of the file that held the run). A p95 taken by an earlier rule
  from samples that were not recorded is said to be so (``percentiles``), and a run the
  README quotes that a later run replaced comes back into ``history`` from the commit that
  wrote it (``RECOVERED``).

Both are idempotent: a second call changes nothing.

    python benchmarks/restate.py percentiles benchmarks/results/sessions-*.json
    python benchmarks/restate.py provenance benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from jupyter_vgpu.testing.compute_share import of_cells  # noqa: E402
from jupyter_vgpu.testing.percentiles import RULE, percentile  # noqa: E402

#: Said in a run that recorded no cells, so its percentiles could not be taken again.
NO_CELLS = (
    "not recomputed: this run recorded no per-cell latencies (no cells_detail); its p95 is the "
    "value at int(0.95 * (n - 1)) of its sorted cells, the rule before numpy.percentile"
)
FROM_GIT = "git log of this file"
#: Commits that only restated results by this script (its percentiles, its provenance, a
#: recovered run): never the commit that wrote a file's figures.
RESTATEMENTS = ("b71c4d6", "b0bd6c9", "3800456")

#: Keys merged into a file by hand (no benchmark writes them), per file: they move to
#: ``history``. Keys of the figures themselves stay where readers find them.
HAND = {
    "codec-h100.json": ("commit_note", "earlier_run"),
    "pause-h100.json": ("commit_note", "earlier_run"),
    "coverage-h100.json": ("runs", "step_overhead", "notes", "expandable_vs_runtime_2026_11_26"),
    "driver-vmm-h100.json": ("measured", "reading", "whole_range_run"),
    "escapes-h100.json": ("not_measured", "summary"),
    "faults-h100.json": ("rerun_2026_11_26",),
    "pause-prepared-h100.json": ("note",),
    "sessions-h100.json": ("note",),
    "sessions-h200x2.json": ("note",),
    "sessions-transformer-h200.json": ("note", "gpu_run_on"),
}

#: Files whose p95 came from a rule of its own and recorded no samples to take it again.
EARLIER_P95 = {
    "hub-usage.json": "ms_p95 is the value at int(0.95 * n) - 1 of the sorted times (not numpy.percentile); "
    "the times were not recorded, so it is not recomputed",
    "watchdog-cpu.json": "cpu_ms_per_look_p95 is the value at int(0.95 * n) of the sorted looks (not "
    "numpy.percentile); the looks were not recorded, so it is not recomputed",
    "watchdog-h100.json": "cpu_ms_per_look_p95 is the value at int(0.95 * n) of the sorted looks (not "
    "numpy.percentile); the looks were not recorded, so it is not recomputed",
}

#: Runs a file held once and lost when a later run took its place, which the README still
#: quotes: each comes back into the file's history from the commit that wrote it.
RECOVERED = {
    "pause-h100.json": (("e1b3664", "the first run on the H100, before the batched copy-out"),),
}


# -- percentiles ---------------------------------------------------------------------


def restate_percentiles(doc: dict) -> int:
    """Recompute the percentiles of every run of a sessions output that has its cells;
    returns how many runs it changed."""
    changed = 0
    doc["percentiles"] = RULE
    for run in doc.get("runs", []):
        cells = run.get("cells_detail") or []
        if not cells:
            if run.get("percentiles") != NO_CELLS:
                run["percentiles"] = NO_CELLS
                changed += 1
            continue
        latencies = [c["cell_s"] for c in cells]
        if run.get("cells") != len(latencies):
            raise SystemExit(
                f"run of {run['sessions']} sessions: {run.get('cells')} cells, {len(latencies)} recorded"
            )
        new = {f"p{q}_cell_s": percentile(latencies, q) for q in (50, 95, 99)}
        solo = run.get("solo_p50_cell_s", doc["solo_cell_s"])
        share = run.get("compute_share") or {}
        new_share = {
            **share,
            **of_cells(cells, run.get("gpus", doc.get("gpus", 1)), solo),
            "percentiles": RULE,
        }
        if (
            any(run.get(k) != v for k, v in new.items())
            or share != new_share
            or run.get("percentiles") != RULE
        ):
            run.update(new)
            run["compute_share"] = new_share
            run["percentiles"] = RULE
            changed += 1
    return changed


# -- provenance from git ---------------------------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


@functools.cache
def versions(path: str) -> list[tuple[str, str, object]]:
    """``(commit, committer date, parsed file)`` of every commit that changed ``path``
    (relative to the checkout), oldest first."""
    out = []
    for line in git("log", "--reverse", "--format=%H %cI", "--", path).splitlines():
        sha, date = line.split()
        try:
            doc = json.loads(git("show", f"{sha}:{path}"))
        except (subprocess.CalledProcessError, json.JSONDecodeError):
            continue  # removed, or not JSON at that commit
        out.append((sha, date, doc))
    return out


def first_holding(path: str, holds: Callable[[object], bool]) -> tuple[str, str] | None:
    """``(commit, date)`` of the oldest version of ``path`` from which on every version
    ``holds``: the commit that wrote what is there now."""
    found = None
    for sha, date, doc in versions(path):
        try:
            ok = holds(doc)
        except (KeyError, TypeError, IndexError, AttributeError):
            ok = False
        if ok and found is None:
            found = (sha, date)
        elif not ok:
            found = None
    return found


def full_sha(short: str) -> str:
    return git("rev-parse", "--verify", f"{short}^{{commit}}").strip()


def commit_date(sha: str) -> str:
    return git("show", "-s", "--format=%cI", sha).strip()


def entry(path: str, what: str, value, holds: Callable[[object], bool]) -> dict:
    """A ``history`` entry for ``value``, with the commit and date of the version of
    ``path`` that first held it."""
    where = first_holding(path, holds)
    sha, date = where if where else (None, None)
    said = f"{FROM_GIT}: the first version that held it as it is"
    return {"commit": sha, "date": date, "provenance": said, "what": what, "value": value}


def restate_provenance(path: Path) -> bool:
    """Give ``path`` its ``commit`` and ``date`` and a ``history``; returns whether it changed."""
    rel = str(path.resolve().relative_to(ROOT))
    raw = json.loads(path.read_text())
    doc = raw if isinstance(raw, dict) else {"rows": raw}
    before = json.dumps(raw, sort_keys=True)
    history = doc.pop("history", [])
    for key in HAND.get(path.name, ()):
        if key not in doc:
            continue
        value = doc.pop(key)
        if key == "not_measured" and isinstance(value, dict) and "earlier" in value:
            for row in value["earlier"]:  # rows of an earlier run, kept as they were
                history.append(
                    entry(
                        rel,
                        f"the case '{row['name']}' as measured before mapped_by: {value.get('why', '')}",
                        row,
                        lambda d, row=row: row in d["cases"] or row in d["not_measured"]["earlier"],
                    )
                )
            continue
        if key == "earlier_run":
            history.append(
                entry(rel, "the run before the one at the top", value, lambda d, v=value: _same_run(d, v))
            )
            continue
        history.append(entry(rel, key, value, lambda d, key=key, value=value: d[key] == value))
    if "runs" in doc and isinstance(doc["runs"], list):
        for run in doc["runs"]:
            _run_provenance(rel, run)
    if isinstance(doc.get("transformer"), dict) and "commit" not in doc["transformer"]:
        calibration = doc["transformer"]
        where = first_holding(rel, lambda d: d["transformer"]["solo_cell_s"] == calibration["solo_cell_s"])
        if where:
            calibration["commit"], calibration["date"] = where
            calibration["provenance"] = f"{FROM_GIT}: the first version that held it as it is"
    if path.name == "coverage-h100.json":
        _coverage_rows(rel, doc, history)
    for short, what in RECOVERED.get(path.name, ()):
        sha = full_sha(short)
        if not any(h.get("commit") == sha and h.get("what") == what for h in history):
            value = json.loads(git("show", f"{sha}:{rel}"))
            said = f"git show {short}:{rel} (the version of this file that commit wrote)"
            history.append(
                {"commit": sha, "date": commit_date(sha), "provenance": said, "what": what, "value": value}
            )
    if path.name in EARLIER_P95:
        doc["percentiles"] = EARLIER_P95[path.name]
    restated = {full_sha(short) for short in RESTATEMENTS}
    if doc.get("provenance") and doc.get("commit") in restated:  # found before RESTATEMENTS was
        del doc["commit"]
        if doc["provenance"].startswith(FROM_GIT):  # its date came from that commit too
            del doc["date"]
    if "commit" not in doc:
        writers = git("log", "--format=%H %cI", "--", rel).splitlines()
        sha, date = next(line.split() for line in writers if line.split()[0] not in restated)
        doc["commit"] = sha
        if "timestamp" in doc:  # the benchmark wrote when it ran
            stamp = datetime.datetime.fromtimestamp(doc.pop("timestamp"), datetime.timezone.utc)
            doc["date"] = stamp.isoformat(timespec="seconds")
            doc["provenance"] = (
                f"commit: {FROM_GIT}, the last commit that wrote it; date: the run's timestamp"
            )
        elif "date" in doc:
            doc["provenance"] = (
                f"commit: {FROM_GIT}, the last commit that wrote it; date: as the run recorded it"
            )
        else:
            doc["date"] = date
            doc["provenance"] = (
                f"{FROM_GIT}: the last commit that wrote it (the code measured is in it or before it)"
            )
    if history:
        doc["history"] = history
    order = ["commit", "dirty", "date", "command", "machine", "provenance"]
    out = {k: doc[k] for k in order if k in doc} | {k: v for k, v in doc.items() if k not in order}
    if json.dumps(out, sort_keys=True) == before:
        return False
    path.write_text(json.dumps(out, indent=2) + "\n")
    return True


def _same_run(doc: dict, run: dict) -> bool:
    """Whether ``doc`` held ``run`` (an earlier run's workloads): at its top, as the run
    of its day, or as its ``earlier_run`` once a later run took the top."""
    return run["workloads"] in (doc["workloads"], doc.get("earlier_run", {}).get("workloads"))


def _run_provenance(rel: str, run: dict) -> None:
    """A sessions run's own ``commit`` and ``date``."""
    if "commit" in run:
        return
    code = run.pop("code", None)
    if code:
        pairs = re.findall(r"\b([0-9a-f]{7,40})\b(?: \((\d+)(?: sessions?)?\))?", code)
        short = next((s for s, n in pairs if n and int(n) == run["sessions"]), pairs[0][0])
        run["commit"] = full_sha(short)
        run["provenance"] = f"commit: recorded by hand as {code!r}"
        if "date" not in run:
            run["date"] = commit_date(run["commit"])
        return
    where = first_holding(rel, lambda d: any(r.get("wall_s") == run["wall_s"] for r in d["runs"]))
    if where:
        run["commit"] = where[0]
        run.setdefault("date", where[1])
        run["provenance"] = f"commit: {FROM_GIT}, the first version that held this run"


def _coverage_rows(rel: str, doc: dict, history: list) -> None:
    """coverage-h100.json's rows come from several runs, named by ``run``: each run
    gets a history entry of its own (from the hand-written ``runs``), and the row
    measured alone gets its commit from its own ``measured``."""
    labels = next((h for h in history if h.get("what") == "runs"), None)
    if labels is None:
        return
    history.remove(labels)
    for name, said in labels["value"].items():
        names = {r["name"] for r in doc["paths"] if r.get("run") == name}
        where = first_holding(
            rel,
            lambda d, names=names, name=name: all(
                any(r["name"] == n and r.get("run", name) == name and r == _row(doc, n) for r in d["paths"])
                for n in names
            ),
        )
        sha, date = where if where else (None, None)
        said_where = f"{FROM_GIT}: the first version that held the run's rows as they are"
        history.append(
            {"commit": sha, "date": date, "provenance": said_where, "what": f"run {name}", "value": said}
        )
    for row in doc["paths"]:
        measured = row.get("measured", "")
        match = re.search(r"code ([0-9a-f]{7,40})", measured)
        if "run" not in row and match:
            row["commit"] = full_sha(match[1])
            row["provenance"] = "commit: recorded by hand in measured"


def _row(doc: dict, name: str) -> dict:
    return next(r for r in doc["paths"] if r["name"] == name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("percentiles", "provenance"))
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    for path in args.files:
        if not path.is_file():
            parser.error(f"no such file: {path}")
        if path.suffix != ".json":
            print(f"{path}: not a JSON file, left as it is")
            continue
        if args.what == "percentiles":
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list) or "solo_cell_s" not in doc:
                parser.error(f"{path}: not a sessions output")
            changed = restate_percentiles(doc)
            path.write_text(json.dumps(doc, indent=2) + "\n")
            print(f"{path}: {changed} runs restated")
        else:
            print(f"{path}: {'restated' if restate_provenance(path) else 'unchanged'}")


if __name__ == "__main__":
    main()
