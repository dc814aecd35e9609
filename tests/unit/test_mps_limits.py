"""The MPS daemon's own limits, a ceiling no client's environment lifts: the card's
largest compute share and budget among its ``mps`` slices (:func:`mps.ceiling`), given
to the daemon as it starts and again as slices come and go.

The control program is a stand-in here (this machine has no driver): a script on
``PATH`` under the real program's name that keeps the defaults the daemon would, lists
its servers and records every command it was sent, so the tests read exactly what the
arbiter asked. What a real daemon does with these commands is
``tests/gpu/test_mps.py::test_a_client_that_clears_its_limits_still_meets_the_daemons``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

import pytest

from jupyter_vgpu.node import mps
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice

GiB = 2**30
CARD = "GPU-78b63d1a-c3a4-1316-c904-a077699c919c"
OTHER = "GPU-0c3e1a52-95a1-4c7e-9a4e-5d2b8f3c1e77"

#: The control program's part in these tests: ``-d`` makes the pipe directory's
#: ``control`` socket stand-in; a command on stdin is recorded in ``commands`` and
#: answered as the daemon would, from ``state`` beside it. ``STANDIN_SAYS`` makes it
#: answer every ``set_`` command with that text instead.
STANDIN = """#!{python}
import json, os, sys
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
state_path = os.path.join(pipe, "state")
state = {{"threads": 100.0, "memory": "0M", "servers": []}}
if os.path.exists(state_path):
    state = json.load(open(state_path))
if sys.argv[1:] == ["-d"]:
    os.makedirs(pipe, exist_ok=True)
    open(os.path.join(pipe, "control"), "w").close()
    json.dump(state, open(state_path, "w"))
    sys.exit(0)
command = sys.stdin.read().strip()
with open(os.path.join(pipe, "commands"), "a") as f:
    f.write(command + "\\n")
words = command.split()
if command.startswith("set_") and os.environ.get("STANDIN_SAYS"):
    print(os.environ["STANDIN_SAYS"])
elif words[0] == "get_server_list":
    print("\\n".join(str(p) for p in state["servers"]))
elif words[0] == "set_default_active_thread_percentage":
    state["threads"] = float(words[1])
elif words[0] == "set_default_device_pinned_mem_limit":
    state["memory"] = words[2]
elif words[0] == "get_default_active_thread_percentage":
    print(state["threads"])
elif words[0] == "get_default_device_pinned_mem_limit":
    print(words[1] + "=" + state["memory"])
json.dump(state, open(state_path, "w"))
"""


@pytest.fixture
def control(monkeypatch):
    """The stand-in control program first on ``PATH``, and a directory short enough for
    the daemon's sockets for an arbiter socket."""
    directory = Path(tempfile.mkdtemp(prefix="vgpu-"))
    program = directory / "bin" / mps.CONTROL
    program.parent.mkdir()
    program.write_text(STANDIN.format(python=sys.executable))
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("STANDIN_SAYS", raising=False)
    yield directory
    shutil.rmtree(directory)


def commands(daemons: mps.MPSDaemons, uuid: str = CARD) -> list[str]:
    path = daemons.directories(uuid)[0] / "commands"
    return path.read_text().splitlines() if path.exists() else []


def limits_of(daemons: mps.MPSDaemons, uuid: str = CARD) -> list[str]:
    return [c for c in commands(daemons, uuid) if c.startswith("set_")]


async def settle(arbiter: Arbiter) -> None:
    """Until every task the arbiter started in the background (a daemon's start, its
    limits) has ended, those they started included."""
    while arbiter._inflight:
        await asyncio.gather(*list(arbiter._inflight))


def a_slice(share: int, budget: int, uuid: str = CARD, **fields) -> Slice:
    return Slice(uuid, 0, "NVIDIA H100 80GB HBM3", 80 * GiB, budget, share, **{"isolation": "mps", **fields})


def test_the_ceiling_is_the_largest_share_and_budget_of_the_cards_mps_slices():
    slices = [
        a_slice(25, 2 * GiB),
        a_slice(50, 1 * GiB),
        a_slice(100, 40 * GiB, isolation="time-slicing"),  # not an MPS client
        a_slice(100, 40 * GiB, uuid=OTHER),  # another card's
        Slice("GPU-sim-0", 0, "Simulated", 80 * GiB, 40 * GiB, 100, isolation="mps", simulated=True),
    ]
    assert mps.ceiling(slices, CARD) == (50, 2 * GiB)
    assert mps.ceiling(slices, OTHER) == (100, 40 * GiB)
    assert mps.ceiling(slices[2:3], CARD) is None


def test_the_daemon_takes_the_limits_as_its_default_and_for_each_running_server(control):
    daemons = mps.MPSDaemons(str(control / "arbiter.sock"))
    daemons.ensure(CARD)
    state = daemons.directories(CARD)[0] / "state"
    state.write_text('{"threads": 100.0, "memory": "0M", "servers": [4242, 4343]}')
    read = daemons.set_limits(CARD, 25, 2 * GiB + 12345)  # rounded down to MiB
    assert limits_of(daemons) == [
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 2048M",
        "set_active_thread_percentage 4242 25",
        "set_device_pinned_mem_limit 4242 0 2048M",
        "set_active_thread_percentage 4343 25",
        "set_device_pinned_mem_limit 4343 0 2048M",
    ]
    assert read == "25.0; 0=2048M"


