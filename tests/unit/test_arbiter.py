"""The node arbiter with real kernels on a simulated card (the stand-in pause: states,
books and decisions for real, no memory moves): an idle kernel is paused so a busy one
gets room, a cell waits with a message while every kernel is busy and fails readably
after the timeout, no kernel can raise its own budget, and a restart loses nothing."""

import json
import socket
import time
import urllib.request

import pytest

from jupyter_vgpu import channel
from jupyter_vgpu.host import procs
from jupyter_vgpu.host.arbiter_control import ControlError
from jupyter_vgpu.slice import Card, Slice
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.kernel_runner import Kernel
from jupyter_vgpu.testing.waiting import wait_for

MiB, GiB = 2**20, 2**30
#: A 1 GiB simulated card and 600 MiB budgets: two kernels' budgets pass the card.
SLICE = Slice("GPU-sim-arbiter", 0, "Simulated card", GiB, 600 * MiB, 50, simulated=True, idle_seconds=3600)
HOLD_700 = "import torch\nx = torch.zeros(700 * 2**20 // 4)  # 700 MiB on the simulated card\n"


@pytest.fixture
def arbiter(tmp_path):
    process = ArbiterProcess(tmp_path, "--queue-timeout=20").start()
    yield process
    process.stop()


def start_kernel(
    tmp_path, arbiter: ArbiterProcess, user: str, slice_: Slice = SLICE, args: tuple[str, ...] = ()
) -> Kernel:
    chan = tmp_path / f"channel-{user}"
    chan.mkdir()
    env = {
        "JUPYTER_VGPU_ARBITER": str(arbiter.socket),
        "JUPYTER_VGPU_CHANNEL": str(chan),
        "JUPYTER_VGPU_SLICE": "",
    }
    kernel = Kernel(tmp_path, env, args=args)
    kernel.channel = chan
    with arbiter.control() as c:
        c.register(kernel.pid, user, "", slice_)
    wait_for(lambda: arbiter.kernel(kernel.pid), 30, f"{user}'s kernel to join the arbiter")
    return kernel


@pytest.fixture
def two(tmp_path, arbiter):
    ada, bob = start_kernel(tmp_path, arbiter, "ada"), start_kernel(tmp_path, arbiter, "bob")
    yield ada, bob
    ada.shutdown()
    bob.shutdown()


def state_of(arbiter, kernel) -> str | None:
    entry = arbiter.kernel(kernel.pid)
    return entry and entry["state"]


def test_an_idle_kernel_is_paused_so_that_another_gets_room(arbiter, two):
    ada, bob = two
    ada.run(HOLD_700)
    wait_for(
        lambda: (arbiter.kernel(ada.pid) or {}).get("resident") == 700 * MiB, 30, "ada's 700 MiB in the books"
    )
    assert bob.run("print(1 + 1)").strip() == "2"
    assert state_of(arbiter, ada) == "paused"
    decisions = arbiter.books()["decisions"]
    pause = next(d for d in decisions if d["what"] == "pause" and d["server"] == "ada/")
    assert "bob" in pause["reason"]
    assert pause["released"] == 0  # the stand-in moves no device memory, and says so
    assert ada.run("print(x.numel() * 4 // 2**20)").strip() == "700"  # ada comes back on her next cell
    assert state_of(arbiter, ada) in ("active", "idle")


def test_a_cell_waits_with_a_message_while_every_kernel_is_busy(arbiter, two):
    ada, bob = two
    ada.run(HOLD_700)
    msg_id = ada.client.execute("import time\ntime.sleep(4)")  # ada holds her room for 4 s
    wait_for(lambda: state_of(arbiter, ada) == "active", 30, "ada running")
    out = bob.run("print('bob ran')")
    assert "waiting for GPU memory on GPU 0" in out
    assert "1 session(s) running" in out
    assert out.strip().endswith("bob ran")
    ada.client.get_shell_msg(timeout=30)  # ada's reply
    del msg_id


