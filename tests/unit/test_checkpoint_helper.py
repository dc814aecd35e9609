"""The suspend helper (``python -m jupyter_vgpu.host.checkpoint hold PID``) and the
kernel's interrupts: a SIGINT that reaches it (Jupyter interrupts a kernel by signalling
its process group) changes nothing, and prints no traceback.

No GPU needed: the helper is held where it blocks on its output, after it found that
the target process cannot be checkpointed (no CUDA in it; no ``cuda-bindings`` here).
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

from jupyter_vgpu.testing.waiting import wait_for


def full_pipe() -> tuple[int, int, int]:
    """A pipe whose buffer is full (a process that writes to it blocks): its read end,
    its write end and the bytes in it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    filled = 0
    try:
        while True:
            filled += os.write(write_end, b"x" * 4096)
    except BlockingIOError:
        pass
    os.set_blocking(write_end, True)
    return read_end, write_end, filled


def test_an_interrupt_of_its_process_group_does_not_end_the_helper_or_print_a_traceback(tmp_path):
    target = subprocess.Popen(["sleep", "60"])  # a process without CUDA: no checkpoint possible
    read_end, write_end, filled = full_pipe()
    stderr = tmp_path / "helper.err"
    with open(stderr, "wb") as err:
        helper = subprocess.Popen(
            [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "hold", str(target.pid)],
            stdin=subprocess.PIPE,
            stdout=write_end,
            stderr=err,
            start_new_session=True,  # a group of its own, as a kernel's: signalled as a whole below
        )
    os.close(write_end)
    try:
        wchan = Path(f"/proc/{helper.pid}/wchan")
        wait_for(
            lambda: helper.poll() is None and "pipe_write" in wchan.read_text(),
            what="the helper to block writing its answer",
        )
        # what Jupyter's interrupt does to a kernel's group; on return the signal is pending
        # (a handler runs before the helper's write returns) or was discarded (ignored)
        os.killpg(helper.pid, signal.SIGINT)
        with os.fdopen(read_end, "rb") as out:
            read_end = None
            answer = out.read()  # drains the pipe; the helper writes and exits
        assert helper.wait(30) == 1, stderr.read_text()
    finally:
        if read_end is not None:
            os.close(read_end)
        if helper.poll() is None:
            helper.kill()
            helper.wait()
        target.kill()
        target.wait()
    assert answer[filled:].startswith(b"failed "), answer[filled:]
    assert stderr.read_text() == ""


def test_a_kernel_from_before_the_move_still_finds_its_helper():
    """Kernels started before an upgrade run the helper by its old name
    (``jupyter_vgpu.node.checkpoint``): it is the same helper."""
    old, new = (
        subprocess.run([sys.executable, "-m", name], capture_output=True, text=True)
        for name in ("jupyter_vgpu.node.checkpoint", "jupyter_vgpu.host.checkpoint")
    )
    assert old.returncode == new.returncode == 1
    assert old.stderr == new.stderr
    assert "usage: python -m jupyter_vgpu.host.checkpoint hold PID" in old.stderr
