"""Demo logins: any user name, one shared password; ``admin`` is the admin."""

from __future__ import annotations

import hmac

from jupyterhub.auth import Authenticator
from traitlets import Unicode


class DemoAuthenticator(Authenticator):
    """Lets anyone log in under any name with one shared password (demos and tests only).

    JupyterHub's ``SharedPasswordAuthenticator`` would need a second, 32-character
    password for admins; a demo wants one password for everyone.
    """

    password = Unicode(
        help="The shared password. Set it from JUPYTER_VGPU_DEMO_PASSWORD in the demo config."
    ).tag(config=True)

    async def authenticate(self, handler, data):
        if self.password and hmac.compare_digest(data.get("password", ""), self.password):
            return data["username"]
        return None
