"""Failures and the disk tier, measured with real kernels and a real node arbiter.

- ``restart``: N kernels, each holding data and paused; the arbiter is killed (SIGKILL)
  and started again. ``books_whole_s``: from the new arbiter's launch until its books
  hold every kernel in its tier again (nobody registers anything again: the kernels
  reconnect, the journal has the slices). ``first_cell_s``: from the launch until the
  first paused kernel has run a cell through the new arbiter (its resume included).
- ``disk``: one kernel's paused data moved to the disk tier, its page cache dropped, then
  a cell: ``resume_s`` is the engine's resume from disk (``gpu_bytes`` of memory back,
  ``disk_bytes`` read), ``plain_read_s`` a plain read of a file of ``disk_bytes`` with a
  cold page cache, 64 MiB at a time, and ``plain_read_gpu_bytes_s`` the same of a file of
  ``gpu_bytes`` (the kernel's bytes as they would be on disk uncompressed);
  ``resume_phases`` where the resume's time went (``PauseEngine.stats()["last_resume_disk"]``:
  seconds waiting for reads, in the GPU's unpack, with a read in flight, bytes read; None
  on the zstandard path).
- ``faults``: a process stopped at a named step (failpoints) and killed there with
  SIGKILL: ``bytes_lost`` is the bytes of every surviving kernel that did not come back
  bit-identical, ``longest_silent_wait_s`` the longest stretch any waiting cell went
  without a message in its output.

On a GPU (``--device gpu``, the default where CUDA is) kernels hold CUDA tensors through
the pausable allocator; on a CPU (``--device cpu``) the card is simulated and the bytes
are real all the same (segments of the allocator's host backend, the zstandard path).

    python benchmarks/faults.py --out benchmarks/results/faults-h100.json
    python benchmarks/faults.py --device cpu --kernels 20 --out benchmarks/results/faults-cpu.json
    # a run cut short, finished: only the fault steps it lacks, merged into its file
    python benchmarks/faults.py --skip restart disk --steps arbiter.spill server --merge \
        --out benchmarks/results/faults-h100.json

Goals (the issue's): books whole within 5 s, 0 bytes lost and no silent wait over 2 s
anywhere, a resume from disk at 0.8x a plain read of the file or better.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout, not an installed copy

import provenance  # noqa: E402

from jupyter_vgpu import channel  # noqa: E402
from jupyter_vgpu.testing import fault_scene as scene  # noqa: E402
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess  # noqa: E402
from jupyter_vgpu.testing.waiting import wait_for  # noqa: E402

MiB, GiB = 2**20, 2**30


class CPU:
    """Kernels on a simulated card holding real bytes in host-backend segments."""

    name = "cpu"

    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def kernel(self, tmp, arbiter, user, env=None, heavy=False):
        k = scene.start_kernel(tmp, arbiter, user, env)
        k.seed = abs(hash(user)) % 10_000
        out = scene.run(k, scene.hold_code(k.seed, self.nbytes, simulated_mib=700 if heavy else 0))
        assert out.error is None, out.error
        assert "Error" not in out.text, out.text
        k.expected = scene.digest(k.seed, self.nbytes)
        return k

    def victim_needed(self, arbiter, asker):
        """The victims hold 700 MiB of the simulated 1 GiB card: any cell of another needs them paused."""

    def digest_code(self):
        return scene.DIGEST


class GPU:
    """Kernels holding CUDA tensors through the pausable allocator."""

    name = "gpu"

    def __init__(self, gib: int):
        self.gib = gib

    def kernel(self, tmp, arbiter, user, env=None, heavy=False):
        from jupyter_vgpu.testing.fault_kernels import fill, gpu_kernel

        k = gpu_kernel(tmp, arbiter, user, max(8, 2 * self.gib) * GiB, env=env)
        k.expected = fill(k, abs(hash(user)) % 10_000, n=self.gib)
        return k

    def victim_needed(self, arbiter, asker):
        from jupyter_vgpu.testing.fault_kernels import needs_the_victim

        needs_the_victim(arbiter, asker)

    def digest_code(self):
        from jupyter_vgpu.testing.fault_kernels import DIGEST

        return DIGEST

    @property
    def nbytes(self):
        return self.gib * GiB


def waited(out) -> float:
    """The longest silence of a cell until its code ran (its ``back`` line: hashing the
    data is not a wait), or over all of it where the code never ran."""
    return out.silence_until("back") if "back" in out.text else out.longest_silence


def check(work, kernel) -> tuple[int, float]:
    """``(bytes lost, longest silence before the cell's code ran)`` of a kernel's data,
    checked by a cell."""
    out = scene.run(kernel, scene.BACK + work.digest_code(), timeout=600)
    lines = out.text.strip().splitlines()
    lost = 0 if lines and lines[-1] == kernel.expected else work.nbytes
    return lost, waited(out)


def arbiter_for(tmp, *more, env=None):
    return ArbiterProcess(
        tmp, "--queue-timeout=300", f"--ArbiterApp.disk_dir={tmp / 'disk'}", "--ArbiterApp.disk_reserve=1M",
        *more, env=env,
    )  # fmt: skip


def shut(*things):
    for t in things:
        try:
            if isinstance(t, ArbiterProcess):
                t.env = {}
                t.stop()
            else:
                t.shutdown()
        except Exception as e:  # a kernel killed by the scenario
            print(f"  (cleanup: {e})", file=sys.stderr)


# -- restart --------------------------------------------------------------------------------


def restart(work, tmp: Path, n: int) -> dict:
    arbiter = arbiter_for(tmp).start()
    kernels = []
    try:
        for i in range(n):
            k = work.kernel(tmp, arbiter, f"user{i}")
            assert "paused as soon as the cell ends" in scene.run(k, "%vgpu pause").text
            kernels.append(k)
            print(f"  kernel {i + 1}/{n} paused", file=sys.stderr)
        whole = {k.pid: "host" for k in kernels}
        wait_for(lambda: scene.books_consistent(arbiter, whole), 60, "every kernel paused in the books")
        arbiter.process.kill()
        arbiter.process.wait(30)
        t0 = time.monotonic()
        arbiter.start(wait=False)
        wait_for(lambda: scene.books_consistent(arbiter, whole), 60, "the books whole again", interval=0.02)
        books_whole = time.monotonic() - t0
        out = scene.run(kernels[0], scene.BACK + work.digest_code(), timeout=600)
        first_cell = time.monotonic() - t0
        assert out.text.strip().splitlines()[-1] == kernels[0].expected, out.text
        return {
            "kernels": n,
            "books_whole_s": round(books_whole, 3),
            "first_cell_s": round(first_cell, 3),
            "first_cell_longest_silent_wait_s": round(out.silence_until("back"), 3),
        }
    finally:
        shut(*kernels, arbiter)


# -- disk -----------------------------------------------------------------------------------


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read(tmp: Path, nbytes: int) -> float:
    """Seconds to read a file of ``nbytes`` (random bytes) with a cold page cache."""
    path = tmp / "plain.bin"
    chunk = os.urandom(64 * MiB)
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            f.write(chunk[: min(left, len(chunk))])
            left -= len(chunk)
    drop_cache(path)
    buf = bytearray(64 * MiB)
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(view):
            pass
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def disk(work, tmp: Path) -> dict:
    arbiter = arbiter_for(
        tmp, "--ArbiterApp.host_memory_limit=64G", "--ArbiterApp.host_spill_fraction=0.0001"
    ).start()
    k = None
    try:
        k = work.kernel(tmp, arbiter, "ada")
        assert "paused as soon as the cell ends" in scene.run(k, "%vgpu pause").text
        wait_for(lambda: arbiter.kernel(k.pid)["tier"] == "disk", 600, "the kernel moved to the disk tier")
        entry = arbiter.kernel(k.pid)
        for f in (tmp / "disk").rglob("*"):
            if f.is_file():
                drop_cache(f)
        lost, silence = check(work, k)
        assert lost == 0, "the data came back from disk different"
        report = channel.read_json(channel.kernel_path(k.channel, k.id)) if hasattr(k, "channel") else None
        pause = (report or {}).get("pause", {})
        resume, phases = pause.get("last_resume_seconds"), pause.get("last_resume_disk")
        if resume is None:  # a kernel without a channel: ask it
            ask = "import json\nfrom jupyter_vgpu.kernel.extension import get_hook as _g\n"
            ask += "_s = _g(get_ipython()).pausing.stats()\n"
            ask += "print(json.dumps([_s['last_resume_seconds'], _s.get('last_resume_disk')]))"
            text = scene.run(k, ask).text
            resume, phases = json.loads(text.strip().splitlines()[-1])
        read = plain_read(tmp, entry["disk_bytes"])
        read_whole = plain_read(tmp, work.nbytes)
        return {
            "gpu_bytes": work.nbytes,
            "disk_bytes": entry["disk_bytes"],
            "resume_s": round(resume, 4),
            "plain_read_s": round(read, 4),
            "plain_read_gpu_bytes_s": round(read_whole, 4),
            "resume_gbps": round(work.nbytes / resume / 1e9, 3),
            "plain_read_gbps": round(entry["disk_bytes"] / read / 1e9, 3),
            "longest_silent_wait_s": round(silence, 3),
            "resume_phases": phases,
        }
    finally:
        shut(*(x for x in (k, arbiter) if x is not None))


# -- faults ---------------------------------------------------------------------------------


def kernel_fault(work, tmp: Path, step: str) -> dict:
    """A victim killed at ``step`` while the asker waits for it (or once paused)."""
    arbiter = arbiter_for(
        tmp, "--ArbiterApp.host_memory_limit=64G", "--ArbiterApp.host_spill_fraction=0.0001"
    ).start()
    asker = victim = None
    try:
        asker = work.kernel(tmp, arbiter, "asker")
        victim = work.kernel(
            tmp, arbiter, "victim", env={"JUPYTER_VGPU_FAILPOINTS": f"{step}=stop"}, heavy=True
        )
        work.victim_needed(arbiter, asker)
        silences = []
        cell = None
        if step.startswith("kernel.pause"):
            cell = scene.Background(asker, "print('asker ran')", timeout=600)
        else:
            silences.append(scene.run(asker, "print('asker ran')", timeout=600).longest_silence)
            if step.startswith("kernel.resume"):
                wait_for(lambda: arbiter.kernel(victim.pid)["tier"] == "disk", 600, "the victim on disk")
                scene.Background(victim, work.digest_code(), timeout=60)
        scene.stopped_at_failpoint(victim.pid, f"the victim at {step}", timeout=600)
        if cell is not None:
            cell.said(3, 60)  # a wait of seconds, told as it goes
        scene.kill(victim.pid, "kill")
        if cell is not None:
            silences.append(waited(cell.join(600)))
        scene.reap(victim)
        wait_for(lambda: scene.books_consistent(arbiter, {asker.pid: ""}), 10, "the books without the victim")
        lost, silence = check(work, asker)
        return {
            "process": "kernel",
            "step": step,
            "bytes_lost": lost,
            "longest_silent_wait_s": round(max([silence, *silences]), 3),
        }
    finally:
        shut(*(x for x in (victim, asker, arbiter) if x is not None))


def arbiter_fault(work, tmp: Path, step: str) -> dict:
    """The arbiter killed at ``step``; the victim and the asker live on."""
    more = (
        ("--ArbiterApp.host_memory_limit=64G", "--ArbiterApp.host_spill_fraction=0.0001")
        if step == "arbiter.spill"
        else ()
    )
    if step in ("arbiter.suspend", "arbiter.restore", "checkpoint.locked", "checkpoint.restored"):
        more = ("--ArbiterApp.suspend_after=1",)  # paused, then suspended 1 s later
    arbiter = arbiter_for(tmp, *more).start()
    asker = victim = None
    try:
        asker = work.kernel(tmp, arbiter, "asker")
        victim = work.kernel(tmp, arbiter, "victim", heavy=True)
        arbiter.stop()
        arbiter.env = {"JUPYTER_VGPU_FAILPOINTS": f"{step}=stop"}
        arbiter.start()
        if step != "arbiter.hello":  # armed at the hellos of this start itself
            wait_for(
                lambda: scene.books_consistent(arbiter, {victim.pid: "gpu", asker.pid: "gpu"}), 10, "books"
            )
            work.victim_needed(arbiter, asker)
        silences = []
        if step in ("arbiter.restore", "checkpoint.restored"):
            silences.append(scene.run(asker, "print('asker ran')", timeout=600).longest_silence)
            wait_for(lambda: arbiter.kernel(victim.pid)["tier"] == "suspended", 120, "the victim suspended")
            cell = scene.Background(victim, scene.BACK + work.digest_code(), timeout=600)
        elif step != "arbiter.hello":
            cell = scene.Background(asker, "print('asker ran')", timeout=600)
        else:
            cell = None
        scene.stopped_at_failpoint(arbiter.process.pid, f"the arbiter at {step}", timeout=600)
        if cell is not None and not cell.partial.ended:
            try:
                cell.said(3, 5)  # whoever waits on the stopped arbiter says so
            except AssertionError:
                pass  # the cell had ended already
        scene.kill(arbiter.process.pid, "kill")
        arbiter.process.wait(30)
        if cell is not None:
            silences.append(waited(cell.join(600)))
        arbiter.env = {}
        arbiter.start()
        wait_for(lambda: scene.books_consistent(arbiter, {victim.pid: "", asker.pid: ""}), 10, "whole books")
        lost = 0
        for k in (victim, asker):
            gone, silence = check(work, k)
            lost += gone
            silences.append(silence)
        return {
            "process": "arbiter",
            "step": step,
            "bytes_lost": lost,
            "longest_silent_wait_s": round(max(silences), 3),
        }
    finally:
        shut(*(x for x in (victim, asker, arbiter) if x is not None))


def server_fault(work, tmp: Path) -> dict:
    """A server killed while its kernel is paused: the kernel ends with it, as Jupyter's
    kernels do (ipykernel's parent poller), the node lets go of it (``released_s``: from
    the kill until the books hold only the other kernel), and another user's kernel keeps
    its data (``bytes_lost``) and runs on."""
    from jupyter_vgpu.testing.fault_kernels import served_kernel

    arbiter = arbiter_for(tmp).start()
    served = served_kernel(tmp, arbiter)
    server, ada, pid = served.server, served.kernel, served.pid
    bob = None
    try:
        assert scene.run(ada, scene.hold_code(1, 16 * MiB, simulated_mib=700)).error is None
        bob = scene.start_kernel(tmp, arbiter, "bob")
        assert scene.run(bob, scene.hold_code(2, 16 * MiB)).error is None
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "host", 30, "ada paused")
        killed = time.monotonic()
        scene.kill(server.proc.pid, "kill")
        server.proc.wait(30)
        wait_for(lambda: scene.process_state(pid) in (None, "Z"), 10, "ada's kernel to end with its server")
        wait_for(lambda: scene.books_consistent(arbiter, {bob.pid: ""}), 10, "the books without ada")
        released = time.monotonic() - killed
        out = scene.run(bob, scene.DIGEST)
        lost = 0 if out.text.strip().splitlines()[-1:] == [scene.digest(2, 16 * MiB)] else 16 * MiB
        return {
            "process": "server",
            "step": "kernel paused",
            "bytes_lost": lost,
            "longest_silent_wait_s": round(out.longest_silence, 3),
            "released_s": round(released, 3),
        }
    finally:
        shut(*(x for x in (bob, arbiter) if x is not None))
        if server.proc.poll() is None:
            server.stop()


def helper_fault(work, tmp: Path) -> dict:
    """Chaos mode's checkpoint helper killed while it holds the kernel (GPU only)."""
    import psutil

    from jupyter_vgpu.testing.fault_kernels import gpu_kernel

    env = {"JUPYTER_VGPU_CHAOS": "suspend", "JUPYTER_VGPU_FAILPOINTS": "checkpoint.held=stop"}
    k = gpu_kernel(tmp, None, "ada", 8 * GiB, env=env)

    def helpers():
        return [c for c in psutil.Process(k.pid).children() if "jupyter_vgpu.host.checkpoint" in c.cmdline()]

    try:
        from jupyter_vgpu.testing.fault_kernels import fill

        k.expected = fill(k, 7, n=work.gib)
        found = wait_for(helpers, 120, "the checkpoint helper")[0]
        scene.stopped_at_failpoint(found.pid, "the helper")
        scene.kill(found.pid, "kill")
        lost, silence = check(work, k)
        return {"process": "checkpoint helper", "step": "checkpoint.held", "bytes_lost": lost,
                "longest_silent_wait_s": round(silence, 3)}  # fmt: skip
    finally:
        for h in helpers():
            h.kill()
        shut(k)


KERNEL_STEPS = [
    "kernel.pause.start", "kernel.pause.copy", "kernel.pause.release", "kernel.pause.reply",
    "kernel.spill.write", "kernel.spill.written", "kernel.resume.mapped", "kernel.resume.copy",
]  # fmt: skip
ARBITER_STEPS = ["arbiter.pause", "arbiter.grant", "arbiter.spill", "arbiter.hello"]
GPU_ARBITER_STEPS = ["arbiter.suspend", "checkpoint.locked", "arbiter.restore", "checkpoint.restored"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("gpu", "cpu"), default=None, help="default: gpu where CUDA is")
    ap.add_argument("--kernels", type=int, default=20, help="paused kernels for the restart")
    ap.add_argument(
        "--disk-gib",
        type=float,
        default=None,
        help="data moved to disk (default: 8 GiB on a GPU, 0.5 on CPU)",
    )
    ap.add_argument("--skip", nargs="*", default=[], choices=("restart", "disk", "faults"))
    ap.add_argument(
        "--steps",
        nargs="*",
        default=None,
        help="run only these fault steps (a failpoint name, 'server' or 'helper'; default: all)",
    )
    ap.add_argument(
        "--merge",
        action="store_true",
        help="keep what --out holds and replace only the parts and fault rows this run measures",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    record = provenance.record()
    device = args.device
    if device is None:
        import torch

        device = "gpu" if torch.cuda.is_available() else "cpu"
    small = CPU(16 * MiB) if device == "cpu" else GPU(1)
    big_gib = args.disk_gib or (8 if device == "gpu" else 0.5)
    big = CPU(int(big_gib * GiB)) if device == "cpu" else GPU(int(big_gib))
    result: dict = {"device": device, "host": platform.node(), "python": platform.python_version()}
    if args.merge and args.out and args.out.exists():
        result = {**json.loads(args.out.read_text()), **result}
    result = provenance.stamped(result, record)  # an earlier file's record moves to its history

    def tmp() -> Path:
        return Path(tempfile.mkdtemp(prefix="vgpu-faults-"))

    def save(final: bool = False) -> None:
        """The result so far, written after every part: a run cut short keeps what it measured."""
        result["goals"] = goals(result)
        text = json.dumps(result, indent=2)
        if final:
            print(text)
        if args.out:
            args.out.write_text(text + "\n")

    if "restart" not in args.skip:
        print("restart", file=sys.stderr)
        result["restart"] = restart(small, tmp(), args.kernels)
        print(json.dumps(result["restart"]), file=sys.stderr)
        save()
    if "disk" not in args.skip:
        print("disk", file=sys.stderr)
        result["disk"] = disk(big, tmp())
        print(json.dumps(result["disk"]), file=sys.stderr)
        save()
    if "faults" not in args.skip:
        cases = [(kernel_fault, step) for step in KERNEL_STEPS]
        cases += [
            (arbiter_fault, step) for step in ARBITER_STEPS + (GPU_ARBITER_STEPS if device == "gpu" else [])
        ]
        cases += [(server_fault, "server")] + ([(helper_fault, "helper")] if device == "gpu" else [])
        if args.steps is not None:
            unknown = set(args.steps) - {step for _, step in cases}
            if unknown:
                ap.error(f"no such fault step on a {device}: {', '.join(sorted(unknown))}")
            cases = [(fault, step) for fault, step in cases if step in args.steps]
        faults = result["faults"] = [] if args.steps is None else result.get("faults", [])
        for fault, step in cases:
            row = fault(small, tmp(), step) if fault in (kernel_fault, arbiter_fault) else fault(small, tmp())
            row["date"], row["commit"] = record["date"], record["commit"]
            faults[:] = [f for f in faults if (f["process"], f["step"]) != (row["process"], row["step"])]
            faults.append(row)
            print(json.dumps(row), file=sys.stderr)
            save()
    if device == "cpu":
        result["notes"] = (
            f"On a CPU the resume from disk decodes zstandard on the machine's cores ({os.cpu_count()} "
            "here): the decoder, not the disk, bounds it; the goal is the GPU path's, where "
            "nvCOMP decodes behind the reads."
        )
    save(final=True)


def goals(result: dict) -> dict:
    """The issue's goals, each True or False, for what ``result`` holds so far."""
    out = {
        "books_whole_within_5_s": result.get("restart", {}).get("books_whole_s", 0) <= 5,
        "no_bytes_lost": all(f["bytes_lost"] == 0 for f in result.get("faults", [])),
        f"no_silent_wait_over_{scene.SILENCE_GOAL:g}_s": all(
            f["longest_silent_wait_s"] <= scene.SILENCE_GOAL for f in result.get("faults", [])
        ),
    }
    if "disk" in result:
        # the measure: GB/s of uncompressed bytes, beside a plain read of the file
        d = result["disk"]
        out["disk_resume_at_least_0.8x_plain_read"] = d["resume_gbps"] >= 0.8 * d["plain_read_gbps"]
    return out


if __name__ == "__main__":
    main()
