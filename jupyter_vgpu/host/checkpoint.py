"""Suspend and restore a whole process on the GPU: the driver's process checkpoint.

``cuCheckpointProcessLock`` / ``…Checkpoint`` / ``…Restore`` / ``…Unlock`` (libcuda
since CUDA 12.8, driver 550+), called through NVIDIA's ``cuda-bindings`` on another
process's PID. While a process is locked the driver blocks every CUDA call of every
thread of it instead of failing it; the checkpoint moves all of its device memory,
context included, to host memory, and the card holds nothing of it. Measured on the
H100 box (``benchmarks/results/probe-h100.jsonl``): a process holding 4 GiB went from
4.94 GB in NVML to nothing in 2.6 s, came back in 1.2 s with its data intact, and a
thread of it doing ``acc.add_(1)`` in a loop lost no update.

Run as ``python -m jupyter_vgpu.host.checkpoint hold PID [PID ...]``: suspends the
processes (a kernel with its CUDA child processes), prints ``suspended``, restores them
when a line arrives on stdin (or stdin closes), prints ``restored``. Kernels in chaos
mode ``suspend`` use it; the node arbiter calls the functions directly. The helper
ignores SIGINT: an interrupt of the kernel is not meant for it, and ending it would
leave the kernel suspended. ``python -m jupyter_vgpu.host.checkpoint serve`` is a worker
of the node arbiter's, which makes every driver call through such workers, each bounded
(:mod:`.checkpoint_pool`). ``python -m jupyter_vgpu.host.checkpoint restore PID
[PID ...]`` restores (or unlocks) the processes whoever suspended them and prints
``restored``: a kernel whose checkpoint's holder ended (the helper, or the node arbiter
with no successor) restores itself so. The driver keeps a process's checkpoint state
whatever becomes of its holder (:func:`state`), so any later process can finish the job.

A restore is never tried without room. Measured on the H100 (driver 580, 2026-11-25,
``benchmarks/results/gpu-tests-h100.log``): a restore the card had no room for failed with
``CUDA_ERROR_OUT_OF_MEMORY``, and every later one, with the card empty, with
``CUDA_ERROR_OPERATING_SYSTEM``, the process still ``checkpointed``: its memory was out
of reach for good. So :func:`restore` first reads NVML's free memory on each card the
processes held memory on (:func:`jupyter_vgpu.nvml.footprint` at the suspend) and
refuses, with :class:`NoRoom` and no driver call, unless it exceeds that footprint by
:data:`RESTORE_HEADROOM`.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable

from jupyter_vgpu import failpoints
from jupyter_vgpu.host import peers
from jupyter_vgpu.units import format_bytes

_driver = None


class CheckpointUnavailable(RuntimeError):
    """The driver or ``cuda-bindings`` lacks the process checkpoint; the message says which."""


class CheckpointError(RuntimeError):
    """A checkpoint call failed; the message names the call and the driver's error."""


class NoRoom(CheckpointError):
    """A restore was not tried: a card has too little free memory for it (the message
    says how much is needed and free); the processes stay checkpointed, restorable."""


#: Free memory a restore needs past the processes' footprint at the suspend, bytes. The
#: driver's own need past NVML's figure was not measured (a failed restore cannot be
#: retried, so each try costs a process); 512 MiB is a margin, not a measurement.
RESTORE_HEADROOM = 512 * 2**20


def _load():
    global _driver
    if _driver is None:
        try:
            from cuda.bindings import driver
        except ImportError as e:
            raise CheckpointUnavailable(f"cuda-bindings is not installed ({e})") from None
        if not hasattr(driver, "cuCheckpointProcessLock"):
            raise CheckpointUnavailable("this cuda-bindings has no cuCheckpointProcess* (needs CUDA 12.8+)")
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise CheckpointUnavailable(f"the CUDA driver does not start: {err}")
        _driver = driver
    return _driver


def unavailable() -> str | None:
    """Why suspending cannot work here, or None when it can."""
    try:
        _load()
    except CheckpointUnavailable as e:
        return str(e)
    return None


def _call(name: str, *args):
    driver = _load()
    result = getattr(driver, name)(*args)
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CheckpointError(f"{name} failed: {err}")
    return result


def state(pid: int) -> str:
    """The process's checkpoint state: ``running``, ``locked``, ``checkpointed`` or ``failed``."""
    _, value = _call("cuCheckpointProcessGetState", pid)
    return value.name.removeprefix("CU_PROCESS_STATE_").lower()


def _pids(pids: int | Iterable[int]) -> list[int]:
    return [pids] if isinstance(pids, int) else list(pids)