@pytest.mark.parametrize(
    ("says", "reason"),
    [
        ("Invalid command", "exited 0: Invalid command"),
        ("", "read back '100.0' and '0=0M' after being set to 25% and 2048 MiB"),
    ],
)
def test_limits_the_daemon_did_not_take_are_refused_with_what_it_said(control, monkeypatch, says, reason):
    daemons = mps.MPSDaemons(str(control / "arbiter.sock"))
    daemons.ensure(CARD)
    if says:
        monkeypatch.setenv("STANDIN_SAYS", says)
    else:  # a daemon that answers nothing and keeps its defaults
        monkeypatch.setenv("STANDIN_SAYS", " ")
    with pytest.raises(mps.MPSUnavailable, match=reason.replace("(", r"\(").replace(")", r"\)")):
        daemons.set_limits(CARD, 25, 2 * GiB)


def test_the_arbiter_keeps_each_cards_daemon_at_its_ceiling_as_slices_come_and_go(control):
    arbiter = Arbiter(ArbiterApp(registrars="none", socket_path=str(control / "arbiter.sock")))

    def decided(what: str) -> list[dict]:
        return [d for d in arbiter.decisions if d["what"] == what]

    async def scenario() -> None:
        arbiter.register(101, "ada", "", a_slice(25, 2 * GiB))
        await settle(arbiter)
        assert arbiter.mps.started == {CARD}
        assert limits_of(arbiter.mps)[:2] == [
            "set_default_active_thread_percentage 25",
            "set_default_device_pinned_mem_limit 0 2048M",
        ]
        [said] = decided("mps limits")
        assert "at most 25% of its SMs and 2.00 GiB" in said["message"], said
        arbiter.register(102, "bob", "", a_slice(50, 4 * GiB))
        arbiter.register(103, "eve", "", a_slice(100, 60 * GiB, isolation="time-slicing"))
        arbiter.register(104, "ada", "again", a_slice(25, 2 * GiB))  # the Hub registers again and again
        await settle(arbiter)
        assert limits_of(arbiter.mps)[2:] == [
            "set_default_active_thread_percentage 50",
            "set_default_device_pinned_mem_limit 0 4096M",
        ]
        arbiter.unregister(102)  # bob's server ends: the card's ceiling comes down again
        await settle(arbiter)
        assert limits_of(arbiter.mps)[4:] == [
            "set_default_active_thread_percentage 25",
            "set_default_device_pinned_mem_limit 0 2048M",
        ]
        assert len(decided("mps limits")) == 3
        arbiter.unregister(101)
        arbiter.unregister(104)  # none left: the last ceiling stays, nothing is sent
        await settle(arbiter)
        assert len(limits_of(arbiter.mps)) == 6

    asyncio.run(scenario())
    assert not decided("mps limits refused")
    assert not decided("mps unavailable")


def test_a_daemon_that_refuses_its_limits_is_a_decision_that_says_so(control, monkeypatch):
    monkeypatch.setenv("STANDIN_SAYS", "Invalid command")
    arbiter = Arbiter(ArbiterApp(registrars="none", socket_path=str(control / "arbiter.sock")))

    async def scenario() -> None:
        arbiter.register(101, "ada", "", a_slice(25, 2 * GiB))
        await settle(arbiter)

    asyncio.run(scenario())
    assert arbiter.mps.started == {CARD}  # the daemon runs: its limits alone were refused
    [refused] = [d for d in arbiter.decisions if d["what"] == "mps limits refused"]
    assert refused["gpu"] == CARD
    assert "set_default_active_thread_percentage 25" in refused["message"]
    assert "Invalid command" in refused["message"]


def test_a_slice_that_leaves_mps_takes_its_share_out_of_the_cards_ceiling(control):
    arbiter = Arbiter(ArbiterApp(registrars="none", socket_path=str(control / "arbiter.sock")))

    async def scenario() -> None:
        arbiter.register(101, "ada", "", a_slice(25, 2 * GiB))
        arbiter.register(102, "bob", "", a_slice(50, 4 * GiB))
        await settle(arbiter)
        assert limits_of(arbiter.mps) == [
            "set_default_active_thread_percentage 50",
            "set_default_device_pinned_mem_limit 0 4096M",
        ]
        # an admin moves bob's server to time-slicing: the same server, another slice
        arbiter.register(102, "bob", "", a_slice(50, 4 * GiB, isolation="time-slicing"))
        await settle(arbiter)

    asyncio.run(scenario())
    assert limits_of(arbiter.mps)[-2:] == [
        "set_default_active_thread_percentage 25",
        "set_default_device_pinned_mem_limit 0 2048M",
    ]
