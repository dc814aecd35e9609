"""The MPS backend's daemons: where they live, and a readable refusal where MPS is missing."""

import shutil

import pytest

from jupyter_vgpu.node import mps
from jupyter_vgpu.node.socket_path import mps_pipe_directory


def test_every_gpu_gets_its_own_pipe_and_log_directory_beside_the_arbiter(tmp_path):
    daemons = mps.MPSDaemons(str(tmp_path / "arbiter.sock"))
    pipe_a, log_a = daemons.directories("GPU-a")
    pipe_b, _ = daemons.directories("GPU-b")
    assert pipe_a == tmp_path / "mps" / "GPU-a" / "pipe"
    assert log_a == tmp_path / "mps" / "GPU-a" / "log"
    assert pipe_a != pipe_b
    assert str(pipe_a) == mps_pipe_directory(str(tmp_path / "arbiter.sock"), "GPU-a")  # what servers get


@pytest.mark.skipif(shutil.which(mps.CONTROL) is not None, reason="this machine has MPS")
def test_without_the_control_program_the_daemon_is_refused_with_the_reason(tmp_path):
    daemons = mps.MPSDaemons(str(tmp_path / "arbiter.sock"))
    assert not daemons.running("GPU-a")
    with pytest.raises(mps.MPSUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
        daemons.ensure("GPU-a")
    assert daemons.started == set()
