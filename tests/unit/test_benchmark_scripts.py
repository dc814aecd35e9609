"""Every benchmark says how it is run (``--help``) and records where its figures come
from (``benchmarks/provenance.py``)."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
#: Modules the scripts share, not scripts themselves.
SHARED = {"gpu_common.py", "provenance.py", "step_workers.py"}
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name not in SHARED)

#: ``sessions.start_arbiter``'s arguments as its command line gives them: no card of its
#: own to manage (``gpu_uuids`` empty), so the arbiter's default
ARBITER_ARGS = argparse.Namespace(
    watermark=0.6,
    suspend_after=3600.0,
    host_memory_limit="",
    card_reserve=0,
    share_pieces="off",
    room_ahead="on",
    room_held_seconds=0.0,
    trim_before_spill="on",
    node_even_contexts=False,
    grant_on_demand=False,
    grant_margin="1G",
    suspend_wait=0.0,
    turn_wait=0.0,
    release_first=False,
    local_memory=False,
    gpu_uuids=[],
)


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_answers_help(script):
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: "), done.stdout[:500]


@pytest.mark.parametrize("script", ["sessions.py", "sessions_tail.py"])
def test_a_time_slicing_file_without_rates_is_refused_with_its_name(script, tmp_path):
    bad = tmp_path / "slicing.json"
    bad.write_text('{"solo_p50_step_s": 0.15}')
    args = ["--out", str(tmp_path / "out.json"), "--time-slicing", str(bad)]
    if script == "sessions_tail.py":
        args += ["--sessions", str(ROOT / "benchmarks/results/sessions-h100.json"), "--commits", "a15fe60"]
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True)
    assert done.returncode == 2  # argparse's usage error, before any work
    assert f"--time-slicing: {bad}: no time-slicing rates" in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "out.json").exists()


def test_sessions_tail_reads_one_backends_runs_with_that_backends_own_speeds(tmp_path):
    # 32f9a63 ran seeds 11, 7 and 23 under MPS and seed 11 time-sliced beside the first
    sessions = str(ROOT / "benchmarks/results/sessions-h100.json")
    results = ROOT / "benchmarks/results"

    def tail(commits, isolation, slicing):
        out = tmp_path / f"{commits}-{isolation}.json"
        args = ["--sessions", sessions, "--commits", commits, "--isolation", isolation, "--out", str(out)]
        done = subprocess.run(
            [sys.executable, str(BENCHMARKS / "sessions_tail.py"), *args, "--time-slicing", str(slicing)],
            capture_output=True,
            text=True,
        )
        return done, out

    done, out = tail("32f9a63", "mps", results / "time-slicing-mps-32f9a63-h200.json")
    assert done.returncode == 0, done.stderr[-2000:]
    mps = json.loads(out.read_text())
    assert [r["seed"] for r in mps["runs"]] == [11, 7, 23]
    assert mps["isolation"] == "mps"
    assert mps["time_slicing"]["file"].endswith("mps-32f9a63-h200.json")
    done, out = tail("32f9a63", "time-slicing", results / "time-slicing-02e18cf-h200.json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [r["seed"] for r in json.loads(out.read_text())["runs"]] == [11]
    # runs from before the field ran time-sliced: none of them is an MPS run
    done, out = tail("a15fe60", "mps", results / "time-slicing-mps-h200.json")
    assert done.returncode == 1
    assert not out.exists()
    assert "no run of a15fe60 under mps" in done.stderr, done.stderr[-2000:]


def test_a_record_names_the_commit_the_date_the_machine_and_the_command(monkeypatch):
    provenance = load("provenance")
    monkeypatch.setattr(sys, "argv", ["benchmarks/x.py", "--out", "x.json"])
    record = provenance.record()
    assert set(record) == set(provenance.KEYS)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert record["commit"] == head.stdout.strip()
    assert record["dirty"] in (True, False)
    when = datetime.datetime.fromisoformat(record["date"])
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    assert record["command"] == ["benchmarks/x.py", "--out", "x.json"]
    machine = record["machine"]
    assert machine["host_memory_bytes"] > 0
    assert isinstance(machine["gpu"], str)
    assert machine["gpu"]
    assert (machine["driver"] is None) == (machine["gpu"] == "cpu")


def test_a_copy_without_git_takes_the_commit_from_the_environment(monkeypatch):
    provenance = load("provenance")
    monkeypatch.setattr(provenance, "_git", lambda *args: None)
    monkeypatch.setenv("JUPYTER_VGPU_COMMIT", "abc123")
    assert provenance.commit() == ("abc123", None)
    monkeypatch.delenv("JUPYTER_VGPU_COMMIT")
    assert provenance.commit() == (None, None)


def test_the_commit_given_in_the_environment_wins_over_a_git_directory(monkeypatch):
    # a GPU machine's copy of the tree held a stale git directory: its HEAD was not the tree's
    provenance = load("provenance")
    monkeypatch.setattr(provenance, "_git", lambda *args: "stale\n" if args[0] == "rev-parse" else "")
    monkeypatch.setenv("JUPYTER_VGPU_COMMIT", "abc123")
    assert provenance.commit() == ("abc123", None)
    monkeypatch.delenv("JUPYTER_VGPU_COMMIT")
    assert provenance.commit() == ("stale", False)


def test_an_earlier_record_moves_into_the_history_once():
    provenance = load("provenance")
    earlier = {
        "commit": "old",
        "date": "2026-11-20T00:00:00+00:00",
        "provenance": "git log of this file",
        "command": ["a"],
        "runs": [1],
    }
    now = {"commit": "new", "dirty": False, "date": "2026-11-27T00:00:00+00:00", "command": ["b"]}
    doc = provenance.stamped(earlier, now)
    assert {k: doc[k] for k in now} == now
    assert doc["runs"] == [1]
    assert [(h["commit"], h["command"]) for h in doc["history"]] == [("old", ["a"])]
    assert "provenance" not in doc, "how the earlier record was found goes with it"
    assert doc["history"][0]["provenance"] == "git log of this file"
    assert provenance.stamped(doc, now) == doc  # the run's own record is not history


@pytest.mark.parametrize("local_memory", [False, True])
def test_the_kernels_settings_of_a_sessions_run_reach_the_kernel_side(monkeypatch, local_memory):
    """What ``--local-memory`` puts on the kernels' command lines sets the kernel's trait
    (a misspelt setting would be ignored by traitlets, not refused), and the solo session
    that carries it is still a context manager."""
    from traitlets.config.loader import KVArgParseConfigLoader

    from jupyter_vgpu.kernel.config import VGPUKernel

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    argv = list(sessions.kernel_settings(argparse.Namespace(local_memory=local_memory)))
    config = KVArgParseConfigLoader(argv=argv).load_config()
    assert VGPUKernel(config=config).give_back_local_memory is local_memory
    made = sessions.solo_session(argparse.Namespace(), None)  # nothing runs before it is entered
    assert hasattr(made, "__enter__")
    assert hasattr(made, "__exit__")


def test_same_checkpoint_sessions_load_one_checkpoint_and_only_the_adapters_differ(tmp_path, monkeypatch):
    import argparse
    import ast

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when the script runs: its neighbours import
    sessions = load("sessions")
    ask = argparse.Namespace(workload="transformer", tune="lora", tokens=2048, checkpoint=tmp_path / "base")
    shared = sessions.setup_code(argparse.Namespace(**vars(ask), same_checkpoint=True))
    own = sessions.setup_code(argparse.Namespace(**vars(ask), same_checkpoint=False))
    ast.parse(shared), ast.parse(own)  # each a cell Python can run
    assert f"from_pretrained({str(tmp_path / 'base')!r}" in shared
    assert "if '':" in own  # built from the session's own seed instead
    # the adapters are drawn after the session's seed in both
    assert shared.index('manual_seed(int(os.environ.get("SESSION"') < shared.index("class LoRA")
    assert sessions.model_of(argparse.Namespace(**vars(ask), same_checkpoint=True))["same_checkpoint"] is True
    for flag, said in (
        ("--same-checkpoint", "--same-checkpoint is the transformer's"),
        ("--solo-here", "--solo-here times this card beside a --calibration"),
    ):
        refused = subprocess.run(
            [sys.executable, str(BENCHMARKS / "sessions.py"), flag, "--out", str(tmp_path / "o")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 2
        assert said in refused.stderr


def test_sessions_count_what_the_arbiter_did_from_its_counters_not_its_kept_decisions(tmp_path, monkeypatch):
    """A long run outlives the arbiter's decision log (the last 200): the four-card run
    reported no suspends while 81 cells came back from one. The counts come from the
    arbiter's Prometheus counters instead: the real registry's page parses to what was
    counted, and a real arbiter serves its page to the harness."""

    from prometheus_client import generate_latest

    from jupyter_vgpu.node.metrics import Metrics

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    metrics = Metrics()
    for _ in range(250):  # more than the decision log keeps
        metrics.pauses.labels(gpu="GPU-a", reason="room").inc()
    metrics.pauses.labels(gpu="GPU-b", reason="idle").inc()
    for _ in range(81):
        metrics.suspends.labels(gpu="GPU-a").inc()
    metrics.prefetches.labels(gpu="GPU-a", outcome="granted").inc()
    metrics.prefetches.labels(gpu="GPU-a", outcome="no room").inc()
    metrics.spills.inc()
    for _ in range(3):
        metrics.releases.labels(gpu="GPU-b").inc()
    page = generate_latest(metrics.registry).decode()
    assert sessions.counts_from_metrics(page) == {
        "pauses": 251, "suspends": 81, "releases": 3, "spills": 1, "prefetches": 1
    }  # fmt: skip

    arbiter = sessions.start_arbiter(tmp_path, ARBITER_ARGS)
    try:
        assert sessions.arbiter_counts(arbiter) == {
            "pauses": 0, "suspends": 0, "releases": 0, "spills": 0, "prefetches": 0
        }  # fmt: skip
    finally:
        arbiter.stop()


def test_sessions_report_each_kernel_processs_host_memory_from_the_arbiters_books(tmp_path, monkeypatch):
    """The run's output carries the kernels' own host memory at its end (PSS, anonymous,
    RSS: mean, max, sum), from a real arbiter's books about a real kernel."""

    from jupyter_vgpu.slice import Slice
    from jupyter_vgpu.testing.kernel_runner import Kernel
    from jupyter_vgpu.testing.waiting import wait_for

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    arbiter = sessions.start_arbiter(tmp_path, ARBITER_ARGS)
    env = {"JUPYTER_VGPU_ARBITER": str(arbiter.socket), "JUPYTER_VGPU_CHANNEL": "", "JUPYTER_VGPU_SLICE": ""}
    kernel = None
    try:
        assert sessions.process_figures(arbiter.books()) == {
            "kernels": 0, "pss_bytes": None, "anon_bytes": None, "rss_bytes": None,
        }  # fmt: skip
        kernel = Kernel(tmp_path, env)
        with arbiter.control() as c:
            c.register(kernel.pid, "ada", "", Slice("GPU-sim", 0, "card", 2**30, 2**29, 50, simulated=True))
        books = wait_for(
            lambda: (b := arbiter.books())["kernels"] and b["kernels"][0]["process"] and b,
            30,
            "the kernel's process measured in the books",
        )
        figures = sessions.process_figures(books)
        seen = books["kernels"][0]["process"]
        assert figures["kernels"] == 1
        for key in ("pss_bytes", "anon_bytes", "rss_bytes"):
            assert figures[key] == {"mean": seen[key], "max": seen[key], "sum": seen[key]}, (key, figures)
        assert 0 < figures["pss_bytes"]["sum"] < figures["rss_bytes"]["sum"]  # its libraries are shared
    finally:
        if kernel is not None:
            kernel.shutdown()
        arbiter.stop()


