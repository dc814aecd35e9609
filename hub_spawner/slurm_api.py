"""``POST /hub/api/batchspawner``: a Slurm job's server says which port it listens on.

batchspawner's ``batchspawner-singleuser`` picks a free port on the node and POSTs
``{"port": <port>}`` here with the server's token before it starts the server; the Hub
then connects to the node's address on that port. batchspawner's own handler sets
*every* attribute the body names on the spawner the token belongs to, and that token is
in the user's server's environment, readable by the user: with it a user could set the
spawner's ``exec_prefix`` (the command prefix the Hub runs ``squeue`` and ``scancel``
with, as the Hub's account) or its slice. :func:`hub_spawner.setup_slurm` puts this
handler in its place: the port and nothing else, once per start, from the server's own
token.
"""

from __future__ import annotations

from jupyterhub.apihandlers.base import APIHandler
from tornado import web

#: The path, relative to the Hub's prefix (batchspawner-singleuser posts to it).
PATH = r"/api/batchspawner"


class JobPortHandler(APIHandler):
    """``POST /hub/api/batchspawner`` with ``{"port": 1-65535}``: 201; anything else in
    the body 400; a token that is no server's 403; a port already known 409."""

    @web.authenticated
    def post(self):
        token = self.get_auth_token()
        user = self.current_user
        spawners = getattr(user, "spawners", {}) or {}
        spawner = next(
            (s for s in spawners.values() if token and getattr(s, "api_token", None) == token), None
        )
        if spawner is None:
            raise web.HTTPError(403, "Only a server's own token may say the server's port")
        body = self.get_json_body()
        if not isinstance(body, dict) or set(body) != {"port"}:
            raise web.HTTPError(400, 'The body must be {"port": <1-65535>} and nothing else')
        port = body["port"]
        if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
            raise web.HTTPError(400, f"port must be an integer from 1 to 65535, not {port!r}")
        if spawner.port:
            raise web.HTTPError(409, f"The server's port is known already ({spawner.port})")
        spawner.port = port
        self.set_status(201)
        self.finish({"message": f"port {port} recorded"})


def replace_batchspawners_handler() -> list[tuple[str, type]]:
    """Take batchspawner's handler out of JupyterHub's API handlers (importing batchspawner
    adds it) and return ours, for ``JupyterHub.extra_handlers``."""
    import batchspawner.api  # noqa: F401 - adds its handler; taken out below
    from jupyterhub import apihandlers

    apihandlers.default_handlers[:] = [h for h in apihandlers.default_handlers if h[0] != PATH]
    return [(PATH, JobPortHandler)]
