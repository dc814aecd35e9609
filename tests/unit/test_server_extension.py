"""The server extension in a real jupyter server, with real kernels."""

import itertools
import json
import time

import pytest
import requests

from jupyter_vgpu import channel, contracts
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.server_process import JupyterServer
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
SLICE = Slice(
    "GPU-sim-0",
    0,
    "NVIDIA H100 80GB HBM3 (simulated)",
    80 * GiB,
    6 * GiB,
    30,
    simulated=True,
    memory_request=2 * GiB,
    priority=70,
)


def start_server(root, sample_seconds: float) -> JupyterServer:
    """A server of :data:`SLICE` in ``root`` (no Hub), sampling every ``sample_seconds``."""
    return JupyterServer(
        root,
        {"JUPYTER_VGPU_SLICE": SLICE.to_json(), "JUPYTERHUB_API_URL": ""},
        args=[
            f"--VGPUServer.channel_dir={root / 'channel'}",
            f"--VGPUServer.sample_seconds={sample_seconds}",
        ],
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("server"), 0.2)
    yield s
    s.stop()


@pytest.fixture
def kernel(server):
    kid = server.request("POST", "api/kernels", json={"name": "python3"}).json()["id"]
    yield kid
    server.request("DELETE", f"api/kernels/{kid}")


def kernel_row(server, kid):
    doc = server.get("api/vgpu/usage").json()
    return next((k for k in doc["kernels"] if k["id"] == kid), None)


def test_usage_carries_the_slice_follows_its_contract_and_the_channel_is_published(server):
    doc = server.get("api/vgpu/usage").json()
    contracts.validate("usage", doc)
    assert doc["version"] == contracts.version("usage")
    assert Slice.from_dict(doc["slice"]) == SLICE
    assert doc["simulated"] is True
    assert doc["gpu"]["memory_total"] == 80 * GiB
    published = channel.read_json(channel.server_path(server.root / "channel"))
    assert Slice.from_dict(published["slice"]) == SLICE


def test_status_is_gone_usage_is_the_one_document(server):
    assert server.get("api/vgpu/status").status_code == 404


def test_kernels_report_their_usage(server, kernel):
    row = wait_for(
        lambda: (k := kernel_row(server, kernel)) and k["reported"] and k,
        60,
        f"kernel {kernel} to report to the server",
    )
    assert row["pid"] > 0
    assert row["used"] == 0
    assert row["report_error"] is None
    assert "torch not imported" in row["budget_status"]
    for optional in ("state", "host_bytes", "last_pause_seconds", "last_resume_seconds", "codec"):
        assert optional in row
    report = channel.read_json(channel.kernel_path(server.root / "channel", kernel))
    contracts.validate("kernel-report", report)
    assert report["budget"] == 6 * GiB
    contracts.validate("usage", server.get("api/vgpu/usage").json())


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        ({"torch_reserved": 10**400}, "torch_reserved: must be at most"),
        ({"torch_allocated": "lots"}, "torch_allocated: must be an integer"),
        ({"updated": float("nan")}, "updated: must be a number"),
        ({"pid": None}, "pid: must be an integer"),
        ({"surprise": 1}, "unknown field"),
    ],
)
def test_a_report_that_breaks_its_contract_is_refused_with_the_reason(server, kernel, damage, reason):
    path = channel.kernel_path(server.root / "channel", kernel)
    wait_for(lambda: channel.read_json(path), 60, f"kernel {kernel}'s first report")

    def refused():
        # the kernel rewrites its report every second: write ours until a sample sees it
        good = channel.read_json(path) or {}
        if "surprise" in good or good.get("pid") is None:
            good = {}
        channel.write_json(path, {**good, **damage})
        row = kernel_row(server, kernel)
        return row if row and row["report_error"] else None

    row = wait_for(refused, 30, f"a sample that refuses kernel {kernel}'s damaged report")
    assert reason in row["report_error"]
    assert row["reported"] is False
    assert row["used"] == 0
    contracts.validate("usage", server.get("api/vgpu/usage").json())


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
    contracts.validate("usage", events[1])


def test_between_slow_samples_the_stream_says_it_is_alive(tmp_path):
    """With samples 30 s apart, the stream still writes within the panel's 10 s of
    silence (``silentSeconds`` in labextension/src/model.ts): a comment line, which SSE
    readers skip, so that the panel tells a slow sampling period from a stopped server."""
    slow = start_server(tmp_path, 30)
    try:
        lines = []  # (monotonic seconds, line) of the first three non-empty lines
        # a read that waits 12 s fails the test (requests' ReadTimeout): the panel would
        # have dropped the stream after 10
        url, headers = f"{slow.url}/api/vgpu/usage/stream", {"Authorization": f"token {slow.token}"}
        with requests.get(url, headers=headers, stream=True, timeout=(10, 12)) as r:
            for line in r.iter_lines(decode_unicode=True):
                if line:
                    lines.append((time.monotonic(), line))
                if len(lines) == 3:
                    break
    finally:
        slow.stop()
    texts = [text for _, text in lines]
    assert texts[0].startswith("data: "), texts
    assert texts[1:] == [": alive", ": alive"], texts
    gaps = [b - a for (a, _), (b, _) in itertools.pairwise(lines)]
    assert max(gaps) < 10, gaps


def test_unauthenticated_requests_are_refused(server):
    for path in ("api/vgpu/usage", "api/vgpu/usage/stream"):
        assert requests.get(f"{server.url}/{path}", timeout=10).status_code == 403
