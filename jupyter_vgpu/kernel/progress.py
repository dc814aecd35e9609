"""What a waiting cell shows: no silent wait.

A cell may wait before its code runs: for room on the GPU (the node arbiter pauses
someone, or queues the request), for the arbiter itself (restarting), for its own
memory to come back (from host memory, from disk, from the driver's checkpoint), or for
a pause of its kernel in progress to end. :class:`Progress` is how every one of those
waits speaks: nothing for a wait shorter than :data:`FIRST_AFTER` seconds, then one line
naming what the cell waits for and why, rewritten every :data:`EVERY` seconds with the
time waited so far (``\\r``: Jupyter's front ends show one line that changes), and ended
with a newline when the wait is over. So no cell waits longer than about
:data:`FIRST_AFTER` seconds without a word, however long it waits.

:meth:`Progress.run` runs work that blocks (a resume) in a thread of its own while the
cell's thread keeps the line alive: output written from the cell's own thread reaches
the cell's output area.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

#: Seconds a wait may last before its line appears.
FIRST_AFTER = 1.0
#: Seconds between two updates of the line.
EVERY = 1.0

PREFIX = "jupyter-vgpu: "


class Progress:
    """One wait of a cell, and its line.

    Args:
        say: writes text to the cell's output: ``say(text, end)``.
        what: what the cell waits for, in words (changed later with :meth:`update`).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, say: Callable[..., None], what: str, clock: Callable[[], float] = time.monotonic):
        self.say, self.what, self.clock = say, what, clock
        self.t0 = clock()
        self.shown = False
        self._last = 0.0

    @property
    def elapsed(self) -> float:
        return self.clock() - self.t0

    def update(self, what: str) -> None:
        """What the cell waits for now (shown at the next :meth:`tick`, or now if a line is up)."""
        if what != self.what:
            self.what = what
            if self.shown:
                self._show()

    def tick(self) -> None:
        """Show or refresh the line when it is due; call at least every :data:`EVERY` s."""
        now = self.clock()
        if not self.shown:
            if now - self.t0 >= FIRST_AFTER:
                self._show()
        elif now - self._last >= EVERY:
            self._show()

    def _show(self) -> None:
        waited = self.elapsed
        still = "still " if self.shown else ""
        self.say(f"{PREFIX}{still}waiting {waited:.0f} s: {self.what}", end="\r")
        self.shown = True
        self._last = self.clock()

    def done(self, outcome: str | None = None) -> None:
        """End the wait: the line (if one is up) ends with ``outcome`` or the time waited."""
        if self.shown:
            self.say(f"{PREFIX}{outcome or self.what} (after {self.elapsed:.1f} s)", end="\n")
            self.shown = False

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` while keeping the line alive."""
        end = self.clock() + seconds
        while True:
            self.tick()
            left = end - self.clock()
            if left <= 0:
                return
            time.sleep(min(left, EVERY / 4))

    def run(self, work: Callable[[], object]):
        """Run ``work()`` in a thread of its own while this thread keeps the line alive;
        returns its result or raises what it raised (the line stays up: the caller ends
        it with :meth:`done`). An interrupt of this thread waits for the work to end first
        (its effects are kept), then is raised."""
        box: dict = {}

        def target():
            try:
                box["result"] = work()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e

        thread = threading.Thread(target=target, name="jupyter-vgpu-resume", daemon=True)
        thread.start()
        interrupted: BaseException | None = None
        while thread.is_alive():
            try:
                thread.join(EVERY / 4)
                self.tick()
            except KeyboardInterrupt as e:  # the work cannot be left half done
                interrupted = e
                self.update(f"{self.what} (interrupted: finishing this first)")
        if "error" in box:
            raise box["error"]
        if interrupted is not None:
            raise interrupted
        return box.get("result")
