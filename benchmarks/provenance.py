"""Where a benchmark's figures come from: what every results file records beside them.

:func:`record` gives the keys every benchmark writes at the top of its JSON:

- ``commit``: the environment's ``JUPYTER_VGPU_COMMIT`` where it is set (a GPU machine
  given a copy of the work tree: ``JUPYTER_VGPU_COMMIT=$(git rev-parse HEAD)`` where the
  copy is made; such a copy may hold a stale git directory), else the checkout's
  ``git rev-parse HEAD``, else None;
- ``dirty``: whether tracked files differed from that commit (None where unknown);
- ``date``: when the run began, ISO 8601 in UTC;
- ``command``: the command line it was started with (``sys.argv``);
- ``machine``: the GPUs NVML lists (name, memory) with the driver's version, or
  ``"gpu": "cpu"`` where NVML has none; the host's memory (``MemTotal``), CPUs,
  Python, and PyTorch's version where the benchmark has imported it.

A file that later runs add to keeps each part's own record: runs appended to a sessions
output carry :func:`run_record`, and what an earlier output holds and a run keeps moves
under ``history`` (:func:`carried`), one entry per earlier record.

Usage: ``doc = {**provenance.record(), **figures}``, taken once when the run begins.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The keys :func:`record` writes.
KEYS = ("commit", "dirty", "date", "command", "machine")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def commit() -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout this file is in (see the module's doc)."""
    given = os.environ.get("JUPYTER_VGPU_COMMIT")
    if given:  # said where the copy was made: a copy may hold a stale git directory
        return given, None
    head = _git("rev-parse", "HEAD")
    if head is None:
        return None, None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return head.strip(), None if status is None else bool(status.strip())


def host_memory_bytes() -> int | None:
    """``MemTotal`` of /proc/meminfo, bytes (None where there is none)."""
    from jupyter_vgpu.host.meminfo import meminfo

    return meminfo().get("MemTotal")


def gpus() -> dict:
    """``{"gpu": name of the first GPU, "gpus": [{"name", "memory_bytes"}], "driver": version}``
    from NVML (:mod:`jupyter_vgpu.nvml`), or ``{"gpu": "cpu", "gpus": [], "driver": None,
    "nvml": why}`` without one."""
    from jupyter_vgpu import nvml

    try:
        cards = [{"name": g.name, "memory_bytes": g.memory_total} for g in nvml.list_gpus()]
        driver = nvml.driver_version()
    except nvml.NVMLUnavailable as e:  # no library, no driver: a machine without a GPU
        return {"gpu": "cpu", "gpus": [], "driver": None, "nvml": str(e)}
    return {"gpu": cards[0]["name"] if cards else "cpu", "gpus": cards, "driver": driver}


def machine() -> dict:
    """The machine a run is on: GPUs and driver (:func:`gpus`), host memory, CPUs, Python,
    and PyTorch's version where it is imported already (never imported here)."""
    out = {
        **gpus(),
        "host_memory_bytes": host_memory_bytes(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = getattr(torch, "__version__", None)
    return out


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def run_record() -> dict:
    """``commit``, ``dirty``, ``date`` and ``command`` of this run, for a part of a file
    that runs at several commits add to (a sessions output's runs)."""
    head, dirty = commit()
    return {"commit": head, "dirty": dirty, "date": now(), "command": list(sys.argv)}


def record() -> dict:
    """Every key of :data:`KEYS` for this run (see the module's doc); take it once, when
    the run begins."""
    return {**run_record(), "machine": machine()}


#: Keys of an earlier record that move with it: :data:`KEYS` and ``provenance``, the note
#: of how a file written before this module got its commit and date.
CARRIED = (*KEYS, "provenance")


def carried(earlier: dict, what: str) -> dict:
    """A ``history`` entry for the record of an earlier output whose figures a new run
    keeps: its provenance keys (those it has, :data:`CARRIED`) and ``what`` it held."""
    return {**{k: earlier[k] for k in CARRIED if k in earlier}, "what": what}


def stamped(figures: dict, provenance: dict) -> dict:
    """``figures`` with ``provenance`` first; an earlier record ``figures`` carried at its
    top (an output read back to add to) moves into its ``history``, unless it is this
    very record."""
    out = dict(figures)
    earlier = {k: out.pop(k) for k in CARRIED if k in out}
    if earlier and any(earlier.get(k) != provenance.get(k) for k in ("commit", "date", "command")):
        history = out.pop("history", [])
        history.append(carried(earlier, "the figures of this file that the run above did not measure again"))
        out["history"] = history
    return {**provenance, **out}


def write(doc: dict, out: str | os.PathLike | None) -> None:
    """Print ``doc`` as indented JSON and write it to ``out`` (its folder made if need be;
    nothing written where ``out`` is None)."""
    text = json.dumps(doc, indent=2)
    print(text)
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
