"""Host memory and disk as tiers of the node, with kernels holding real bytes: paused
kernels past the node's host budget move to disk (the coldest first) and come back
bit-exact; a full disk gives a clear error and the data stays in host memory; a pause
that would pass the budget with no disk to spill to is not made; pinned slabs kept warm
by idle kernels go before any paused data moves; a spill made for one kernel's room holds
up no other kernel's; ``%vgpu status`` and Prometheus say where everything is."""

import dataclasses
import json
import os
import select
import subprocess
import sys
import urllib.request
from pathlib import Path

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.server_process import free_port
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB
SEEDS = {"ada": (11, 16 * MiB), "bob": (12, 16 * MiB)}


def kernels_holding(tmp_path, arbiter, *users):
    out = []
    for user in users:
        k = scene.start_kernel(tmp_path, arbiter, user)
        cell = scene.run(k, scene.hold_code(*SEEDS[user]))
        assert cell.error is None
        assert "Error" not in cell.text, cell.text
        out.append(k)
    return out


def pause(kernel) -> None:
    assert "paused as soon as the cell ends" in scene.run(kernel, "%vgpu pause").text


def test_paused_kernels_past_the_host_budget_move_to_disk_coldest_first(tmp_path):
    port = free_port()
    arbiter = ArbiterProcess(
        tmp_path,
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        "--ArbiterApp.disk_reserve=1M",
        "--ArbiterApp.host_memory_limit=40M",  # one paused kernel (14 MB) fits under the mark, two do not
        "--ArbiterApp.host_spill_fraction=0.5",
        f"--metrics-port={port}",
    ).start()
    ada, bob = kernels_holding(tmp_path, arbiter, "ada", "bob")
    try:
        pause(ada)
        wait_for(lambda: arbiter.kernel(ada.pid)["tier"] == "host", 10, "ada paused in host memory")
        pause(bob)  # now past the mark: ada, paused longer, goes to disk; bob stays
        wait_for(lambda: arbiter.kernel(ada.pid)["tier"] == "disk", 10, "ada moved to the disk tier")
        assert arbiter.kernel(bob.pid)["tier"] == "host"
        node = arbiter.books()["node"]
        assert node["host_used"] == arbiter.kernel(bob.pid)["host_bytes"] <= 20 * MiB
        assert node["disk_used"] == arbiter.kernel(ada.pid)["disk_bytes"] > 0
        files = [p for d in scene.disk_dirs(tmp_path / "disk") for p in d.rglob("*") if p.is_file()]
        assert files, "ada's data is in files of her own"
        for f in files:
            assert f.stat().st_mode & 0o077 == 0, f"{f} is readable by others"
        assert (tmp_path / "disk" / str(os.getuid())).stat().st_mode & 0o777 == 0o700

        def scrape() -> str | None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            return text if 'jupyter_vgpu_kernels{tier="disk"} 1.0' in text else None

        metrics = wait_for(scrape, 10, "the gauges of the tiers")
        assert 'jupyter_vgpu_kernels{tier="host"} 1.0' in metrics
        assert "jupyter_vgpu_spills_total 1.0" in metrics
        series = dict(
            line.rsplit(" ", 1) for line in metrics.splitlines() if line and not line.startswith("#")
        )
        assert float(series["jupyter_vgpu_disk_bytes"]) == node["disk_used"]
        assert float(series["jupyter_vgpu_host_bytes"]) == node["host_used"]
        assert float(series["jupyter_vgpu_host_limit_bytes"]) == 40 * MiB
        status = scene.run(bob, "%vgpu status").text  # bob comes back for it, from host memory
        assert "tier" in status
        assert "node memory" in status
        assert "in the disk tier" in status
        for k, user in ((ada, "ada"), (bob, "bob")):
            out = scene.run(k, scene.DIGEST)
            assert out.text.strip().splitlines()[-1] == scene.digest(*SEEDS[user]), out.text
            assert out.longest_silence <= scene.SILENCE
        assert not [f for f in files if f.exists()], "a resume from disk removes its files"
        wait_for(lambda: arbiter.books()["node"]["disk_used"] == 0, 10, "the disk tier empty")
    finally:
        ada.shutdown()
        bob.shutdown()
        arbiter.stop()


