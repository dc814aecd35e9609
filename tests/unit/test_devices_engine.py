"""The pause of a kernel that sees several devices, as one (:mod:`jupyter_vgpu.kernel.pause.devices`).

Each device's own pause and resume (the bytes) are :class:`PauseEngine`'s, run on real
cards in ``tests/gpu/test_two_gpus.py``; here each device's engine is a recorder that
can be told to fail, so that what is checked is the rule across devices alone: nothing
half paused, nothing half back.
"""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace

import pytest

from jupyter_vgpu.kernel.pause import devices, vmm
from jupyter_vgpu.kernel.pause.engine import Outcome, PauseError, ResumeError
from jupyter_vgpu.kernel.pause.states import PauseState

GiB = 1 << 30


class Allocator:
    """The allocator's units: ``on`` maps a device to the bytes mapped there."""

    def __init__(self, on: dict[int, int]):
        self.on = on

    def segments(self):
        return [SimpleNamespace(device=d, size=n, mapped=True) for d, n in self.on.items() if n]

    def machinery(self):
        return contextlib.nullcontext()

    def figures(self):
        return SimpleNamespace(unpausable=0)


class DeviceEngine:
    """One device's engine: pauses and resumes its device's bytes in ``allocator.on``."""

    fail: dict[tuple[int, str], BaseException] = {}

    def __init__(self, torch, allocator, device, *, host_cap_bytes, among_devices, **options):
        assert among_devices, "each device's engine must leave the other devices' units alone"
        self.allocator, self.device, self.cap = allocator, device, host_cap_bytes
        self.state = PauseState.ACTIVE
        self.held = 0
        self._lock = threading.Lock()
        self.arena = SimpleNamespace(held_bytes=device * GiB, slab_bytes=256 << 20)
        self.device_codec = None
        self.codec_name = "zstd"

    def _fail(self, step: str) -> None:
        error = DeviceEngine.fail.get((self.device, step))
        if error is not None:
            raise error

    def pause(self) -> Outcome:
        self._fail("pause")
        self.held, self.allocator.on[self.device] = self.allocator.on[self.device], 0
        self.state = PauseState.PAUSED
        return Outcome(1.0, self.held, self.held, self.held // 2, ("zstd",))

    def resume(self) -> Outcome:
        self._write_back(self._map_back(), 0.0)
        return Outcome(1.0, self.held, self.held, 0, ("zstd",))

    def _map_back(self):
        self._fail("map")
        self.allocator.on[self.device] = self.held
        return "taken"

    def _undo_map_back(self, taken) -> None:
        self.allocator.on[self.device] = 0

    def _write_back(self, taken, t0: float) -> Outcome:
        try:
            self._fail("write")
        except BaseException:
            self._undo_map_back(taken)
            raise
        self.state = PauseState.ACTIVE
        return Outcome(1.0, self.held, self.held, 0, ("zstd",))

    def room_needed(self) -> int:
        return self.held if self.state == PauseState.PAUSED else 0

    @property
    def paused_bytes(self) -> int:
        return self.held if self.state == PauseState.PAUSED else 0


def comes_back_once_lifted(both, allocator, failure: tuple[int, str]) -> None:
    """With ``failure`` gone, a resume brings every byte of both devices back."""
    del DeviceEngine.fail[failure]
    both.resume()
    assert both.state == PauseState.ACTIVE
    assert allocator.on == {0: 4 * GiB, 1: 6 * GiB}


@pytest.fixture
def engine(monkeypatch):
    DeviceEngine.fail = {}
    monkeypatch.setattr(devices, "PauseEngine", DeviceEngine)
    allocator = Allocator({0: 4 * GiB, 1: 6 * GiB})
    torch = pytest.importorskip("torch")
    both = devices.DevicesEngine(torch, allocator, [0, 1], host_cap_bytes=8 * GiB)
    monkeypatch.setattr(both, "_on", lambda device: contextlib.nullcontext())  # no CUDA device here
    return both, allocator


def test_a_pause_takes_every_device_and_a_resume_brings_every_device_back(engine):
    both, allocator = engine
    out = both.pause()
    assert both.state == PauseState.PAUSED
    assert allocator.on == {0: 0, 1: 0}
    assert out.segment_bytes == 10 * GiB
    assert both.room_needed_per_device() == {0: 4 * GiB, 1: 6 * GiB}
    assert both.room_needed() == 6 * GiB
    assert [e.cap for e in both.engines.values()] == [4 * GiB, 4 * GiB]  # the host cap shared out
    assert (both.arena.held_bytes, both.arena.slab_bytes) == (GiB, 256 << 20)  # as one arena
    both.resume()
    assert both.state == PauseState.ACTIVE
    assert allocator.on == {0: 4 * GiB, 1: 6 * GiB}


@pytest.mark.parametrize(
    ("failure", "raised", "says"),
    [
        (
            PauseError("memory the allocator does not cover"),
            PauseError,
            r"pausing device 1 failed.*device 0 resumed",
        ),
        (KeyboardInterrupt(), KeyboardInterrupt, None),  # an interrupt passes as itself, undone
    ],
)
def test_a_device_that_fails_its_pause_leaves_none_paused(engine, failure, raised, says):
    both, allocator = engine
    DeviceEngine.fail[(1, "pause")] = failure
    with pytest.raises(raised, match=says) as caught:
        both.pause()
    assert not getattr(caught.value, "still_paused", False)
    assert both.state == PauseState.ACTIVE
    assert allocator.on == {0: 4 * GiB, 1: 6 * GiB}


def test_an_undo_that_fails_leaves_the_kernel_paused_and_says_so(engine):
    both, allocator = engine
    DeviceEngine.fail[(1, "pause")] = PauseError("refused")
    DeviceEngine.fail[(0, "map")] = vmm.DeviceFull(2, "no room")
    with pytest.raises(PauseError, match="resuming device 0, paused before it, failed too") as caught:
        both.pause()
    assert caught.value.still_paused
    assert both.state == PauseState.PAUSED
    comes_back_once_lifted(both, allocator, (0, "map"))


def test_no_room_on_the_second_device_brings_nothing_back(engine):
    both, allocator = engine
    both.pause()
    DeviceEngine.fail[(1, "map")] = vmm.DeviceFull(2, "resuming needs 6 GiB free bytes on device 1")
    with pytest.raises(vmm.DeviceFull):
        both.resume()
    assert allocator.on == {0: 0, 1: 0}, "the first device's memory was mapped back alone"
    assert both.state == PauseState.PAUSED
    assert both.paused_bytes == 10 * GiB
    comes_back_once_lifted(both, allocator, (1, "map"))


def test_damaged_data_of_one_device_keeps_the_kernel_paused_and_the_rest_unwritten(engine):
    both, allocator = engine
    both.pause()
    DeviceEngine.fail[(0, "write")] = ResumeError("chunk 3 damaged", paused_bytes=4 * GiB, host_bytes=GiB)
    with pytest.raises(ResumeError):
        both.resume()
    assert both.state == PauseState.PAUSED
    assert allocator.on == {0: 0, 1: 0}
    comes_back_once_lifted(both, allocator, (0, "write"))


def test_a_device_that_holds_nothing_is_not_paused(engine):
    both, allocator = engine
    allocator.on[1] = 0
    assert both.pause().segment_bytes == 4 * GiB
    assert sorted(both.engines) == [0]
    both.resume()
    assert allocator.on == {0: 4 * GiB, 1: 0}


def test_a_report_before_any_pause_makes_no_engine(engine):
    both, _ = engine
    figures = both.stats()
    assert both.engines == {}, "a report loaded a device's codec"
    assert (figures["state"], figures["paused_bytes"], figures["codec"], both.codec_name) == (
        PauseState.ACTIVE, 0, None, None,
    )  # fmt: skip
