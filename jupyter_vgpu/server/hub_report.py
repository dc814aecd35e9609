"""Reporting usage to the Hub, so its admin view and metrics see every server's kernels."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from .hub_client import HubClient, HubError

#: Default target, relative to ``JUPYTERHUB_API_URL``; ``{user}`` is URL-quoted.
DEFAULT_URL = "{api_url}/vgpu/usage/users/{user}"


class HubReport:
    """POSTs this server's usage document to the Hub with the server's own token.

    The body is the contract ``usage-report``: ``{"server_name": str, "usage": <the
    /api/vgpu/usage document>}``. A Hub without the endpoint (404) or refusing it is
    logged once until a report succeeds; the server carries on either way.

    Args:
        source: coroutine function returning the current usage document.
        client: the Hub client.
        url_template: the target URL; ``{api_url}`` and ``{user}`` are filled in.
    """

    def __init__(
        self,
        source: Callable[[], Awaitable[dict[str, Any]]],
        client: HubClient,
        url_template: str = DEFAULT_URL,
    ):
        self.source = source
        self.client = client
        self.url = client.url(url_template or DEFAULT_URL)
        self.sent = 0

    @classmethod
    def from_env(cls, source, url_template: str = DEFAULT_URL, environ=None) -> HubReport | None:
        """A reporter when running under JupyterHub, else None."""
        client = HubClient.from_env(environ)
        return None if client is None else cls(source, client, url_template)

    async def report(self) -> bool:
        """Send one report; True when the Hub accepted it (2xx)."""
        body = {"server_name": self.client.server_name, "usage": await self.source()}
        try:
            await self.client.request("POST", self.url, body)
        except HubError as e:
            if e.code == 404:
                self.client.warn_once(
                    "report", f"the Hub has no usage endpoint at {self.url} (404); usage stays local"
                )
            else:
                self.client.warn_once("report", f"the Hub refused the usage report: {e}")
            return False
        self.client.recovered("report")
        self.sent += 1
        return True