def test_a_spill_that_meets_a_full_device_gives_a_clear_error_and_the_data_stays_in_host_memory(tmp_path):
    """ada's files meet a full device (links to /dev/full in her own directory): her
    spill fails with the device's error and her data stays, bit-exact, in host memory.
    The arbiter's own write to the disk tier succeeds, so the failure is hers alone: the
    disk tier is not taken for failing (one kernel's word never stops everyone's spills)."""
    arbiter = ArbiterProcess(
        tmp_path,
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        "--ArbiterApp.disk_reserve=1M",
        "--ArbiterApp.host_memory_limit=40M",
        "--ArbiterApp.host_spill_fraction=0.1",
    ).start()
    (ada,) = kernels_holding(tmp_path, arbiter, "ada")
    try:
        # ada's directory of the disk tier, where every file she writes meets a full device
        start = Path(f"/proc/{ada.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
        where = tmp_path / "disk" / str(os.getuid()) / f"kernel-{ada.pid}-{start}"
        where.mkdir(mode=0o700, parents=True)
        for key in range(1, 9):
            (where / f"{key}.tmp").symlink_to("/dev/full")
        pause(ada)
        decision = wait_for(
            lambda: next((d for d in arbiter.books()["decisions"] if d["what"] == "spill failed"), None),
            10,
            "the spill to fail",
        )
        assert "No space left on device" in decision["message"]
        assert arbiter.books()["node"]["disk_problem"] is None
        assert arbiter.kernel(ada.pid)["tier"] == "host"
        assert arbiter.kernel(ada.pid)["host_bytes"] > 0
        out = scene.run(ada, scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(*SEEDS["ada"]), out.text
    finally:
        ada.shutdown()
        arbiter.stop()


def test_a_pause_that_would_pass_the_host_budget_is_not_made(tmp_path):
    # no disk tier, a host budget smaller than ada: bob's cell cannot have her room
    arbiter = ArbiterProcess(
        tmp_path, "--queue-timeout=3", "--ArbiterApp.disk_dir=", "--ArbiterApp.host_memory_limit=100M"
    ).start()
    bob = scene.start_kernel(tmp_path, arbiter, "bob")
    ada = scene.start_kernel(tmp_path, arbiter, "ada")
    try:
        assert scene.run(ada, scene.hold_code(*SEEDS["ada"], simulated_mib=700)).error is None
        wait_for(lambda: arbiter.kernel(ada.pid)["resident"] >= 700 * MiB, 30, "ada's memory in the books")
        out = scene.run(bob, "print('must not run')")
        assert "MemoryError" in out.text
        assert "must not run" not in out.text
        assert out.longest_silence <= scene.SILENCE
        skipped = next(d for d in arbiter.books()["decisions"] if d["what"] == "pause skipped")
        assert "host memory for paused kernels is full" in skipped["message"]
        assert "there is no disk tier" in skipped["message"]
        assert arbiter.kernel(ada.pid)["tier"] == "gpu"
    finally:
        ada.shutdown()
        bob.shutdown()
        arbiter.stop()


#: A kernel as the arbiter sees one, spoken over the arbiter's socket by a small process
#: of the test's (pinned host memory needs a GPU, and a kernel keeping warm slabs is what
#: is wanted here): an idle kernel keeping WARM bytes, which lets them go when asked, says
#: so on its stdout, and stays until it is killed.
PROTOCOL_KERNEL = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
warm = int(sys.argv[2])
def send(msg):
    sock.sendall(json.dumps(msg).encode() + b"\\n")
send({"type": "hello", "version": 2, "kernel_id": "warm-kernel", "state": "idle", "resident": 0,
      "paused_bytes": 0, "host_bytes": warm, "disk_bytes": 0, "budget": None, "idle_seconds": 600.0})
print("hello", flush=True)
for line in sock.makefile("rb"):
    msg = json.loads(line)
    if msg["type"] == "trim":
        send({"type": "state", "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0,
              "disk_bytes": 0, "resume_seconds": None})
        send({"type": "reply", "id": msg["id"], "ok": True, "message": "", "released": warm})
        print("trimmed", flush=True)
        break
sys.stdin.read()  # connected (in the books) until the test ends it
"""


def line_within(process: subprocess.Popen, seconds: float) -> str:
    """The next line ``process`` prints, or '' when none comes within ``seconds``."""
    if not select.select([process.stdout], [], [], seconds)[0]:
        return ""
    return process.stdout.readline().strip()


def test_idle_kernels_let_warm_pinned_memory_go_before_paused_data_moves_to_disk(tmp_path):
    """A kernel keeps its pinned slabs after a resume so that its next pause need not pin
    again; they count in the node's host budget, and past the mark the arbiter asks idle
    kernels to let them go before it moves anyone's paused data to disk."""
    arbiter = ArbiterProcess(
        tmp_path,
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        "--ArbiterApp.disk_reserve=1M",
        "--ArbiterApp.host_memory_limit=40M",  # ada paused (14 MB) is under the mark of 20M
        "--ArbiterApp.host_spill_fraction=0.5",
    ).start()
    (ada,) = kernels_holding(tmp_path, arbiter, "ada")
    warm = None
    try:
        pause(ada)
        wait_for(lambda: arbiter.kernel(ada.pid)["tier"] == "host", 10, "ada paused in host memory")
        warm = subprocess.Popen(
            [sys.executable, "-c", PROTOCOL_KERNEL, str(arbiter.socket), str(16 * MiB)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        with arbiter.control() as c:  # its own server, as the Hub would register one
            c.register(warm.pid, "eve", "", scene.SLICE)
        assert line_within(warm, 10) == "hello"  # 14 + 16 MB: past the mark of 20M
        trimmed = line_within(warm, 15)
        if trimmed != "trimmed":  # say what the arbiter saw and decided instead
            books = arbiter.books()
            seen = {k: arbiter.kernel(p) for k, p in (("ada", ada.pid), ("warm", warm.pid))}
            raise AssertionError(
                f"the idle kernel was not asked to trim within 15 s: node {books['node']}, kernels {seen}, "
                f"decisions {books['decisions'][-8:]}, unknown {books.get('unknown')}"
            )
        wait_for(lambda: arbiter.books()["node"]["host_used"] == arbiter.kernel(ada.pid)["host_bytes"], 10,
                 "the node's host bytes back to ada's paused data alone")  # fmt: skip
        decisions = [d["what"] for d in arbiter.books()["decisions"]]
        assert "trim" in decisions, decisions
        assert "spill" not in decisions, "no paused data moved to disk while warm slabs could go"
        assert arbiter.kernel(ada.pid)["tier"] == "host"
        assert scene.run(ada, scene.DIGEST).text.strip().splitlines()[-1] == scene.digest(*SEEDS["ada"])
    finally:
        if warm is not None:
            warm.kill()  # whether or not it was asked to trim
            warm.wait(10)
        ada.shutdown()
        arbiter.stop()


def test_a_spill_made_for_one_kernels_room_holds_up_no_other_kernels(tmp_path):
    """ann needs vic off the simulated card; vic's pause needs host memory that only a spill
    of sam (paused first, the coldest) makes, and sam's spill stops at its write and never
    ends. Meanwhile bob, paused in host memory with a small budget the card has room for,
    runs a cell: it comes back (the spill runs outside the card's lock), and the arbiter
    still waits for sam (``pause_timeout`` 600 s). Once sam is killed, ann gets her room,
    and every kernel's bytes are intact."""
    arbiter = ArbiterProcess(
        tmp_path,
        "--queue-timeout=300",
        "--ArbiterApp.pause_timeout=600",  # sam's spill is waited for, all the while
        f"--ArbiterApp.disk_dir={tmp_path / 'disk'}",
        "--ArbiterApp.disk_reserve=1M",
        "--ArbiterApp.host_memory_limit=720M",  # sam and bob (27 MiB) and vic (700 MiB or more) do not fit
    ).start()
    small = dataclasses.replace(scene.SLICE, memory_limit=64 * MiB, memory_request=64 * MiB)
    stop_at_spill = {"JUPYTER_VGPU_FAILPOINTS": "kernel.spill.write=stop"}
    sam = scene.start_kernel(tmp_path, arbiter, "sam", stop_at_spill)
    bob = scene.start_kernel(tmp_path, arbiter, "bob", slice_=small)
    vic = scene.start_kernel(tmp_path, arbiter, "vic")
    ann = scene.start_kernel(tmp_path, arbiter, "ann")
    kernels = (sam, bob, vic, ann)
    try:
        for k, seed in ((sam, 21), (bob, 22)):
            assert scene.run(k, scene.hold_code(seed, 16 * MiB)).error is None
            pause(k)
            wait_for(lambda k=k: arbiter.kernel(k.pid)["tier"] == "host", 10, f"{k.user} in host memory")
        assert scene.run(vic, scene.hold_code(23, 16 * MiB, simulated_mib=700)).error is None
        wait_for(lambda: arbiter.kernel(vic.pid)["resident"] >= 700 * MiB, 30, "vic's memory in the books")
        waiting = scene.Background(ann, "print('ann ran')", timeout=300)
        scene.stopped_at_failpoint(sam.pid, "sam's spill, made for vic's pause, at its write")
        out = scene.run(bob, scene.DIGEST, timeout=120)  # far less than sam's 600 s
        assert out.error is None, (out.error, out.text)
        assert out.text.strip().splitlines()[-1] == scene.digest(22, 16 * MiB), out.text
        # the arbiter gave bob his room: he did not give up on it (its silence past the
        # kernel's patience) and come back on his own
        assert "has not answered" not in out.text, out.text
        assert "on its own" not in out.text, out.text
        assert scene.process_state(sam.pid) == "T", "sam's spill ended before bob's cell: nothing was shown"
        assert arbiter.kernel(vic.pid)["tier"] == "gpu", "vic was paused without the host room"
        scene.kill(sam.pid, "kill")
        out = waiting.join(300)
        assert out.error is None, out.error
        assert out.text.rstrip().endswith("ann ran"), out.text
        assert out.longest_silence <= scene.SILENCE, (out.longest_silence, out.text)
        out = scene.run(vic, scene.DIGEST)
        assert out.text.strip().splitlines()[-1] == scene.digest(23, 16 * MiB), out.text
    finally:
        scene.reap(sam)
        for k in kernels[1:]:
            k.shutdown()
        arbiter.stop()


#: A version-3 kernel over the arbiter's socket: its hello says what its pause would store
#: (``pausable_bytes``, argv[2]); each line on its stdin is sent as a state message.
SAYING_KERNEL = """
import json, socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
def send(msg):
    sock.sendall(json.dumps(msg).encode() + b"\\n")
send({"type": "hello", "version": 3, "kernel_id": "saying", "state": "idle", "resident": 0,
      "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0, "pausable_bytes": int(sys.argv[2]),
      "budget": None, "idle_seconds": 600.0})
for line in sys.stdin:
    send({"type": "state", "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0,
          "disk_bytes": 0, "resume_seconds": None, **json.loads(line)})
"""


def test_what_a_kernel_says_its_pause_stores_is_taken_within_its_budget_and_forgotten_unsaid(tmp_path):
    """The arbiter takes ``pausable_bytes`` from a version-3 hello or state into its
    books, never past the kernel's budget; a state that leaves it out leaves it unknown
    (the estimate of a pause falls back on the resident bytes, :func:`.tiers.host_need`)."""
    arbiter = ArbiterProcess(tmp_path).start()
    process = subprocess.Popen(
        [sys.executable, "-c", SAYING_KERNEL, str(arbiter.socket), str(300 * MiB)],
        stdin=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        with arbiter.control() as c:
            c.register(process.pid, "eve", "", scene.SLICE)

        def said() -> int | None:
            return (arbiter.kernel(process.pid) or {"pausable_bytes": -1})["pausable_bytes"]

        wait_for(lambda: said() == 300 * MiB, 10, "the hello's figure in the books")
        budget = arbiter.kernel(process.pid)["budget"]
        for line, books in ((json.dumps({"pausable_bytes": 64 * scene.GiB}), budget), ("{}", None)):
            process.stdin.write(line + "\n")
            process.stdin.flush()
            wait_for(lambda books=books: said() == books, 10, f"{books} in the books")
    finally:
        process.kill()
        process.wait()
        arbiter.stop()
