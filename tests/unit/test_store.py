"""The host store: the cap, spill to disk and back, refusal, damaged spill files, clean-up."""

import threading

import numpy as np
import pytest

from jupyter_vgpu.kernel.codec.zstd import Codec, CodecError, Packed
from jupyter_vgpu.kernel.pause.store import HostMemoryFull, HostStore, available_host_memory

rng = np.random.default_rng(5)


@pytest.fixture(scope="module")
def codec():
    with Codec(chunk_bytes=16 * 1024, threads=2) as c:
        yield c


@pytest.fixture(scope="module")
def sample(codec) -> tuple[bytes, Packed]:
    """About 100 kB of mixed chunks: random (RAW), repetitive (ZSTD) and zero (CONST)."""
    data = np.concatenate(
        [
            rng.integers(0, 256, 40_000, dtype=np.uint8),
            np.repeat(rng.integers(0, 256, 2_500, dtype=np.uint8), 16),
            np.zeros(20_001, np.uint8),
        ]
    )
    packed = codec.encode(data)
    assert {c.kind.name for c in packed.chunks} == {"RAW", "ZSTD", "CONST"}
    return data.tobytes(), packed


def test_default_cap_is_half_of_available_memory():
    available = available_host_memory()
    assert 0.4 * available < HostStore().cap_bytes <= 0.6 * available


def test_within_the_cap_data_stays_in_memory(sample):
    _, packed = sample
    store = HostStore(cap_bytes=3 * packed.stored_bytes)
    key = store.put(packed)
    assert store.get(key) is packed
    assert store.stats() == {
        "host_bytes": packed.stored_bytes,
        "disk_bytes": 0,
        "entries": 1,
        "cap_bytes": 3 * packed.stored_bytes,
    }
    assert store.room() == 2 * packed.stored_bytes
    store.drop(key)
    store.drop(key)  # dropping twice is harmless
    assert store.stats()["host_bytes"] == 0
    with pytest.raises(KeyError):
        store.get(key)


def test_past_the_cap_without_spill_dir_is_refused_and_nothing_kept(sample):
    _, packed = sample
    store = HostStore(cap_bytes=packed.stored_bytes + 10)
    key = store.put(packed)
    before = store.stats()
    with pytest.raises(HostMemoryFull) as e:
        store.put(packed)
    message = str(e.value)
    for figure in (packed.stored_bytes, packed.stored_bytes + 10):
        assert str(figure) in message
    assert "no spill directory" in message
    assert store.stats() == before
    store.drop(key)
    store.put(packed)  # room again once dropped


def test_past_the_cap_data_spills_to_disk_and_comes_back(codec, sample, tmp_path):
    data, packed = sample
    with HostStore(cap_bytes=packed.stored_bytes, spill_dir=tmp_path / "spill") as store:
        first, second = store.put(packed), store.put(packed)
        assert store.stats()["host_bytes"] == packed.stored_bytes
        assert store.stats()["disk_bytes"] == packed.stored_bytes
        files = list((tmp_path / "spill").rglob("*.chunks"))
        assert len(files) == 1
        # the payloads, then each chunk's size (u64) and CRC-32 (u32), their count and a mark
        assert files[0].stat().st_size == packed.stored_bytes + 12 * len(packed.chunks) + 8
        back = store.get(second)
        assert back.chunks[1].payload is not None
        assert codec.decode_bytes(back) == data
        assert codec.decode_bytes(store.get(first)) == data
        assert store.stats()["disk_bytes"] == packed.stored_bytes  # reading does not move it
        store.drop(second)
        assert not files[0].exists()
        assert store.stats()["disk_bytes"] == 0
        store.put(packed)
    assert list((tmp_path / "spill").iterdir()) == []  # close removed the private directory


def test_a_zero_cap_sends_everything_to_disk_but_empty_data_needs_no_room(codec, tmp_path):
    store = HostStore(cap_bytes=0, spill_dir=tmp_path)
    key = store.put(codec.encode(np.zeros(1 << 20, np.uint8)))
    assert store.stats()["disk_bytes"] > 0
    assert codec.decode_bytes(store.get(key)) == bytes(1 << 20)
    empty = store.put(codec.encode(np.empty(0, np.uint8)))
    assert store.get(empty).nbytes == 0
    store.close()


def test_stores_sharing_a_spill_directory_keep_their_own_files(codec, sample, tmp_path):
    data, packed = sample
    other = codec.encode(np.arange(50_000, dtype=np.uint8))
    a, b = HostStore(cap_bytes=0, spill_dir=tmp_path), HostStore(cap_bytes=0, spill_dir=tmp_path)
    key_a, key_b = a.put(packed), b.put(other)
    assert key_a == key_b  # each store counts its keys from 1
    assert codec.decode_bytes(a.get(key_a)) == data
    assert codec.decode_bytes(b.get(key_b)) == np.arange(50_000, dtype=np.uint8).tobytes()
    a.close()
    assert codec.decode_bytes(b.get(key_b)) == np.arange(50_000, dtype=np.uint8).tobytes()
    b.close()
    assert list(tmp_path.iterdir()) == []


def spilled_file(store: HostStore):
    (path,) = list(store.spill_dir.rglob("*.chunks"))
    return path


def test_a_damaged_spill_file_is_caught_naming_the_chunk(codec, sample, tmp_path):
    data, packed = sample
    store = HostStore(cap_bytes=0, spill_dir=tmp_path)
    key = store.put(packed)
    path = spilled_file(store)
    intact = path.read_bytes()
    offset = packed.chunks[0].stored_bytes + packed.chunks[1].stored_bytes + 3
    damaged = bytearray(intact)
    damaged[offset] ^= 0x01
    path.write_bytes(bytes(damaged))
    victim = f"chunk at byte {packed.chunks[2].offset} \\(number 2\\) in spill file"
    with pytest.raises(CodecError, match=victim):
        store.get(key)
    path.write_bytes(intact[:-1])
    with pytest.raises(CodecError, match="were written"):
        store.get(key)
    table = bytearray(intact)
    table[-9] ^= 0x01  # the trailer's CRC-32 of the last chunk
    path.write_bytes(bytes(table))
    with pytest.raises(CodecError, match="table of chunk sizes and CRC-32s is damaged"):
        store.get(key)
    path.write_bytes(intact)  # the file repaired: the entry was kept and reads back
    assert codec.decode_bytes(store.get(key)) == data
    path.unlink()
    with pytest.raises(FileNotFoundError):
        store.get(key)
    store.close()


def test_a_failed_spill_keeps_nothing(sample, tmp_path):
    _, packed = sample
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    store = HostStore(cap_bytes=0, spill_dir=blocker)
    with pytest.raises(FileExistsError):
        store.put(packed)
    assert store.stats() == {"host_bytes": 0, "disk_bytes": 0, "entries": 0, "cap_bytes": 0}


def test_bad_cap_is_refused():
    with pytest.raises(ValueError, match="cap_bytes"):
        HostStore(cap_bytes=-1)


def test_concurrent_puts_gets_and_drops_keep_the_figures_right(codec, sample, tmp_path):
    data, packed = sample
    store = HostStore(cap_bytes=4 * packed.stored_bytes, spill_dir=tmp_path)
    errors = []

    def work():
        try:
            for _ in range(10):
                key = store.put(packed)
                assert codec.decode_bytes(store.get(key)) == data
                store.drop(key)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.stats() == {
        "host_bytes": 0,
        "disk_bytes": 0,
        "entries": 0,
        "cap_bytes": 4 * packed.stored_bytes,
    }
    store.close()
