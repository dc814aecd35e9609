"""The arbiter's word each second while it waits on the driver or on a victim: a cell
that waits on a restore or a suspend of tens of GiB is never silent, and its kernel never
takes the silence for a hung arbiter (it gives up on one after a minute of silence)."""

import asyncio

import pytest

from jupyter_vgpu.node.room import said_while


def test_a_long_wait_is_told_at_once_and_then_every_interval_with_its_seconds():
    messages: list[str] = []

    async def tell(message: str) -> None:
        messages.append(message)

    async def work() -> str:
        await asyncio.sleep(0.75)
        return "restored"

    assert asyncio.run(said_while(work(), tell, "restoring", every=0.2)) == "restored"
    assert messages[0] == "restoring"
    assert len(messages) >= 3, messages  # 0.75 s of work, a word each 0.2 s
    assert all(m.startswith("restoring (") and m.endswith(" s)") for m in messages[1:]), messages


def test_what_the_work_raises_reaches_the_caller_and_a_cancelled_wait_cancels_the_work():
    async def tell(message: str) -> None:
        pass

    async def fails() -> None:
        await asyncio.sleep(0.05)
        raise RuntimeError("the driver refused")

    with pytest.raises(RuntimeError, match="the driver refused"):
        asyncio.run(said_while(fails(), tell, "restoring", every=0.01))

    ended = []

    async def endless() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            ended.append(True)
            raise

    async def main() -> None:
        waiting = asyncio.ensure_future(said_while(endless(), tell, "suspending", every=0.01))
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
    assert ended == [True]
