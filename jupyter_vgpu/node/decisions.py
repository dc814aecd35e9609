"""The arbiter's decision log: what it did or declined to do, and why, newest last.

Every pause, suspend, spill, trim, restore, refusal, watchdog action and kernel that
joined or left is one entry (a dict: ``time``, Unix seconds; ``what``; and the fields
that say about whom and why: ``server``, ``pid``, ``message``...). The last
:data:`KEPT` entries are kept for the books (``{"type": "books"}``, the Hub's admin
page, the tests); each is also one line of the log (``what key=value ...``).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator

log = logging.getLogger("jupyter_vgpu.node")

#: How many decisions the books keep.
KEPT = 200


class DecisionLog:
    """The latest :data:`KEPT` decisions, oldest first."""

    def __init__(self, kept: int = KEPT):
        self._entries: collections.deque[dict] = collections.deque(maxlen=kept)

    def add(self, what: str, **fields) -> None:
        """Record the decision ``what`` with ``fields`` (JSON values), and log it."""
        self._entries.append({"time": time.time(), "what": what, **fields})
        log.info("%s %s", what, " ".join(f"{k}={v}" for k, v in fields.items()))

    def __iter__(self) -> Iterator[dict]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
