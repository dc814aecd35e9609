"""Ranges of a file read by several preadv calls at once (kernel/pause/parallel_read.py):
the bytes of the file, exactly, at any offset and length, on a disk (O_DIRECT) and on
tmpfs, through the page cache where the buffer cannot take O_DIRECT; a short file or a
failing read raises, and no reading thread outlives its reader."""

import os
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

from jupyter_vgpu.kernel.codec.zstd import CodecError
from jupyter_vgpu.kernel.pause import parallel_read
from jupyter_vgpu.kernel.pause.parallel_read import DIRECT_ALIGN, Reader, ShortFile

rng = np.random.default_rng(17)
TASK = 16 * DIRECT_ALIGN  # 64 KiB: a window of a few hundred KiB is several tasks
SIZE = 40 * TASK + 12345  # a file that ends in the middle of a block


def fs_type(path: Path) -> str:
    """The file system of ``path``, from /proc/self/mounts (the longest mount point)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        _, point, fs = line.split()[:3]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fs
    return kind


@pytest.fixture(params=["disk", "tmpfs"])
def where(request, tmp_path):
    """A directory on a disk (the test's own, unless /tmp is a tmpfs), or on tmpfs."""
    if request.param == "tmpfs":
        if not os.path.isdir("/dev/shm") or fs_type(Path("/dev/shm/x")) != "tmpfs":
            pytest.skip("no tmpfs at /dev/shm")
        with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
            yield Path(d)
        return
    if fs_type(tmp_path) == "tmpfs":
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            assert fs_type(Path(d)) != "tmpfs", "no directory on a disk to test with"
            yield Path(d)
        return
    yield tmp_path


def data_file(directory: Path, size: int = SIZE) -> tuple[Path, np.ndarray]:
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = directory / "f.bin"
    path.write_bytes(data.tobytes())
    return path, data


def buffer(n: int, unaligned: bool = False) -> np.ndarray:
    """``n`` bytes at an address aligned for O_DIRECT, or one byte past such an address."""
    raw = np.empty(n + 2 * DIRECT_ALIGN, np.uint8)
    at = -raw.ctypes.data % DIRECT_ALIGN + unaligned
    return raw[at : at + n]


def reading_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jupyter-vgpu-disk")]


def ranges(size: int) -> list[tuple[int, int]]:
    """Windows at odd offsets and of odd lengths, in and across blocks and tasks, up to the
    file's last byte."""
    fixed = [(0, 1), (1, 4095), (4095, 4097), (5, 3 * TASK + 7), (TASK - 1, TASK + 1), (size - 1, size)]
    fixed += [(size - 3 * TASK - 11, size), (0, size), (12345, 12345 + 8 * TASK)]
    randoms = []
    for _ in range(40):
        first = int(rng.integers(0, size - 1))
        randoms.append((first, int(rng.integers(first + 1, min(size, first + 6 * TASK) + 1))))
    return fixed + randoms


@pytest.mark.parametrize("unaligned", [False, True], ids=["O_DIRECT", "page cache"])
def test_every_range_comes_back_exactly_read_in_parallel(where, unaligned):
    path, data = data_file(where)
    done = ranges(SIZE)
    with Reader(path, threads=4, task_bytes=TASK) as reader:
        for first, end in done:
            out = buffer(parallel_read.window_bytes(first, end), unaligned)
            out[:] = 0xA5  # no stale byte passes for a read one
            pad = reader.read(first, end, out)
            assert np.array_equal(out[pad : pad + end - first], data[first:end]), (first, end)
            if unaligned:
                assert reader.direct is False, "an unaligned buffer takes no O_DIRECT read"
            elif fs_type(path) != "tmpfs":
                assert reader.direct is True, (
                    "a disk's file system takes O_DIRECT: the page cache was bypassed"
                )
    assert reader.bytes_read >= sum(end - first for first, end in done)
    assert reader.read_s > 0
    assert not reading_threads()


def test_windows_read_at_once_into_buffers_of_their_own_each_get_their_bytes(tmp_path):
    """Several ranges in flight together (as a resume keeps them, one per buffer), waited
    for in any order."""
    path, data = data_file(tmp_path)
    spans = [(7, 5 * TASK + 3), (5 * TASK + 3, 11 * TASK), (11 * TASK + 100, SIZE), (2, 3)]
    with Reader(path, threads=3, task_bytes=TASK) as reader:
        bufs = [buffer(parallel_read.window_bytes(f, e)) for f, e in spans]
        windows = [reader.start(f, e, b) for (f, e), b in zip(spans, bufs, strict=True)]
        for (f, e), b, w in reversed(list(zip(spans, bufs, windows, strict=True))):
            pad = w.wait()
            assert np.array_equal(b[pad : pad + e - f], data[f:e])
        assert reader.bytes_read >= sum(e - f for f, e in spans)


@pytest.mark.parametrize("unaligned", [False, True], ids=["O_DIRECT", "page cache"])
def test_a_file_shorter_than_the_range_raises_where_it_ends(where, unaligned):
    path, _ = data_file(where)
    with Reader(path, threads=4, task_bytes=TASK) as reader:
        for first, end in [(SIZE - 10, SIZE + 10), (100, SIZE + 5 * TASK), (SIZE + TASK, SIZE + 2 * TASK)]:
            with pytest.raises(ShortFile, match=f"ends at byte {SIZE}") as caught:
                reader.read(first, end, buffer(parallel_read.window_bytes(first, end), unaligned))
            assert isinstance(caught.value, CodecError)
            assert (caught.value.at, caught.value.end) == (SIZE, end)
        out = buffer(parallel_read.window_bytes(0, 10), unaligned)  # still reads after a failure
        assert reader.read(0, 10, out) == 0
    assert not reading_threads()


def test_a_failing_read_raises_from_its_window_and_no_thread_outlives_the_reader(tmp_path):
    """A directory opens, and every read of it fails (EISDIR): each task of the window
    fails on its thread, the window says so, and closing the reader leaves no thread."""
    (tmp_path / "d").mkdir()
    before = reading_threads()
    reader = Reader(tmp_path / "d", threads=4, task_bytes=TASK)
    try:
        with pytest.raises(IsADirectoryError):
            reader.read(0, 6 * TASK, buffer(6 * TASK))
        assert reading_threads(), "the reads ran on the reader's threads"
    finally:
        reader.close()
    assert reading_threads() == before == []


def test_a_buffer_too_small_or_a_task_size_off_the_blocks_is_refused(tmp_path):
    path, _ = data_file(tmp_path)
    with pytest.raises(ValueError, match="not a multiple of 4096"):
        Reader(path, task_bytes=TASK + 1)
    with Reader(path, task_bytes=TASK) as reader, pytest.raises(ValueError, match="holds no window"):
        reader.read(0, 2 * DIRECT_ALIGN + 1, buffer(2 * DIRECT_ALIGN))
    with pytest.raises(FileNotFoundError):
        Reader(tmp_path / "gone")
    assert not reading_threads()
