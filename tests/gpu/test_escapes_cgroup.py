"""Escapes from the process tree on the real card: a kernel with a 2 GiB slice, in a
cgroup of its own as the local spawner starts servers, leaves a process behind in every
way that leaves the process tree, which takes 4 GiB; the arbiter (``kill`` after 1 s,
NVML every 0.25 s) maps it to the server by cgroup, catches it while it holds the memory
(the issue's 2 s is benchmarks/escapes.py's to measure) and ends it. A
GPU process of no server is reported and ended by default deny; an allowlisted one is
left alone."""

from __future__ import annotations

import os
import sys
import time

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import card_holder, escape_cases
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.preloaded import environment
from jupyter_vgpu.testing.waiting import wait_for

pytestmark = pytest.mark.gpu
GiB = 2**30
KILL = ("--over-budget=kill", "--ArbiterApp.grace_seconds=1", "--ArbiterApp.poll_seconds=0.25")


def decisions(arbiter: ArbiterProcess, since: float, prefix: str) -> list[dict]:
    return [d for d in arbiter.books()["decisions"] if d["what"].startswith(prefix) and d["time"] >= since]


@pytest.fixture(scope="module")
def card():
    gpu = nvml.list_gpus()[0]
    return gpu, Slice.on_card(gpu, 2 * GiB, 100)


@pytest.mark.parametrize("case", sorted(escape_cases.CASES))
def test_an_escape_from_the_tree_is_mapped_by_cgroup_caught_and_ended(tmp_path, card, case):
    gpu, slice_ = card
    arbiter = ArbiterProcess(tmp_path, *KILL).start()
    kernel = Kernel(tmp_path, environment(JUPYTER_VGPU_ARBITER=str(arbiter.socket)), load_extension=True)
    cgroup, why = escape_cases.server_cgroup(kernel.pid)
    if cgroup is None:
        kernel.shutdown()
        arbiter.stop()
        pytest.skip(f"no cgroup can be made here: {why}")
    try:
        with arbiter.control() as c:
            c.register(kernel.pid, "mallory", "", slice_, cgroup=str(cgroup))
        kernel.run("import os")
        since = time.time()
        took_file = tmp_path / "took"
        out = kernel.run(escape_cases.kernel_code(case, took_file), timeout=120)
        took = escape_cases.took_time(out)
        assert took is not None, out
        wait_for(lambda: decisions(arbiter, since, "over budget: kill"), 10, "the arbiter to end the escape")
        warned = decisions(arbiter, since, "over budget: warn")[0]
        killed = decisions(arbiter, since, "over budget: kill")[0]
        assert warned["mapped_by"] == "cgroup", warned
        assert warned["time"] - took < 8.0, (warned, took)  # caught while it holds the memory (12 s)
        assert killed["total"] >= escape_cases.HOLD
        wait_for(
            lambda: nvml.process_memory(gpu.uuid).get(killed["pid"]) is None, 10, "its memory to be freed"
        )
        assert killed["pid"] != kernel.pid, "the process that took the memory was ended, not the kernel"
    finally:
        kernel.shutdown()
        escape_cases.remove_cgroup(cgroup)
        arbiter.stop()


def test_a_gpu_process_of_no_server_is_reported_and_ended(tmp_path, card):
    arbiter = ArbiterProcess(tmp_path, *KILL).start()
    since = time.time()
    process = card_holder.hold(GiB)
    try:
        wait_for(lambda: process.poll() is not None, 10, "default deny to end the unowned process")
        warned = decisions(arbiter, since, "unowned: warn")
        killed = decisions(arbiter, since, "unowned: kill")
        assert [d["pid"] for d in warned] == [process.pid]
        assert [d["pid"] for d in killed] == [process.pid]
        # after the grace period, never before it (a loaded machine only makes it later)
        assert killed[0]["time"] - warned[0]["time"] >= 1.0
        assert "belongs to no vGPU server" in warned[0]["message"]
        assert arbiter.process.poll() is None, "the arbiter never ends itself"
    finally:
        process.kill()
        arbiter.stop()


def test_an_allowlisted_gpu_process_is_left_alone(tmp_path, card):
    python = os.path.realpath(sys.executable)
    arbiter = ArbiterProcess(tmp_path, *KILL, f'--ArbiterApp.allowed_executables=["{python}"]').start()
    since = time.time()
    process = card_holder.hold(GiB)
    try:
        time.sleep(3)  # three grace periods
        assert process.poll() is None, "an allowlisted program was ended"
        assert not decisions(arbiter, since, "unowned")
    finally:
        process.kill()
        arbiter.stop()
