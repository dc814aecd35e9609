"""The MPS backend's daemons: where they live, and a readable refusal where MPS is missing."""

import shutil
import tempfile
from pathlib import Path

import pytest

from jupyter_vgpu.host.socket_path import mps_pipe_directory
from jupyter_vgpu.node import mps


@pytest.fixture
def short_dir():
    """A directory short enough for the daemon's sockets (pytest's tmp_path is not)."""
    path = Path(tempfile.mkdtemp(prefix="vgpu-"))
    yield path
    shutil.rmtree(path)


UUID = "GPU-78b63d1a-c3a4-1316-c904-a077699c919c"  # an H100's, as NVML spells it


def test_every_gpu_gets_its_own_pipe_and_log_directory_beside_the_arbiter(tmp_path):
    daemons = mps.MPSDaemons(str(tmp_path / "arbiter.sock"))
    pipe_a, log_a = daemons.directories(UUID)
    pipe_b, _ = daemons.directories("GPU-b")
    assert pipe_a.parent.parent == tmp_path / "mps"
    assert pipe_a.name == "pipe"
    assert log_a == pipe_a.parent / "log"
    assert pipe_a != pipe_b
    assert str(pipe_a) == mps_pipe_directory(str(tmp_path / "arbiter.sock"), UUID)  # what servers get
    # the UUID is not spelt out: the daemon's sockets must fit sun_path
    assert len(str(pipe_a)) == len(str(tmp_path / "mps")) + 1 + 12 + len("/pipe")


def test_a_pipe_directory_too_long_for_a_unix_socket_is_refused_with_the_reason(tmp_path):
    deep = tmp_path / ("d" * 80)
    daemons = mps.MPSDaemons(str(deep / "arbiter.sock"))
    with pytest.raises(mps.MPSUnavailable, match="too long for the daemon's Unix sockets"):
        daemons.ensure(UUID)
    assert daemons.started == set()
    assert not deep.exists()


@pytest.mark.skipif(shutil.which(mps.CONTROL) is not None, reason="this machine has MPS")
def test_without_the_control_program_the_daemon_is_refused_with_the_reason(short_dir):
    daemons = mps.MPSDaemons(str(short_dir / "arbiter.sock"))
    assert not daemons.running("GPU-a")
    with pytest.raises(mps.MPSUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
        daemons.ensure("GPU-a")
    assert daemons.started == set()
