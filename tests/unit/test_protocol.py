"""The arbiter's socket protocol refuses what it does not expect, field by field."""

import json

import pytest

from jupyter_vgpu.node.protocol import ProtocolError, decode


def line(**msg) -> bytes:
    return json.dumps(msg).encode()


@pytest.mark.parametrize("released", [0, 2**31, None])
def test_a_reply_says_how_many_device_bytes_a_pause_released_or_null(released):
    msg = decode(line(type="reply", id=3, ok=True, message="done", released=released))
    assert msg["released"] == released


@pytest.mark.parametrize(
    ("msg", "says"),
    [
        ({"type": "reply", "id": 3, "ok": True, "message": "done"}, "fields"),
        ({"type": "reply", "id": 3, "ok": True, "message": "done", "released": -1}, "released"),
        ({"type": "reply", "id": 3, "ok": True, "message": "done", "released": "0"}, "released"),
        ({"type": "reply", "id": 3, "ok": True, "message": "done", "released": True}, "released"),
        ({"type": "reply", "id": 3, "ok": 1, "message": "done", "released": 0}, "ok must be"),
        (
            {
                "type": "state",
                "state": "asleep",
                "resident": 0,
                "paused_bytes": 0,
                "host_bytes": 0,
                "resume_seconds": None,
            },
            "state must be",
        ),
        ({"type": "room", "id": 1, "for": "run", "budget": 2**40}, "fields"),
        ({"type": "grant", "id": 1}, "unknown message type"),
    ],
)
def test_malformed_messages_are_refused_with_what_is_wrong(msg, says):
    with pytest.raises(ProtocolError, match=says):
        decode(json.dumps(msg).encode())


@pytest.mark.parametrize("raw", [b"[1, 2]", b"not json", b"[" * 100_000])
def test_a_line_that_is_not_a_json_object_is_refused(raw):
    with pytest.raises(ProtocolError, match="not a JSON object"):
        decode(raw)
