"""The driver's checkpoint calls, each bounded (:mod:`jupyter_vgpu.node.checkpoint_pool`),
with the recording stand-in answering in the workers as the driver would: a call that
never returns is given up at its deadline (its worker ended) with a message naming it,
and a call about another kernel made meanwhile is answered at once by another worker."""

import os
import threading

import pytest

from jupyter_vgpu.host import checkpoint
from jupyter_vgpu.node.checkpoint_pool import CheckpointPool, CheckpointTimeout
from jupyter_vgpu.testing import checkpoint_standin


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
