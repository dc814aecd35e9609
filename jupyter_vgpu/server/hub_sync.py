"""Following the Hub: the server polls its own slice, so quota changes reach kernels live."""

from __future__ import annotations

import logging

from jupyter_vgpu import contracts
from jupyter_vgpu.slice import Slice

from .hub_client import HubClient, HubError
from .state import ServerState

log = logging.getLogger("jupyter_vgpu")

#: This server's slices at the Hub, relative to ``JUPYTERHUB_API_URL``.
SLICES_URL = "{api_url}/vgpu/slices/users/{user}"


class HubSync:
    """Polls ``GET {JUPYTERHUB_API_URL}/vgpu/slices/users/{user}`` with the server's token.

    Args:
        state: the server's slice state, updated when the Hub's slice changes.
        client: the Hub client.
    """

    def __init__(self, state: ServerState, client: HubClient):
        self.state = state
        self.client = client
        self.url = client.url(SLICES_URL)

    @classmethod
    def from_env(cls, state: ServerState, environ=None) -> HubSync | None:
        """A poller when running under JupyterHub, else None."""
        client = HubClient.from_env(environ)
        return None if client is None else cls(state, client)

    async def poll(self) -> None:
        """One poll: adopt this server's slice from the Hub's answer if it changed.

        The answer is a JSON list of the user's running slices (or ``{"slices": [...]}``),
        each ``{"server_name": str, "slice": <the contract "slice">, ...}``; the slice is
        checked against its contract. A failed request is logged once until a poll
        succeeds again; the last slice stays in force.
        """
        try:
            document = await self.client.request("GET", self.url)
        except HubError as e:
            self.client.warn_once("sync", self._explain(e))
            return
        self.client.recovered("sync")
        try:
            new = find_slice(document, self.client.server_name)
        except (ValueError, KeyError, TypeError) as e:
            log.error("jupyter-vgpu: the Hub sent an unusable slice: %s", e)
            return
        if new is not None:  # None: the Hub no longer lists us (stopping); keep the last slice
            self.state.update(slice_=new)

    def _explain(self, e: HubError) -> str:
        if e.code == 403:
            return (
                f"the Hub refused {self.url} (403): this server's token lacks read:users "
                "for its own user; quota changes will not reach running kernels"
            )
        if e.code == 404:
            return f"the Hub has no vGPU slices endpoint at {self.url} (404): is hub_spawner installed?"
        return f"cannot read this server's slice from the Hub: {e}"


def find_slice(document, server_name: str) -> Slice | None:
    """This server's slice in the Hub's answer, or None when the answer does not list it.

    Args:
        document: the decoded JSON: a list of slice models, or ``{"slices": [...]}``.
        server_name: ``JUPYTERHUB_SERVER_NAME`` ("" for the default server).

    Raises:
        jupyter_vgpu.contracts.ContractError: the matching entry's slice breaks the
            contract ``slice`` (a ``ValueError``).
        jupyter_vgpu.slice.SliceError: it breaks a rule across fields (a request above
            the limit).
        TypeError: the document has neither form.
    """
    if isinstance(document, dict) and "slices" in document:
        document = document["slices"]
    if not isinstance(document, list):
        raise TypeError(f"expected a list of slices, got {type(document).__name__}")
    for entry in document:
        if isinstance(entry, dict) and (entry.get("server_name") or "") == server_name:
            contracts.validate("slice", entry["slice"], field="slice")
            return Slice.from_dict(entry["slice"])
    return None