def suspend(pids: int | Iterable[int], timeout: float = 10.0) -> float:
    """Lock every process of ``pids`` (waiting up to ``timeout`` seconds each for its
    running CUDA calls), then move all their device memory to the host; returns the
    seconds it took. A kernel goes with the processes it shares GPU memory with (CUDA
    IPC peers, workers with CUDA contexts): all are locked before any is checkpointed,
    so none runs against a peer that left the card.

    Raises:
        CheckpointUnavailable: no process checkpoint here.
        CheckpointError: the driver refused; every process is back as it was (restored
            and unlocked).
    """
    driver = _load()
    group = _pids(pids)
    t0 = time.perf_counter()
    args = driver.CUcheckpointLockArgs()
    args.timeoutMs = int(timeout * 1000)
    locked: list[int] = []
    done: list[int] = []
    try:
        for pid in group:
            _call("cuCheckpointProcessLock", pid, args)
            locked.append(pid)
        failpoints.hit("checkpoint.locked")
        for pid in group:
            _call("cuCheckpointProcessCheckpoint", pid, driver.CUcheckpointCheckpointArgs())
            done.append(pid)
    except CheckpointError:
        for pid in reversed(done):
            _quietly("cuCheckpointProcessRestore", pid, driver.CUcheckpointRestoreArgs())
        for pid in reversed(locked):
            _quietly("cuCheckpointProcessUnlock", pid, driver.CUcheckpointUnlockArgs())
        raise
    return time.perf_counter() - t0


def _quietly(name: str, *args) -> None:
    try:
        _call(name, *args)
    except CheckpointError:
        pass


def room_short(need: dict[str, int], free_of: Callable[[str], int]) -> str | None:
    """Why a restore of processes that held ``need`` (bytes per GPU UUID) must wait, in
    words, or None when every card has that much free plus :data:`RESTORE_HEADROOM`
    (``free_of(uuid)``: its free bytes)."""
    for uuid, nbytes in need.items():
        free = free_of(uuid)
        if free < nbytes + RESTORE_HEADROOM:
            return (
                f"the GPU has {format_bytes(free)} free where the restore needs "
                f"{format_bytes(nbytes + RESTORE_HEADROOM)} (the {format_bytes(nbytes)} the driver "
                "took off the card, and a margin)"
            )
    return None


def restore(pids: int | Iterable[int], need: dict[str, int] | None = None) -> float:
    """Bring suspended processes back to the GPU (in the reverse order of their suspend)
    and unlock them; returns the seconds it took. Whatever holds them now may call it: a
    process left ``locked`` (a suspend cut short) is unlocked, one already ``running`` is
    left alone (a restore that ended before its caller heard of it).

    Args:
        pids: the processes, as they were suspended (the kernel last).
        need: bytes per GPU UUID the processes held when suspended
            (:func:`jupyter_vgpu.nvml.footprint`); with it, no restore is tried unless
            NVML shows that much free plus :data:`RESTORE_HEADROOM` on each card.

    Raises:
        NoRoom: too little free memory; nothing was tried, the processes stay restorable.
        CheckpointError: the driver refused; those not yet restored stay suspended.
    """
    driver = _load()
    group = list(reversed(_pids(pids)))
    t0 = time.perf_counter()
    states = {}
    for pid in group:
        try:
            states[pid] = state(pid)
        except CheckpointError:
            if len(group) == 1:
                raise
            states[pid] = "running"  # a child without a CUDA context, or gone: nothing to bring back
    if need and "checkpointed" in states.values():
        from jupyter_vgpu import nvml

        why = room_short(need, nvml.free_memory)
        if why:
            raise NoRoom(why)
    for pid in group:
        if states[pid] == "checkpointed":
            _call("cuCheckpointProcessRestore", pid, driver.CUcheckpointRestoreArgs())
            failpoints.hit("checkpoint.restored")
            states[pid] = "locked"
    for pid in group:
        if states[pid] == "locked":
            _call("cuCheckpointProcessUnlock", pid, driver.CUcheckpointUnlockArgs())
    return time.perf_counter() - t0


