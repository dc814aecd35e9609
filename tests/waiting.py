"""Waiting for a condition in tests: one helper, with a failure that says what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], *, timeout: float = 30.0, interval: float = 0.1, what: str) -> T:
    """Call ``condition`` until it returns something truthy, and return that.

    Raises:
        AssertionError: ``timeout`` seconds passed; the message names ``what`` and the
            last value seen.
    """
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = condition()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:.0f} s for {what}; last saw {last!r}")
        time.sleep(interval)
