"""The one way tests and benchmarks wait for something: poll a condition until it holds or a deadline."""

from __future__ import annotations

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
    start = time.monotonic()
    deadline = start + timeout
    last: object = None
    while True:
        try:
            value = condition()
        except AssertionError:
            raise
        except Exception as e:
            value, last = None, f"{type(e).__name__}: {e}"
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            shown = repr(last)
            shown = shown if len(shown) <= 2000 else shown[:2000] + "…"
            waited = time.monotonic() - start
            raise AssertionError(f"timed out after {waited:.1f} s waiting for {what}; last: {shown}")
        time.sleep(interval)