def test_a_cell_that_gets_no_room_before_the_timeout_fails_readably(tmp_path):
    arbiter = ArbiterProcess(tmp_path, "--queue-timeout=2").start()
    ada, bob = start_kernel(tmp_path, arbiter, "ada"), start_kernel(tmp_path, arbiter, "bob")
    try:
        ada.run(HOLD_700)
        ada.client.execute("import time\ntime.sleep(8)")
        wait_for(lambda: state_of(arbiter, ada) == "active", 30, "ada running")
        out = bob.run("print('must not run')")
        assert "MemoryError" in out
        assert "no room on the GPU after 2 s" in out
        assert "must not run" not in out
    finally:
        ada.shutdown()
        bob.shutdown()
        arbiter.stop()


def test_background_pauses_wait_until_no_kernel_on_the_card_runs_code(tmp_path):
    # the card is above its watermark while ada idles; bob needs no room, so only the
    # background look could pause ada, and it must not while bob's cell runs
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.watermark=0.5", "--ArbiterApp.poll_seconds=0.2").start()
    ada = start_kernel(tmp_path, arbiter, "ada", SLICE.replace(idle_seconds=0.5))
    small = SLICE.replace(memory_limit=100 * MiB, memory_request=100 * MiB)
    bob = start_kernel(tmp_path, arbiter, "bob", small)
    try:
        ada.run(HOLD_700)
        wait_for(lambda: (arbiter.kernel(ada.pid) or {}).get("resident"), 30, "ada's 700 MiB in the books")
        bob.client.execute("import time\ntime.sleep(4)")
        wait_for(lambda: state_of(arbiter, bob) == "active", 30, "bob running")
        seen = []
        while state_of(arbiter, bob) == "active":  # about 4 s: 20 background looks
            seen.append(state_of(arbiter, ada))
        assert len(seen) > 10
        assert set(seen) == {"idle"}, "ada was paused in the background during bob's cell"
        bob.client.get_shell_msg(timeout=30)
        wait_for(lambda: state_of(arbiter, ada) == "paused", 10, "ada paused once the card is quiet")
        decisions = [d for d in arbiter.books()["decisions"] if d["what"] == "pause"]
        assert [(d["server"], d["reason"]) for d in decisions] == [("ada/", "idle")]
    finally:
        ada.shutdown()
        bob.shutdown()
        arbiter.stop()


def test_no_kernel_can_raise_its_own_budget(arbiter, two):
    ada, _ = two
    big = SLICE.replace(memory_limit=200 * GiB, gpu_memory=400 * GiB).to_dict()
    # through the socket, speaking for itself
    code = (
        "import json, os, socket\ns = socket.socket(socket.AF_UNIX)\n"
        "s.connect(os.environ['JUPYTER_VGPU_ARBITER'])\n"
        f"big = json.loads({json.dumps(big)!r})\n"
        "msg = {'type': 'register', 'pid': os.getpid(), 'user': 'ada', 'server': '', 'slice': big}\n"
        "s.sendall(json.dumps(msg).encode() + b'\\n')\nprint(s.makefile().readline())"
    )
    assert "register refused: no process of a user's server may" in ada.run(code)
    # nor read every user's figures
    peek = (
        "s = socket.socket(socket.AF_UNIX)\ns.connect(os.environ['JUPYTER_VGPU_ARBITER'])\n"
        's.sendall(b\'{"type": "books"}\\n\')\nprint(s.makefile().readline())'
    )
    assert "books refused: no process of a user's server may" in ada.run(peek)
    # through the server's channel file, which the kernel can write
    channel.write_json(channel.server_path(ada.channel), {"slice": big})
    out = ada.run("%vgpu status")
    assert "600.00 MiB" in out
    assert "200.00 GiB" not in out
    assert arbiter.kernel(ada.pid)["budget"] == 600 * MiB


def test_a_restarted_arbiter_finds_every_kernel_again(arbiter, two):
    ada, bob = two
    ada.run(HOLD_700)
    arbiter.stop()
    arbiter.start()
    with arbiter.control() as c:  # standalone, the harness registers again (under a Hub, the Hub does)
        for kernel, user in ((ada, "ada"), (bob, "bob")):
            c.register(kernel.pid, user, "", SLICE)
    wait_for(
        lambda: arbiter.kernel(ada.pid) and arbiter.kernel(bob.pid), 30, "both kernels back in the books"
    )
    assert bob.run("print(2 + 2)").strip() == "4"
    assert ada.run("print(x.numel() * 4 // 2**20)").strip() == "700"


