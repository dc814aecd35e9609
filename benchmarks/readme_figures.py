"""The README's benchmark figures, from the results files they come from.

Tables are written here: each sits in the README between ``<!-- figures:NAME -->`` and
``<!-- /figures:NAME -->`` and is made from its JSON by :data:`TABLES`. A figure in the
README's prose is a :class:`Claim`: a phrase with the figure in it, rendered from its
JSON, that the README must hold (white space aside).

    python benchmarks/readme_figures.py            # check: exit 1 naming each figure that differs
    python benchmarks/readme_figures.py --write    # write the tables into README.md

``tests/unit/test_readme_figures.py`` runs the check, so a results file and the README
cannot drift apart; when a benchmark writes new figures, ``--write`` redoes the tables and
the check names each phrase of the prose to change, with the README's value and the
file's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import string
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed copy
RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "README.md"
GiB, MiB = 1 << 30, 1 << 20


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def history(doc: dict, what: str) -> dict:
    """The value of ``doc``'s history entry whose ``what`` starts with ``what``."""
    return next(h["value"] for h in doc.get("history", []) if h["what"].startswith(what))


def pct(ratio: float) -> str:
    """A ratio over a reference as a change: ``+4.6%`` below 10%, ``+93%`` from 10% on."""
    change = (ratio - 1) * 100
    return f"{change:+.1f}%" if abs(change) < 10 else f"{change:+.0f}%"


def fig(value: float, digits: int = 2) -> str:
    return f"{value:.{digits}f}"


# -- tables ---------------------------------------------------------------------------------

CODEC_ROWS = (
    ("bf16_weights", "bf16 weights N(0, 0.02)"),
    ("fp32_adam_v", "fp32 Adam second moment"),
    ("bf16_relu_act", "bf16 ReLU activations"),
    ("zeros", "all zeros"),
)


def codec_table() -> list[str]:
    doc = load("codec-h100.json")
    now = {(w["name"], w["path"]): w for w in doc["workloads"]}
    before = {(w["name"], w["path"]): w for w in history(doc, "the run before")["workloads"]}
    out = [
        "| workload | ratio nvCOMP / zstd | nvCOMP pause / resume | zstd pause / resume "
        "| raw pinned copy out / in |",
        "|---|---|---|---|---|",
    ]
    for name, label in CODEC_ROWS:
        nv, zs = now[(name, "nvcomp")], now[(name, "zstd")]
        nv0, zs0 = before[(name, "nvcomp")], before[(name, "zstd")]
        if nv["host_bytes"] == 0:
            ratio = f"0 bytes kept / {zs['host_bytes'] // 1024} KiB"
        else:
            ratio = f"{nv['ratio']:.2f} / {zs['ratio']:.2f}"

        def speeds(w, w0):
            return (
                f"{w['offload_gbps']:.1f} / {w['resume_gbps']:.1f} "
                f"({w0['offload_gbps']:.1f} / {w0['resume_gbps']:.1f})"
            )

        raw = f"{nv['raw_d2h_gbps']:.0f} / {nv['raw_h2d_gbps']:.0f}"
        out.append(f"| {label} | {ratio} | {speeds(nv, nv0)} | {speeds(zs, zs0)} | {raw} |")
    return out


