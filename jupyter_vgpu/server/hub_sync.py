"""Following the Hub: the server polls its own slice, so quota changes reach kernels live."""

from __future__ import annotations

import json
import logging
import os
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

from jupyter_vgpu.slice import Slice, SliceError

from .state import ServerState

log = logging.getLogger("jupyter_vgpu")


class HubSync:
    """Polls ``GET {JUPYTERHUB_API_URL}/vgpu/slices/users/{user}`` with the server's token.

    Created only under JupyterHub (``JUPYTERHUB_API_URL``, ``JUPYTERHUB_API_TOKEN`` and
    ``JUPYTERHUB_USER`` set). Never blocks the event loop.
    """

    def __init__(self, state: ServerState, environ=None):
        environ = os.environ if environ is None else environ
        self.state = state
        api = environ["JUPYTERHUB_API_URL"].rstrip("/")
        self.url = f"{api}/vgpu/slices/users/{quote(environ['JUPYTERHUB_USER'])}"
        self.token = environ["JUPYTERHUB_API_TOKEN"]
        self.server_name = environ.get("JUPYTERHUB_SERVER_NAME", "")
        self._warned = False

    @classmethod
    def from_env(cls, state: ServerState, environ=None) -> HubSync | None:
        environ = os.environ if environ is None else environ
        if all(environ.get(k) for k in ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER")):
            return cls(state, environ)
        return None

    async def poll(self) -> None:
        """One poll: adopt this server's slice from the Hub's answer if it changed."""
        try:
            response = await AsyncHTTPClient().fetch(
                self.url, headers={"Authorization": f"token {self.token}"}, request_timeout=10
            )
        except (HTTPClientError, OSError) as e:
            if not self._warned:
                log.warning("jupyter-vgpu: cannot read this server's slice from the Hub: %s", e)
                self._warned = True
            return
        self._warned = False
        try:
            slices = json.loads(response.body)
            mine = next(s for s in slices if s.get("server_name", "") == self.server_name)
            new = Slice.from_dict(mine["slice"])
        except StopIteration:
            return  # the Hub no longer lists us (stopping): keep the last slice
        except (ValueError, KeyError, TypeError, SliceError) as e:
            log.error("jupyter-vgpu: the Hub sent an unusable slice: %s", e)
            return
        self.state.update(slice_=new)
