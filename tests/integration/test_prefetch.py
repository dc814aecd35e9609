"""Resume before the cell runs: the JupyterLab extension tells the server that the user
started working in a notebook (``POST /api/vgpu/kernels/<id>/prefetch``); the server
passes the word to the kernel through its channel, and the kernel asks the node arbiter
to come back ahead of the cell. Real server, kernels and arbiter, on a simulated card
(1 GiB): a paused kernel comes back with no cell run, where the card has room; where it
has none, only kernels idle past their ``idle_seconds`` are taken off the card for it;
requests are rate-limited."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.fault_kernels import served_kernel
from jupyter_vgpu.testing.waiting import wait_for

MiB = scene.MiB


@pytest.fixture
def node(tmp_path, request):
    watermark = getattr(request, "param", 0.9)  # of the 1 GiB card
    arbiter = ArbiterProcess(
        tmp_path,
        "--queue-timeout=60",
        "--ArbiterApp.prefetch_interval=3",
        f"--ArbiterApp.watermark={watermark}",
    ).start()
    served = served_kernel(tmp_path, arbiter)
    server, kid, ada, pid = served.server, served.kernel_id, served.kernel, served.pid
    assert scene.run(ada, scene.hold_code(1, 16 * MiB, simulated_mib=700)).error is None
    bob = scene.start_kernel(tmp_path, arbiter, "bob")
    yield arbiter, server, kid, ada, pid, bob
    bob.shutdown()
    server.stop()
    arbiter.stop()


def decisions(arbiter, what: str, server: str) -> list[dict]:
    return [d for d in arbiter.books()["decisions"] if d["what"] == what and d.get("server") == server]


# At 0.5, ada's 700 MiB back take the card past its watermark, and bob, within his
# idle_seconds, stays: the watermark is what the prefetch's pauses aim at, not a refusal
# while the card has the room (48 contexts filled 44% of the card, past any mark pauses reach)
@pytest.mark.parametrize("node", [0.9, 0.5], ids=["under the watermark", "past the watermark"], indirect=True)
def test_a_paused_kernel_comes_back_before_its_cell_when_its_user_starts_working(node):
    arbiter, server, kid, ada, pid, bob = node
    assert scene.run(bob, "print('bob ran')").text.strip() == "bob ran"
    wait_for(lambda: arbiter.kernel(pid)["tier"] == "host", 10, "ada paused for bob")

    answer = server.request("POST", f"api/vgpu/kernels/{kid}/prefetch")
    assert answer.status_code == 202, answer.text
    again = server.request("POST", f"api/vgpu/kernels/{kid}/prefetch")
    assert again.status_code == 429, again.text
    assert "message" in again.json()
    wait_for(
        lambda: arbiter.kernel(pid)["tier"] == "gpu" and arbiter.kernel(pid)["state"] == "idle",
        10,
        "ada back on the card, idle, with no cell run",
    )
    assert decisions(arbiter, "prefetch", "ada/"), arbiter.books()["decisions"]
    out = scene.run(ada, scene.BACK + scene.DIGEST)
    assert out.text.splitlines()[0] == "back", out.text  # nothing waited for before the code ran
    assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
    row = next(line for line in scene.run(ada, "%vgpu status").text.splitlines() if "last prefetch" in line)
    assert "back, asked" in row, row
    # the report that carries it keeps to its contract: the server takes it
    usage = server.request("GET", "api/vgpu/usage").json()
    mine = next(k for k in usage["kernels"] if k["id"] == kid)
    assert mine["report_error"] is None, mine
    assert mine["reported"] is True, mine


def test_a_prefetch_takes_nobody_off_the_card_within_their_idle_seconds(node):
    arbiter, server, kid, ada, pid, bob = node
    assert scene.run(bob, scene.hold_code(2, 16 * MiB, simulated_mib=700)).error is None
    wait_for(lambda: arbiter.kernel(pid)["tier"] == "host", 10, "ada paused for bob's 700 MiB")
    wait_for(lambda: arbiter.kernel(bob.pid)["state"] == "idle", 10, "bob idle")

    assert server.request("POST", f"api/vgpu/kernels/{kid}/prefetch").status_code == 202
    refused = wait_for(lambda: decisions(arbiter, "prefetch refused", "ada/"), 10, "the arbiter's answer")
    assert "no room" in refused[-1]["message"], refused
    assert arbiter.kernel(bob.pid)["tier"] == "gpu"  # idle, yet left where it is
    assert arbiter.kernel(pid)["tier"] == "host"
    assert not decisions(arbiter, "prefetch", "ada/")
    # the cell still brings ada back, pausing bob as usual
    out = scene.run(ada, scene.BACK + scene.DIGEST)
    assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
    # and her kernel says what came of the prefetch, with the arbiter's word
    row = next(line for line in scene.run(ada, "%vgpu status").text.splitlines() if "last prefetch" in line)
    assert "refused" in row, row
    assert "no room" in row, row


@pytest.mark.parametrize(
    ("carol_mib", "dave_limit_mib", "dave_mib"),
    [(100, 800, 700), (200, 300, 150)],
    ids=["the card above its watermark", "room promised to the running cell"],
)
def test_a_prefetch_pauses_kernels_idle_past_their_idle_seconds_while_another_cell_runs(
    node, tmp_path, carol_mib, dave_limit_mib, dave_mib
):
    # The background look pauses a kernel idle past its idle_seconds only on a card where
    # no cell runs. Carol's long cell (a slice of ``carol_mib``) keeps this one busy: dave
    # stays, idle past his 1 s, holding ``dave_mib``, until ada's user starts working and
    # the prefetch pauses him. With 700 MiB: the card (1 GiB, watermark 0.9) would be past
    # its watermark with ada's 700 MiB back. With 150 MiB: it would not, but 874 MiB free
    # cannot hold ada's 700 beside the 200 promised to carol's running cell.
    arbiter, server, kid, ada, pid, _ = node
    carol = scene.start_kernel(
        tmp_path,
        arbiter,
        "carol",
        slice_=dataclasses.replace(scene.SLICE, memory_limit=carol_mib * MiB, memory_request=carol_mib * MiB),
    )
    dave = scene.start_kernel(
        tmp_path,
        arbiter,
        "dave",
        slice_=dataclasses.replace(
            scene.SLICE,
            idle_seconds=1,
            memory_limit=dave_limit_mib * MiB,
            memory_request=dave_limit_mib * MiB,
        ),
    )
    long_cell = threading.Thread(target=scene.run, args=(carol, "import time\ntime.sleep(30)"))
    try:
        long_cell.start()
        wait_for(lambda: arbiter.kernel(carol.pid)["state"] == "active", 10, "carol's cell running")
        assert scene.run(dave, scene.hold_code(2, 16 * MiB, simulated_mib=dave_mib)).error is None
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "host", 10, f"ada paused for dave's {dave_mib} MiB")
        wait_for(
            lambda: (
                arbiter.kernel(dave.pid)["state"] == "idle" and arbiter.kernel(dave.pid)["idle_seconds"] > 2
            ),
            10,
            "dave idle past his idle_seconds",
        )
        assert arbiter.kernel(dave.pid)["tier"] == "gpu"  # a cell runs on the card: no background pause

        assert server.request("POST", f"api/vgpu/kernels/{kid}/prefetch").status_code == 202
        wait_for(lambda: decisions(arbiter, "prefetch", "ada/"), 15, "ada's prefetch granted")
        assert arbiter.kernel(dave.pid)["tier"] == "host"
        assert arbiter.kernel(carol.pid)["state"] == "active"  # running: never a candidate
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "gpu", 10, "ada back on the card")
        out = scene.run(ada, scene.BACK + scene.DIGEST)
        assert out.text.splitlines()[0] == "back", out.text
        assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
    finally:
        carol.manager.interrupt_kernel()  # her cell has done its part: no need to sit out its 30 s
        long_cell.join()
        dave.shutdown()
        carol.shutdown()


# At 0.95 the card is under its watermark with ada back (her 716 MiB beside dave's 250):
# no pause is owed to the watermark, and what moves dave is her cell's room alone
@pytest.mark.parametrize("node", [0.95], indirect=True)
def test_a_prefetch_makes_the_room_its_cell_will_need_while_the_kernel_comes_back(node, tmp_path):
    # Ada's budget is 800 MiB; back, she holds 716 of it, and dave's 250 MiB leave her cell
    # short of its room. The prefetch grants her return (716 MiB fit) and, meanwhile, pauses
    # dave (idle past his 1 s) for her cell, which then finds its room made. Bob, within his
    # idle_seconds, stays.
    arbiter, server, kid, ada, pid, bob = node
    dave = scene.start_kernel(
        tmp_path,
        arbiter,
        "dave",
        slice_=dataclasses.replace(
            scene.SLICE, idle_seconds=1, memory_limit=300 * MiB, memory_request=300 * MiB
        ),
    )
    try:
        assert "paused" in scene.run(ada, "%vgpu pause").text
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "host", 10, "ada paused by %vgpu pause")
        assert scene.run(dave, scene.hold_code(2, 16 * MiB, simulated_mib=250)).error is None
        wait_for(
            lambda: (
                arbiter.kernel(dave.pid)["state"] == "idle" and arbiter.kernel(dave.pid)["idle_seconds"] > 1.5
            ),
            10,
            "dave idle past his idle_seconds",
        )
        assert arbiter.kernel(dave.pid)["tier"] == "gpu"

        assert server.request("POST", f"api/vgpu/kernels/{kid}/prefetch").status_code == 202
        wait_for(lambda: decisions(arbiter, "prefetch", "ada/"), 15, "ada's prefetch granted")
        paused = wait_for(lambda: decisions(arbiter, "pause", "dave/"), 15, "dave paused ahead of ada's cell")
        assert paused[-1]["reason"] == "room ahead for ada/", paused
        assert arbiter.kernel(bob.pid)["tier"] == "gpu"  # within his idle_seconds: left where he is
        wait_for(lambda: arbiter.kernel(pid)["tier"] == "gpu", 10, "ada back on the card")
        out = scene.run(ada, scene.BACK + scene.DIGEST)
        assert out.text.splitlines()[0] == "back", out.text
        assert out.text.strip().splitlines()[-1] == scene.digest(1, 16 * MiB), out.text
        made = [d for d in arbiter.books()["decisions"] if d.get("reason") == "room for ada/"]
        assert not made, made  # her cell found its room made
    finally:
        dave.shutdown()


def test_a_prefetch_for_a_kernel_the_server_does_not_run_is_a_404(node):
    server = node[1]
    answer = server.request("POST", "api/vgpu/kernels/00000000-0000-0000-0000-000000000000/prefetch")
    assert answer.status_code == 404
    assert "no kernel" in answer.json()["message"]