def test_a_stalled_cells_stacks_list_every_thread_of_the_process(tmp_path, monkeypatch):
    """``sessions.dump_stacks``, what a run keeps of a kernel whose cell stalled: one line
    per thread of the process (its name, state and wait channel, from /proc), whether or
    not py-spy is installed."""
    import os
    import threading

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    done = threading.Event()
    waiter = threading.Thread(target=done.wait, name="vgpu-waiter")
    waiter.start()
    try:
        name = sessions.dump_stacks(os.getpid(), tmp_path / "stacks.txt")
        tasks = {t.name for t in Path(f"/proc/{os.getpid()}/task").iterdir()}
    finally:
        done.set()
        waiter.join()
    lines = [line for line in (tmp_path / name).read_text().splitlines() if " state " in line]
    assert {line.split()[0] for line in lines} >= {str(waiter.native_id)}, lines
    assert len(lines) >= len(tasks) - 1, (lines, tasks)  # a thread may end between the looks


def test_a_stalled_cell_keeps_what_it_printed_while_it_waited(tmp_path, monkeypatch):
    """``Session.timed`` on a cell that gives no reply in time: ``Stalled`` carries what the
    cell printed meanwhile (a cell waiting for room prints why), and ``stall_of`` keeps its
    last line beside what a real arbiter's books and the kernel's process say, and with
    ``--logs`` the stacks and the arbiter's log so far."""

    from jupyter_vgpu.testing.kernel_runner import Kernel

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    arbiter = sessions.start_arbiter(tmp_path, ARBITER_ARGS)
    kernel = Kernel(tmp_path, {})
    try:
        code = (
            "import time\n"
            "print('waiting 1 s: queued', flush=True)\n"
            "print('waiting 2 s: queued behind bob', flush=True)\n"
            "time.sleep(30)"
        )
        with pytest.raises(sessions.Stalled) as stalled:
            sessions.Session.timed(kernel, code, timeout=3)
        assert "waiting 2 s: queued behind bob" in stalled.value.said
        kernel.index, kernel.report = 3, dict  # what a Session adds to a kernel
        logs = tmp_path / "logs"
        logs.mkdir()
        entry = sessions.stall_of(kernel, None, 0.0, arbiter, logs, stalled.value.said)
        assert (entry["session"], entry["cycle"], entry["said"]) == (
            3,
            None,
            "waiting 2 s: queued behind bob",
        )
        assert (entry["arbiter_state"], entry["alive"]) == (None, True)  # never registered; alive
        assert {p.name for p in logs.iterdir()} == {
            "stacks-kernel-3.txt",
            "stacks-arbiter-at-3.txt",
            "arbiter-at-3.log",
        }
    finally:
        kernel.shutdown()
        arbiter.stop()