def test_bad_messages_get_a_clear_answer_and_change_nothing(arbiter, two):
    ada, _ = two
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(arbiter.socket))
        reader = s.makefile("rb")
        for bad, says in (
            (b"not json\n", "not a JSON object"),
            (b'{"type": "pause"}\n', 'type: must be one of "hello"'),
            (b'{"type": "state", "state": "gone"}\n', "state: missing field(s): resident"),
            (b'{"type": "room", "id": 1, "for": "run", "budget": 1}\n', 'room: unknown field(s): "budget"'),
            (b'{"type": "hello", "version": 9, "kernel_id": "k"}\n', "hello.version: must be one of 1, 2"),
        ):
            s.sendall(bad)
            answer = json.loads(reader.readline())
            assert answer["type"] == "error"
            assert says in answer["message"]  # and the connection stays open for the next line
        s.sendall(b"x" * 70000 + b"\n")
        assert json.loads(reader.readline())["message"] == "line too long"
    assert arbiter.kernel(ada.pid)["budget"] == 600 * MiB
    with arbiter.control() as c, pytest.raises(ControlError, match="slice"):
        c._ask({"type": "register", "pid": 1, "user": "x", "server": "", "slice": {"gpu_uuid": 3}})


def metrics_page(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def test_the_books_show_each_kernel_processs_own_host_memory(tmp_path):
    """A kernel's process holds host memory of its own (its libraries, its objects, its
    paused data): the books show its RSS, the anonymous part of it that process alone
    holds, and, read in the background, its breakdown with PSS (its libraries' pages
    shared, divided among their sharers), measured by the arbiter, not said by the kernel,
    and what /proc says of it."""
    with socket.socket() as s:  # a port free now; the arbiter binds it as it starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    arbiter = ArbiterProcess(
        tmp_path, "--ArbiterApp.process_memory_seconds=0.5", f"--ArbiterApp.metrics_port={port}"
    ).start()
    ada = start_kernel(tmp_path, arbiter, "ada")
    try:
        ada.run("import numpy as np\nheld = np.ones(256 * 2**20, dtype=np.uint8)")
        entry = wait_for(
            lambda: (
                (e := arbiter.kernel(ada.pid))
                and ((e["process"] or {}).get("anon_bytes") or 0) >= 256 * MiB
                and e
            ),
            30,
            "ada's 256 MiB array in her process's memory in the books",
        )
        assert entry["process_bytes"] < 4 * GiB, entry
        assert 256 * MiB <= entry["process_private_bytes"] <= entry["process_bytes"], entry
        kinds = ("rss", "pss", "anon", "file", "shmem")
        last: list = []

        def agree() -> dict | None:
            """The books' figures, where every kind is within 16 MiB of /proc's now."""
            seen, now = arbiter.kernel(ada.pid)["process"], procs.memory(ada.pid)
            last[:] = [seen, now]
            return seen if all(abs(seen[f"{k}_bytes"] - getattr(now, k)) < 16 * MiB for k in kinds) else None

        # a kernel just done with a cell still loads pages for a moment (its reports, lazy
        # imports): the books' look, twice a second, agrees with /proc once it is quiet
        try:
            seen = wait_for(agree, 30, "the books' figures of ada's process within 16 MiB of /proc's")
        except AssertionError as e:
            raise AssertionError(f"{e}; books and /proc last: {last}") from None
        assert seen["source"] == "smaps_rollup", seen
        assert seen["age_seconds"] < 5, seen
        # its libraries' pages are shared (with this test's process, at least): PSS is less
        assert seen["pss_bytes"] < seen["rss_bytes"], seen
        assert seen["pss_anon_bytes"] >= 256 * MiB, seen
        # and summed by tier for Prometheus: ada's kernel is idle, its memory on the card
        page = wait_for(lambda: metrics_page(port), 10, "the arbiter's metrics page")
        gauge = next(
            x for x in page.splitlines() if x.startswith('jupyter_vgpu_kernel_process_pss_bytes{tier="gpu"}')
        )
        assert float(gauge.split()[-1]) >= 256 * MiB, gauge
    finally:
        ada.shutdown()
        arbiter.stop()


