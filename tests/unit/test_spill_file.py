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
        out = np.empty(head + d.size, np.uint8)
        written.read(off - head, out)
        spill.check(out, 0, written.records[off], piece, written.path)
        assert np.array_equal(out[head:], d)
        assert written.records[off] == i
    # a damaged CRC-32 table, a piece read at another's place, a short file: all named
    raw = bytearray(written.path.read_bytes())
    head = spill.header_bytes(len(crcs[1]))
    raw[offsets[1] - head + 40] ^= 1
    written.path.write_bytes(bytes(raw))
    out = np.empty(head, np.uint8)
    written.read(offsets[1] - head, out)
    with pytest.raises(CodecError, match=r"record 1 .* CRC-32s do not match"):
        spill.check(out, 0, 1, Piece(crcs[1], data[1].size), written.path)
    out = np.empty(spill.header_bytes(len(crcs[0])), np.uint8)
    written.read(offsets[0] - len(out), out)
    with pytest.raises(CodecError, match="header does not match"):
        spill.check(out, 0, 2, Piece(crcs[0], data[0].size), written.path)
    with pytest.raises(CodecError, match="ends at byte"):
        written.read(written.nbytes - 10, np.empty(20, np.uint8))


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
