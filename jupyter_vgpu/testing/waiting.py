"""The one way tests and benchmarks wait for something: poll a condition until it holds or a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    condition: Callable[[], T], timeout: float = 30.0, what: str = "a condition", interval: float = 0.2
) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    Args:
        condition: called with no argument. An AssertionError it raises ends the wait
            at once (a definite failure); any other exception is kept as the last
            observation and the wait goes on (a server still starting).
        timeout: seconds before giving up.
        what: what is awaited, in words ("ada's server to be ready"), for the failure.
        interval: seconds between two calls.

    Raises:
        AssertionError: ``condition`` was still falsy after ``timeout`` seconds; the
            message names ``what``, the time waited and the last observation.
    """
    watch = _Watch(condition, timeout, what)
    while not watch.looked():
        time.sleep(interval)
    return watch.value


async def wait_for_async(
    condition: Callable[[], T], timeout: float = 30.0, what: str = "a condition", interval: float = 0.02
) -> T:
    """:func:`wait_for` inside an event loop: between two calls the loop runs its other
    tasks (the work being waited for), rather than the thread sleeping."""
    watch = _Watch(condition, timeout, what)
    while not watch.looked():  # noqa: ASYNC110 (a condition of any kind: no event to wait on)
        await asyncio.sleep(interval)
    return watch.value


class _Watch:
    """One wait of :func:`wait_for` or :func:`wait_for_async`: ``looked()`` calls the
    condition once and says whether the wait is over (``value`` then holds what it gave)."""

    def __init__(self, condition: Callable[[], T], timeout: float, what: str):
        self.condition, self.what = condition, what
        self.start = time.monotonic()
        self.deadline = self.start + timeout
        self.last: object = None
        self.value = None

    def looked(self) -> bool:
        try:
            value = self.condition()
        except AssertionError:
            raise
        except Exception as e:
            value, self.last = None, f"{type(e).__name__}: {e}"
        else:
            self.last = value
        if value:
            self.value = value
            return True
        if time.monotonic() >= self.deadline:
            shown = repr(self.last)
            shown = shown if len(shown) <= 2000 else shown[:2000] + "…"
            waited = time.monotonic() - self.start
            raise AssertionError(f"timed out after {waited:.1f} s waiting for {self.what}; last: {shown}")
        return False
