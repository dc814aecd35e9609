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
        """One poll: adopt this server's slice from the Hub's answer if it changed.

        The answer is a JSON list of the user's running slices (or ``{"slices": [...]}``),
        each ``{"server_name": str, "slice": <Slice dict>, ...}``. A failed request is
        logged once until a poll succeeds again; the last slice stays in force.
        """
        try:
            response = await AsyncHTTPClient().fetch(
                self.url, headers={"Authorization": f"token {self.token}"}, request_timeout=10
            )
        except HTTPClientError as e:
            self._warn(self._explain(e))
            return
        except OSError as e:
            self._warn(f"the Hub at {self.url} cannot be reached: {e}")
            return
        self._warned = False
        try:
            new = find_slice(json.loads(response.body), self.server_name)
        except (ValueError, KeyError, TypeError, SliceError) as e:
            log.error("jupyter-vgpu: the Hub sent an unusable slice: %s", e)
            return
        if new is not None:  # None: the Hub no longer lists us (stopping); keep the last slice
            self.state.update(slice_=new)

    def _explain(self, e: HTTPClientError) -> str:
        if e.code == 403:
            return (
                f"the Hub refused {self.url} (403): this server's token lacks read:users "
                "for its own user; quota changes will not reach running kernels"
            )
        if e.code == 404:
            return f"the Hub has no vGPU slices endpoint at {self.url} (404): is hub_spawner installed?"
        return f"cannot read this server's slice from the Hub: {e}"

    def _warn(self, message: str) -> None:
        if not self._warned:
            log.warning("jupyter-vgpu: %s", message)
            self._warned = True


def find_slice(document, server_name: str) -> Slice | None:
    """This server's slice in the Hub's answer, or None when the answer does not list it.

    Args:
        document: the decoded JSON: a list of slice models, or ``{"slices": [...]}``.
        server_name: ``JUPYTERHUB_SERVER_NAME`` ("" for the default server).

    Raises:
        SliceError: the matching entry's slice is malformed.
        TypeError: the document has neither form.
    """
    if isinstance(document, dict) and "slices" in document:
        document = document["slices"]
    if not isinstance(document, list):
        raise TypeError(f"expected a list of slices, got {type(document).__name__}")
    for entry in document:
        if isinstance(entry, dict) and (entry.get("server_name") or "") == server_name:
            return Slice.from_dict(entry["slice"])
    return None
