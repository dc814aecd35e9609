"""The node's tiers, piece by piece: the host budget's arithmetic (warm pinned slabs of
idle kernels counted, and let go before any paused data moves to disk), the disk tier's
directories (swept when their process ends, a zombie included), the journal of slices
registered over the socket, one arbiter per socket, the protocol's version-2 hello, the
failpoints' names, and the line a waiting cell shows."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jupyter_vgpu import failpoints
from jupyter_vgpu.host import procs
from jupyter_vgpu.kernel.progress import Progress
from jupyter_vgpu.node import disk, handoff, safe_dirs, tiers
from jupyter_vgpu.node.books import ACTIVE, IDLE, PAUSED, SUSPENDED, Kernel, Server
from jupyter_vgpu.node.journal import Journal
from jupyter_vgpu.node.protocol import ProtocolError, decode
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.waiting import wait_for

MiB, GiB = 2**20, 2**30
SLICE = Slice("GPU-x", 0, "card", 80 * GiB, 8 * GiB, 50, simulated=True)


def kernel(pid, state=PAUSED, host=0, disk_bytes=0, idle=0.0, priority=50):
    k = Kernel(pid, Server(pid, f"u{pid}", "", SLICE.replace(priority=priority)), state=state)
    k.host_bytes, k.disk_bytes = host, disk_bytes
    k.since = time.monotonic() - idle
    return k


def test_a_kernel_says_its_tier():
    assert kernel(1, IDLE).tier == "gpu"
    assert kernel(1, PAUSED, host=5).tier == "host"
    assert kernel(1, PAUSED, disk_bytes=5).tier == "disk"
    assert kernel(1, SUSPENDED).tier == "suspended"


def test_paused_kernels_are_asked_to_trim_once_per_pause_and_only_when_the_host_is_short():
    """What a paused kernel gives back on a trim (its heap's free pages, pinned memory past
    its data) is outside the books: a budget over its mark is no reason to ask it, the
    host's available memory under the reserve is; and once asked, not again until its
    next pause."""
    now = time.monotonic()
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=50 * MiB, reserve=GiB)
    cold = kernel(1, PAUSED, host=60 * MiB, idle=300)
    on_disk = kernel(2, PAUSED, disk_bytes=5 * MiB, idle=10)  # no host bytes: its process is still there
    idle = kernel(3, IDLE, host=0)
    everyone = [on_disk, cold, idle]
    assert tiers.to_trim(everyone, budget, 10 * GiB, now) == []  # over the mark; the host is not short
    assert tiers.to_trim(everyone, budget, 0, now) == [cold, on_disk]  # short: coldest first
    cold.trim_asked = time.monotonic()
    assert tiers.to_trim(everyone, budget, 0, now) == [on_disk]  # asked once during this pause
    cold.since = time.monotonic() + 1  # paused anew (the state message after a resume)
    assert tiers.paused_to_trim(everyone, now) == [on_disk, cold]
    assert tiers.paused_to_trim(everyone, now, exclude=(on_disk,)) == [cold]


def test_the_coldest_paused_kernels_spill_until_under_the_mark():
    now = time.monotonic()
    cold, warm, idle = kernel(1, host=40 * MiB, idle=100), kernel(2, host=40 * MiB, idle=10), kernel(3, IDLE)
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=50 * MiB, reserve=GiB)
    assert tiers.host_used([cold, warm, idle]) == 80 * MiB
    assert tiers.to_spill([warm, cold, idle], budget, 10 * GiB, now) == [cold]
    assert tiers.to_spill([warm], budget, 10 * GiB, now) == []
    # 35 MiB of what they hold are shared pieces both count whole: held once, under the mark
    shared = tiers.Sharing(35 * MiB, {1: 35 * MiB, 2: 35 * MiB})
    assert tiers.host_used([cold, warm, idle], shared) == 45 * MiB
    assert tiers.to_spill([warm, cold, idle], budget, 10 * GiB, now, shared) == []
    # short of available memory, everything paused goes, coldest first
    assert tiers.to_spill([warm, cold], budget, 0, now) == [cold, warm]


def test_a_spill_counts_as_freeing_only_what_no_other_kernel_still_reads():
    """Three paused kernels each read the same 30 MiB piece (held once) beside 10 MiB of
    their own: 60 MiB held on the node, over a mark of 45 MiB. Moving one to disk gives
    back its own 10 MiB only (the others still read the piece), so it takes two spills
    to get under; counting each spill as its whole 40 MiB would have stopped after one
    and left the node over its mark until the next look."""
    now = time.monotonic()
    paused = [kernel(pid, host=40 * MiB, idle=100 - pid) for pid in (1, 2, 3)]
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=45 * MiB, reserve=GiB)
    shared = tiers.Sharing(saving=60 * MiB, with_others={1: 30 * MiB, 2: 30 * MiB, 3: 30 * MiB})
    assert tiers.host_used(paused, shared) == 60 * MiB
    assert [shared.frees(k) for k in paused] == [10 * MiB] * 3
    assert tiers.to_spill(paused, budget, 10 * GiB, now, shared) == paused[:2]
    assert tiers.to_spill(paused, budget, 10 * GiB, now, tiers.Sharing(saving=60 * MiB)) == paused[:1]


def test_a_kernel_whose_host_bytes_others_all_read_is_no_spill_candidate():
    """A kernel on disk already, still reading a 30 MiB piece others read too (its spill
    left it in the node's copies), gives nothing back by spilling again: it is left out,
    or the arbiter would ask it on every look; a kernel of its own bytes is taken."""
    now = time.monotonic()
    reader = kernel(1, host=30 * MiB, disk_bytes=10 * MiB, idle=200)
    own = kernel(2, host=40 * MiB, idle=100)
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=10 * MiB, reserve=GiB)
    shared = tiers.Sharing(saving=0, with_others={1: 30 * MiB})
    assert tiers.spillable([reader, own], now, shared=shared) == [own]
    assert tiers.to_spill([reader, own], budget, 10 * GiB, now, shared) == [own]
    assert tiers.spillable([reader, own], now) == [reader, own]  # nothing shared: both


def test_a_pause_is_estimated_from_what_the_kernel_says_it_stores_never_past_its_resident_bytes():
    """An MLP kernel after a cell holds 16 GiB on the card, most of it PyTorch's cached
    blocks of its activations; its pause stores its 2.5 GiB of live bytes at most. Where it
    says so (``pausable_bytes``), the estimate of its pause's host memory is that and a
    margin, not its resident bytes; its warm slabs, counted already, come off either way."""
    k = kernel(1, state=IDLE)
    k.resident = 16 * GiB
    assert tiers.host_need(k) == 16 * GiB  # said nothing: its resident bytes
    k.pausable = 2560 * MiB
    margin = int(k.pausable * tiers.PAUSE_MARGIN_FRACTION) + tiers.PAUSE_MARGIN_BYTES
    assert tiers.host_need(k) == 2560 * MiB + margin
    k.host_bytes = 2 * GiB  # warm slabs pinned ahead for this pause
    assert tiers.host_need(k) == 512 * MiB + margin
    k.pausable = 64 * GiB  # more than it holds: its resident bytes bound it
    assert tiers.host_need(k) == 14 * GiB
    k.state, k.pausable = PAUSED, 0  # a paused kernel's suspend: what is left on the card
    k.resident = GiB
    assert tiers.host_need(k) == GiB


def test_warm_slabs_count_in_every_state_and_idle_kernels_let_them_go_first():
    now = time.monotonic()
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=50 * MiB, reserve=GiB)
    paused = kernel(1, PAUSED, host=30 * MiB, idle=300)
    idle_cold = kernel(2, IDLE, host=20 * MiB, idle=200)  # slabs kept warm after a resume
    idle_warm = kernel(3, IDLE, host=20 * MiB, idle=10)
    running = kernel(4, ACTIVE, host=20 * MiB)
    everyone = [paused, idle_cold, idle_warm, running]
    assert tiers.host_used(everyone) == 90 * MiB  # every kernel's pinned memory is the host's
    # 90 over a mark of 50: the coldest idle kernels let go first (no data moves)...
    assert tiers.to_trim(everyone, budget, 10 * GiB, now) == [idle_cold, idle_warm]
    # ...a running kernel is left to its cell, and paused data is not the trim's
    assert tiers.trimmable(everyone, now) == [idle_cold, idle_warm]
    # once they did, the paused kernel is under the mark: nothing moves to disk
    idle_cold.host_bytes = idle_warm.host_bytes = 0
    assert tiers.host_used(everyone) == 50 * MiB
    assert tiers.to_spill(everyone, budget, 10 * GiB, now) == []
    suspended = kernel(5, SUSPENDED, host=5 * MiB)
    suspended.checkpoint_bytes = 7 * MiB
    assert suspended.host_held == 12 * MiB
    # a pause of an idle kernel adds its resident bytes less the warm slabs it takes first;
    # a suspend of a paused one adds the checkpoint of what it has left on the card
    idle_warm.resident, idle_warm.host_bytes = 100 * MiB, 30 * MiB
    assert tiers.host_need(idle_warm) == 70 * MiB
    paused.resident = 600 * MiB
    assert tiers.host_need(paused) == 600 * MiB


def test_a_suspend_would_strand_paused_data_in_host_memory_only_past_the_mark():
    """A suspended kernel's CUDA calls wait for its restore, the release of its pinned
    slabs among them: its paused data cannot move to disk until it runs again. Past the
    spill mark (its checkpoint's bytes counted) or under the reserve, that data goes to
    disk first; under both, or with nothing of its own in host memory, it need not."""
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=50 * MiB, reserve=GiB)
    victim = kernel(1, PAUSED, host=30 * MiB, idle=600)
    other = kernel(2, PAUSED, host=15 * MiB, idle=10)
    everyone = [victim, other]
    plenty = 10 * GiB
    assert not tiers.strands(victim, everyone, budget, 0, plenty)  # 45 MiB: under the mark
    assert tiers.strands(victim, everyone, budget, 10 * MiB, plenty)  # its checkpoint passes it
    # 50 MiB with its checkpoint: at the mark, not past it; the reserve decides
    assert tiers.strands(victim, everyone, budget, 5 * MiB, GiB + 5 * MiB - 1)
    assert not tiers.strands(victim, everyone, budget, 5 * MiB, GiB + 5 * MiB)
    on_disk = kernel(3, PAUSED, disk_bytes=30 * MiB, idle=600)
    assert not tiers.strands(on_disk, [on_disk, other], budget, 100 * MiB, 0)  # nothing left to move
    idle = kernel(4, IDLE, host=30 * MiB)  # warm slabs: a pause comes before any suspend
    assert not tiers.strands(idle, [idle, other], budget, 100 * MiB, 0)
    read_by_others = tiers.Sharing(saving=0, with_others={1: 30 * MiB})  # a spill would free nothing
    assert not tiers.strands(victim, everyone, budget, 100 * MiB, 0, read_by_others)
    assert tiers.strands(victim, everyone, budget, 100 * MiB, 0, tiers.Sharing(0, {1: 29 * MiB}))


def _arbiter_of(tmp_path, kernels, **settings):
    """An arbiter (its disk tier open under ``tmp_path``) whose books hold ``kernels``, with
    a host budget of 100 MB spilled from 50 MB and a reserve of 1 byte."""
    import asyncio

    from jupyter_vgpu.node.app import ArbiterApp
    from jupyter_vgpu.node.arbiter import Arbiter

    class Conn:  # the arbiter's books read each connection's kernel
        def __init__(self, k):
            self.kernel = k

    app = ArbiterApp(
        host_memory_limit="100M",
        host_spill_fraction=0.5,
        host_reserve="1",
        disk_dir=str(tmp_path / "disk"),
        **settings,
    )
    arbiter = Arbiter(app, checkpoint=None)
    asyncio.run(arbiter.tiering.open())
    arbiter.conns = {k.pid: Conn(k) for k in kernels}
    return arbiter


def test_a_paused_kernel_past_the_mark_goes_to_disk_before_its_suspend(tmp_path):
    """The arbiter's host step for a suspend of a paused kernel, with the node past its
    mark: the kernel's own data is spilled first (and once: tried, or declined, the
    suspend goes on as before); under the mark, the suspend fits as it is."""
    victim = kernel(1, PAUSED, host=30 * 10**6, idle=600)
    other = kernel(2, PAUSED, host=15 * 10**6, idle=10)
    arbiter = _arbiter_of(tmp_path, [victim, other])
    step, who, why = arbiter.tiering.host_step(victim, 10 * 10**6)  # 55 MB past the 50 MB mark
    assert (step, who) == ("spill", victim), why
    assert "goes to disk before its suspend" in why
    assert arbiter.tiering.host_step(victim, 10 * 10**6, tried=[victim])[0] == "fits"  # 55 MB under 100 MB
    victim.refused["spill"] = time.monotonic()
    assert arbiter.tiering.host_step(victim, 10 * 10**6)[0] == "fits"
    victim.refused.clear()
    assert arbiter.tiering.host_step(victim, 0)[0] == "fits"  # 45 MB: under the mark
    victim.host_bytes, victim.disk_bytes = 0, 30 * 10**6  # spilled: nothing of it left to strand
    assert arbiter.tiering.host_step(victim, 10 * 10**6)[0] == "fits"


def test_host_room_tells_the_budget_from_the_reserve():
    budget = tiers.HostBudget(limit=100 * MiB, spill_at=80 * MiB, reserve=GiB)
    held = [kernel(1, host=60 * MiB)]
    assert tiers.host_room(held, budget, 30 * MiB, 10 * GiB) == (0, 0)
    assert tiers.host_room(held, budget, 50 * MiB, 10 * GiB) == (10 * MiB, 0)
    assert tiers.host_room(held, budget, 50 * MiB, GiB + 20 * MiB) == (10 * MiB, 30 * MiB)


def test_a_kernels_disk_directory_goes_when_its_process_ends(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tier = disk.DiskTier(tmp_path / "disk")
    try:
        uid = os.getuid()
        tier.user_dir(uid)
        mine = tier.kernel_dir(uid, os.getpid(), procs.start_time(os.getpid()))
        theirs = tier.kernel_dir(uid, child.pid, procs.start_time(child.pid))
        for d in (mine, theirs):
            os.makedirs(d)
            Path(d, "1.chunks").write_bytes(b"x" * 100)
        assert (tmp_path / "disk").stat().st_mode & 0o777 == 0o711
        assert (tmp_path / "disk" / str(uid)).stat().st_mode & 0o777 == 0o700
        assert tier.sweep() == []
        assert tier.size(uid, child.pid, procs.start_time(child.pid)) == 100
        child.send_signal(signal.SIGKILL)

        def zombie():
            stat = Path(f"/proc/{child.pid}/stat").read_text()
            return stat[stat.rindex(")") + 2] == "Z"

        wait_for(zombie, 10, "the child killed and not reaped")
        assert procs.start_time(child.pid) is None  # a zombie counts as ended
        assert tier.sweep() == [theirs]
        assert os.path.isdir(mine)
    finally:
        tier.close()
        child.kill()
        child.wait()


def test_a_disk_tier_writable_by_everyone_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)
    with pytest.raises(safe_dirs.UnsafePath, match="writable by other users"):
        disk.DiskTier(root)


def test_the_disk_tiers_own_write_tells_a_full_disk(tmp_path):
    """What a kernel says of the disk is checked with the arbiter's own write: on a full
    file system (a tmpfs of 64 KiB, filled) it fails and says why."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", str(mount)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    try:
        tier = disk.DiskTier(mount / "disk")
        assert tier.probe() is None
        with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"x" * 2**20)
        assert "No space left on device" in tier.probe()
        tier.close()
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_the_disk_tier_neither_follows_nor_removes_through_a_link(tmp_path):
    """A user's directory swapped for a link, or a link inside a kernel's directory: the
    sweep removes the link itself, never what it points to, and sizes count no link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"k" * 10)
    tier = disk.DiskTier(tmp_path / "disk")
    try:
        uid = os.getuid()
        tier.user_dir(uid)
        gone = tmp_path / "disk" / str(uid) / "kernel-999999-1"  # no such process
        gone.mkdir()
        (gone / "link").symlink_to(outside)
        (gone / "data").write_bytes(b"d" * 7)
        assert tier.size(uid, 999999, 1) == 7
        assert tier.sweep() == [str(gone)]
        assert (outside / "keep").read_bytes() == b"k" * 10
        (tmp_path / "disk" / "4242").symlink_to(outside)  # another "user's" directory, a link
        assert tier.sweep() == []
        assert (outside / "keep").exists()
        with pytest.raises(safe_dirs.UnsafePath, match="not a directory"):
            tier.user_dir(4242)
    finally:
        tier.close()


def test_the_journal_keeps_registrations_of_live_processes_only(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        j = Journal(tmp_path / "registrations.json")
        j.add(os.getpid(), "ada", "", SLICE)
        j.add(child.pid, "bob", "gpu", SLICE.replace(memory_limit=4 * GiB))
        assert (tmp_path / "registrations.json").stat().st_mode & 0o777 == 0o600
        child.kill()
        child.wait()
        again = Journal(tmp_path / "registrations.json").load()
        assert again == [(os.getpid(), "ada", "", SLICE, procs.start_time(os.getpid()), None)]
        assert len(json.loads((tmp_path / "registrations.json").read_text())) == 1
    finally:
        child.kill()
        child.wait()


def test_a_damaged_journal_is_set_aside_not_fatal(tmp_path):
    (tmp_path / "registrations.json").write_text("{not json")
    assert Journal(tmp_path / "registrations.json").load() == []


def test_a_second_holder_of_the_lock_makes_the_first_stop(tmp_path):
    lock = tmp_path / "arbiter.lock"
    code = (
        "import os, sys, time\nfrom jupyter_vgpu.node import handoff\n"
        f"handoff.take(os.open({str(tmp_path)!r}, os.O_RDONLY))\nprint('held', flush=True)\ntime.sleep(60)"
    )
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        assert first.stdout.readline().strip() == "held"
        fd = handoff.take(directory, timeout=10)
        assert first.wait(10) == -signal.SIGTERM  # asked to hand over, it ended
        assert lock.read_text().strip() == str(os.getpid())
        os.close(fd)
    finally:
        os.close(directory)
        first.kill()
        first.wait()


def test_a_lock_naming_a_process_that_is_no_arbiter_is_not_believed(tmp_path):
    """The PID in the lock file is signalled only when it is an arbiter of this user: one
    that names any other process (a user's write, a PID since reused) is never ended."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    directory = os.open(tmp_path, os.O_RDONLY)
    holder = handoff.take(directory)  # this process holds the lock...
    try:
        os.pwrite(holder, f"{bystander.pid}\n".encode(), 0)  # ...and the file names another
        code = (
            "import os\nfrom jupyter_vgpu.node import handoff\n"
            f"handoff.take(os.open({str(tmp_path)!r}, os.O_RDONLY), timeout=0.5)"
        )
        second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert second.returncode != 0
        assert "does not let go" in second.stderr
        assert bystander.poll() is None  # never signalled
    finally:
        os.close(holder)
        os.close(directory)
        bystander.kill()
        bystander.wait()


def test_a_lock_file_that_is_a_link_is_refused(tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / "arbiter.lock").symlink_to(tmp_path / "elsewhere")
    directory = os.open(tmp_path, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="Too many levels of symbolic links"):
            handoff.take(directory, timeout=1)
    finally:
        os.close(directory)


def test_a_version_2_hello_carries_where_the_memory_is():
    hello = {
        "type": "hello", "version": 2, "kernel_id": "k", "state": "paused", "resident": 0,
        "paused_bytes": 5, "host_bytes": 4, "disk_bytes": 0, "budget": None, "idle_seconds": 12.5,
    }  # fmt: skip
    assert decode(json.dumps(hello).encode()) == hello
    assert decode(b'{"type": "hello", "version": 1, "kernel_id": "k"}')["version"] == 1
    three = {**hello, "version": 3, "pausable_bytes": 7}  # version 3 adds what a pause would store
    assert decode(json.dumps(three).encode()) == three
    four = {**three, "version": 4}  # version 4 adds the room to grow, not to the hello
    assert decode(json.dumps(four).encode()) == four
    five = {**four, "version": 5, "cached_bytes": 9}  # version 5 adds what a release gives back
    assert decode(json.dumps(five).encode()) == five
    six = {**five, "version": 6}  # version 6 says which requests for room are cells, not in the hello
    assert decode(json.dumps(six).encode()) == six
    for bad, says in (
        ({**hello, "state": "asleep"}, "hello.state: must be one of"),
        ({**hello, "idle_seconds": -1}, "hello.idle_seconds: must be at least 0"),
        ({**hello, "version": 7}, "hello.version: must be one of 1, 2, 3, 4, 5, 6; got 7"),
        ({**hello, "version": True}, "hello.version: must be one of 1, 2, 3, 4, 5, 6; got true"),
        ({**three, "pausable_bytes": -1}, "hello.pausable_bytes: must be at least 0"),
        ({**five, "cached_bytes": -1}, "hello.cached_bytes: must be at least 0"),
        ({k: v for k, v in hello.items() if k != "disk_bytes"}, r"hello: missing field\(s\): disk_bytes"),
    ):
        with pytest.raises(ProtocolError, match=says):
            decode(json.dumps(bad).encode())
    state = {"type": "state", "state": "paused", "resident": 0, "paused_bytes": 1, "host_bytes": 1}
    state["resume_seconds"] = None
    assert "disk_bytes" not in decode(json.dumps(state).encode())  # version 1 leaves it out
    assert decode(json.dumps({**state, "disk_bytes": 3}).encode())["disk_bytes"] == 3


def test_failpoints_name_known_steps_and_actions_only():
    assert failpoints.parse("kernel.pause.copy=stop, arbiter.grant=kill") == {
        "kernel.pause.copy": "stop",
        "arbiter.grant": "kill",
    }
    with pytest.raises(failpoints.FailpointError, match="unknown step"):
        failpoints.parse("kernel.pause.cpoy=stop")
    with pytest.raises(failpoints.FailpointError, match="action must be"):
        failpoints.parse("kernel.pause.copy=raise_limit")
    assert failpoints.parse("arbiter.room=raise") == {"arbiter.room": "raise"}


def test_a_failpoint_ends_the_process_that_reaches_it_and_no_other(tmp_path):
    code = "from jupyter_vgpu import failpoints\nfailpoints.hit('arbiter.hello')\nprint('went on')"
    env = {**os.environ, failpoints.ENV: "arbiter.hello=kill"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.returncode == -signal.SIGKILL
    assert "went on" not in done.stdout
    env[failpoints.ENV] = ""
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "went on"


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_wait_is_shown_after_a_second_and_updated_every_second():
    shown = []
    clock = Clock()
    p = Progress(lambda text, end="\n": shown.append(text + end), "asking for room", clock=clock)
    clock.now = 0.5
    p.tick()
    assert shown == []  # a short wait says nothing
    clock.now = 1.0
    p.tick()
    assert shown == ["jupyter-vgpu: waiting 1 s: asking for room\r"]
    p.update("pausing ada/")
    assert shown[-1] == "jupyter-vgpu: still waiting 1 s: pausing ada/\r"
    clock.now = 1.5
    p.tick()
    assert len(shown) == 2
    clock.now = 2.0
    p.tick()
    assert shown[-1] == "jupyter-vgpu: still waiting 2 s: pausing ada/\r"
    p.done("back on the GPU")
    assert shown[-1] == "jupyter-vgpu: back on the GPU (after 2.0 s)\n"


def test_work_run_under_a_progress_line_hands_back_its_result_or_error():
    shown = []
    p = Progress(lambda text, end="\n": shown.append(text), "bringing memory back")
    assert p.run(lambda: 42) == 42
    with pytest.raises(ValueError, match="damaged"):
        p.run(lambda: (_ for _ in ()).throw(ValueError("damaged")))


def _arbiter_over_its_host_budget(tmp_path, **settings):
    """An arbiter whose node is past its 100 MB host budget for a 30 MB pause of an idle
    kernel: an idle kernel keeps 20 MB of warm slabs, a cold paused one 60 MB of data."""
    victim = kernel(1, IDLE)
    victim.resident = 30 * 10**6
    warm, cold = kernel(2, IDLE, host=20 * 10**6, idle=60), kernel(3, PAUSED, host=60 * 10**6, idle=600)
    return _arbiter_of(tmp_path, [victim, warm, cold], **settings), victim, warm, cold


def test_warm_slabs_go_before_paused_data_unless_the_admin_says_spill_first(tmp_path):
    arbiter, victim, warm, cold = _arbiter_over_its_host_budget(tmp_path)
    step, who, why = arbiter.tiering.host_step(victim, 30 * 10**6)
    assert (step, who) == ("trim", warm), why
    arbiter, victim, warm, cold = _arbiter_over_its_host_budget(tmp_path, trim_before_spill=False)
    step, who, why = arbiter.tiering.host_step(victim, 30 * 10**6)
    assert (step, who) == ("spill", cold), why
    assert "host memory for paused kernels is full" in why
    # spill first, but the disk tier takes nothing now: the trim is made rather than a refusal
    arbiter, victim, warm, cold = _arbiter_over_its_host_budget(
        tmp_path, trim_before_spill=False, disk_limit="1M"
    )
    assert arbiter.tiering.host_step(victim, 30 * 10**6)[:2] == ("trim", warm)


def test_the_background_step_spills_first_and_trims_only_what_is_still_over(tmp_path):
    import asyncio

    def run(arbiter):
        done = []

        async def trim(k):
            done.append(("trim", k.pid))
            k.host_bytes = 0

        async def spill(k, tell=None):
            done.append(("spill", k.pid))
            k.host_bytes, k.disk_bytes = 0, k.host_bytes

        arbiter.tiering.trim, arbiter.tiering.spill = trim, spill
        asyncio.run(arbiter.tiering._spill_coldest())
        return done

    # 80 MB held against a 50 MB mark: one of them is enough when it is the cold one
    assert run(_arbiter_over_its_host_budget(tmp_path)[0]) == [("trim", 2), ("spill", 3)]
    assert run(_arbiter_over_its_host_budget(tmp_path, trim_before_spill=False)[0]) == [("spill", 3)]
