"""The pause states are named constants that stay the plain strings the kernel writes:
the kernel report's and the arbiter protocol's lists (their contracts) are theirs."""

import json

from jupyter_vgpu import contracts
from jupyter_vgpu.kernel import gate as g
from jupyter_vgpu.kernel.pause.states import PauseState


def test_the_states_are_the_kernel_reports_and_fold_into_the_protocols():
    report = contracts.schema("kernel-report")
    pause_states = report["$defs"]["pause"]["properties"]["state"]["enum"]
    assert sorted(PauseState) == sorted(pause_states)
    kernel_states = report["$defs"]["kernel_state"]["enum"]
    protocol_states = contracts.schema("to-arbiter")["$defs"]["kernel-state"]["enum"]
    assert sorted({s.kernel_state for s in PauseState}) == sorted(kernel_states) == sorted(protocol_states)
    assert [PauseState(s).kernel_state for s in ("pausing", "suspending", "resuming")] == [
        "idle",
        "paused",
        "active",
    ]


def test_a_state_is_written_shown_and_looked_up_as_its_plain_string():
    state = PauseState.PAUSED
    assert json.dumps({"state": state}) == '{"state": "paused"}'
    assert (str(state), f"{state}", f"{state:>8}") == ("paused", "paused", "  paused")
    assert state == "paused"
    assert {"paused": 1}[state] == {state: 1}["paused"] == 1
    assert PauseState("paused") is state
    assert g.PAUSED is state
    assert g.BUSY == "busy"  # the gate's own: the kernel reports itself active
