"""The driver's checkpoint calls, each bounded (:mod:`jupyter_vgpu.node.checkpoint_pool`),
with the recording stand-in answering in the workers as the driver would: a call that
never returns is given up at its deadline (its worker ended) with a message naming it,
and a call about another kernel made meanwhile is answered at once by another worker."""

import os
import signal
import subprocess
import sys
import threading

import pytest

from jupyter_vgpu.host import checkpoint, procs
from jupyter_vgpu.node.checkpoint_pool import CheckpointPool, CheckpointTimeout
from jupyter_vgpu.testing import checkpoint_standin
from jupyter_vgpu.testing.waiting import wait_for


@pytest.fixture
def standin(tmp_path, monkeypatch):
    log = tmp_path / "checkpoint.jsonl"
    monkeypatch.setenv(checkpoint_standin.ENV, str(log))
    return log


def test_calls_are_answered_by_the_workers(standin):
    pool = CheckpointPool(size=2)
    try:
        me = os.getpid()
        assert pool.state(me) == "running"
        assert pool.suspend([me], nbytes=0) == 0.0
        assert pool.state(me) == "checkpointed"
        assert pool.restore([me], {"GPU-x": 1}) == 0.0
        assert [c["call"] for c in checkpoint_standin.calls(str(standin))] == [
            "state",
            "suspend",
            "state",
            "restore",
        ]
    finally:
        pool.close()


def test_a_restore_that_never_returns_is_given_up_and_holds_no_one_else(standin, monkeypatch):
    monkeypatch.setenv(checkpoint.HANG_ENV, f"restore:{os.getpid()}")
    pool = CheckpointPool(size=4, base_timeout=2.0)
    try:
        stuck: dict = {}

        def restore():
            try:
                pool.restore([os.getpid()])
            except CheckpointTimeout as e:
                stuck["error"] = str(e)

        t = threading.Thread(target=restore)
        t.start()
        # meanwhile another kernel's question is answered, by another worker
        assert pool.state(1) == "running"
        t.join(30)
        assert f"the driver's restore of process {os.getpid()} did not return within 2 s" in stuck["error"]
        assert pool.state(1) == "running"  # the pool goes on after a worker was ended
    finally:
        pool.close()


#: Stands for the arbiter: starts a checkpoint worker as the pool does, sends it a call that
#: never returns, prints the worker's PID and waits (the test then kills it).
OWNER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "serve"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
worker.stdin.write(b'{"call": "restore", "pids": [4242]}\\n')
worker.stdin.flush()
print(worker.pid, flush=True)
time.sleep(600)
"""


def test_a_worker_ends_when_its_arbiter_does_even_inside_a_call(standin):
    """A driver call of a worker whose arbiter died must not return later and act on
    processes the next arbiter answers for: the worker ends with its parent, even while
    its call has not returned."""
    env = {**os.environ, checkpoint.HANG_ENV: "restore:4242"}
    owner = subprocess.Popen([sys.executable, "-c", OWNER], env=env, stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        worker = int(owner.stdout.readline())
        assert procs.running(worker)
        # its second thread, the watch on its parent, is up: past its start, into its calls
        wait_for(lambda: len(os.listdir(f"/proc/{worker}/task")) >= 2, 30, "the worker to start")
        os.kill(owner.pid, signal.SIGKILL)  # the arbiter dies while its worker is inside the call
        owner.wait(10)
        wait_for(lambda: not procs.running(worker), 10, "the worker to end with its arbiter")
    finally:
        owner.kill()
        if worker is not None and procs.running(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_worker_whose_arbiter_ended_before_it_looked_ends_too():
    """The arbiter names itself to its workers: a worker that starts after its arbiter
    has ended (handed meanwhile to a subreaper, which it would take for its parent) ends
    at once instead of serving, and says nothing (its arguments were understood)."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    worker = subprocess.Popen(
        [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "serve", "--parent", str(gone.pid)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out, err = worker.communicate(timeout=60)  # a worker that served would end with its input, 0
    except subprocess.TimeoutExpired:
        worker.kill()
        raise
    assert worker.returncode == 1, (worker.returncode, err)
    assert (out, err) == (b"", b"")
