"""REST and streaming endpoints of the server extension, under ``/api/vgpu``.

- ``GET /api/vgpu/usage``: the usage document (contract ``usage``: the slice, the GPU,
  per-kernel usage and totals; see :mod:`jupyter_vgpu.server.sampler`).
- ``GET /api/vgpu/usage/stream``: the same documents as Server-Sent Events, one
  ``data: <document>`` per sample, for the JupyterLab panel; between two samples, a
  comment line (``: alive``) at least every :data:`HEARTBEAT_SECONDS`, so that a reader
  can tell a slow sampling period from a server that stopped answering.
- ``POST /api/vgpu/kernels/<kernel id>/prefetch``: the user started working in the
  kernel's notebook (opened, focused or edited it): a paused or suspended kernel comes
  back ahead of the cell where the card has room (the node arbiter decides). 202 when
  passed on; 404 for a kernel this server does not run; 429 within
  :data:`PREFETCH_EVERY` seconds of the last for the same kernel.

Authenticated and authorised like every jupyter_server API: the token in the
``Authorization`` header, or the session cookie with its XSRF header (what JupyterLab
sends; the panel reads the stream with ``fetch``, so no credential travels in a URL).
"""

from __future__ import annotations

import asyncio
import json
import time

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


#: Seconds between two writes of the usage stream at most: a sample, or a comment line
#: where no new sample is due (``sample_seconds`` may be longer). The panel takes a
#: stream silent for 10 s for a server that stopped answering (``labextension/src/model.ts``).
HEARTBEAT_SECONDS = 4.0


class UsageStreamHandler(VGPUHandler):
    @web.authenticated
    @authorized
    async def get(self):
        self.set_header("Content-Type", "text/event-stream")
        self.set_header("Cache-Control", "no-cache")
        self.set_header("X-Accel-Buffering", "no")
        sent = None
        try:
            while True:
                document = await self.sampler.current()
                if document is sent:  # no new sample yet: a comment, which readers skip
                    self.write(": alive\n\n")
                else:
                    self.write(f"data: {json.dumps(document)}\n\n")
                    sent = document
                await self.flush()
                await asyncio.sleep(min(self.sampler.config.sample_seconds, HEARTBEAT_SECONDS))
        except StreamClosedError:
            return


#: A kernel id in a URL, as jupyter_server's kernel handlers match it.
KERNEL_ID = r"(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)"

#: Seconds between two prefetch requests the server passes on for one kernel (the
#: node arbiter has its own limit per user: ``ArbiterApp.prefetch_interval``).
PREFETCH_EVERY = 2.0


class PrefetchHandler(VGPUHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str):
        if kernel_id not in self.kernel_manager:
            raise web.HTTPError(404, f"this server runs no kernel {kernel_id}")
        state = self.sampler.state
        since = time.time() - state.prefetches.get(kernel_id, 0.0)
        if since < PREFETCH_EVERY:
            self.set_status(429)
            self.set_header("Retry-After", str(int(PREFETCH_EVERY - since) + 1))
            self.finish(json.dumps({"message": f"one prefetch per {PREFETCH_EVERY:g} s per kernel"}))
            return
        state.prefetch(kernel_id)
        self.set_status(202)
        self.finish(json.dumps({"kernel_id": kernel_id, "prefetch": "asked"}))


def handlers(base_url: str, sampler: Sampler) -> list[tuple]:
    """Tornado handler specs for the extension's endpoints under ``base_url``."""
    kwargs = {"sampler": sampler}
    return [
        (url_path_join(base_url, "api/vgpu/usage"), UsageHandler, kwargs),
        (url_path_join(base_url, "api/vgpu/usage/stream"), UsageStreamHandler, kwargs),
        (url_path_join(base_url, f"api/vgpu/kernels/{KERNEL_ID}/prefetch"), PrefetchHandler, kwargs),
    ]
