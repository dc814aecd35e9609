"""What came of the last prefetch asked of a kernel (``last_prefetch`` in its report and
``%vgpu status``): a request the kernel drops says why, so that a user's click that
brought nothing back can be told from one that never reached the kernel. The kernel's
own decision, on ``server.json``'s request, without a Jupyter server; the whole path
(server, kernel, arbiter): ``tests/integration/test_prefetch.py``."""

import threading
import time

import jsonschema
import pytest

from jupyter_vgpu import contracts
from jupyter_vgpu.kernel.hook import PREFETCH_FRESH, KernelHook
from jupyter_vgpu.kernel.pause.states import PauseState
from jupyter_vgpu.testing.waiting import wait_for


class Pausing:
    """The kernel's pause control as a prefetch reads it: its state, and a prefetch that
    comes back or is refused with the arbiter's word."""

    def __init__(self, state: str, refusal: str | None = None):
        self.state, self.refusal, self.prefetch_refusal = state, refusal, None
        self.asked = threading.Event()

    def prefetch(self) -> bool:
        self.prefetch_refusal = self.refusal
        self.asked.set()
        return self.refusal is None


def hook(pausing: Pausing) -> KernelHook:
    h = KernelHook.__new__(KernelHook)  # the decision alone: no shell, channel or thread
    h.kernel_id, h._prefetch_seen, h.last_prefetch, h.pausing = "k1", 0.0, None, pausing
    return h


def test_a_request_seen_too_late_is_dropped_and_says_so():
    h = hook(Pausing(PauseState.PAUSED))
    at = time.time() - PREFETCH_FRESH - 5
    h._prefetch_if_asked({"k1": at})
    assert h.last_prefetch["outcome"] == "late"
    assert "after it was asked" in h.last_prefetch["message"]
    assert not h.pausing.asked.is_set(), "nothing was asked of the arbiter"


def test_a_kernel_on_the_card_has_nothing_to_bring_back_and_says_so():
    h = hook(Pausing(PauseState.IDLE))
    h._prefetch_if_asked({"k1": time.time()})
    assert h.last_prefetch["outcome"] == "not away"
    assert PauseState.IDLE in h.last_prefetch["message"]


def decided(h: KernelHook) -> dict:
    """The prefetch's outcome once its thread has one."""
    return wait_for(lambda: h.last_prefetch["outcome"] != "under way" and h.last_prefetch, 5, "its outcome")


def test_a_refusal_carries_the_arbiters_word_within_the_reports_limit():
    h = hook(Pausing(PauseState.PAUSED, refusal="no room to come back ahead of the cell (2 GiB short)"))
    h._prefetch_if_asked({"k1": time.time()})
    last = decided(h)
    assert last["outcome"] == "refused"
    assert "2 GiB short" in last["message"]

    long = hook(Pausing(PauseState.PAUSED, refusal="x" * 10_000))
    long._prefetch_if_asked({"k1": time.time()})
    assert len(decided(long)["message"]) == 4000


def test_a_kernel_that_came_back_says_back():
    h = hook(Pausing(PauseState.SUSPENDED))
    h._prefetch_if_asked({"k1": time.time()})
    last = decided(h)
    assert last["outcome"] == "back"
    assert last["message"] is None
    assert last["decided_at"] >= last["asked_at"]


def test_a_request_seen_once_is_not_taken_again():
    h = hook(Pausing(PauseState.PAUSED))
    at = time.time()
    h._prefetch_if_asked({"k1": at})
    decided(h)
    h.pausing.asked.clear()
    h._prefetch_if_asked({"k1": at})  # server.json read again, the same request in it
    assert not h.pausing.asked.is_set()


@pytest.mark.parametrize("outcome", ["late", "not away", "under way", "back", "refused"])
def test_each_outcome_keeps_to_the_kernel_reports_contract(outcome):
    schema = contracts.schema("kernel-report")
    part = {"$defs": schema["$defs"], **schema["properties"]["last_prefetch"]}
    jsonschema.validate({"asked_at": 1.0, "outcome": outcome, "message": None, "decided_at": 2.0}, part)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"asked_at": 1.0, "outcome": "maybe", "message": None, "decided_at": 2.0}, part)
