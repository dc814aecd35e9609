"""The arbiter's socket protocol as contracts (``to-arbiter``, ``from-arbiter``), checked on
both sides without jsonschema (:mod:`jupyter_vgpu.contracts.lean`): the lean checker
agrees with jsonschema on every message and its broken variants, and says what is wrong
in the same words; a kernel drops what breaks the contract and keeps its link."""

import contextlib
import json
import logging
import math
import socket
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_vgpu import contracts
from jupyter_vgpu.contracts import lean
from jupyter_vgpu.kernel.arbiter_client import HELLO_VERSION, ArbiterClient
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
SLICE = Slice("GPU-sim-0", 0, "H100", 80 * GiB, 8 * GiB, 50, simulated=True).to_dict()

#: Valid messages of each kind, both ways.
TO_ARBITER = [
    {"type": "hello", "version": 1, "kernel_id": "k"},
    {
        "type": "hello", "version": 2, "kernel_id": "k", "state": "paused", "resident": 0,
        "paused_bytes": 5, "host_bytes": 4, "disk_bytes": 0, "budget": None, "idle_seconds": 12.5,
    },
    {
        "type": "state", "state": "idle", "resident": 1, "paused_bytes": 0, "host_bytes": 0,
        "disk_bytes": 0, "resume_seconds": 0.25,
    },
    {
        "type": "state", "state": "active", "resident": 1, "paused_bytes": 0, "host_bytes": 0,
        "resume_seconds": None,
    },
    {
        "type": "hello", "version": 5, "kernel_id": "k", "state": "idle", "resident": 17 * GiB,
        "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0, "pausable_bytes": 2 * GiB,
        "cached_bytes": 14 * GiB, "budget": None, "idle_seconds": 1.5,
    },
    {
        "type": "state", "state": "idle", "resident": 1, "paused_bytes": 0, "host_bytes": 0,
        "disk_bytes": 0, "pausable_bytes": 1, "cached_bytes": 0, "resume_seconds": None,
    },
    {"type": "room", "id": 1, "for": "run"},
    {"type": "room", "id": 2, "for": "grow", "bytes": 2**30},
    {"type": "channel", "version": 4, "for": "grow"},
    {"type": "reply", "id": 7, "ok": True, "message": "done in 0.1 s", "released": 0},
    {"type": "register", "pid": 1234, "user": "ada", "server": "", "slice": SLICE},
    {
        "type": "register", "pid": 1234, "user": "ada", "server": "", "slice": SLICE,
        "cgroup": "cgroup2:/jupyter/ada", "start": 99, "uid": 1000,
    },
    {"type": "unregister", "pid": 1234},
    {"type": "books"},
    {"type": "refresh"},
]  # fmt: skip
FROM_ARBITER = [
    {"type": "welcome", "slice": SLICE, "server": "ada/", "disk_dir": "/var/lib/jupyter-vgpu/disk/1000/k"},
    {"type": "welcome", "slice": None, "server": None, "disk_dir": None},
    {"type": "welcome", "slice": SLICE, "server": "ada/"},
    {"type": "welcome", "slice": SLICE, "server": "ada/", "disk_dir": None, "grow": True},
    {"type": "slice", "slice": SLICE},
    {"type": "grant", "id": 1},
    {"type": "wait", "id": 1, "message": "making room on GPU 0"},
    {"type": "deny", "id": 1, "message": "no room on the GPU after 60 s"},
    {"type": "failed", "id": 1, "message": "the node arbiter could not decide this request (KeyError: 3)"},
    {"type": "pause", "id": 3},
    {"type": "suspend", "id": 3},
    {"type": "trim", "id": 3},
    {"type": "release", "id": 3},
    {"type": "spill", "id": 3, "dir": "/var/lib/jupyter-vgpu/disk/1000/k"},
    {"type": "notice", "message": "over budget"},
    {"type": "error", "message": "say hello first"},
    {"type": "node", "host_used": 0, "host_limit": 64 * GiB, "disk_used": 2**63 - 1},
    {"type": "ok"},
    {"type": "ok", "books": {"servers": [], "kernels": []}},
]
MESSAGES = [("to-arbiter", m) for m in TO_ARBITER] + [("from-arbiter", m) for m in FROM_ARBITER]

