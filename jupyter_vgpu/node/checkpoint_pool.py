"""The driver's checkpoint calls, each bounded: none can hold up the arbiter, nor another kernel.

``cuCheckpointProcessLock`` takes a timeout; ``…Checkpoint``, ``…Restore`` and
``…Unlock`` do not, and a call that never returns would hold whatever waits on it: a
thread of the arbiter, and, were the calls made in the arbiter's own process, perhaps
the driver's locks every other call of that process needs. So each call runs in a worker
process of the arbiter's (``python -m jupyter_vgpu.host.checkpoint serve``: one request
and one answer at a time, a JSON object a line), taken from a small pool, with a
deadline: the lock's own timeout plus a margin, or, for moving memory, a base plus a
time per GiB. A call past its deadline ends its worker (SIGKILL) and raises
:class:`CheckpointTimeout`; the process it was about is left as the driver has it
(locked, or checkpointed), and the arbiter's books and the kernel say so. Other calls run
in other workers meanwhile, so one kernel's stuck restore slows no other kernel's pause,
suspend or restore. A worker ends as soon as the arbiter does, even inside a call (it waits
on a pidfd of its parent): a call must not return after its arbiter died and act on
processes that the next arbiter answers for.

:class:`CheckpointPool` has :mod:`jupyter_vgpu.host.checkpoint`'s interface (``state``, ``suspend``,
``restore``, ``NoRoom``, ``CheckpointError``), blocking and thread-safe: the arbiter calls
it from its executor's threads.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable

from jupyter_vgpu.host.checkpoint import CheckpointError, NoRoom

__all__ = ["CheckpointError", "CheckpointPool", "CheckpointTimeout", "NoRoom"]

GiB = 2**30


class CheckpointTimeout(CheckpointError):
    """A driver call did not return in time; its worker was ended. The message names the
    call, the processes and the seconds waited; the processes are as the driver left them."""


class _Worker:
    def __init__(self, env: dict[str, str]):
        self.process = subprocess.Popen(
            # its parent named: one that ends before the worker looks is not mistaken
            # for the subreaper the worker is handed to
            [sys.executable, "-m", "jupyter_vgpu.host.checkpoint", "serve", "--parent", str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # a signal to the arbiter's group is not meant for it
        )
        self._buffer = b""

    def alive(self) -> bool:
        return self.process.poll() is None

    def ask(self, request: dict, timeout: float) -> dict | None:
        """The answer to ``request``, or None when none came within ``timeout`` seconds
        (or the worker ended)."""
        try:
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + timeout
        fd = self.process.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            return json.loads(line)
        except ValueError:
            return None

    def end(self) -> None:
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(5)


class CheckpointPool:
    """Worker processes making the driver's checkpoint calls, each call bounded.

    Args:
        size: the most workers at once (calls beyond wait for one).
        base_timeout: seconds any call may take, on top of its size.
        seconds_per_gib: seconds a checkpoint or restore may take per GiB it moves.
        lock_timeout: seconds ``cuCheckpointProcessLock`` waits for running CUDA calls.
    """

    NoRoom = NoRoom
    CheckpointError = CheckpointError
    Timeout = CheckpointTimeout

    def __init__(
        self,
        size: int = 8,
        base_timeout: float = 30.0,
        seconds_per_gib: float = 1.0,
        lock_timeout: float = 10.0,
    ):
        self.size, self.base_timeout = size, base_timeout
        self.seconds_per_gib, self.lock_timeout = seconds_per_gib, lock_timeout
        self._idle: list[_Worker] = []
        self._count = 0
        self._cond = threading.Condition()
        self._env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}

    def _take(self) -> _Worker:
        with self._cond:
            while True:
                while self._idle:
                    worker = self._idle.pop()
                    if worker.alive():
                        return worker
                    self._count -= 1
                if self._count < self.size:
                    self._count += 1
                    break
                self._cond.wait()
        try:
            return _Worker(self._env)
        except OSError:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _give_back(self, worker: _Worker, keep: bool) -> None:
        with self._cond:
            if keep and worker.alive():
                self._idle.append(worker)
            else:
                self._count -= 1
            self._cond.notify()
        if not keep:
            worker.end()

    def _call(self, call: str, pids: list[int], timeout: float, need: dict | None = None):
        worker = self._take()
        answer = worker.ask(
            {"call": call, "pids": pids, "need": need, "lock_timeout": self.lock_timeout}, timeout
        )
        self._give_back(worker, keep=answer is not None)
        if answer is None:
            raise CheckpointTimeout(
                f"the driver's {call} of process {', '.join(map(str, pids))} did not return within "
                f"{timeout:.0f} s; it was given up (the process is as the driver left it)"
            )
        if answer.get("ok"):
            return answer.get("result")
        kind = NoRoom if answer.get("kind") == "NoRoom" else CheckpointError
        raise kind(str(answer.get("error", "the driver refused")))

    def _moving(self, nbytes: int) -> float:
        return self.base_timeout + self.seconds_per_gib * nbytes / GiB

    def state(self, pid: int) -> str:
        """:func:`.checkpoint.state`, within ``base_timeout`` seconds.

        Raises:
            CheckpointError, CheckpointTimeout: as :func:`.checkpoint.state`, or no answer in time.
        """
        return self._call("state", [pid], self.base_timeout)

    def suspend(self, pids: int | Iterable[int], nbytes: int = 0) -> float:
        """:func:`.checkpoint.suspend` of ``pids`` holding ``nbytes`` on the card, within
        the lock's timeout plus :meth:`_moving` seconds.

        Raises:
            CheckpointError, CheckpointTimeout: as :func:`.checkpoint.suspend`, or no answer in time.
        """
        group = [pids] if isinstance(pids, int) else list(pids)
        return self._call("suspend", group, self.lock_timeout + self._moving(nbytes))

    def restore(self, pids: int | Iterable[int], need: dict[str, int] | None = None) -> float:
        """:func:`.checkpoint.restore`, within :meth:`_moving` seconds of what it brings back.

        Raises:
            NoRoom, CheckpointError, CheckpointTimeout: as :func:`.checkpoint.restore`, or no
                answer in time.
        """
        group = [pids] if isinstance(pids, int) else list(pids)
        return self._call("restore", group, self._moving(sum((need or {}).values())), need)

    def close(self) -> None:
        """End every idle worker (a call in progress ends its own when it returns)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for worker in idle:
            worker.end()