def pause_table() -> list[str]:
    doc = load("pause-h100.json")
    out = [
        "| on the GPU | host/GPU | pause (cold) | resume | raw copy d2h / h2d | NVML paused "
        "| suspend / restore |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in doc["workloads"]:
        out.append(
            f"| {round(w['gpu_bytes'] / GiB)} GiB | {w['host_bytes'] / w['gpu_bytes']:.2f} "
            f"| {w['pause_s']:.2f} s ({w['cold_pause_s']:.2f} s) | {w['resume_s']:.2f} s "
            f"| {w['raw_d2h_s']:.2f} / {w['raw_h2d_s']:.2f} s | {w['nvml_paused_bytes'] / MiB:.0f} MiB "
            f"| {w['suspend_s']:.2f} / {w['restore_s']:.2f} s |"
        )
    return out


def prepared_table() -> list[str]:
    doc = load("pause-prepared-h100.json")
    out = [
        "| on the GPU | first pause, pinning on the way | pinning ahead (while idle) "
        "| first pause after it | warm pause |",
        "|---|---|---|---|---|",
    ]
    for w in doc["workloads"]:
        out.append(
            f"| {round(w['gpu_bytes'] / GiB)} GiB | {w['cold_pause_s']:.2f} s | {w['prepare_s']:.2f} s "
            f"| {w['prepared_first_pause_s']:.3f} s ({w['prepared_first_vs_warm']:.2f}× warm) "
            f"| {w['pause_s']:.3f} s |"
        )
    return out


def sessions_runs() -> list[tuple[str, dict]]:
    """The sessions table's runs, with their labels: the MLP at think 180 s under today's
    arbiter rule ('on a quiet card'), one row per size up to 20 sessions (the runs that
    recorded their cells) and every run at 32 sessions with the host budget that held the
    paused sets (96G)."""
    doc = load("sessions-h100.json")
    out = []
    for run in doc["runs"]:
        if run.get("workload", "mlp") != "mlp" or run.get("think_s") != doc["think_s"]:
            continue
        if run.get("background_pauses") != "on a quiet card" or not run.get("cells_detail"):
            continue
        if run["sessions"] > 20 and run.get("host_memory_limit") != "96G":
            continue
        label = str(run["sessions"])
        if run.get("seed") is not None:
            label += f", seed {run['seed']}"
        if run.get("edit_before_s"):
            label += f", editing {run['edit_before_s']:g} s before each cell"
        if run.get("seed") is not None:  # a schedule replayed at several commits
            label += f" (at {run['commit'][:7]})"
        out.append((label, run))
    return sorted(out, key=lambda lr: (lr[1]["sessions"], lr[1].get("seed") is not None, lr[0]))


def sessions_table() -> list[str]:
    doc = load("sessions-h100.json")
    static = doc["static_sessions"]
    out = [
        "| sessions | × static | cells | p50 / p95 cell | p50 / p95 over solo "
        "| p95 over solo, compute sharing alone | outside the cell's code (p50, kernel paused) "
        "| OOM | suspends | host memory peak |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, run in sessions_runs():
        solo = run["solo_p50_cell_s"]
        outside = run["p50_outside_s_by_state_before"]
        if run.get("edit_before_s"):
            away = f"{outside['idle']:.3f} s ({run['prefetched']} prefetched)"
        else:
            away = f"{outside['paused']:.3f} s"
            if "suspended" in outside:
                away += f" ({outside['suspended']:.2f} s suspended)"
        out.append(
            f"| {label} | {run['sessions'] / static:g}× | {run['cells']} "
            f"| {run['p50_cell_s']:.3f} / {run['p95_cell_s']:.3f} s "
            f"| {pct(run['p50_cell_s'] / solo)} / {pct(run['p95_cell_s'] / solo)} "
            f"| {pct(run['compute_share']['p95_over_solo'])} | {away} | {run['ooms']} | {run['suspends']} "
            f"| {run['host_used_peak_bytes'] / 1e9:.1f} GB |"
        )
    return out


def escapes_table() -> list[str]:
    """Every case of escapes-h100.json, in the order of benchmarks/escapes.py, with the
    rows its history keeps from before ``mapped_by`` where the last run lacks them."""
    doc = load("escapes-h100.json")
    rows = [(c, "") for c in doc["cases"]]
    rows += [
        (h["value"], f" ({h['date'][:10]}, before `mapped_by`)")
        for h in doc.get("history", [])
        if h["what"].startswith("the case ")
    ]
    names = escape_case_names()
    out = ["| escape | caught | after | action | known by |", "|---|---|---|---|---|"]
    for case, when in sorted(rows, key=lambda cw: names.index(cw[0]["name"])):
        caught = "yes" if case["caught"] else "**no**"
        action = f"{case['action']} after {case['seconds_to_action']:.2f} s" if case["action"] else "none"
        out.append(
            f"| {case['name']}{when} | {caught} | {case['seconds_to_catch']:.3f} s | {action} "
            f"| {case.get('mapped_by') or '—'} |"
        )
    return out


def escape_case_names() -> list[str]:
    """The case names of benchmarks/escapes.py, in its order."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import escapes

    return list(escapes.CASES)


TABLES: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "codec-paths": ("codec-h100.json", codec_table),
    "pause": ("pause-h100.json", pause_table),
    "pause-prepared": ("pause-prepared-h100.json", prepared_table),
    "sessions": ("sessions-h100.json", sessions_table),
    "escapes": ("escapes-h100.json", escapes_table),
}


# -- figures in the prose --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Claim:
    """A phrase of the README (``text``, a :meth:`str.format` template) whose figures come
    from ``file``: ``values()`` gives them, formatted."""

    name: str
    file: str
    text: str
    values: Callable[[], dict[str, str]]

    def rendered(self) -> str:
        return self.text.format(**self.values())

    def pattern(self) -> re.Pattern:
        """The phrase with any figures in the fields' places."""
        parts = []
        for literal, field, _, _ in string.Formatter().parse(self.text):
            parts.append(r"\s+".join(re.escape(w) for w in literal.split(" ")))
            if field is not None:
                parts.append(r"([-+−]?\d[\d.,]*%?)")
        return re.compile("".join(parts))


def _calibration() -> dict:
    doc = load("sessions-h100.json")
    t = doc["transformer"]
    return {
        "w": fig(doc["working_set_bytes"] / GiB),
        "solo": fig(doc["solo_cell_s"]),
        "peak": fig(doc["session_peak_bytes"] / GiB, 1),
        "static": str(doc["static_sessions"]),
        "steps": str(doc["steps_per_cell"]),
        "t_w": fig(t["working_set_bytes"] / 1e9),
        "t_peak": fig(t["session_peak_bytes"] / 1e9),
        "t_static": str(t["static_sessions"]),
        "t_steps": str(t["steps_per_cell"]),
        "t_solo": fig(t["solo_cell_s"]),
    }


def _liveness() -> dict:
    doc = load("liveness-h100.json")
    answers = {m: [r["message_seconds"] for r in doc["rows"] if r["mode"] == m] for m in ("pause", "suspend")}
    alone, beside = doc["neighbour"]["alone"], doc["neighbour"]["beside_a_stuck_restore"]
    return {
        "p_lo": fig(min(answers["pause"])),
        "p_hi": fig(max(answers["pause"])),
        "s_lo": fig(min(answers["suspend"])),
        "s_hi": fig(max(answers["suspend"])),
        "restart": fig(doc["lifecycle"]["restart_seconds"]),
        "shutdown": fig(doc["lifecycle"]["shutdown_seconds"]),
        "beside_s": fig(beside["suspend_seconds"]),
        "beside_r": fig(beside["restore_seconds"]),
        "alone_s": fig(alone["suspend_seconds"]),
        "alone_r": fig(alone["restore_seconds"]),
    }


def _codec() -> dict:
    doc = load("codec-h100.json")
    now = {(w["name"], w["path"]): w for w in doc["workloads"]}
    before = {(w["name"], w["path"]): w for w in history(doc, "the run before")["workloads"]}
    nv, nv0 = now[("bf16_weights", "nvcomp")], before[("bf16_weights", "nvcomp")]
    direct = [w[("bf16_weights", "nvcomp-direct")] for w in (now, before)]
    pauses = sorted(w["offload_gbps"] for w in direct)
    resumes = sorted(w["resume_gbps"] for w in direct)
    resume_ratios = sorted(w["resume_gbps"] / w["raw_h2d_gbps"] for w in (nv, nv0))
    return {
        "host": fig(nv["host_bytes"] / nv["gpu_bytes"]),
        "pause_lo": fig(min(w["offload_gbps"] / w["raw_d2h_gbps"] for w in (nv, nv0))),
        "pause_hi": fig(max(w["offload_gbps"] / w["raw_d2h_gbps"] for w in (nv, nv0))),
        "resume_lo": fig(resume_ratios[0]),
        "resume_hi": fig(resume_ratios[1]),
        "short": fig(1.3 - resume_ratios[0]),
        "zstd_resume": fig(now[("bf16_weights", "zstd")]["resume_gbps"], 1),
        "at_once": fig(nv["resume_right_after_pause_gbps"], 1),
        "direct_pause": f"{pauses[0]:.0f}-{pauses[1]:.0f}",
        "direct_resume": f"{resumes[0]:.0f}-{resumes[1]:.0f}",
    }


def _fresh() -> dict:
    by_idle = load("resume-fresh-h100.json")["resume_gbps_by_idle_s"]
    return {k: f"{by_idle[v]:.0f}" for k, v in (("at0", "0.0"), ("at5", "0.005"), ("at10", "0.01"))}


def _pause() -> dict:
    doc = load("pause-h100.json")
    big = doc["workloads"][-1]
    before = history(doc, "the run before")
    first = history(doc, "the first run on the H100")
    redesign = history(doc, "the last run before issue 40")
    return {
        "redesign_commit": next(h["commit"][:7] for h in doc["history"] if h["value"] is redesign),
        "redesign_p": fig(redesign["workloads"][-1]["pause_s"]),
        "redesign_r": fig(redesign["workloads"][-1]["resume_s"]),
        "redesign_overhead": f"{redesign['step_overhead_idle'] * 100:+.2f}%",
        "before_p": fig(before["workloads"][-1]["pause_s"]),
        "before_r": fig(before["workloads"][-1]["resume_s"]),
        "first_p": fig(first["workloads"][-1]["pause_s"]),
        "first_r": fig(first["workloads"][-1]["resume_s"]),
        "out": fig(big["pause_vs_raw_d2h"]),
        "in": fig(big["resume_vs_raw_h2d"]),
        "pre": fig(doc["step_s_preloaded"] * 1e3),
        "plain": fig(doc["step_s_plain"] * 1e3),
        "overhead": f"{doc['step_overhead_idle'] * 100:+.2f}%",
        "before_overhead": f"{(before['step_s_preloaded'] / before['step_s_plain'] - 1) * 100:+.1f}%",
    }


def _prepared() -> dict:
    small, big = load("pause-prepared-h100.json")["workloads"]
    return {
        "r8": fig(small["resume_s"], 3),
        "r32": fig(big["resume_s"], 3),
        "raw8": fig(small["raw_h2d_s"], 3),
        "raw32": fig(big["raw_h2d_s"], 3),
        "x8": fig(small["resume_s"] / small["raw_h2d_s"]),
        "x32": fig(big["resume_s"] / big["raw_h2d_s"]),
        "step": f"{load('pause-prepared-h100.json')['step_overhead_idle'] * 100:+.2f}%",
    }


def _run(**match) -> dict:
    """The one sessions-h100.json run whose fields are ``match``."""
    runs = [r for r in load("sessions-h100.json")["runs"] if all(r.get(k) == v for k, v in match.items())]
    if len(runs) != 1:
        raise LookupError(f"{len(runs)} runs of sessions-h100.json match {match}")
    return runs[0]


SEED7 = {
    "sessions": 32,
    "seed": 7,
    "edit_before_s": 0.0,
    "commit": "02c86665fbf10bca40e8420b7520192a143760e6",
}
SEED7_EDIT = {"sessions": 32, "seed": 7, "edit_before_s": 2.0}
#: Seed 7 again after issue 40's redesign (the arbiter split, the host floor).
SEED7_RERUN = {
    "sessions": 32,
    "seed": 7,
    "edit_before_s": 0.0,
    "commit": "d37fa5c9682aa3f134b98efd312853bccab4fc6a",
}
UNSEEDED = {"sessions": 32, "seed": None, "edit_before_s": 0.0, "host_memory_limit": "96G", "think_s": 180.0}
UNSEEDED_EDIT = {
    "sessions": 32,
    "seed": None,
    "edit_before_s": 2.0,
    "host_memory_limit": "96G",
    "think_s": 180.0,
}
DEFAULT_BUDGET = {"sessions": 32, "workload": "mlp", "edit_before_s": 0.0, "host_memory_limit": None}
TRANSFORMER = {"sessions": 44, "workload": "transformer", "seed": 7, "share_pieces": None}
TRANSFORMER_EARLIER = {"sessions": 44, "workload": "transformer", "seed": None}
#: The first run of 44 sessions from one checkpoint with sharing that works (the codec's
#: output slots zeroed, a3c2822), on an H200 kept to the H100's card and calibration.
TRANSFORMER_SHARED = {
    "sessions": 44,
    "workload": "transformer",
    "share_pieces": "all",
    "commit": "b06209b8065b0586cb56bf5a1d4305ea2ab37197",
}


def over(run: dict, key: str) -> float:
    return run[key] / run["solo_p50_cell_s"]


def met(run: dict) -> int:
    return round(run["compute_share"]["met_another"] * run["cells"])


def _p95_points(*runs: dict) -> str:
    points = sorted((over(r, "p95_cell_s") - r["compute_share"]["p95_over_solo"]) * 100 for r in runs)
    return f"{points[0]:.0f}-{points[-1]:.0f}"


def _rerun() -> dict:
    run = _run(**SEED7_RERUN)
    return {
        "commit": run["commit"][:7],
        "p50": pct(over(run, "p50_cell_s")),
        "p95": pct(over(run, "p95_cell_s")),
        "ooms": str(run["ooms"]),
        "pauses": str(run["pauses"]),
        "peak": f"{run['host_used_peak_bytes'] / 1e9:.1f}",
    }


def _multigpu() -> dict:
    rows = {(w["cards"], w["name"].split(" GiB")[0]): w for w in load("multigpu-h200x2.json")["workloads"]}
    one, two = rows[(1, "8")], rows[(2, "8")]
    return {
        "p1": fig(one["pause_s"], 3),
        "r1": fig(one["resume_s"], 3),
        "p2": fig(two["pause_s"], 3),
        "r2": fig(two["resume_s"], 3),
        "s1": fig(one["suspend_s"]),
        "t1": fig(one["restore_s"]),
        "s2": fig(two["suspend_s"]),
        "t2": fig(two["restore_s"]),
    }


def _sessions() -> dict:
    seed, seed_edit = _run(**SEED7), _run(**SEED7_EDIT)
    plain, edit = _run(**UNSEEDED), _run(**UNSEEDED_EDIT)
    twelve, twenty = (
        _run(sessions=12, background_pauses="on a quiet card"),
        _run(sessions=20, background_pauses="on a quiet card"),
    )
    away = sorted(r["p50_outside_s_by_state_before"]["paused"] for r in (seed, plain))
    return {
        "cs12": pct(twelve["compute_share"]["p95_over_solo"]),
        "cs20": pct(twenty["compute_share"]["p95_over_solo"]),
        "m12": pct(over(twelve, "p95_cell_s")),
        "m20": pct(over(twenty, "p95_cell_s")),
        "away": f"{away[0]:.2f}-{away[1]:.2f}",
        "p50_seed": pct(over(seed, "p50_cell_s")),
        "alone_seed": str(seed["cells"] - met(seed)),
        "cells": str(seed["cells"]),
        "back": str(seed_edit["prefetched"]),
        "idle": fig(seed_edit["p50_outside_s_by_state_before"]["idle"]),
        "p50_seed_edit": pct(over(seed_edit, "p50_cell_s")),
        "refused": str(seed_edit["cells"] - seed_edit["prefetched"]),
        "p50_plain": pct(over(plain, "p50_cell_s")),
        "met_plain": str(met(plain)),
        "cs50_plain": pct(plain["compute_share"]["p50_over_solo"]),
        "pts_seed": _p95_points(seed, seed_edit),
        "p95_seed": pct(over(seed, "p95_cell_s")),
        "p95_seed_edit": pct(over(seed_edit, "p95_cell_s")),
        "cs95_seed": pct(seed["compute_share"]["p95_over_solo"]),
        "pts_plain": _p95_points(plain, edit),
        "p95_plain": pct(over(plain, "p95_cell_s")),
        "p95_edit": pct(over(edit, "p95_cell_s")),
        "cs95_plain": pct(plain["compute_share"]["p95_over_solo"]),
        "cs95_edit": pct(edit["compute_share"]["p95_over_solo"]),
        "met_seed": str(met(seed)),
    }


def _draws(sessions: int, cell: float) -> dict:
    row = next(
        r for r in load("compute-share.json")["runs"] if r["sessions"] == sessions and r["cell_s"] == cell
    )
    return row


def _compute_share() -> dict:
    mlp, transformer = _draws(32, 1.046), _draws(44, 0.94)
    return {
        "met": f"{mlp['share']['met_another'] * 100:.0f}",
        "p95": pct(mlp["share"]["p95_over_solo"]),
        "queue": pct(mlp["one at a time"]["p95_over_solo"]),
        "within": f"{mlp['share']['runs_within_p95_goal'] * 100:.1f}",
        "t_p95": pct(transformer["share"]["p95_over_solo"]),
        "t_within": f"{transformer['share']['runs_within_p95_goal'] * 100:.1f}",
    }


def _default_budget() -> dict:
    run = _run(**DEFAULT_BUDGET)
    return {
        "p50": pct(over(run, "p50_cell_s")),
        "p95": pct(over(run, "p95_cell_s")),
        "suspends": str(run["suspends"]),
        "contexts": f"{run['sessions'] * load('sessions-h100.json')['context_bytes'] / 1e9:.0f}",
    }


def _think30() -> dict:
    sixteen = _run(sessions=16, think_s=30.0)
    thirty_two = _run(sessions=32, think_s=30.0)
    return {
        "p50_16": fig(sixteen["p50_cell_s"]),
        "p95_16": fig(sixteen["p95_cell_s"]),
        "o50_16": pct(over(sixteen, "p50_cell_s")),
        "o95_16": pct(over(sixteen, "p95_cell_s")),
        "p50_32": fig(thirty_two["p50_cell_s"], 1),
        "p95_32": fig(thirty_two["p95_cell_s"], 1),
        "busy": str(thirty_two["cells_by_state_before"]["active"]),
        "cells": str(thirty_two["cells"]),
    }


def _transformer() -> dict:
    run, earlier = _run(**TRANSFORMER), _run(**TRANSFORMER_EARLIER)
    h200 = load("sessions-transformer-h200.json")["runs"][0]
    calibration = load("sessions-h100.json")["transformer"]
    return {
        "p50": fig(run["p50_cell_s"]),
        "o50": pct(over(run, "p50_cell_s")),
        "p95": fig(run["p95_cell_s"]),
        "o95": pct(over(run, "p95_cell_s")),
        "cs95": pct(run["compute_share"]["p95_over_solo"]),
        "spills": str(run["spills"]),
        "disk": fig(run["p50_outside_s_by_state_before"]["paused"], 1),
        "refused": str(run["cells"] - run["prefetches"]),
        "h200": fig(h200["host_used_peak_bytes"] / 1e9, 1),
        "e_suspends": str(earlier["suspends"]),
        "e_p50": pct(over(earlier, "p50_cell_s")),
        "contexts": f"{run['sessions'] * calibration['context_bytes'] / 1e9:.0f}",
    }


def _transformer_shared() -> dict:
    run = _run(**TRANSFORMER_SHARED)
    pieces, here = run["shared_pieces"], run["solo_here"]["solo_p50_cell_s"]
    return {
        "held": fig(pieces["held_bytes"] / 1e9),
        "referenced": fig(pieces["referenced_bytes"] / 1e9, 1),
        "peak": fig(run["host_used_peak_bytes"] / 1e9, 1),
        "spills": str(run["spills"]),
        "ooms": str(run["ooms"]),
        "p50": fig(run["p50_cell_s"], 3),
        "o50": pct(over(run, "p50_cell_s")),
        "here": fig(here, 3),
        "o50_here": pct(run["p50_cell_s"] / here),
        "inner": fig(run["p50_inner_s"], 3),
    }


def _two_gpus() -> dict:
    doc = load("sessions-h200x2.json")
    run = doc["runs"][0]
    return {
        "static": str(doc["static_sessions"]),
        "sessions": str(run["sessions_started"]),
        "p50": fig(run["p50_cell_s"], 3),
        "solo": fig(run["solo_p50_cell_s"], 3),
        "o50": pct(over(run, "p50_cell_s")),
        "p95": fig(run["p95_cell_s"]),
        "o95": pct(over(run, "p95_cell_s")),
        "p99": fig(run["p99_cell_s"]),
        "host": f"{run['host_used_peak_bytes'] / 1e9:.0f}",
    }


def _four_gpus() -> dict:
    doc = load("sessions-h200x4.json")
    run = doc["runs"][0]
    static = doc["static_sessions"] * doc["gpus"]
    return {
        "static": str(doc["static_sessions"]),
        "batch": f"{doc['model']['batch']:,}",
        "peak": fig(doc["session_peak_bytes"] / 2**30, 1),
        "sessions": str(run["sessions"]),
        "times": f"{run['sessions'] / static:.0f}",
        "p50": fig(run["p50_cell_s"], 3),
        "solo": fig(run["solo_p50_cell_s"], 3),
        "o50": pct(over(run, "p50_cell_s")),
        "p95": fig(run["p95_cell_s"]),
        "o95": pct(over(run, "p95_cell_s")),
        "c95": pct(run["compute_share"]["p95_over_solo"]),
        "host": f"{run['host_used_peak_bytes'] / 1e9:.0f}",
    }


def _other_card() -> dict:
    """The two-GPU test's caught process, from the JSON line the test prints into its log."""
    log = (RESULTS / "gpu-tests-h200x2.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith('{"took"'))
    seen = json.loads(line)
    return {
        "warned": fig(seen["warned"]["time"] - seen["took"]),
        "ended": fig(seen["killed"]["time"] - seen["warned"]["time"], 1),
    }


def _escapes() -> dict:
    doc = load("escapes-h100.json")
    cases = doc["cases"] + [h["value"] for h in doc.get("history", []) if h["what"].startswith("the case ")]
    return {"slowest": fig(max(c["seconds_to_catch"] for c in cases), 3)}


def _mps() -> dict:
    clients = load("mps-h100.json")["clients"]
    full, quarter = clients["100% share, no pinned limit"], clients["25% share, 2 GiB budget"]
    return {
        "sms": str(quarter["sms"]),
        "all": str(full["sms"]),
        "q": fig(quarter["matmul_s"]),
        "f": fig(full["matmul_s"]),
    }


def _watchdog_gpu() -> dict:
    doc = load("watchdog-h100.json")
    return {
        "median": fig(doc["cpu_ms_per_look_median"], 1),
        "nvml": fig(doc["nvml_cpu_ms_per_look_median"], 1),
        "core": fig(doc["cpu_percent_at_1s_poll"], 1),
    }


def _watchdog_cpu() -> dict:
    doc = load("watchdog-cpu.json")
    return {"median": fig(doc["cpu_ms_per_look_median"], 1), "core": fig(doc["cpu_percent_at_1s_poll"])}


def _hub() -> dict:
    doc = load("hub-usage.json")
    return {"servers": str(doc["servers"]), "gpus": str(doc["gpus"]), "median": fig(doc["ms_median"], 1)}


def _slurm() -> dict:
    doc = load("slurm-cpu.json")
    nodes = sorted(doc["slices_per_node"].values())
    per_gpu = sorted(doc["slices_per_gpu"].items())
    first = [v for k, v in per_gpu if k.startswith(per_gpu[0][0].split()[0])]
    return {
        "p50": fig(doc["p50_s"], 1),
        "max": fig(doc["max_s"], 1),
        "local_p50": fig(doc["local_p50_s"], 1),
        "local_max": fig(doc["local_max_s"], 1),
        "nodes": " and ".join(str(n) for n in nodes),
        "gpus": " and ".join(str(n) for n in sorted(first, reverse=True)),
    }


def _offload() -> dict:
    rows = [w for w in load("offload-h100.json")["workloads"] if "zero" not in w["workload"]]
    off = sorted(w["offload_gbps"] for w in rows)
    back = sorted(w["restore_gbps"] for w in rows)
    return {"off": f"{off[0]:.1f}-{off[-1]:.1f}", "back": f"{back[0]:.1f}-{back[-1]:.1f}"}


def _host_budget() -> dict:
    plain = _run(**UNSEEDED)
    default = _run(**DEFAULT_BUDGET)
    return {
        "peak": f"{plain['host_used_peak_bytes'] / 1e9:.0f}",
        "default": pct(over(default, "p50_cell_s")),
        "held": pct(over(plain, "p50_cell_s")),
    }


def _hosttier() -> dict:
    runs = load("hosttier-h100.json")["sharing"]
    off, on = runs["off"], runs["all"]
    return {
        "n": str(off["kernels"]),
        "weights": f"{off['weights_bytes'] / 2**30:.0f}",
        "own": f"{off['own_bytes'] / 2**20:.0f}",
        "off": fig(off["host_bytes_per_kernel"] / 1e9, 2),
        "on": fig(on["host_bytes_per_kernel"] / 1e9, 2),
    }


#: The 12x runs made with time-slicing measured, the seventeenth to nineteenth tries
#: (docs/design.md): each commit's time-sliced runs in its cell-tails file (which may hold
#: other runs).
TIME_SLICED_COMMITS = ("a15fe60", "02e18cf", "32f9a63")
#: The 12x runs with every kernel an MPS client, the nineteenth try.
MPS_COMMIT = "32f9a63"


def _time_sliced() -> dict:
    eleven = [
        r["memory_path_points"]
        for commit in TIME_SLICED_COMMITS
        for r in load(f"cell-tails-{commit}-h100.json")["runs"]
        if r["commit"].startswith(commit) and r["seed"] == 11
    ]
    sliced = sorted(m["time_slicing"] for m in eleven)
    even = sorted(m["even"] for m in eleven)
    return {
        "runs": str(len(eleven)),
        "within": str(sum(s <= 10 for s in sliced)),
        "s_lo": f"{sliced[0]:.1f}",
        "s_hi": f"{sliced[-1]:.1f}",
        "e_lo": f"{even[0]:.0f}",
        "e_hi": f"{even[-1]:.0f}",
    }


def _mps_sessions() -> dict:
    """The memory path's share of p95 (points of the solo cell, against even sharing) of
    the 12x runs made as MPS clients, by seed."""
    runs = load(f"cell-tails-{MPS_COMMIT}-mps-h100.json")["runs"]
    share = {r["seed"]: r["memory_path_points"]["even"] for r in runs if r["commit"].startswith(MPS_COMMIT)}
    return {f"s{seed}": f"{share[seed]:.1f}" for seed in (11, 7, 23)}


#: The 12x runs with cells taking turns of 2 s, the twentieth try.
TURNS_COMMIT = "4734218"


def _turns() -> dict:
    """The p50 over the solo cell of the 12x runs with cells taking turns of 2 s, by seed
    (seed 23 twice, in the order run), and seed 23's sharing the card under MPS."""
    every = load("sessions-h100.json")["runs"]
    runs = [r for r in every if r["commit"].startswith(TURNS_COMMIT)]
    if not runs or any(r["arbiter"]["turn_wait"] != 2.0 for r in runs):
        raise LookupError(f"the runs of {TURNS_COMMIT} in sessions-h100.json are not all with turns of 2 s")
    p50 = {}
    for run in runs:
        p50.setdefault(run["seed"], []).append(pct(over(run, "p50_cell_s")))
    [shared] = [r for r in every if r["commit"].startswith(MPS_COMMIT) and r["seed"] == 23]
    return {
        "p23": p50[23][0],
        "p23b": p50[23][1],
        "p11": p50[11][0],
        "p7": p50[7][0],
        "share23": pct(over(shared, "p50_cell_s")),
    }


def _mps_totals() -> dict:
    """The card's total speed of 2 to 4 MLP steps together, as MPS clients and
    time-sliced, measured one after the other on one card."""
    mps = load("time-slicing-mps-h200.json")["card_total_by_contexts"].values()
    sliced = load("time-slicing-33df4e6-h200.json")["card_total_by_contexts"].values()
    return {
        "m_lo": f"{min(mps):.2f}",
        "m_hi": f"{max(mps):.2f}",
        "t_lo": f"{min(sliced):.2f}",
        "t_hi": f"{max(sliced):.2f}",
    }


CLAIMS = [
    Claim(
        "time slicing: the card's total as MPS clients",
        "time-slicing-mps-h200.json",
        "({m_lo}-{m_hi} of the card in all, time-sliced {t_lo}-{t_hi})",
        _mps_totals,
    ),
    Claim(
        "sessions: 12x with cells taking turns",
        "sessions-h100.json",
        "with 2 s the p50 was {p23} and {p23b} of a solo cell on seed 23 (sharing: {share23}), {p11} on "
        "seed 11 and {p7} on seed 7",
        _turns,
    ),
    Claim(
        "sessions: 12x as MPS clients",
        f"cell-tails-{MPS_COMMIT}-mps-h100.json",
        "with every kernel an MPS client, {s11}, {s7} and {s23} points on seeds 11, 7 and 23 "
        "against even sharing",
        _mps_sessions,
    ),
    Claim(
        "sessions: seed 11 with time-slicing's cost",
        "cell-tails-02e18cf-h100.json",
        "on seed 11, {runs} runs gave {s_lo} to {s_hi} points ({within} within 10) against the "
        "compute-sharing model with time-slicing's measured cost, {e_lo}-{e_hi} against even sharing",
        _time_sliced,
    ),
    Claim(
        "hosttier: pieces held once",
        "hosttier-h100.json",
        "kernels holding the same {weights} GiB of bf16 weights and {own} MiB of their\nown held {off} GB of "
        "host memory each when paused, and {on} GB each with sharing on",
        _hosttier,
    ),
    Claim(
        "liveness: answers",
        "liveness-h100.json",
        "answered in {p_lo}–{p_hi} s paused and {s_lo}–{s_hi} s suspended, a restart of a suspended "
        "kernel took {restart} s and a shutdown {shutdown} s",
        _liveness,
    ),
    Claim(
        "liveness: a neighbour",
        "liveness-h100.json",
        "suspended in {beside_s} s and restored in {beside_r} s beside a restore that never returned, "
        "{alone_s} s and {alone_r} s alone",
        _liveness,
    ),
    Claim("codec: host bytes", "codec-h100.json", "host bytes {host}× the raw bytes", _codec),
    Claim("codec: pause", "codec-h100.json", "Pause {pause_lo}× and {pause_hi}× the raw copy", _codec),
    Claim(
        "codec: resume",
        "codec-h100.json",
        "Resume {resume_lo}× and {resume_hi}× (goal 1.3×): met on one machine, {short} short on the other",
        _codec,
    ),
    Claim("codec: zstandard resume", "codec-h100.json", "path's resume {zstd_resume} GB/s (goal 8)", _codec),
    Claim("codec: resume at once", "codec-h100.json", "({at_once} GB/s for bf16 weights)", _codec),
    Claim(
        "resume into fresh memory",
        "resume-fresh-h100.json",
        "{at0} GB/s right after the pause, {at5} after 5 ms, {at10} from 10 ms on",
        _fresh,
    ),
    Claim(
        "codec: without graphs",
        "codec-h100.json",
        "paused bf16 weights at {direct_pause} GB/s and resumed them at {direct_resume}",
        _codec,
    ),
    Claim(
        "pause: the runs before",
        "pause-h100.json",
        "32 GiB {before_p} s / {before_r} s; before the batched copy-out (the first run on the H100) "
        "{first_p} s / {first_r} s",
        _pause,
    ),
    Claim(
        "pause: before the redesign",
        "pause-h100.json",
        "before issue 40's redesign, at {redesign_commit}: 32 GiB {redesign_p} s / {redesign_r} s, a "
        "training step {redesign_overhead}",
        _pause,
    ),
    Claim(
        "pause: against the raw copy",
        "pause-h100.json",
        "beats the raw copy out by {out}× and the resume the raw copy in by {in}×",
        _pause,
    ),
    Claim(
        "pause: training step",
        "pause-h100.json",
        "took {pre} ms against {plain} ms without it ({overhead}; the run before: {before_overhead})",
        _pause,
    ),
    Claim(
        "pause prepared: resume",
        "pause-prepared-h100.json",
        "Resume in the same run: {r8} s at 8 GiB and {r32} s at 32 GiB, against raw pinned copies in "
        "of {raw8} s and {raw32} s ({x8}× and {x32}× of the raw copy",
        _prepared,
    ),
    Claim(
        "pause prepared: step",
        "pause-prepared-h100.json",
        "a training step {step} with the allocator",
        _prepared,
    ),
    Claim("sessions: the working set", "sessions-h100.json", "each holding W = {w} GiB", _calibration),
    Claim(
        "sessions: the cell and the peak",
        "sessions-h100.json",
        "a cell is {steps} training steps on a batch of 61,440 random tokens, {solo} s on an empty card, "
        "with a peak of {peak} GiB (W, gradients, activations, CUDA context), so static slices fit {static}",
        _calibration,
    ),
    Claim(
        "transformer: the calibration",
        "sessions-h100.json",
        "W {t_w} GB, peak {t_peak} GB, so static slices fit {t_static}; a cell is {t_steps} steps, "
        "{t_solo} s alone",
        _calibration,
    ),
    Claim(
        "sessions: the model at 12 and 20",
        "sessions-h100.json",
        "it gave {cs12} and {cs20} at 12 and 20 sessions where {m12} and {m20} were measured",
        _sessions,
    ),
    Claim(
        "sessions: p50",
        "sessions-h100.json",
        "takes {away} s more than solo: the resume of W and the arbiter's round trip. That is {p50_seed} at "
        "8× (seed 7, where {alone_seed} of {cells} cells met no other)",
        _sessions,
    ),
    Claim(
        "sessions: prefetch",
        "sessions-h100.json",
        "finds the kernel back already in {back} of {cells} cells ({idle} s outside their code); p50 is "
        "{p50_seed_edit} on the same schedule. The other {refused} prefetches were refused",
        _sessions,
    ),
    Claim(
        "sessions: the unseeded run",
        "sessions-h100.json",
        "had p50 {p50_plain} on a schedule where {met_plain} of {cells} cells met another: sharing alone "
        "gave that schedule p50 {cs50_plain}",
        _sessions,
    ),
    Claim(
        "sessions: p95 and the schedule",
        "sessions-h100.json",
        "added {pts_seed} points to p95 on seed 7's schedule ({p95_seed} and {p95_seed_edit} measured, "
        "{cs95_seed} by sharing alone) and {pts_plain} points on the two unseeded ones ({p95_plain} and "
        "{p95_edit}, against {cs95_plain} and {cs95_edit})",
        _sessions,
    ),
    Claim(
        "compute share: draws",
        "compute-share.json",
        "a cell meets another in {met}% of cases, and sharing alone puts p95 at {p95}",
        _compute_share,
    ),
    Claim("compute share: one at a time", "compute-share.json", "would be at {queue}", _compute_share),
    Claim(
        "compute share: one run's p95",
        "compute-share.json",
        "One run's own p95 is within +50% in {within}% of draws",
        _compute_share,
    ),
    Claim("sessions: seed 7", "sessions-h100.json", "({met_seed} of 32 cells met another)", _sessions),
    Claim(
        "a kernel of two cards",
        "multigpu-h200x2.json",
        "paused in {p2} s and resumed in {r2} s (an engine per device, nvCOMP on each), against {p1} s "
        "and {r1} s for the same bytes on one card; the driver's checkpoint of the whole process took "
        "{s2} s and its restore {t2} s (one card: {s1} s / {t1} s)",
        _multigpu,
    ),
    Claim(
        "sessions: seed 7 after the redesign",
        "sessions-h100.json",
        "replayed at {commit}, after the arbiter was split along its seams, ran at p50 {p50} and "
        "p95 {p95} with {ooms} out-of-memory errors, {pauses} pauses and a host memory peak of {peak} GB",
        _rerun,
    ),
    Claim(
        "sessions: default host budget",
        "sessions-h100.json",
        "ran at p50 {p50} and p95 {p95} (in the JSON)",
        _default_budget,
    ),
    Claim(
        "sessions: default host budget, contexts",
        "sessions-h100.json",
        "beside 32 CUDA contexts ({contexts} GB) had the arbiter suspend {suspends} kernels",
        _default_budget,
    ),
    Claim(
        "sessions: think 30",
        "sessions-h100.json",
        "16 sessions (4×) ran at p50 {p50_16} s and p95 {p95_16} s ({o50_16} and {o95_16} over solo), "
        "32 sessions (8×) at p50 {p50_32} s and p95 {p95_32} s",
        _think30,
    ),
    Claim(
        "sessions: think 30, busy",
        "sessions-h100.json",
        "({busy} of {cells} found their kernel still busy",
        _think30,
    ),
    Claim(
        "transformer: latencies",
        "sessions-h100.json",
        "p50 {p50} s ({o50}), p95 {p95} s ({o95}; sharing alone {cs95} on this schedule)",
        _transformer,
    ),
    Claim(
        "transformer: the disk tier",
        "sessions-h100.json",
        "So {spills} sets went to disk; a cell whose kernel came back from disk waited {disk} s at p50, "
        "and {refused} prefetches were refused",
        _transformer,
    ),
    Claim(
        "transformer: 256 GiB host",
        "sessions-transformer-h200.json",
        "peaked at {h200} GB in use",
        _transformer,
    ),
    Claim(
        "transformer: the earlier run",
        "sessions-h100.json",
        "had {e_suspends} suspends and p50 {e_p50}",
        _transformer,
    ),
    Claim(
        "transformer: contexts",
        "sessions-h100.json",
        "44 CUDA contexts also hold {contexts} GB",
        _transformer,
    ),
    Claim(
        "transformer, one checkpoint shared: host",
        "sessions-h100.json",
        "the node held {held} GB of pieces for {referenced} GB the kernels referenced, "
        "host memory in use peaked at {peak} GB, {spills} spills and {ooms} OOM",
        _transformer_shared,
    ),
    Claim(
        "transformer, one checkpoint shared: time",
        "sessions-h100.json",
        "p50 was {p50} s: {o50} over the H100's solo cell, {o50_here} over a solo cell timed on the same "
        "card in the same run ({here} s; the cells' own time at p50 was {inner} s)",
        _transformer_shared,
    ),
    Claim(
        "compute share: the transformer",
        "compute-share.json",
        "sharing alone gives a p95 of {t_p95} over random draws, and a run within +50% in {t_within}%",
        _compute_share,
    ),
    Claim(
        "escapes: the slowest catch",
        "escapes-h100.json",
        "Every escape was caught within {slowest} s of holding the memory",
        _escapes,
    ),
    Claim(
        "MPS",
        "mps-h100.json",
        "sees {sms} of the {all} SMs and runs 100 bf16 8192² matmuls in {q} s against {f} s at 100%",
        _mps,
    ),
    Claim(
        "two GPUs: the other card",
        "gpu-tests-h200x2.log",
        "was warned {warned} s after it held the memory and ended {ended} s later",
        _other_card,
    ),
    Claim(
        "two GPUs: sessions",
        "sessions-h200x2.json",
        "static partitioning fits {static} MLP sessions per card",
        _two_gpus,
    ),
    Claim(
        "two GPUs: sessions' latencies",
        "sessions-h200x2.json",
        "{sessions} sessions shared the two cards with cells at p50 {p50} s against {solo} s solo ({o50}), "
        "p95 {p95} s ({o95}), p99 {p99} s, no OOM, host memory peak {host} GB",
        _two_gpus,
    ),
    Claim(
        "four GPUs: sessions",
        "sessions-h200x4.json",
        "static partitioning fits {static} MLP sessions per card at a batch of {batch} tokens "
        "(a session's peak {peak} GiB)",
        _four_gpus,
    ),
    Claim(
        "four GPUs: sessions' latencies",
        "sessions-h200x4.json",
        "{sessions} sessions ({times}x static) shared the four cards with cells at p50 {p50} s against "
        "{solo} s solo ({o50}), p95 {p95} s ({o95}; {c95} had memory cost nothing), no OOM, host "
        "memory peak {host} GB",
        _four_gpus,
    ),
    Claim(
        "watchdog on the GPU",
        "watchdog-h100.json",
        "{median} ms of CPU per look median, of which NVML's per-process query is {nvml} ms: "
        "{core}% of a core",
        _watchdog_gpu,
    ),
    Claim(
        "Hub usage",
        "hub-usage.json",
        "with {servers} servers on {gpus} GPUs, {median} ms median",
        _hub,
    ),
    Claim(
        "watchdog on the CI box",
        "watchdog-cpu.json",
        "{median} ms per look, {core}% of a core",
        _watchdog_cpu,
    ),
    Claim(
        "Slurm spawns",
        "slurm-cpu.json",
        "p50 {p50} s, max {max} s (sbatch, Slurm's scheduling, `srun`, the server's start in the job and "
        "its port reaching the Hub), beside {local_p50} s p50 ({local_max} s max) with the local spawner",
        _slurm,
    ),
    Claim(
        "Slurm placement",
        "slurm-cpu.json",
        "The slices went {nodes} to the nodes, but {gpus} to each node's GPUs",
        _slurm,
    ),
    Claim(
        "per-tensor offload",
        "offload-h100.json",
        "({off} GB/s offload, {back} GB/s restore)",
        _offload,
    ),
    Claim(
        "host budget",
        "sessions-h100.json",
        "host memory in use peaked at {peak} GB",
        _host_budget,
    ),
    Claim(
        "host budget: p50",
        "sessions-h100.json",
        "(p50 {default} over solo); with `96G` nothing moved and p50 was {held}",
        _host_budget,
    ),
]


# -- checking and writing -------------------------------------------------------------------


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def table_block(name: str) -> re.Pattern:
    return re.compile(
        rf"(<!-- figures:{re.escape(name)} -->\n)(.*?)(<!-- /figures:{re.escape(name)} -->)", re.S
    )


def problems(readme: str) -> list[str]:
    """What in ``readme`` differs from the results files, one line each (none: it agrees)."""
    out = []
    for name, (source, make) in TABLES.items():
        found = table_block(name).search(readme)
        if not found:
            out.append(f"table {name} ({source}): no <!-- figures:{name} --> block in the README")
            continue
        want = "\n".join(make()) + "\n"
        if found.group(2) != want:
            have = found.group(2).splitlines()
            diff = [
                f"  README: {a}\n  {source}: {b}"
                for a, b in zip(have, want.splitlines(), strict=False)
                if a != b
            ]
            more = (
                ""
                if len(have) == len(want.splitlines())
                else f" ({len(have)} rows, not {len(want.splitlines())})"
            )
            out.append(f"table {name} differs from {source}{more}:\n" + "\n".join(diff))
    flat = _flat(readme)
    for claim in CLAIMS:
        want = claim.rendered()
        if _flat(want) in flat:
            continue
        match = claim.pattern().search(flat)
        if match:
            out.append(
                f"figure '{claim.name}': the README says '{match.group(0)}', {claim.file} gives '{want}'"
            )
        else:
            out.append(f"figure '{claim.name}': no phrase like '{want}' ({claim.file}) in the README")
    return out


def write_tables(readme: str) -> str:
    for name, (_, make) in TABLES.items():
        block = table_block(name)
        if not block.search(readme):
            raise SystemExit(f"README.md has no <!-- figures:{name} --> block to write")
        readme = block.sub(lambda m, make=make: m.group(1) + "\n".join(make()) + "\n" + m.group(3), readme)
    return readme


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="write the tables into the README, then check")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args()
    text = args.readme.read_text()
    if args.write:
        text = write_tables(text)
        args.readme.write_text(text)
    found = problems(text)
    for line in found:
        print(line)
    if found:
        sys.exit(1)
    print(f"{args.readme}: {len(TABLES)} tables and {len(CLAIMS)} figures agree with benchmarks/results/")


if __name__ == "__main__":
    main()
