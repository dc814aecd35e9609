"""The arbiter's socket protocol refuses what it does not expect (the ``to-arbiter``
contract), field by field, naming the message's type, the field and what is wrong."""

import json

import pytest

from jupyter_vgpu.node.protocol import ProtocolError, decode


def line(**msg) -> bytes:
    return json.dumps(msg).encode()


@pytest.mark.parametrize("released", [0, 2**31, None])
def test_a_reply_says_how_many_device_bytes_a_pause_released_or_null(released):
    msg = decode(line(type="reply", id=3, ok=True, message="done", released=released))
    assert msg["released"] == released


STATE = {"type": "state", "state": "idle", "resident": 0, "paused_bytes": 0, "host_bytes": 0}
STATE["resume_seconds"] = None
REPLY = {"type": "reply", "id": 3, "ok": True, "message": "done", "released": 0}
REGISTER = {"type": "register", "pid": 1234, "user": "ada", "server": "", "slice": {}}


@pytest.mark.parametrize(
    ("msg", "says"),
    [
        ({"type": "reply", "id": 3, "ok": True, "message": "done"}, "reply: missing field(s): released"),
        (
            {"type": "reply", "id": 3, "ok": True, "message": "done", "released": -1},
            "reply.released: must be at",
        ),
        (
            {"type": "reply", "id": 3, "ok": True, "message": "done", "released": "0"},
            "reply.released: must be an",
        ),
        (
            {"type": "reply", "id": 3, "ok": True, "message": "done", "released": True},
            "reply.released: must be an",
        ),
        (
            {"type": "reply", "id": 3, "ok": 1, "message": "done", "released": 0},
            "reply.ok: must be true or false",
        ),
        (
            {"type": "reply", "id": 3, "ok": True, "message": "x" * 5000, "released": 0},
            "at most 4096 characters",
        ),
        ({**STATE, "state": "asleep"}, 'state.state: must be one of "active", "idle", "paused", "suspended"'),
        ({**STATE, "resident": 10**400}, "state.resident: must be at most 4611686018427387904; got 1000"),
        ({**STATE, "resident": 1.0}, "state.resident: must be an integer, not a number with a fraction"),
        (
            {**STATE, "resume_seconds": float("nan")},
            "resume_seconds: must be a number or null, not NaN",
        ),
        ({**STATE, "resume_seconds": 1e9}, "state.resume_seconds: must be less than 1000000000"),
        ({"type": "room", "id": 1, "for": "run", "budget": 2**40}, 'room: unknown field(s): "budget"'),
        ({"type": "room", "id": 1, "for": "everything"}, 'room.for: must be one of "run", "resume"'),
        ({"type": "room", "id": -1, "for": "run"}, "room.id: must be at least 0; got -1"),
        ({"type": "grant", "id": 1}, 'type: must be one of "hello", "state"'),
        ({"type": None}, "type: must be one of"),
        ({"id": 1}, "missing field(s): type"),
        ({**REGISTER, "pid": 0}, "register.pid: must be at least 1; got 0"),
        ({**REGISTER, "slice": "ada's"}, "register.slice: must be an object, not a string"),
        ({**REGISTER, "user": "x" * 257}, "register.user: must be at most 256 characters long"),
        ({**REGISTER, "cgroup": 5}, "register.cgroup: must be a string or null"),
        ({"type": "books", "all": True}, 'books: unknown field(s): "all"'),
        ({"type": "unregister"}, "unregister: missing field(s): pid"),
    ],
)
def test_malformed_messages_are_refused_with_what_is_wrong(msg, says):
    with pytest.raises(ProtocolError) as e:
        decode(json.dumps(msg).encode())
    assert says in str(e.value)
    assert len(str(e.value)) < 300, "no huge value is repeated back"


@pytest.mark.parametrize("raw", [b"[1, 2]", b"not json", b"[" * 100_000])
def test_a_line_that_is_not_a_json_object_is_refused(raw):
    with pytest.raises(ProtocolError, match="not a JSON object"):
        decode(raw)
