"""Cells take turns on a card (``ArbiterApp.turn_wait``): real kernels and arbiter on a
simulated card. Ada's cell runs until the test lets it end; bob's cell, sent meanwhile,
waits for it (saying so in its output) and runs as it ends, or, once ada's has run as
long as the setting (a long cell), beside it. What is not a cell the user ran (a
completion, a silent execute) never waits."""

from __future__ import annotations

import dataclasses
import time

import pytest

from jupyter_vgpu.testing import fault_scene as scene
from jupyter_vgpu.testing.arbiter_process import ArbiterProcess
from jupyter_vgpu.testing.waiting import wait_for


@pytest.fixture
def node(tmp_path, request):
    arbiter = ArbiterProcess(
        tmp_path, "--queue-timeout=60", f"--ArbiterApp.turn_wait={request.param}"
    ).start()
    # two budgets that fit the card (1 GiB) together: a cell waits for its turn, not for room
    small = dataclasses.replace(scene.SLICE, memory_limit=300 * scene.MiB, memory_request=300 * scene.MiB)
    ada = scene.start_kernel(tmp_path, arbiter, "ada", slice_=small)
    bob = scene.start_kernel(tmp_path, arbiter, "bob", slice_=small)
    yield arbiter, ada, bob, tmp_path / "go"
    for kernel in (ada, bob):
        kernel.shutdown()
    arbiter.stop()


def running_until(go) -> str:
    """A cell that says it runs, then runs until the file ``go`` exists."""
    return (
        "import pathlib, time\n"
        "print('ada runs', flush=True)\n"
        f"while not pathlib.Path({str(go)!r}).exists():\n"
        "    time.sleep(0.02)\n"
        "print('ada done')"
    )


def turns(arbiter, server: str) -> list[dict]:
    return [d for d in arbiter.books()["decisions"] if d["what"] == "turn" and d["server"] == server]


@pytest.mark.parametrize("node", [60], indirect=True)
def test_a_cell_waits_for_the_running_cell_and_runs_as_it_ends(node):
    arbiter, ada, bob, go = node
    long = scene.Background(ada, running_until(go))
    long.said(1)  # ada's code runs: its room granted
    cell = scene.Background(bob, "print('bob ran')")
    cell.said(1)  # the wait, said after a second of it
    assert "waiting for its turn on GPU 0: 1 cell(s) running" in cell.partial.texts[0], cell.partial.texts
    assert "bob ran" not in "".join(cell.partial.texts)
    released = time.monotonic()
    go.touch()
    out = cell.join(30)
    assert out.error is None, out.error
    assert "bob ran" in out.text, out.text
    ran = out.times[out.texts.index(next(t for t in out.texts if "bob ran" in t))]
    assert ran >= released, "bob's code ran before ada's cell ended"
    assert "ada done" in long.join(30).text
    [turn] = wait_for(lambda: turns(arbiter, "bob/"), 10, "bob's turn in the decisions")
    assert turn["message"].endswith("its turn came"), turn


@pytest.mark.parametrize("node", [1.5], indirect=True)
def test_a_cell_runs_beside_a_long_cell_once_that_cell_has_run_turn_wait(node):
    arbiter, ada, bob, go = node
    long = scene.Background(ada, running_until(go))
    long.said(1)
    out = scene.run(bob, "print('bob ran')", timeout=30)
    assert out.error is None, out.error
    assert "bob ran" in out.text, out.text
    assert long.result is None, "ada's cell still runs: bob's ran beside it"
    [turn] = turns(arbiter, "bob/")
    # ada's cell is long once it has run 1.5 s: bob's waits that out, not a wait of its own
    assert turn["message"].endswith("the 1 cell(s) running had run 1.5 s: it runs beside them"), turn
    go.touch()
    assert "ada done" in long.join(30).text


@pytest.mark.parametrize("node", [60], indirect=True)
def test_a_completion_and_a_silent_execute_never_wait_in_line(node):
    arbiter, ada, bob, go = node
    long = scene.Background(ada, running_until(go))
    long.said(1)
    try:
        bob.client.complete("impo", 4)
        reply = bob.client.get_shell_msg(timeout=10)
        assert reply["msg_type"] == "complete_reply", reply["msg_type"]
        assert "import" in reply["content"]["matches"], reply["content"]
        bob.client.execute("x = 1", silent=True)
        reply = bob.client.get_shell_msg(timeout=10)
        assert reply["content"]["status"] == "ok", reply["content"]
        assert long.result is None, "ada's cell still runs"
        assert turns(arbiter, "bob/") == []
    finally:
        go.touch()
        long.join(30)


@pytest.mark.parametrize("node", [60], indirect=True)
def test_a_cell_interrupted_in_line_leaves_it(node):
    arbiter, ada, bob, go = node
    long = scene.Background(ada, running_until(go))
    long.said(1)
    cell = scene.Background(bob, "print('bob ran')")
    cell.said(1)  # in line, saying so
    bob.manager.interrupt_kernel()  # the user stops the waiting cell
    out = cell.join(30)
    assert "bob ran" not in out.text, out.text
    [turn] = wait_for(lambda: turns(arbiter, "bob/"), 10, "bob's given-up turn in the decisions")
    assert turn["message"].endswith("the cell was given up"), turn
    assert long.result is None, "ada's cell ran on, untouched"
    go.touch()
    assert "ada done" in long.join(30).text


@pytest.mark.parametrize("node", [3], indirect=True)
def test_a_kernel_whose_code_ran_long_unnamed_a_cell_takes_turns_with_every_request_since(node):
    arbiter, ada, bob, go = node
    # a silent execute (an extension's, or cells hidden as such) that runs past turn_wait
    bob.client.execute("import time; time.sleep(3.5)", silent=True)
    reply = bob.client.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "ok", reply["content"]
    [kept] = wait_for(
        lambda: [d for d in arbiter.books()["decisions"] if d["what"] == "turns kept"],
        10,
        "bob's word found wanting",
    )
    assert kept["server"] == "bob/", kept
    kept_by = {k["server"]: k["turns_kept"] for k in arbiter.books()["kernels"]}
    assert kept_by == {"ada/": False, "bob/": True}, kept_by
    assert turns(arbiter, "bob/") == [], "the silent execute itself waited for nothing"
    long = scene.Background(ada, running_until(go))
    long.said(1)  # ada's cell runs, young
    try:
        bob.client.complete("impo", 4)  # never a cell: it waits its turn all the same now
        reply = bob.client.get_shell_msg(timeout=30)
        assert reply["msg_type"] == "complete_reply", reply["msg_type"]
        assert long.result is None, "ada's cell still runs"
        [turn] = wait_for(lambda: turns(arbiter, "bob/"), 10, "bob's completion's turn in the decisions")
        assert turn["message"].endswith("the 1 cell(s) running had run 3 s: it runs beside them"), turn
    finally:
        go.touch()
        long.join(30)