def _say(line: str) -> None:
    """One line to whoever started the helper; nothing when it has gone (a kernel that
    ended while suspended closes the pipe first)."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def footprint(pids: list[int]) -> dict[str, int]:
    """What a checkpoint of ``pids`` takes off each card and its restore needs back: bytes
    per GPU UUID (:func:`jupyter_vgpu.nvml.footprint`), read just before the suspend; {}
    where NVML cannot say (the restore is then tried without looking at the card first)."""
    try:
        from jupyter_vgpu import nvml

        return nvml.footprint(pids)
    except Exception:
        return {}


def _hold(pids: list[int]) -> int:
    need = footprint(pids)
    try:
        seconds = suspend(pids)
    except (CheckpointUnavailable, CheckpointError) as e:
        _say(f"failed {e}")
        return 1
    _say(f"suspended {seconds:.3f}")
    failpoints.hit("checkpoint.held")
    sys.stdin.readline()  # a line, or the end of the pipe: either way the holder lets go
    if not any(peers.alive(pid) for pid in pids):
        return 0  # they ended while suspended: nothing to bring back
    return _restore(pids, need)


def _restore(pids: list[int], need: dict[str, int] | None = None) -> int:
    try:
        seconds = restore(pids, need)
    except (CheckpointUnavailable, CheckpointError) as e:
        _say(f"failed {e}")
        return 1
    _say(f"restored {seconds:.3f}")
    return 0


#: Environment variable of the arbiter's (tests only) naming calls its checkpoint workers
#: never return from, as a driver call that hangs would not: ``CALL:PID`` pairs, comma
#: separated (``restore:4242``).
HANG_ENV = "JUPYTER_VGPU_CHECKPOINT_HANG"


def _end_with_parent(parent: int | None = None) -> None:
    """End this process (``os._exit``) as soon as its parent has ended, whatever this
    process's main thread is doing: a driver call of a worker whose arbiter died must not
    return later and act on processes that the next arbiter answers for. A thread waits
    on a pidfd of the parent (Linux 5.3+; elsewhere it watches ``getppid``).

    ``parent`` is the PID of the process that started this one, as it said (the arbiter
    passes its own): when that process ended before this one looked, this process was
    handed to a subreaper, which ``getppid`` would name instead. The pidfd is taken
    first and the parent checked after, so a PID reused meanwhile is never watched."""
    told = parent is not None
    parent = parent if told else os.getppid()
    try:
        pidfd = os.pidfd_open(parent)
    except (OSError, AttributeError):
        pidfd = None
    # the parent ended before this process looked (an arbiter may be PID 1 in a container:
    # only a parent not named is judged by being 1)
    if os.getppid() != parent or (not told and parent == 1):
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the parent has ended
        else:
            while os.getppid() == parent:
                time.sleep(0.1)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-the-arbiter", daemon=True).start()


def _serve(parent: int | None = None) -> int:
    """A worker of the arbiter's :class:`.checkpoint_pool.CheckpointPool`: one request a
    line on stdin (``{"call": "state"|"suspend"|"restore", "pids": [...], "need": {...}
    | null, "lock_timeout": seconds}``), one answer a line on stdout (``{"ok": true,
    "result": ...}``, or ``{"ok": false, "kind": "NoRoom"|..., "error": str}``), until
    stdin closes. It ends at once when the arbiter does (:func:`_end_with_parent`). With
    ``JUPYTER_VGPU_CHECKPOINT_STANDIN`` in its environment (the arbiter's, set by a
    test), the recording stand-in answers instead of the driver."""
    _end_with_parent(parent)
    impl = sys.modules[__name__]
    if os.environ.get("JUPYTER_VGPU_CHECKPOINT_STANDIN"):
        from jupyter_vgpu.testing import checkpoint_standin as impl

        impl.LOG = os.environ["JUPYTER_VGPU_CHECKPOINT_STANDIN"]
    hang = set(os.environ.get(HANG_ENV, "").split(","))
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            call, pids = request["call"], [int(p) for p in request["pids"]]
            if any(f"{call}:{p}" in hang for p in pids):
                threading.Event().wait()  # a driver call that never returns (tests, HANG_ENV)
            if call == "state":
                result = impl.state(pids[0])
            elif call == "suspend":
                result = impl.suspend(pids, timeout=float(request.get("lock_timeout") or 10.0))
            elif call == "restore":
                result = impl.restore(pids, request.get("need") or None)
            else:
                raise ValueError(f"no call {call!r}")
            answer = {"ok": True, "result": result}
        except NoRoom as e:
            answer = {"ok": False, "kind": "NoRoom", "error": str(e)}
        except Exception as e:
            answer = {"ok": False, "kind": type(e).__name__, "error": str(e)}
        _say(json.dumps(answer))
    return 0


def main(argv: list[str]) -> int:
    """``python -m jupyter_vgpu.host.checkpoint ARGS``: ``hold``, ``restore`` or ``serve``
    (the module's docstring); the exit status. A Ctrl-C sent to the kernel's process group
    is ignored: the helper ends only when its work does.

    Raises:
        SystemExit: with the usage, on arguments it does not take.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    usage = (
        "usage: python -m jupyter_vgpu.host.checkpoint hold PID [PID ...] | "
        "restore [--need UUID=BYTES ...] PID [PID ...] | serve [--parent PID]"
    )
    if argv == ["serve"]:
        return _serve()
    if len(argv) == 3 and argv[:2] == ["serve", "--parent"] and argv[2].isdigit():
        return _serve(int(argv[2]))
    if not argv or argv[0] not in ("hold", "restore"):
        sys.exit(usage)
    need: dict[str, int] = {}
    pids: list[int] = []
    args = iter(argv[1:])
    for arg in args:
        if arg == "--need" and argv[0] == "restore":
            uuid, _, nbytes = next(args, "").partition("=")
            if not uuid or not nbytes.isdigit():
                sys.exit(usage)
            need[uuid] = int(nbytes)
        elif arg.isdigit():
            pids.append(int(arg))
        else:
            sys.exit(usage)
    if not pids:
        sys.exit(usage)
    return _hold(pids) if argv[0] == "hold" else _restore(pids, need)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
