"""The one helper tests and benchmarks wait with (``jupyter_vgpu.testing.waiting``): it
returns what the condition gave once it holds, ends at once on a failed assertion, and on
a timeout names what it waited for and what it last saw."""

import asyncio

import pytest

from jupyter_vgpu.testing.waiting import wait_for, wait_for_async


def counter(until: int):
    seen = []

    def condition():
        seen.append(len(seen))
        if len(seen) == 1:
            raise ConnectionRefusedError("not listening yet")  # kept, the wait goes on
        return len(seen) if len(seen) >= until else 0

    return condition, seen


def test_it_returns_what_the_condition_gave_once_it_holds():
    condition, seen = counter(3)
    assert wait_for(condition, 5, "three looks", interval=0.01) == 3
    assert len(seen) == 3


def test_a_timeout_names_what_was_waited_for_and_the_last_look():
    with pytest.raises(AssertionError, match=r"waiting for the answer; last: 0"):
        wait_for(lambda: 0, 0.05, "the answer", interval=0.01)
    with pytest.raises(AssertionError, match=r"last: 'ConnectionRefusedError: no'"):
        wait_for(lambda: (_ for _ in ()).throw(ConnectionRefusedError("no")), 0.05, "x", interval=0.01)


def test_a_failed_assertion_ends_the_wait_at_once():
    def condition():
        raise AssertionError("wrong, not late")

    with pytest.raises(AssertionError, match="wrong, not late"):
        wait_for(condition, 30, "never")


def test_inside_a_loop_the_work_waited_for_runs_between_looks():
    async def go():
        done = []

        async def work():
            await asyncio.sleep(0.05)
            done.append(True)

        task = asyncio.ensure_future(work())
        assert await wait_for_async(lambda: done, 5, "the task's work") == [True]
        await task
        with pytest.raises(AssertionError, match=r"timed out after .* waiting for nothing"):
            await wait_for_async(lambda: None, 0.05, "nothing")

    asyncio.run(go())
