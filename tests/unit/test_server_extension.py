"""The server extension in a real jupyter server, with real kernels."""

import json
import time

import pytest
import requests

from jupyter_vgpu import channel
from jupyter_vgpu.slice import Slice

from ..server_process import JupyterServer

GiB = 2**30
SLICE = Slice("GPU-sim-0", 0, "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, 6 * GiB, 30, simulated=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    s = JupyterServer(
        root,
        {"JUPYTER_VGPU_SLICE": SLICE.to_json(), "JUPYTERHUB_API_URL": ""},
        args=[f"--VGPUServer.channel_dir={root / 'channel'}", "--VGPUServer.sample_seconds=0.2"],
    )
    yield s
    s.stop()


def test_status_carries_the_slice_and_the_channel_is_published(server):
    doc = server.get("api/vgpu/status").json()
    assert Slice.from_dict(doc["slice"]) == SLICE
    assert doc["simulated"] is True
    assert doc["gpu"]["memory_total"] == 80 * GiB
    published = channel.read_json(channel.server_path(server.root / "channel"))
    assert Slice.from_dict(published["slice"]) == SLICE


def test_kernels_report_their_usage(server):
    kid = server.request("POST", "api/kernels", json={"name": "python3"}).json()["id"]
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            doc = server.get("api/vgpu/usage").json()
            kernel = next((k for k in doc["kernels"] if k["id"] == kid), None)
            if kernel and kernel["reported"]:
                break
            time.sleep(0.3)
        assert kernel is not None
        assert kernel["reported"]
        assert kernel["pid"] > 0
        assert kernel["used"] == 0
        assert "torch not imported" in kernel["budget_status"]
        report = channel.read_json(channel.kernel_path(server.root / "channel", kid))
        assert report["budget"] == 6 * GiB
    finally:
        server.request("DELETE", f"api/kernels/{kid}")


def test_stream_sends_server_sent_events(server):
    events = []
    with server.get("api/vgpu/usage/stream", stream=True) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
            if len(events) == 2:
                break
    assert events[0]["slice"]["memory_limit"] == 6 * GiB
    assert events[1]["timestamp"] > events[0]["timestamp"]


def test_unauthenticated_requests_are_refused(server):
    for path in ("api/vgpu/usage", "api/vgpu/status", "api/vgpu/usage/stream"):
        assert requests.get(f"{server.url}/{path}", timeout=10).status_code == 403
