"""The single-user server's one client of the Hub's vGPU API.

Both conversations with the Hub go through it: following this server's slice
(:mod:`jupyter_vgpu.server.hub_sync`) and reporting its usage
(:mod:`jupyter_vgpu.server.hub_report`). It reads JupyterHub's environment once, sends
the server's own token, never blocks the event loop, and logs a failing request once
until a request succeeds again.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError

log = logging.getLogger("jupyter_vgpu")

#: The environment JupyterHub gives every server it spawns.
REQUIRED = ("JUPYTERHUB_API_URL", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_USER")


class HubError(Exception):
    """A request to the Hub failed; ``code`` is the HTTP status, or None when the Hub
    could not be reached."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code


class HubClient:
    """Talks to ``JUPYTERHUB_API_URL`` with ``JUPYTERHUB_API_TOKEN`` on behalf of
    ``JUPYTERHUB_USER``'s server ``JUPYTERHUB_SERVER_NAME``.

    Attributes:
        api_url: the Hub's API root, without a trailing slash.
        user: the server's user name.
        server_name: the server's name ("" for the default server).
    """

    def __init__(self, environ: Mapping[str, str]):
        self.api_url = environ["JUPYTERHUB_API_URL"].rstrip("/")
        self.user = environ["JUPYTERHUB_USER"]
        self.server_name = environ.get("JUPYTERHUB_SERVER_NAME", "")
        self._token = environ["JUPYTERHUB_API_TOKEN"]
        self._warned: set[str] = set()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> HubClient | None:
        """A client when running under JupyterHub (its variables set), else None."""
        environ = os.environ if environ is None else environ
        if all(environ.get(k) for k in REQUIRED):
            return cls(environ)
        return None

    def url(self, template: str) -> str:
        """``template`` with ``{api_url}`` and ``{user}`` (URL-quoted) filled in."""
        return template.format(api_url=self.api_url, user=quote(self.user, safe=""))

    async def request(self, method: str, url: str, body: Any = None) -> Any:
        """One JSON request to the Hub; the decoded answer (None for an empty one).

        Raises:
            HubError: the Hub refused (``code`` set) or could not be reached; the
                message says which.
        """
        headers = {"Authorization": f"token {self._token}"}
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        try:
            response = await AsyncHTTPClient().fetch(
                url, method=method, body=data, headers=headers, request_timeout=10
            )
        except HTTPClientError as e:
            message = e.message
            if e.response is not None and e.response.body:
                try:
                    message = json.loads(e.response.body).get("message") or message
                except (ValueError, AttributeError):
                    pass
            raise HubError(f"the Hub answered {method} {url} with {e.code}: {message}", e.code) from None
        except OSError as e:
            raise HubError(f"the Hub at {url} cannot be reached: {e}") from None
        return json.loads(response.body) if response.body else None

    def warn_once(self, topic: str, message: str) -> None:
        """Log ``message`` once per ``topic`` until :meth:`recovered` is called for it."""
        if topic not in self._warned:
            log.warning("jupyter-vgpu: %s", message)
            self._warned.add(topic)

    def recovered(self, topic: str) -> None:
        """``topic`` works again: its next failure is logged."""
        self._warned.discard(topic)
