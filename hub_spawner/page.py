"""The admin page ``/hub/vgpu``: every GPU and MIG instance, its slices, limits and
requests against usage, overcommit, and why a GPU takes no slice (NVML failures).

Rendered with the Hub's own templates (``templates/vgpu.html`` extends the Hub's
``page.html``); ``templates/page.html`` adds a "vGPU" link to the Hub's navigation bar
for whoever may open the admin page.
"""

from __future__ import annotations

from jupyterhub.handlers.base import BaseHandler
from jupyterhub.scopes import Scope
from tornado import web

from jupyter_vgpu.units import format_bytes

from .config import VGPUHub


class VGPUPageHandler(BaseHandler):
    """``GET /hub/vgpu`` (admins: ``read:users`` on every user)."""

    @web.authenticated
    async def get(self):
        if self.parsed_scopes.get("read:users") != Scope.ALL:
            raise web.HTTPError(
                403, "The vGPU overview is for hub admins (it needs read:users on every user)."
            )
        hub = VGPUHub.instance(config=self.settings["config"])
        _, gpus = hub.snapshot(self.users)
        html = await self.render_template(
            "vgpu.html",
            gpus=gpus,
            problems=hub.problems,
            placement=hub.placement,
            overcommit_ratio=hub.overcommit_ratio,
            isolation=hub.isolation,
            size=format_bytes,
        )
        self.finish(html)
