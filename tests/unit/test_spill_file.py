"""The disk tier's files: the GPU path's pieces written from (pinned) host memory with
their chunk CRC-32s, read back and checked; the host path's store moved to a directory;
a full disk keeps everything where it was."""

import dataclasses
import os
import pickle
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jupyter_vgpu.kernel.codec.zstd import Codec, CodecError
from jupyter_vgpu.kernel.pause import spill
from jupyter_vgpu.kernel.pause.store import HostStore

rng = np.random.default_rng(5)


@dataclasses.dataclass(frozen=True)
class Piece:  # the fields of codec.device.Piece the file uses
    crcs: np.ndarray
    span: int
    slab: int = 0
    start: int = 0


def records(n=3):
    data = [rng.integers(0, 256, 4096 * (i + 1), dtype=np.uint8) for i in range(n)]
    crcs = [rng.integers(0, 2**32, 5 + i, dtype=np.uint32) for i in range(n)]
    return data, crcs


def test_pieces_go_to_one_file_and_come_back_checked(tmp_path):
    data, crcs = records()
    written, offsets = spill.SpillFile.write(
        tmp_path / "k", "p.vgpu", [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
    )
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o700
    assert written.path.stat().st_mode & 0o777 == 0o600
    assert written.nbytes == written.path.stat().st_size
    assert not list((tmp_path / "k").glob("*.tmp"))
    for i, (d, c, off) in enumerate(zip(data, crcs, offsets, strict=True)):
        piece = Piece(c, d.size, spill.DISK, off)
        head = spill.header_bytes(len(c))
        out = read(written, off - head, off + d.size)
        assert written.direct, "ext4 takes O_DIRECT: the read bypassed the page cache"
        spill.check(out, 0, written.records[off], piece, written.path)
        assert np.array_equal(out[head:], d)
        assert written.records[off] == i
    # a damaged CRC-32 table, a piece read at another's place, a short file: all named
    raw = bytearray(written.path.read_bytes())
    head = spill.header_bytes(len(crcs[1]))
    raw[offsets[1] - head + 40] ^= 1
    written.path.write_bytes(bytes(raw))
    out = read(written, offsets[1] - head, offsets[1])
    with pytest.raises(CodecError, match=r"record 1 .* CRC-32s do not match"):
        spill.check(out, 0, 1, Piece(crcs[1], data[1].size), written.path)
    n = spill.header_bytes(len(crcs[0]))
    out = read(written, offsets[0] - n, offsets[0])
    with pytest.raises(CodecError, match="header does not match"):
        spill.check(out, 0, 2, Piece(crcs[0], data[0].size), written.path)
    for unaligned in (False, True):
        with pytest.raises(CodecError, match="ends at byte"):
            read(written, written.nbytes - 10, written.nbytes + 10, unaligned=unaligned)


def aligned(n: int, unaligned: bool = False) -> np.ndarray:
    """``n`` bytes at an address aligned for O_DIRECT, or one byte past such an address."""
    raw = np.empty(n + 2 * spill.DIRECT_ALIGN, np.uint8)
    at = -raw.ctypes.data % spill.DIRECT_ALIGN + unaligned
    return raw[at : at + n]


def read(written: spill.SpillFile, first: int, end: int, unaligned: bool = False) -> np.ndarray:
    buffer = aligned(spill.window_bytes(first, end), unaligned)
    pad = written.read_window(first, end, buffer)
    return buffer[pad : pad + end - first]


def test_where_o_direct_cannot_be_used_the_same_bytes_come_through_the_page_cache(tmp_path):
    """A buffer O_DIRECT cannot take (here: one byte past an aligned address) is read
    through the page cache, to the same place. (A file system that refuses O_DIRECT at
    open, as tmpfs did before Linux 6.6, takes the same path; this machine's do not.)"""
    data, crcs = records()
    written, offsets = spill.SpillFile.write(
        tmp_path, "p.vgpu", [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
    )
    head = spill.header_bytes(len(crcs[2]))
    out = read(written, offsets[2] - head, offsets[2] + data[2].size, unaligned=True)
    assert written.direct is False
    spill.check(out, 0, 2, Piece(crcs[2], data[2].size, spill.DISK, offsets[2]), written.path)
    assert np.array_equal(out[head:], data[2])


def test_a_full_disk_leaves_no_file_and_says_so(tmp_path):
    data, crcs = records()
    where = tmp_path / "k"
    where.mkdir(mode=0o700)
    (where / "p.vgpu.tmp").symlink_to("/dev/full")  # every write meets a full device
    with pytest.raises(spill.SpillError, match="No space left on device"):
        spill.SpillFile.write(
            where, "p.vgpu", [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
        )
    assert not (where / "p.vgpu").exists()
    assert not (where / "p.vgpu.tmp").exists()


def test_the_store_moves_what_it_holds_in_memory_to_a_directory(tmp_path):
    codec = Codec(threads=2)
    try:
        blobs = [rng.integers(0, 4, 300_000, dtype=np.uint8) for _ in range(3)]
        with HostStore() as store:
            keys = [store.put(codec.encode(b)) for b in blobs]
            held = store.stats()["host_bytes"]
            assert store.spill(tmp_path / "disk") == held
            assert store.stats()["host_bytes"] == 0
            assert store.stats()["disk_bytes"] == held
            assert store.in_memory() == 0
            files = sorted((tmp_path / "disk").glob("*.chunks"))
            assert len(files) == 3
            assert all(f.stat().st_mode & 0o077 == 0 for f in files)
            assert store.spill(tmp_path / "disk") == 0  # nothing left in memory
            for key, blob in zip(keys, blobs, strict=True):
                assert codec.decode_bytes(store.get(key)) == blob.tobytes()
            store.drop(keys[0])
            assert not files[0].exists()
            assert files[1].exists()
    finally:
        codec.close()


def test_a_full_disk_keeps_the_stores_entries_in_memory(tmp_path):
    codec = Codec(threads=2)
    try:
        with HostStore() as store:
            key = store.put(codec.encode(rng.integers(0, 4, 300_000, dtype=np.uint8)))
            held = store.stats()["host_bytes"]
            where = tmp_path / "disk"
            where.mkdir(mode=0o700)
            (where / f"{key}.tmp").symlink_to("/dev/full")
            with pytest.raises(OSError, match="No space left on device"):
                store.spill(where)
            assert store.stats()["host_bytes"] == held
            assert store.stats()["disk_bytes"] == 0
            assert store.get(key).chunks[0].payload is not None
            assert os.path.lexists(where / f"{key}.tmp") is False
    finally:
        codec.close()


@dataclasses.dataclass(frozen=True)
class RawPiece(Piece):  # a piece stored as its own bytes (the codec below decodes nothing)
    offset: int = 0
    length: int = 0


class CopyCodec:
    """Stands in for the GPU codec (``DeviceCodec.unpack``'s interface) on a machine with
    no GPU: each piece's stored bytes are its bytes, copied back to its place."""

    def unpack(self, items, arena):
        for dst, pieces in items:
            for p in pieces:
                src = np.frombuffer(spill._memory(arena.address(p.slab, p.start), p.length), np.uint8)
                dst.numpy()[p.offset : p.offset + p.length] = src


@pytest.mark.parametrize("unaligned", [False, True], ids=["O_DIRECT", "page cache"])
def test_a_resume_streams_every_window_back_in_place(tmp_path, unaligned):
    """Windows smaller than the file: each is read (bypassing the page cache where the
    buffer allows), its headers checked, its pieces written back at their offsets."""
    import torch

    data, crcs = records(5)
    written, offsets = spill.SpillFile.write(
        tmp_path, "p.vgpu", [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
    )
    ranges = [torch.zeros(d.size, dtype=torch.uint8) for d in data]
    items = [
        (r, [RawPiece(c, d.size, spill.DISK, off, 0, d.size)])
        for r, d, c, off in zip(ranges, data, crcs, offsets, strict=True)
    ]

    def pinned(n):
        raw = torch.empty(n + 2 * spill.DIRECT_ALIGN, dtype=torch.uint8)
        at = -raw.data_ptr() % spill.DIRECT_ALIGN + unaligned
        return raw[at : at + n]

    spill.unpack(CopyCodec(), items, written, pinned, window=3 * 4096)
    assert written.direct is (not unaligned)
    for r, d in zip(ranges, data, strict=True):
        assert np.array_equal(r.numpy(), d)


def test_pieces_a_spill_left_in_host_memory_come_back_from_there_beside_the_file(tmp_path):
    """A spill leaves the pieces other kernels read too in the node's copies (mapped in
    the kernel, slabs its arena adopted); the resume from disk reads those where the
    arena has them, every other piece from the file, each back at its place."""
    import torch

    from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena

    data, crcs = records(6)
    on_disk = [0, 2, 3, 5]
    written, offsets = spill.SpillFile.write(
        tmp_path, "p.vgpu", [(data[i].ctypes.data, data[i].size, crcs[i]) for i in on_disk]
    )
    arena = PinnedArena(torch, pin=lambda n: torch.empty(n, dtype=torch.uint8))
    where = dict(zip(on_disk, offsets, strict=True))
    at = np.cumsum([0] + [d.size for d in data])[:-1]
    whole = torch.zeros(sum(d.size for d in data), dtype=torch.uint8)
    pieces = [
        RawPiece(crcs[i], d.size, spill.DISK, where[i], int(at[i]), d.size)
        if i in where
        else RawPiece(crcs[i], d.size, arena.adopt(d.ctypes.data), 0, int(at[i]), d.size)
        for i, d in enumerate(data)
    ]

    def pinned(n):
        return torch.empty(n, dtype=torch.uint8)

    spill.unpack(CopyCodec(), [(whole, pieces)], written, pinned, arena=arena)
    assert np.array_equal(whole.numpy(), np.concatenate(data))
    with pytest.raises(CodecError, match="in host memory, and the resume was given no arena"):
        spill.unpack(CopyCodec(), [(whole, pieces)], written, pinned)


class RecordingCodec:
    """Stands in for the GPU codec as :class:`CopyCodec` does, and records what it was
    given: each piece's bytes in the order they came, and whether
    any window's bytes changed while the codec still had them (it holds each window a
    moment, as the GPU would while its copies run, and looks again)."""

    def __init__(self, hold_s=0.002):
        self.hold_s, self.seen, self.changed = hold_s, [], []

    def unpack(self, items, arena):
        views = []
        for dst, pieces in items:
            for p in pieces:
                src = np.frombuffer(spill._memory(arena.address(p.slab, p.start), p.length), np.uint8)
                views.append((p, src, src.copy()))
                dst.numpy()[p.offset : p.offset + p.length] = src
        time.sleep(self.hold_s)  # the reads of the other buffers go on meanwhile
        for p, src, first in views:
            if not np.array_equal(src, first):
                self.changed.append(p)
            self.seen.append((p.offset, first))


def many_records(tmp_path, n=60):
    """``n`` pieces of odd sizes in one file: ``(file, items, data, ranges)``."""
    import torch

    data = [rng.integers(0, 256, int(rng.integers(1, 3 * 4096)), dtype=np.uint8) for _ in range(n)]
    crcs = [rng.integers(0, 2**32, int(rng.integers(1, 9)), dtype=np.uint32) for _ in range(n)]
    written, offsets = spill.SpillFile.write(
        tmp_path, "p.vgpu", [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
    )
    whole = torch.zeros(sum(d.size for d in data), dtype=torch.uint8)  # one range, pieces side by side
    at = np.cumsum([0] + [d.size for d in data])[:-1]
    pieces = [
        RawPiece(c, d.size, spill.DISK, off, int(a), d.size)
        for d, c, off, a in zip(data, crcs, offsets, at, strict=True)
    ]
    return written, [(whole, pieces)], data, whole


def threads_reading():
    return [t for t in threading.enumerate() if t.name.startswith("jupyter-vgpu-disk")]


@pytest.mark.parametrize("buffers", [2, 3, 4])
def test_a_resume_from_disk_keeps_k_buffers_and_never_reads_into_one_the_codec_holds(tmp_path, buffers):
    """Windows of about two records, read ahead into ``buffers`` pinned buffers by three
    threads at once: every piece reaches the codec intact and in file order, no window
    changes while the codec holds it, no more buffers are made than asked, and the figures
    add up."""
    import torch

    written, items, data, whole = many_records(tmp_path)
    made = []

    def pinned(n):
        raw = torch.empty(n + 2 * spill.DIRECT_ALIGN, dtype=torch.uint8)
        at = -raw.data_ptr() % spill.DIRECT_ALIGN
        made.append(n)
        return raw[at : at + n]

    codec = RecordingCodec()
    figures = spill.unpack(
        codec, items, written, pinned, window=6 * 4096, buffers=buffers, threads=3, task_bytes=4096
    )
    assert not codec.changed, f"a buffer was read into while the codec held it: {codec.changed[:3]}"
    assert [off for off, _ in codec.seen] == sorted(off for off, _ in codec.seen), "out of file order"
    assert len(codec.seen) == len(data)
    for (_, got), d in zip(codec.seen, data, strict=True):
        assert np.array_equal(got, d)
    assert np.array_equal(whole.numpy(), np.concatenate(data))
    assert len(made) == buffers, "one pinned buffer per slot, each made once"
    assert figures.windows > 3 * buffers
    assert figures.direct is True
    assert written.direct is True
    assert figures.bytes_read >= written.nbytes
    assert figures.read_bytes_per_s > 0
    assert 0 < figures.read_wait_s + figures.unpack_s <= figures.seconds
    assert figures.unpack_s >= figures.windows * codec.hold_s
    assert (figures.buffers, figures.threads, figures.task_bytes) == (buffers, 3, 4096)
    assert not threads_reading()


def test_a_short_file_fails_the_resume_naming_the_record_it_cuts(tmp_path):
    written, items, _, _ = many_records(tmp_path)
    cut = items[0][1][23]
    with open(written.path, "r+b") as f:  # the file ends inside record 23's bytes
        f.truncate(cut.start + cut.span // 2)
    codec = RecordingCodec(hold_s=0)
    with pytest.raises(CodecError, match=r"record 23 of the disk tier's file .* cut short: .* ends at byte"):
        spill.unpack(codec, items, written, torch_pinned, window=6 * 4096, threads=4, task_bytes=4096)
    assert codec.seen, "the windows before the cut went through"
    assert max(off for off, _ in codec.seen) < cut.offset
    assert written.path.exists()
    assert not threads_reading(), "a failed resume leaves no reading thread behind"


def test_a_damaged_header_fails_the_resume_naming_its_record(tmp_path):
    written, items, _, _ = many_records(tmp_path)
    piece = items[0][1][17]
    raw = bytearray(written.path.read_bytes())
    raw[piece.start - spill.header_bytes(len(piece.crcs)) + 12] ^= 1  # its chunk count
    written.path.write_bytes(bytes(raw))
    codec = RecordingCodec(hold_s=0)
    with pytest.raises(CodecError, match=r"record 17 .* header does not match"):
        spill.unpack(codec, items, written, torch_pinned, window=6 * 4096, threads=4, task_bytes=4096)
    assert all(off < piece.offset for off, _ in codec.seen)
    assert not threads_reading()


def torch_pinned(n):
    import torch

    raw = torch.empty(n + 2 * spill.DIRECT_ALIGN, dtype=torch.uint8)
    at = -raw.data_ptr() % spill.DIRECT_ALIGN
    return raw[at : at + n]


def test_an_unwritable_directory_refuses_the_spill_and_leaves_nothing(tmp_path):
    """The kernel's directory is mode 0500 (its owner may not write in it): the spill is
    refused with the system's reason, no file is left, and the same process can write the
    same records to a directory it may write in (so the mode, nothing else, refused it).
    Run as an unprivileged user where the test runs as root, whom modes do not stop."""
    data, crcs = records()
    recs = [(d.ctypes.data, d.size, c) for d, c in zip(data, crcs, strict=True)]
    with tempfile.TemporaryDirectory(dir="/var/tmp") as top:
        top = Path(top)
        top.chmod(0o711)
        closed, open_ = top / "closed", top / "open"
        closed.mkdir(mode=0o700)
        open_.mkdir(mode=0o700)

        def attempt():
            try:
                spill.SpillFile.write(closed, "p.vgpu", recs)
            except spill.SpillError as e:
                refused = str(e)
            else:
                refused = None
            written, _ = spill.SpillFile.write(open_, "p.vgpu", recs)
            return refused, written.path.stat().st_size

        refused, size = as_unprivileged(attempt, closed, open_)
        assert refused is not None, "the spill into a directory of mode 0500 was not refused"
        assert f"writing the disk tier's file {closed / 'p.vgpu'} failed: Permission denied" in refused
        assert os.listdir(closed) == [], "a refused spill left a file"
        assert size == sum(spill.header_bytes(len(c)) + d.size for d, c in zip(data, crcs, strict=True))


def as_unprivileged(fn, closed: Path, open_: Path):
    """``fn()`` with ``closed`` at mode 0500 and ``open_`` writable, as their owner: this
    process where it is not root, else a child turned into user ``nobody`` (65534)."""
    if os.geteuid() != 0:
        closed.chmod(0o500)
        try:
            return fn()
        finally:
            closed.chmod(0o700)
    for d in (closed, open_):
        os.chown(d, 65534, 65534)
    closed.chmod(0o500)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop root, try, say what came of it
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out = pickle.dumps(fn())
        except BaseException as e:  # whatever it is, the parent reports it
            out = pickle.dumps(RuntimeError(repr(e)))
        os.write(w, out)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = pickle.loads(f.read())
    os.waitpid(pid, 0)
    if isinstance(got, RuntimeError):
        raise got
    return got


def test_the_figures_of_a_resume_from_disk_are_what_the_kernel_report_carries(tmp_path):
    """``PauseEngine.stats()["last_resume_disk"]`` is a :class:`spill.DiskResume`'s fields,
    and the kernel report's ``pause`` object admits no field it does not describe."""
    import jsonschema

    from jupyter_vgpu import contracts

    written, items, _, _ = many_records(tmp_path, n=8)
    figures = spill.unpack(RecordingCodec(hold_s=0), items, written, torch_pinned, window=6 * 4096)
    report = contracts.schema("kernel-report")
    entry = {**report["$defs"]["pause"]["properties"]["last_resume_disk"], "$defs": report["$defs"]}
    jsonschema.validate(dataclasses.asdict(figures), entry)
    jsonschema.validate(None, entry)  # before any resume from disk
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**dataclasses.asdict(figures), "other": 1}, entry)
