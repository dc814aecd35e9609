"""REST and streaming endpoints of the server extension, under ``/api/vgpu``.

- ``GET /api/vgpu/usage``: the usage document (contract ``usage``: the slice, the GPU,
  per-kernel usage and totals; see :mod:`jupyter_vgpu.server.sampler`).
- ``GET /api/vgpu/usage/stream``: the same documents as Server-Sent Events, one
  ``data: <document>`` per sample, for the JupyterLab panel.

Authenticated and authorised like every jupyter_server API: the token in the
``Authorization`` header, or the session cookie with its XSRF header (what JupyterLab
sends; the panel reads the stream with ``fetch``, so no credential travels in a URL).
"""

from __future__ import annotations

import asyncio
import json

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web
from tornado.iostream import StreamClosedError

from .sampler import Sampler

AUTH_RESOURCE = "vgpu"


class VGPUHandler(APIHandler):
    auth_resource = AUTH_RESOURCE

    def initialize(self, sampler: Sampler):
        self.sampler = sampler


class UsageHandler(VGPUHandler):
    @web.authenticated
    @authorized
    async def get(self):
        self.finish(json.dumps(await self.sampler.current()))


class UsageStreamHandler(VGPUHandler):
    @web.authenticated
    @authorized
    async def get(self):
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        try:
            while True:
                document = await self.sampler.current()
                self.write(f"data: {json.dumps(document)}\n\n")
                await self.flush()
                await asyncio.sleep(self.sampler.config.sample_seconds)
        except StreamClosedError:
            return


def handlers(base_url: str, sampler: Sampler) -> list[tuple]:
    """Tornado handler specs for the extension's endpoints under ``base_url``."""
    kwargs = {"sampler": sampler}
    return [
        (url_path_join(base_url, "api/vgpu/usage"), UsageHandler, kwargs),
        (url_path_join(base_url, "api/vgpu/usage/stream"), UsageStreamHandler, kwargs),
    ]
