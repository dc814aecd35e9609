"""The server and the Hub: following its slices, reporting usage, against a stand-in Hub."""

import asyncio
import json
import logging
import threading

import pytest
from tornado import web
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from jupyter_vgpu import channel, contracts
from jupyter_vgpu.server.hub_report import HubReport
from jupyter_vgpu.server.hub_sync import HubSync, find_slice
from jupyter_vgpu.server.state import ServerState
from jupyter_vgpu.slice import Slice, SliceError
from jupyter_vgpu.testing.documents import usage
from jupyter_vgpu.testing.server_process import JupyterServer
from jupyter_vgpu.testing.waiting import wait_for

GiB = 2**30
TOKEN = "server-token"
SLICE = Slice("GPU-sim-0", 0, "NVIDIA H100 80GB HBM3 (simulated)", 80 * GiB, 6 * GiB, 30, simulated=True)


class StandInHub:
    """``GET /hub/api/vgpu/slices/users/alice`` served from a thread; ``document`` is
    what it answers, ``status`` its HTTP status; a wrong token gets 403.
    ``POST /hub/api/vgpu/usage/users/alice`` bodies are kept in ``reports`` (or
    answered with ``report_status`` when that is not 200)."""

    def __init__(self):
        self.document: object = []
        self.status = 200
        self.requests = 0
        self.reports: list[dict] = []
        self.report_status = 200
        hub = self

        class Usage(web.RequestHandler):
            def post(self, user):
                if self.request.headers.get("Authorization") != f"token {TOKEN}" or user != "alice":
                    raise web.HTTPError(403)
                if hub.report_status != 200:
                    raise web.HTTPError(hub.report_status)
                hub.reports.append(json.loads(self.request.body))

        class Slices(web.RequestHandler):
            def get(self, user):
                hub.requests += 1
                if self.request.headers.get("Authorization") != f"token {TOKEN}" or user != "alice":
                    raise web.HTTPError(403)
                if hub.status != 200:
                    raise web.HTTPError(hub.status)
                self.write(json.dumps(hub.document))

        sock, self.port = bind_unused_port()
        self.api_url = f"http://127.0.0.1:{self.port}/hub/api"
        started = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            app = web.Application(
                [
                    (r"/hub/api/vgpu/slices/users/([^/]+)", Slices),
                    (r"/hub/api/vgpu/usage/users/([^/]+)", Usage),
                ]
            )
            server = HTTPServer(app)
            server.add_sockets([sock])
            started.set()
            self.loop.run_forever()
            server.stop()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        started.wait()

    def serve_slices(self, *slices_by_server: tuple[str, Slice], wrapped: bool = False) -> None:
        models = [{"user": "alice", "server_name": n, "slice": s.to_dict()} for n, s in slices_by_server]
        self.document = {"slices": models} if wrapped else models

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


@pytest.fixture
def hub():
    h = StandInHub()
    yield h
    h.close()


def env_for(hub: StandInHub, token: str = TOKEN, server_name: str = "") -> dict[str, str]:
    return {
        "JUPYTERHUB_API_URL": hub.api_url,
        "JUPYTERHUB_API_TOKEN": token,
        "JUPYTERHUB_USER": "alice",
        "JUPYTERHUB_SERVER_NAME": server_name,
    }


def published(directory) -> Slice | None:
    doc = channel.read_json(channel.server_path(directory))
    return Slice.from_dict(doc["slice"]) if doc and doc["slice"] else None


@pytest.mark.asyncio
async def test_a_changed_slice_is_published_for_the_kernels(hub, tmp_path):
    state = ServerState(tmp_path, SLICE)
    sync = HubSync.from_env(state, env_for(hub, server_name="gpu"))
    bigger = SLICE.replace(memory_limit=12 * GiB)
    hub.serve_slices(("", SLICE.replace(memory_limit=1 * GiB)), ("gpu", bigger))
    await sync.poll()
    assert published(tmp_path) == bigger
    hub.serve_slices(("gpu", SLICE), wrapped=True)
    await sync.poll()
    assert published(tmp_path) == SLICE