def test_with_logs_each_kernels_package_log_goes_to_its_log_file(tmp_path, monkeypatch):
    """``sessions.KERNEL_LOG``, run first in each session's setup with ``--logs``: the
    package's info lines and the pieces' debug lines reach the kernel's log file, not
    the cell's output."""
    from jupyter_vgpu.testing.kernel_runner import Kernel
    from jupyter_vgpu.testing.waiting import wait_for

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    log = tmp_path / "kernel-0.log"
    kernel = Kernel(tmp_path, {}, log=log)
    try:
        out = kernel.run(
            sessions.KERNEL_LOG + "_logging.getLogger('jupyter_vgpu').info('paused in 0.1 s')\n"
            "_logging.getLogger('jupyter_vgpu.pieces').debug('piece at +0 of its range: kept')\n"
            "_logging.getLogger('jupyter_vgpu.other').debug('not this one')"
        )
        assert out.strip() == ""
        wait_for(
            lambda: "piece at +0 of its range: kept" in log.read_text(), 10, "the piece's line in the log"
        )
        text = log.read_text()
        assert "jupyter_vgpu paused in 0.1 s" in text, text
        assert "not this one" not in text, text
    finally:
        kernel.shutdown()


def test_a_part_measured_again_goes_into_the_results_file_with_its_own_record(monkeypatch):
    """``hosttier.merge``: the disk part measured at a later commit replaces the file's,
    carrying its own commit and date; the part it replaced is kept under ``earlier``
    with the file's record, and the parts not measured again stay as they were."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    hosttier = load("hosttier")
    into = {"commit": "a" * 40, "date": "2026-11-27", "command": ["x"], "machine": {"gpu": "H100"},
            "sharing": {"all": 1}, "disk": {"resume_s": 5.33}}  # fmt: skip
    part = {"commit": "b" * 40, "date": "2026-11-28", "command": ["y"], "machine": {"gpu": "H100"},
            "disk": {"resume_s": 4.19}}  # fmt: skip
    merged = hosttier.merge(into, part)
    assert merged["commit"] == "a" * 40
    assert merged["sharing"] == {"all": 1}
    assert merged["disk"]["resume_s"] == 4.19
    assert (merged["disk"]["run"]["commit"], merged["disk"]["run"]["date"]) == ("b" * 40, "2026-11-28")
    (earlier,) = merged["earlier"]
    assert (earlier["part"], earlier["resume_s"], earlier["run"]["commit"]) == ("disk", 5.33, "a" * 40)


def test_the_disk_read_sweep_reads_every_byte_of_the_file_in_order(tmp_path, monkeypatch):
    """``disk_reads.windowed_read`` reads as a resume reads its spill file (windows into
    a few buffers, ahead of their use, each split into parallel reads): the bytes it
    read, in file order, are the file's, for a file that ends inside a window; and a
    sweep reports every setting, marking the reader's as shipped where it is among them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    disk_reads = load("disk_reads")
    from jupyter_vgpu.kernel.pause import parallel_read, spill

    path = tmp_path / "file.bin"
    crc = disk_reads.write_file(path, 9 * 2**20 + 12345)
    for threads, task, window in ((1, 2**20, 2**20), (4, 2**20, 4 * 2**20), (3, 3 * 2**20, 8 * 2**20)):
        seconds, _, got = disk_reads.windowed_read(path, threads, task, window, 3, check=True)
        assert got == crc, (threads, task, window)
        assert seconds > 0
    _, direct, got = disk_reads.windowed_read(path, 2, 2**20, 4 * 2**20, 3, check=True, direct=False)
    assert (direct, got) == (False, crc)  # through the page cache: the same bytes
    found = disk_reads.sweep(path, [2, parallel_read.READ_THREADS], [parallel_read.TASK_BYTES],
                             [spill.WINDOW], spill.BUFFERS, 1, (True, False))  # fmt: skip
    marks = [(r["threads"], r["direct"], r["default"]) for r in found["settings"]]
    n, on_disk = parallel_read.READ_THREADS, marks[0][1]  # tmpfs before Linux 6.6 takes no O_DIRECT
    assert marks == [(2, on_disk, False), (2, False, False), (n, on_disk, True), (n, False, False)]
    assert found["file_bytes"] == path.stat().st_size
    assert found["best"] in found["settings"]


