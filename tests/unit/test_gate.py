"""The kernel's gate tells its listeners the state now when asked (a figure changed
without the state), in order with the changes themselves."""

import itertools
import threading
import time

from jupyter_vgpu.kernel import gate as g


def test_tell_repeats_the_state_now_and_never_one_older_than_a_change_heard():
    heard: list[str] = []
    gate = g.Gate(lambda prior, cell=False: None, on_change=heard.append)
    gate.tell()
    assert heard == [g.IDLE]
    gate.enter()
    gate.tell()
    assert heard[-1] == g.BUSY
    gate.leave()
    # tells racing with cells: whatever interleaving, the last word heard is the state now
    stop = threading.Event()

    def teller():
        while not stop.wait(0.0001):
            gate.tell()

    t = threading.Thread(target=teller)
    t.start()
    for _ in range(500):
        gate.enter()
        time.sleep(0.0002)  # let the teller in between the changes
        gate.leave()
        time.sleep(0.0002)
    stop.set()
    t.join()
    gate.tell()
    assert heard[-1] == gate.state == g.IDLE
    # each word follows from the one before: a repeat, or a change the gate can make
    steps = {(g.IDLE, g.RESUMING), (g.RESUMING, g.BUSY), (g.BUSY, g.IDLE)}
    odd = [(a, b) for a, b in itertools.pairwise(heard) if a != b and (a, b) not in steps]
    assert not odd, odd[:5]
