"""The server<->kernel file channel: atomic documents, safe names."""

import os
import threading

import pytest

from jupyter_vgpu import channel


def test_write_then_read(tmp_path):
    path = channel.server_path(tmp_path / "ch")
    channel.write_json(path, {"slice": None, "pressure": False})
    assert channel.read_json(path) == {"slice": None, "pressure": False}
    assert [p.name for p in path.parent.iterdir()] == ["server.json"]


def test_read_missing_or_garbage_is_none(tmp_path):
    assert channel.read_json(tmp_path / "absent.json") is None
    (tmp_path / "bad.json").write_text("{trunc")
    assert channel.read_json(tmp_path / "bad.json") is None
    (tmp_path / "list.json").write_text("[1]")
    assert channel.read_json(tmp_path / "list.json") is None


def test_kernel_paths_round_trip_and_refuse_escapes(tmp_path):
    path = channel.kernel_path(tmp_path, "3f2a-11")
    assert channel.kernel_id_of(path) == "3f2a-11"
    assert channel.kernel_id_of(tmp_path / "server.json") is None
    for bad in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="invalid kernel id"):
            channel.kernel_path(tmp_path, bad)


def test_channel_dir_from_env(tmp_path):
    assert channel.channel_dir({}) is None
    assert channel.channel_dir({channel.CHANNEL_ENV: str(tmp_path)}) == tmp_path


def test_readers_never_see_a_partial_document(tmp_path):
    """A reader polling while a writer rewrites a large document sees whole documents only."""
    path = tmp_path / "server.json"
    big = {"pad": "x" * 200_000}
    channel.write_json(path, {"n": -1, **big})
    stop = threading.Event()
    seen = []

    def reader():
        while not stop.is_set():
            doc = channel.read_json(path)
            seen.append(doc is not None and len(doc["pad"]) == 200_000)

    t = threading.Thread(target=reader)
    t.start()
    for n in range(200):
        channel.write_json(path, {"n": n, **big})
    stop.set()
    t.join()
    assert seen
    assert all(seen)
    assert channel.read_json(path)["n"] == 199
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")]