#: Values that straddle every rule the two contracts have.
CANDIDATES = [
    None, True, False, 0, 1, -1, 2, 3, 1.5, 2.0, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 10**400,
    999999999.5, 1e9, math.nan, math.inf, "", "x", "x" * 129, "x" * 257, "x" * 4097, [], {}, {"a": 1},
    "run", "prefetch", "grow", "active", "hello", "welcome", "node", "pause", "books",
]  # fmt: skip


def jsonschema_errors(name: str, document) -> list:
    return list(contracts._validator(name).iter_errors(document))


@pytest.mark.parametrize(("name", "message"), MESSAGES)
def test_every_kind_of_message_keeps_its_contract_by_both_checkers(name, message):
    contracts.validate(name, message)
    lean.validate_message(name, message)


@st.composite
def broken(draw):
    name, message = draw(st.sampled_from(MESSAGES))
    message = dict(message)
    how = draw(st.sampled_from(["replace", "drop", "add", "whole"]))
    if how == "replace":
        message[draw(st.sampled_from(sorted(message)))] = draw(st.sampled_from(CANDIDATES))
    elif how == "drop":
        message.pop(draw(st.sampled_from(sorted(message))))
    elif how == "add":
        message[draw(st.sampled_from(["budget", "surprise", "disk_dir", "version", "id"]))] = 1
    else:
        message = draw(st.sampled_from(CANDIDATES))
    return name, message


@settings(max_examples=1500, deadline=None)
@given(broken())
def test_the_lean_checker_agrees_with_jsonschema(case):
    """Both accept or both refuse; where jsonschema sees one fault, both name it alike."""
    name, message = case
    errors = jsonschema_errors(name, message)
    try:
        lean.validate(name, message)
        said = None
    except contracts.ContractError as e:
        said = str(e)
    assert (said is None) == (not errors), (message, said, [e.message for e in errors])
    if len(errors) == 1:
        with pytest.raises(contracts.ContractError) as e:
            contracts.validate(name, message)
        assert said == str(e.value), message


NODE = {"type": "node", "host_used": 0, "host_limit": 0, "disk_used": 0}


@pytest.mark.parametrize(
    ("message", "said"),
    [
        ({"type": "welcome", "slice": None, "server": 5}, "welcome.server: must be a string or null, not an"),
        ({"type": "welcome", "slice": "x", "server": None}, "welcome.slice: must be an object or null"),
        ({"type": "welcome", "slice": None}, "welcome: missing field(s): server"),
        ({"type": "grant", "id": 1, "surprise": 1}, 'grant: unknown field(s): "surprise"'),
        ({"type": "grant", "id": 10**400}, "grant.id: must be at most 4611686018427387904; got 1000"),
        ({"type": "grant", "id": 1.0}, "grant.id: must be an integer, not a number with a fraction"),
        ({"type": "pause"}, "pause: missing field(s): id"),
        ({"type": "spill", "id": 1, "dir": None}, "spill.dir: must be a string, not null"),
        ({**NODE, "host_used": -1}, "node.host_used: must be at least 0"),
        ({**NODE, "host_used": math.nan}, "node.host_used: must be an integer, not NaN or infinite"),
        ({"type": "notice", "message": ["x" * 10_000]}, "notice.message: must be a string, not an array"),
        ({"type": "resume", "id": 1}, 'type: must be one of "welcome", "slice"'),
        ({"kind": "grant"}, "missing field(s): type"),
        ([{"type": "grant"}], "must be an object, not an array"),
    ],
)
def test_a_message_of_the_arbiters_that_breaks_its_contract_is_named_by_field(message, said):
    with pytest.raises(contracts.ContractError) as e:
        lean.validate_message("from-arbiter", message)
    assert said in str(e.value)
    assert len(str(e.value)) < 300


def test_the_lean_checker_refuses_keywords_it_does_not_check(monkeypatch):
    real = contracts.schema

    def patched(name):
        s = real(name)
        return {**s, "$defs": {**s["$defs"], "x": {"type": "string", "pattern": "^a"}}}

    monkeypatch.setattr(lean, "schema", patched)
    lean._root.cache_clear()
    try:
        with pytest.raises(lean.UnsupportedSchema, match="pattern"):
            lean.validate("to-arbiter", {"type": "books"})
    finally:
        lean._root.cache_clear()


def test_the_protocols_contracts_are_not_the_browsers():
    from jupyter_vgpu.contracts import typescript

    assert {"to-arbiter", "from-arbiter"} <= set(contracts.names())
    assert "ToArbiter" not in typescript.render()