def test_the_tail_counts_prefetched_cells_that_waited_at_their_start_for_room_made_then(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tail = load("sessions_tail")
    t0 = 1000.0

    def cell(session, start, outside, inner=1.0):
        return {"session": session, "start": t0 + start, "cell_s": outside + inner, "inner_s": inner}

    def said(what, at, server, **fields):
        return {"time": t0 + at, "what": what, "server": server, **fields}

    run = {
        "commit": "0" * 40,
        "seed": 1,
        "solo_here": {"solo_p50_cell_s": 1.0},
        "cells_detail": [cell(1, 10, 0.6), cell(2, 30, 0.5), cell(3, 50, 0.05)],
        "decisions": [
            said("pause", 0, "user9/", reason="idle", seconds=0.08, released=1),
            # user8's slabs let go: the pause made for user1 below pins again
            said("trim", 5, "user8/", message="1.50 GiB of pinned host memory let go"),
            # user1: prefetched, then its room made as its cell began (a pause of 0.55 s, a cell running)
            said("prefetch", 8.5, "user1/"),
            said("pause", 10.55, "user8/", reason="room for user1/", seconds=0.5, released=1),
            # user2: prefetched with a room ahead, and still a suspend at its start
            said("prefetch", 28.2, "user2/"),
            said("suspend", 29.0, "user7/", reason="room ahead for user2/", seconds=0.8),
            said("queued", 30.05, "user2/", message="waiting for one of the 1 running cell(s) to end"),
            said("suspend", 30.45, "user6/", reason="room for user2/", seconds=0.4),
            # user3: not prefetched, its room made at its start: not counted
            said("pause", 50.04, "user5/", reason="room for user3/", seconds=0.03, released=1),
            # user9's slabs let go, user8's trim gave nothing back: user9's next pause pins again
            said("trim", 55, "user9/", message="1.50 GiB of pinned host memory let go"),
            said("trim", 55, "user8/", message="0 B of pinned host memory let go"),
            said("pause", 60.7, "user9/", reason="idle", seconds=0.7, released=1),
            said("pause", 60.1, "user8/", reason="idle", seconds=0.1, released=1),
        ],
    }
    out = tail.of_run(run)
    assert out["prefetched_cells"] == 2
    waited = out["waited_for_room_at_start"]
    assert (waited["cells"], waited["over_0_4_s"], waited["without_room_ahead"]) == (2, 2, 1)
    assert [w["session"] for w in waited["each"]] == [1, 2]
    assert waited["outside_s_max"] == pytest.approx(0.6)
    # three cells apart: the model gives each its solo second, and their code took that
    assert out["inner_excess_s"]["p95"] == pytest.approx(0.0)
    pauses = out["pauses_by_cells_running"]
    assert (pauses["0"]["pauses"], pauses["0"]["seconds"]) == (4, [0.5, 0.03, 0.7, 0.1])
    slabs = out["pauses_by_slabs"]
    assert (slabs["warm"]["seconds"], slabs["pinned_again"]["seconds"]) == ([0.03, 0.1], [0.5, 0.7])
    # the cells from the one below the p95 up, slowest first: user1, then user2
    first, second = out["slowest_cells"]
    assert (first["session"], second["session"]) == (1, 2)
    assert first["outside_s"] == pytest.approx(0.6)
    assert first["room_made_for_it"] == [
        {"what": "pause", "server": "user8/", "seconds": 0.5, "released": 1, "pinned_again": True}
    ]
    assert not first["waited_for_a_running_cell"]
    assert second["waited_for_a_running_cell"]
    assert [m["what"] for m in second["room_made_for_it"]] == ["suspend"]


def test_the_tail_sets_a_runs_p95_beside_the_model_evenly_shared_and_time_sliced(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tail = load("sessions_tail")
    # two cells that met from their start, one alone: the model gives 2, 2 and 1 s
    # evenly, 2.5, 2.5 and 1 s where two together run at 0.4 of their speed each
    run = {
        "gpus": 1,
        "p95_cell_s": 2.6,
        "cells_detail": [
            {"start": 0.0, "session": 0},
            {"start": 0.0, "session": 1},
            {"start": 9.0, "session": 2},
        ],
    }
    points = tail.memory_path_points(run, 1.0, {2: 0.4})
    assert points == pytest.approx({"even": 60.0, "time_slicing": 10.0})
    # a solo cell of 2 s: the model's cells take 4, 4 and 2 s, and the points are of 2 s
    assert tail.memory_path_points(run, 2.0) == pytest.approx({"even": -70.0})


def test_the_tail_reads_a_run_whose_cells_took_turns_against_the_model_with_those_turns(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tail = load("sessions_tail")
    # two cells sent together, one alone: shared evenly they take 2, 2 and 1 s; taking
    # turns of up to 5 s, the first takes 1 s and the second waits 1 s, then runs: 2 s
    cells = [{"start": 0.0, "session": 0}, {"start": 0.0, "session": 1}, {"start": 9.0, "session": 2}]
    run = {"gpus": 1, "p95_cell_s": 2.1, "cells_detail": cells, "arbiter": {"turn_wait": 5.0}}
    # the model's p95 with turns: 1.9 s of 1, 1, 2 s (linear); sharing: 2 s
    assert tail.memory_path_points(run, 1.0) == pytest.approx({"even": 10.0, "turns": 20.0})
    # on a card whose own solo cell is 2 s: the model with turns gives 2, 4 and 2 s
    run["solo_here"] = {"solo_p50_cell_s": 2.0}
    assert tail.memory_path_points(run, 1.0)["turns_here"] == pytest.approx((2.1 - 3.8) / 2.0 * 100)
    # turns off, or a run from before the setting: no turns model
    for arbiter in ({"turn_wait": 0.0}, {}):
        run["arbiter"] = arbiter
        assert set(tail.memory_path_points(run, 1.0)) == {"even"}


def test_the_tail_sets_each_cell_beside_its_runs_own_model_turns_included(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tail = load("sessions_tail")

    def cell(session, start, cell_s, inner_s):
        return {"session": session, "start": start, "cell_s": cell_s, "inner_s": inner_s, "step_s": [inner_s]}

    # two cells sent together took turns: the second waited 1.05 s for the first, then
    # ran its 1 s: 0.05 s more than the model's 2 s, spent handing the card over
    run = {
        "commit": "0" * 40,
        "seed": 1,
        "arbiter": {"turn_wait": 2.0},
        "solo_here": {"solo_p50_cell_s": 1.0},
        "cells_detail": [cell(0, 100.0, 1.0, 1.0), cell(1, 100.0, 2.05, 1.0)],
        "decisions": [
            {"time": 99.0, "what": "prefetch", "server": "user9/"},
            {"time": 101.05, "what": "turn", "server": "user1/", "seconds": 1.05, "message": "its turn came"},
        ],
    }
    out = tail.of_run(run)
    assert out["turn_wait"] == 2.0
    assert out["cell_excess_s"]["p95"] == pytest.approx(0.05 * 0.95 + 0.0 * 0.05)
    slowest = out["slowest_cells"][0]
    assert (slowest["session"], slowest["model_s"]) == (1, pytest.approx(2.0))
    assert slowest["waited_for_a_running_cell"]
    # the same cells read as if shared (no turns): each model latency 2 s
    run["arbiter"] = {}
    out = tail.of_run(run)
    assert out["turn_wait"] is None
    assert out["cell_excess_s"]["p50"] == pytest.approx((-1.0 + 0.05) / 2)


def test_step_workers_run_together_in_one_window_and_time_the_steps_inside_it():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import step_workers
    finally:
        sys.path.remove(str(BENCHMARKS))
    workers = step_workers.start("import time\ndef step():\n    time.sleep(0.02)\n", ["A", "B"])
    try:
        steps = step_workers.run_together(workers, 1.0)
    finally:
        step_workers.stop(workers)
    lo, hi = step_workers.window(steps, 1.0)
    assert hi - lo == pytest.approx(1.0 - 2 * step_workers.TRIM_S)
    for name in ("A", "B"):
        assert steps[name][0][0] == pytest.approx(lo - step_workers.TRIM_S, abs=0.05)  # one instant for both
        assert 0.02 <= step_workers.median_step(steps[name], lo, hi) < 0.1
    assert step_workers.median_step(steps["A"], hi, hi) is None


def test_time_slicings_workers_run_the_sessions_own_mlp_cell(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    slicing = load("time_slicing")
    # the sessions' own cell at a small size, on the CPU: it builds, trains and steps
    code = slicing.setup(64, 1, 32).replace('"cuda"', '"cpu"').replace("torch.cuda.synchronize()", "pass")
    scope: dict = {}
    exec(compile(code, "time_slicing.setup", "exec"), scope)
    scope["step"]()
    assert len(scope["step_seconds"]) == 1


def test_the_tail_sorts_steps_by_the_pair_of_states_that_shared_the_card(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    tail = load("sessions_tail")

    def cell(session, code_begins, state, steps):
        return {
            "session": session,
            "start": code_begins - 0.01,
            "cell_s": 0.01 + sum(steps),
            "inner_s": sum(steps),
            "state_at_edit": state,
            "step_s": steps,
        }

    cells = [
        # a paused kernel's cell alone for a step, then beside a restored one for two
        cell(1, 100.0, "paused", [0.15, 0.6, 0.6]),
        cell(2, 100.15, "suspended", [0.2] * 6),
        # alone
        cell(3, 150.0, "paused", [0.15, 0.15]),
        # a step only partly beside another cell, and one beside two: neither counted
        cell(4, 200.0, "paused", [0.15, 0.15]),
        cell(5, 200.2, "suspended", [0.3]),
        cell(6, 300.0, "paused", [1.0]),
        cell(7, 300.1, "paused", [0.2]),
        cell(8, 300.5, "suspended", [0.2]),
    ]
    pairs = tail.steps_by_pair(cells)
    assert pairs == {
        "alone": pytest.approx([0.15, 0.15, 0.15, 0.15]),
        "paused beside paused": pytest.approx([0.2]),
        "paused beside suspended": pytest.approx([0.6, 0.6]),
        "suspended beside paused": pytest.approx([0.2] * 6 + [0.2]),
    }


def test_even_contexts_cycles_each_process_once_and_keeps_going_past_one_the_driver_refuses(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    calls = []

    class Refused(Exception):
        pass

    class Driver:  # jupyter_vgpu.host.checkpoint's surface; no GPU here to call the real one
        CheckpointError = Refused

        @staticmethod
        def suspend(pid):
            calls.append(("suspend", pid))
            if pid == 2:
                raise Refused("cuCheckpointProcessLock failed: CUDA_ERROR_ILLEGAL_STATE")

        @staticmethod
        def restore(pid):
            calls.append(("restore", pid))

    out = sessions.even_contexts([1, 2, 3], Driver)
    assert calls == [("suspend", 1), ("restore", 1), ("suspend", 2), ("suspend", 3), ("restore", 3)]
    assert out["cycled"] == 2
    assert out["refused"] == ["2: cuCheckpointProcessLock failed: CUDA_ERROR_ILLEGAL_STATE"]


def test_a_row_counts_what_the_arbiters_even_contexts_did_from_its_decisions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its neighbours import, as when it runs
    sessions = load("sessions")
    decisions = [
        {"what": "evened", "seconds": 0.9},
        {"what": "pause", "seconds": 0.07},
        {"what": "evened", "seconds": 0.5},
        {"what": "evened", "seconds": 0.6},
        {"what": "even refused", "message": "CUDA_ERROR_NOT_SUPPORTED"},
        {"what": "even: restore waits", "message": "no room"},
    ]
    assert sessions.node_evened(decisions) == {"evened": 3, "p50_s": 0.6, "refused": 1, "restore_waits": 1}
    assert sessions.node_evened([])["p50_s"] is None


def test_a_row_counts_the_cells_requests_to_grow_from_the_arbiters_decisions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its neighbours import, as when it runs
    sessions = load("sessions")
    decisions = [
        {"what": "grown", "seconds": 0.3, "bytes": 2 << 30},
        {"what": "pause", "seconds": 0.07},
        {"what": "grown", "seconds": 0.0, "bytes": 1 << 30},
        {"what": "grown", "seconds": 1.2, "bytes": 4 << 30},
    ]
    assert sessions.grown(decisions) == {"grown": 3, "p50_s": 0.3, "max_s": 1.2, "bytes": 7 << 30}
    assert sessions.grown([]) == {"grown": 0, "p50_s": None, "max_s": None, "bytes": 0}


def test_a_ballasts_watermark_pauses_where_the_smaller_cards_would(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its neighbours import, as when it runs
    sessions = load("sessions")
    card, total = 85_520_809_984, 150_754_820_096  # an H100's memory, an H200's
    ballast = total - card
    here = sessions.watermark_beside(0.6, card, ballast, total)
    assert 0.6 < here < 1
    for kernels in range(0, card, 1 << 30):  # the kernels' bytes, on either card
        assert (kernels <= 0.6 * card) == (kernels + ballast <= here * total), kernels
    assert sessions.watermark_beside(0.6, card, 0, card) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="leaves nothing"):
        sessions.watermark_beside(0.6, card, total, total)
    with pytest.raises(ValueError, match="watermark"):
        sessions.watermark_beside(1.5, card, ballast, total)


def test_a_row_counts_the_cells_that_waited_for_a_running_cell_from_the_arbiters_decisions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its neighbours import, as when it runs
    sessions = load("sessions")
    decisions = [
        {"what": "queued", "server": "user3/", "message": "waiting on GPU 0: its room would need paused "
         "kernels suspended: waiting for one of the 2 running cell(s) to end (up to 3 s)"},
        {"what": "queued", "server": "user4/", "message": "waiting for GPU memory on GPU 0: ..."},
        {"what": "suspend", "server": "user9/", "reason": "room for user4/"},
        {"what": "queued", "server": "user7/", "message": "waiting for one of the 1 running cell(s) to end"},
    ]  # fmt: skip
    assert sessions.waited_for_a_cell(decisions) == {"cells": 2, "servers": ["user3/", "user7/"]}
    assert sessions.waited_for_a_cell([]) == {"cells": 0, "servers": []}


@pytest.mark.parametrize("commit", ["COMMIT_SHA", "f922f59", ""])
def test_gpu_steps_refuses_to_start_without_the_full_commit_its_records_will_name(commit, tmp_path):
    script = ROOT / "scripts" / "gpu-steps"
    env = {"PATH": "/usr/bin:/bin", "JUPYTER_VGPU_COMMIT": commit, "HOME": str(tmp_path)}
    done = subprocess.run(["bash", str(script), "start", "parts"], env=env, capture_output=True, text=True)
    assert done.returncode == 2, done
    assert "must be the full commit" in done.stderr


def test_an_mps_sessions_run_gives_its_kernels_the_arbiters_daemon_and_the_slices_limits(
    tmp_path, monkeypatch
):
    """``--isolation mps``: each kernel gets the pipe directory of the daemon the arbiter
    keeps for its card (the one the spawner gives a server) and MPS's client limits from
    its slice; without it, nothing more. Where no daemon can start (no driver here), the
    run stops with the reason rather than measuring kernels that are no MPS clients."""
    from jupyter_vgpu.host.socket_path import mps_pipe_directory
    from jupyter_vgpu.node.mps import MPSUnavailable
    from jupyter_vgpu.slice import Slice

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    short = Path(tempfile.mkdtemp(prefix="vgpu-"))  # as the run's: the daemon's sockets must fit sun_path
    uuid, socket = "GPU-8d5b7c1e-0000-0000-0000-000000000001", str(short / "arbiter.sock")
    budget = 17 * 2**30
    mps = Slice(uuid, 0, "H100", 80 * 2**30, budget, 100, isolation="mps")
    with sessions.mps_daemons(argparse.Namespace(isolation="time-slicing"), socket, [uuid]) as pipes:
        assert pipes == {}
        assert sessions.mps_environment(mps, pipes) == {}
    env = sessions.mps_environment(mps, {uuid: mps_pipe_directory(socket, uuid)})
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == mps_pipe_directory(socket, uuid)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={budget >> 20}M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert not {k for k in env if not k.startswith("CUDA_MPS_")}, "the rest is Session's own"
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-cuda-mps-control
    refused = pytest.raises(MPSUnavailable, match="nvidia-cuda-mps-control")
    with refused, sessions.mps_daemons(argparse.Namespace(isolation="mps"), socket, [uuid]):
        pass
    shutil.rmtree(short)


def test_a_row_counts_the_cells_that_waited_their_turn_from_the_arbiters_decisions(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sessions = load("sessions")
    decisions = [
        {"what": "turn", "server": "user3/", "seconds": 0.4, "message": "behind 1 running cell(s) and 0 in "
         "line: its turn came"},
        {"what": "queued", "server": "user4/", "message": "waiting for GPU memory on GPU 0: ..."},
        {"what": "turn", "server": "user5/", "seconds": 2.0, "message": "behind 1 running cell(s) and 1 in "
         "line: its 2 s wait ran out"},
        {"what": "turn", "server": "user6/", "seconds": 1.0, "message": "behind 0 running cell(s) and 1 in "
         "line: its turn came"},
        {"what": "turn", "server": "user7/", "seconds": 0.5, "message": "behind 1 running cell(s) and 0 in "
         "line: the 1 cell(s) running had run 2 s: it runs beside them"},
    ]  # fmt: skip
    assert sessions.turns_taken(decisions) == pytest.approx(
        {"cells": 4, "ran_beside": 2, "p50_s": 0.75, "p95_s": 1.85}
    )
    assert sessions.turns_taken([]) == {"cells": 0, "ran_beside": 0, "p50_s": None, "p95_s": None}


@pytest.mark.parametrize(("given", "says"), [("0", "each must be > 0"), ("2,x", "seconds, comma-separated")])
def test_compute_share_refuses_a_turn_wait_it_cannot_model(tmp_path, given, says):
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "compute_share.py"), "--turn-wait", given, "--out", str(out)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"--turn-wait: {says}" in done.stderr, done.stderr[-2000:]
    assert not out.exists()
