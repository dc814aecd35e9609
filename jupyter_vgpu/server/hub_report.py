"""Reporting usage to the Hub, so its admin view and metrics see every server's kernels."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

log = logging.getLogger("jupyter_vgpu")

#: Default target, relative to ``JUPYTERHUB_API_URL``; ``{user}`` is URL-quoted.
DEFAULT_URL = "{api_url}/vgpu/usage/users/{user}"


class HubReport:
    """POSTs this server's usage document to the Hub with the server's own token.

    The body is ``{"server_name": str, "usage": <the /api/vgpu/usage document>}``
    (JSON). Created only under JupyterHub (``JUPYTERHUB_API_URL``,
    ``JUPYTERHUB_API_TOKEN`` and ``JUPYTERHUB_USER`` set). A Hub without the
    endpoint (404) or refusing it is logged once until a report succeeds; the server
    carries on either way.

    Args:
        source: coroutine function returning the current usage document.
        url_template: the target URL; ``{api_url}`` and ``{user}`` are filled in.
        environ: the environment to read (default ``os.environ``).
    """

    def __init__(
        self,
        source: Callable[[], Awaitable[dict[str, Any]]],
        url_template: str = DEFAULT_URL,
        environ=None,
    ):
        environ = os.environ if environ is None else environ
        self.source = source
        self.url = (url_template or DEFAULT_URL).format(
            api_url=environ["JUPYTERHUB_API_URL"].rstrip("/"), user=quote(environ["JUPYTERHUB_USER"], safe="")
        )
        self.token = environ["JUPYTERHUB_API_TOKEN"]
        self.server_name = environ.get("JUPYTERHUB_SERVER_NAME", "")
        self.sent = 0
        self._warned = False

    @classmethod
    def from_env(cls, source, url_template: str = DEFAULT_URL, environ=None) -> HubReport | None:
        """A reporter when running under JupyterHub, else None."""
        environ = os.environ if environ is None else environ
        if all(environ.get(k) for k in ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER")):
            return cls(source, url_template, environ)
        return None

    async def report(self) -> bool:
        """Send one report; True when the Hub accepted it (2xx)."""
        body = json.dumps({"server_name": self.server_name, "usage": await self.source()})
        try:
            await AsyncHTTPClient().fetch(
                self.url,
                method="POST",
                body=body,
                headers={"Authorization": f"token {self.token}", "Content-Type": "application/json"},
                request_timeout=10,
            )
        except HTTPClientError as e:
            if e.code == 404:
                self._warn(f"the Hub has no usage endpoint at {self.url} (404); usage stays local")
            else:
                self._warn(f"the Hub refused the usage report to {self.url}: {e}")
            return False
        except OSError as e:
            self._warn(f"the Hub at {self.url} cannot be reached: {e}")
            return False
        self._warned = False
        self.sent += 1
        return True

    def _warn(self, message: str) -> None:
        if not self._warned:
            log.warning("jupyter-vgpu: %s", message)
            self._warned = True
