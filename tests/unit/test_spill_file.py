"""The disk tier's files: the GPU path's pieces written from (pinned) host memory with
their chunk CRC-32s, read back and checked; the host path's store moved to a directory;
a full disk keeps everything where it was."""

import dataclasses
import os

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