@pytest.mark.asyncio
async def test_refusals_and_bad_answers_keep_the_last_slice_and_say_why(hub, tmp_path, caplog):
    state = ServerState(tmp_path, SLICE)
    hub.serve_slices(("", SLICE.replace(memory_limit=1 * GiB)))
    with caplog.at_level(logging.WARNING, logger="jupyter_vgpu"):
        await HubSync.from_env(state, env_for(hub, token="wrong")).poll()
        assert "403" in caplog.text
        assert "read:users" in caplog.text
        hub.status = 404
        await HubSync.from_env(state, env_for(hub)).poll()
        assert "404" in caplog.text
        hub.status = 200
        hub.document = [{"server_name": "", "slice": {"gpu_uuid": "GPU-sim-0"}}]
        await HubSync.from_env(state, env_for(hub)).poll()
        assert "unusable slice" in caplog.text
        assert "missing field(s)" in caplog.text
        hub.document = [{"server_name": "", "slice": {**SLICE.to_dict(), "memory_limit": 10**400}}]
        await HubSync.from_env(state, env_for(hub)).poll()
        assert "slice.memory_limit: must be at most" in caplog.text
    assert published(tmp_path) == SLICE
    assert hub.requests == 4


def test_find_slice_accepts_both_forms_and_refuses_others():
    models = [{"server_name": "", "slice": SLICE.to_dict()}]
    assert find_slice(models, "") == SLICE
    assert find_slice({"slices": models}, "") == SLICE
    assert find_slice(models, "other") is None
    with pytest.raises(TypeError):
        find_slice("nope", "")
    with pytest.raises(ValueError, match=r"slice\.memory_limit: must be at least 1"):
        find_slice([{"server_name": "", "slice": {"memory_limit": -1}}], "")
    with pytest.raises(SliceError, match="must not exceed memory_limit"):
        find_slice([{"server_name": "", "slice": {**SLICE.to_dict(), "memory_request": 7 * GiB}}], "")


def test_no_hub_sync_outside_jupyterhub(tmp_path):
    assert HubSync.from_env(ServerState(tmp_path, None), {}) is None


def test_a_quota_change_on_the_hub_reaches_a_running_kernel(hub, tmp_path):
    hub.serve_slices(("", SLICE))
    server = JupyterServer(
        tmp_path / "server",
        {"JUPYTER_VGPU_SLICE": SLICE.to_json(), **env_for(hub)},
        args=[f"--VGPUServer.channel_dir={tmp_path / 'channel'}", "--VGPUServer.hub_poll_seconds=0.5"],
    )
    try:
        kid = server.request("POST", "api/kernels", json={"name": "python3"}).json()["id"]
        report = channel.kernel_path(tmp_path / "channel", kid)

        def budget():
            return (channel.read_json(report) or {}).get("budget")

        wait_for(lambda: budget() == 6 * GiB, 60, "the kernel to report its 6 GiB budget")
        hub.serve_slices(("", SLICE.replace(memory_limit=3 * GiB)))
        # the bound for a quota change to reach kernels
        wait_for(
            lambda: budget() == 3 * GiB, 5, "the kernel to adopt the Hub's new 3 GiB budget", interval=0.1
        )
        assert server.get("api/vgpu/usage").json()["slice"]["memory_limit"] == 3 * GiB
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_usage_reports_reach_the_hub_and_a_missing_endpoint_is_tolerated(hub, caplog):
    document = usage(SLICE, totals={"used": 5})

    async def source():
        return document

    reporter = HubReport.from_env(source, environ=env_for(hub, server_name="gpu"))
    assert await reporter.report()
    assert hub.reports == [{"server_name": "gpu", "usage": document}]
    hub.report_status = 404
    with caplog.at_level(logging.WARNING, logger="jupyter_vgpu"):
        assert not await reporter.report()
        assert not await reporter.report()
    assert caplog.text.count("no usage endpoint") == 1
    assert not await HubReport.from_env(source, environ=env_for(hub, token="wrong")).report()
    assert len(hub.reports) == 1


def test_a_running_server_reports_its_kernels_to_the_hub(hub, tmp_path):
    hub.serve_slices(("", SLICE))
    server = JupyterServer(
        tmp_path / "server",
        {"JUPYTER_VGPU_SLICE": SLICE.to_json(), **env_for(hub)},
        args=[f"--VGPUServer.channel_dir={tmp_path / 'channel'}", "--VGPUServer.hub_report_seconds=0.5"],
    )
    try:
        kid = server.request("POST", "api/kernels", json={"name": "python3"}).json()["id"]

        def reported_kernel():
            for r in reversed(hub.reports):
                for k in r["usage"]["kernels"]:
                    if k["id"] == kid and k["pid"]:
                        return r
            return None

        report = wait_for(reported_kernel, 60, f"a usage report to the Hub listing kernel {kid}")
        assert report["server_name"] == ""
        contracts.validate("usage-report", report)
        assert Slice.from_dict(report["usage"]["slice"]) == SLICE
    finally:
        server.stop()