class Pausing:
    last_notice = None

    def own_calls(self):
        return contextlib.nullcontext()


@pytest.fixture
def arbiter_socket(tmp_path):
    """A stand-in arbiter: accepts one kernel, reads its hello, and sends the lines the
    test queued (bytes); ``heard`` collects what the kernel writes."""
    path = str(tmp_path / "arbiter.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    lines: list[bytes] = []
    heard: list[dict] = []

    def serve():
        conn, _ = server.accept()
        reader = conn.makefile("rb")
        heard.append(json.loads(reader.readline()))
        conn.sendall(b"".join(lines))
        for line in reader:
            heard.append(json.loads(line))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    yield path, lines, heard
    server.close()


def test_a_kernel_drops_what_breaks_the_contract_and_keeps_its_link(arbiter_socket, caplog):
    path, lines, heard = arbiter_socket
    adopted = []
    lines += [
        b"not json\n",
        b'{"type": "welcome", "slice": null, "server": 5}\n',  # breaks it: dropped
        b'{"type": "node", "host_used": -1, "host_limit": 1, "disk_used": 0}\n',
        b'{"type": "pause"}\n',  # no id: never obeyed, never answered
        b'{"type": "notice", "message": ["x"]}\n',
        b'{"type": "welcome", "slice": null, "server": null}\n',
        b'{"type": "node", "host_used": 1, "host_limit": 2, "disk_used": 3}\n',
    ]
    figures = {
        "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0,
        "budget": None, "idle_seconds": 0.0, "resume_seconds": None,
    }  # fmt: skip
    said = []
    client = ArbiterClient(
        path, "k", adopted.append, lambda: figures, Pausing(), lambda *a, **k: said.append(a)
    )
    with caplog.at_level(logging.WARNING, logger="jupyter_vgpu"):
        client.start()
        try:
            wait_for(lambda: client.node is not None, 10, "the node's figures")
            wait_for(lambda: len(heard) >= 2, 10, "the kernel's state after its welcome")
            assert client.connected.is_set()
        finally:
            client.stop()
    assert client.node == {"host_used": 1, "host_limit": 2, "disk_used": 3}
    assert adopted == [None]  # the one welcome that keeps the contract
    assert said == []
    assert client.pausing.last_notice is None
    assert client.last_error is None
    assert [m["type"] for m in heard] == ["hello", "state"]  # no reply to the broken pause
    text = caplog.text
    assert "not JSON" in text
    assert "welcome.server: must be a string or null" in text
    assert "node.host_used: must be at least 0" in text
    assert "pause: missing field(s): id" in text
    assert "notice.message: must be a string" in text


@pytest.mark.parametrize("speaks", [5, 4, 3, 2, 1])
def test_a_kernel_speaks_the_version_of_an_older_arbiter_one_step_down_at_a_time(tmp_path, speaks):
    """A version-3 kernel says what its pause would store (``pausable_bytes``), a version-5
    one its cached free blocks (``cached_bytes``); an arbiter that refuses its hello's
    version is spoken to in the version below, down to its own, and is never sent a
    field of a later version."""
    path = str(tmp_path / "arbiter.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(4)
    hellos: list[int] = []
    states: list[dict] = []

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            reader = conn.makefile("rb")
            hello = json.loads(reader.readline())
            hellos.append(hello["version"])
            if hello["version"] > speaks:
                known = ", ".join(map(str, range(1, speaks + 1)))
                refusal = {
                    "type": "error",
                    "message": f"hello.version: must be one of {known}; got {hello['version']}",
                }
                conn.sendall(json.dumps(refusal).encode() + b"\n")
                reader.read()  # until the kernel hangs up
                conn.close()
                continue
            if speaks >= 2:
                assert ("pausable_bytes" in hello) == (speaks >= 3)
                assert ("cached_bytes" in hello) == (speaks >= 5)
            conn.sendall(b'{"type": "welcome", "slice": null, "server": null}\n')
            states.extend(json.loads(line) for line in reader)
            return

    threading.Thread(target=serve, daemon=True).start()
    figures = {
        "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0,
        "pausable_bytes": 5, "cached_bytes": 7, "budget": None, "idle_seconds": 0.0,
        "resume_seconds": None,
    }  # fmt: skip
    client = ArbiterClient(path, "k", lambda _: None, lambda: figures, Pausing(), lambda *a, **k: None)
    client.start()
    try:
        wait_for(lambda: client.connected.is_set() and states, 20, f"the kernel welcomed in version {speaks}")
    finally:
        client.stop()
        server.close()
    assert hellos == list(range(HELLO_VERSION, speaks - 1, -1))
    assert ("pausable_bytes" in states[0]) == (speaks >= 3)
    assert ("cached_bytes" in states[0]) == (speaks >= 5)
    assert ("disk_bytes" in states[0]) == (speaks >= 2)


class SlowSpill(Pausing):
    """A kernel's pausing whose spill lasts until the test lets it end."""

    def __init__(self):
        self.spilling, self.go_on, self.suspends = threading.Event(), threading.Event(), 0

    def spill(self, directory: str) -> None:
        self.spilling.set()
        assert self.go_on.wait(10), "the test never let the spill end"

    def prepare_suspend(self) -> None:
        self.suspends += 1


def test_a_kernel_refuses_a_move_while_another_is_under_way(tmp_path):
    # a suspend that arrives while the kernel writes its paused memory to disk is refused
    # (made, the driver's lock would freeze the spill until the restore); once the spill
    # has ended, the next suspend is made
    path = str(tmp_path / "arbiter.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    replies: dict[int, dict] = {}
    pausing = SlowSpill()
    figures = {
        "state": "paused", "resident": 0, "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0,
        "budget": None, "idle_seconds": 0.0, "resume_seconds": None,
    }  # fmt: skip

    def serve():
        conn, _ = server.accept()
        reader = conn.makefile("rb")
        reader.readline()  # its hello
        conn.sendall(b'{"type": "welcome", "slice": null, "server": null}\n')
        conn.sendall(b'{"type": "spill", "id": 1, "dir": "/nowhere"}\n')
        assert pausing.spilling.wait(10)
        conn.sendall(b'{"type": "suspend", "id": 2}\n')
        for line in reader:
            msg = json.loads(line)
            if msg["type"] == "reply":
                replies[msg["id"]] = msg
                if msg["id"] == 2:
                    pausing.go_on.set()
                elif msg["id"] == 1:
                    conn.sendall(b'{"type": "suspend", "id": 3}\n')
        conn.close()

    class Client(ArbiterClient):
        def _send(self, msg: dict) -> bool:
            # the arbiter's next move may come the moment it reads a move's reply: hold the
            # thread that sent the spill's reply until that move is answered, so a spill
            # still marked under way as its reply goes out is always caught
            sent = super()._send(msg)
            if msg.get("type") == "reply" and msg["id"] == 1:
                wait_for(lambda: 3 in replies, 10, "the reply to the suspend sent after the spill's reply")
            return sent

    threading.Thread(target=serve, daemon=True).start()
    client = Client(path, "k", lambda _: None, lambda: figures, pausing, lambda *a, **k: None)
    client.start()
    try:
        wait_for(lambda: 3 in replies, 20, "the second suspend's reply")
    finally:
        client.stop()
        server.close()
    assert not replies[2]["ok"]
    assert "spill is under way" in replies[2]["message"], replies[2]
    assert replies[1]["ok"], replies[1]
    assert replies[3]["ok"], replies[3]
    assert pausing.suspends == 1  # the one made after the spill


@pytest.mark.parametrize(("welcome", "channel"), [({"grow": True}, True), ({}, False)])
def test_a_kernel_hands_the_allocator_its_grow_channel_only_where_the_arbiter_grants_growth(
    tmp_path, welcome, channel
):
    path = str(tmp_path / "arbiter.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)

    def serve():
        conn, _ = server.accept()
        reader = conn.makefile("rb")
        assert json.loads(reader.readline())["version"] == HELLO_VERSION
        said = {"type": "welcome", "slice": None, "server": None, "disk_dir": None, **welcome}
        conn.sendall(json.dumps(said).encode() + b"\n")
        reader.read()
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    figures = {
        "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0, "disk_bytes": 0,
        "budget": None, "idle_seconds": 0.0, "resume_seconds": None,
    }  # fmt: skip
    handed: list = []
    client = ArbiterClient(path, "k", lambda _: None, lambda: figures, Pausing(), lambda *a, **k: None)
    client.grow_channel = handed.append
    client.start()
    try:
        wait_for(client.connected.is_set, 20, "the kernel welcomed")
    finally:
        client.stop()
        server.close()
    assert handed == [path if channel else None]
    assert client.grows is channel