def test_a_paused_kernel_is_asked_once_to_trim_when_the_host_is_short(tmp_path):
    """Ada's cell builds about 400 MB of 4 kB buffers and drops 63 of every 64: the freed
    pages stay resident in her heap. Her kernel trims nothing on its own
    (``trim_when_paused`` off), so only the arbiter's question gives them back: once she
    is paused and the host's available memory is under the reserve (a reserve larger
    than the host), the arbiter asks her to trim, once in that pause, and says what her
    process's memory did, read from /proc."""
    arbiter = ArbiterProcess(tmp_path, "--ArbiterApp.host_reserve=64T").start()
    ada = start_kernel(tmp_path, arbiter, "ada", args=("--VGPUKernel.trim_when_paused=False",))
    try:
        base = procs.private_bytes(ada.pid)
        ada.run("blocks = [bytearray(4000) for _ in range(100_000)]\nkept = blocks[::64]\ndel blocks")
        held = procs.private_bytes(ada.pid)
        assert held - base >= 300 * MiB, (base, held)  # the freed buffers are still resident
        ada.run("%vgpu pause")
        wait_for(lambda: state_of(arbiter, ada) == "paused", 30, "ada paused")
        wait_for(
            lambda: procs.private_bytes(ada.pid) < held - 250 * MiB,
            30,
            "the arbiter to ask paused ada to trim, and her heap's free pages to go back",
        )
        asked = wait_for(
            lambda: [d for d in arbiter.books()["decisions"] if d["what"] == "trim" and d["pid"] == ada.pid],
            10,
            "the trim in the decisions",
        )
        assert "anonymous" in asked[0]["message"], asked
        time.sleep(2)  # four background looks later, still short: she is not asked again
        again = [d for d in arbiter.books()["decisions"] if d["what"] in ("trim", "trim refused")]
        assert len(again) == 1, again
        assert ada.run("print(len(kept), bytes(kept[-1][:3]))").strip() == "1563 b'\\x00\\x00\\x00'"
    finally:
        ada.shutdown()
        arbiter.stop()


def test_a_kernel_of_two_cards_gets_room_on_each(tmp_path, arbiter):
    """Cleo's slice spans cards a and b; Ada's idle kernel holds 700 MiB of card b alone.
    Room for Cleo's cell is made on both cards, so Ada is paused although card a, Cleo's
    first, is empty."""
    card_b = SLICE.replace(gpu_uuid="GPU-sim-b", gpu_index=1)
    pair = SLICE.replace(gpu_uuid="GPU-sim-a", more_gpus=(Card("GPU-sim-b", 1, GiB),))
    ada = start_kernel(tmp_path, arbiter, "ada", card_b)
    cleo = start_kernel(tmp_path, arbiter, "cleo", pair)
    try:
        ada.run(HOLD_700)
        wait_for(
            lambda: (arbiter.kernel(ada.pid) or {}).get("resident") == 700 * MiB,
            30,
            "ada's 700 MiB in the books",
        )
        assert cleo.run("print(1 + 1)").strip() == "2"
        assert state_of(arbiter, ada) == "paused"
        pause = next(
            d for d in arbiter.books()["decisions"] if d["what"] == "pause" and d["server"] == "ada/"
        )
        assert "cleo" in pause["reason"]
    finally:
        ada.shutdown()
        cleo.shutdown()


def test_an_arbiter_stopped_with_clients_connected_ends_without_a_traceback(tmp_path):
    # its connections' tasks are cancelled before its loop closes: before, each one still
    # open at the end wrote "Task was destroyed but it is pending!" and a RuntimeError
    arbiter = ArbiterProcess(tmp_path).start()
    clients = []
    try:
        for _ in range(3):
            client = socket.socket(socket.AF_UNIX)
            client.settimeout(10)
            client.connect(str(arbiter.socket))
            clients.append(client)
            client.sendall(b"{}\n")  # answered (an error, and the client may go on): its task runs
            assert b"error" in client.recv(4096)
        arbiter.stop()
        assert arbiter.process.returncode == 0, arbiter.log_path.read_text()[-2000:]
        log = arbiter.log_path.read_text()
        assert "Task was destroyed" not in log, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
    finally:
        for client in clients:
            client.close()
        arbiter.stop()
