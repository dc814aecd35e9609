"""A restore is never tried without room: the driver leaves a process whose restore
failed for want of memory unrestorable (measured on the H100, see
``jupyter_vgpu.host.checkpoint``), so the room is read from NVML first."""

import subprocess
import sys

import pytest

from jupyter_vgpu.host import checkpoint

GiB, MiB = 2**30, 2**20


def test_a_restore_waits_unless_every_card_has_its_footprint_and_the_margin_free():
    need = {"GPU-a": 8 * GiB, "GPU-b": GiB}
    free = {"GPU-a": 8 * GiB + checkpoint.RESTORE_HEADROOM, "GPU-b": 4 * GiB}
    assert checkpoint.room_short(need, free.__getitem__) is None
    free["GPU-a"] -= 1
    why = checkpoint.room_short(need, free.__getitem__)
    assert why is not None
    assert "8.00 GiB the driver took off the card" in why, why
    assert checkpoint.room_short({}, free.__getitem__) is None


def test_no_room_is_a_checkpoint_error_so_every_caller_keeps_the_process_suspended():
    assert issubclass(checkpoint.NoRoom, checkpoint.CheckpointError)


@pytest.mark.parametrize(
    "args",
    [
        ["restore"],
        ["restore", "--need", "GPU-a"],
        ["restore", "--need", "GPU-a=many", "12"],
        ["hold", "--need", "GPU-a=1", "12"],
        ["restore", "twelve"],
        ["thaw", "12"],
    ],
)
def test_the_helper_refuses_a_command_line_it_cannot_read(args):
    done = subprocess.run(
        [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "usage:" in done.stderr
