"""The host store: cap, spill to disk, refusal, clean-up."""

import numpy as np
import pytest

from jupyter_vgpu.kernel.offload.codec import Codec
from jupyter_vgpu.kernel.offload.store import HostMemoryFull, HostStore, available_host_memory

rng = np.random.default_rng(1)


@pytest.fixture(scope="module")
def packed():
    c = Codec(chunk_bytes=16 * 1024, threads=1)
    data = rng.integers(0, 256, 100_000, dtype=np.uint8)
    yield c, data, c.encode(data)
    c.close()


def test_default_cap_is_a_fraction_of_available_memory():
    assert 0 < HostStore().cap_bytes <= available_host_memory()


def test_within_the_cap_data_stays_in_memory(packed):
    codec, data, p = packed
    store = HostStore(cap_bytes=10 * p.stored_bytes)
    key = store.put(p)
    assert store.stats()["host_bytes"] == p.stored_bytes
    assert codec.decode_bytes(store.get(key)) == data.tobytes()
    store.drop(key)
    assert store.stats() == {"host_bytes": 0, "disk_bytes": 0, "entries": 0, "cap_bytes": 10 * p.stored_bytes}


def test_past_the_cap_without_spill_dir_is_refused_and_nothing_kept(packed):
    _, _, p = packed
    store = HostStore(cap_bytes=p.stored_bytes)
    store.put(p)
    with pytest.raises(HostMemoryFull, match="host memory cap"):
        store.put(p)
    assert store.stats()["entries"] == 1


def test_past_the_cap_data_spills_to_disk_and_comes_back(packed, tmp_path):
    codec, data, p = packed
    store = HostStore(cap_bytes=p.stored_bytes, spill_dir=tmp_path / "spill")
    first, second = store.put(p), store.put(p)
    assert store.stats()["disk_bytes"] == p.stored_bytes
    assert len(list((tmp_path / "spill").iterdir())) == 1
    assert codec.decode_bytes(store.get(second)) == data.tobytes()
    assert codec.decode_bytes(store.get(first)) == data.tobytes()
    store.close()
    assert list((tmp_path / "spill").iterdir()) == []
