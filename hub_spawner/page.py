"""The admin page ``/hub/vgpu``: every GPU and MIG instance, its slices, limits and
requests against usage, overcommit, why a GPU takes no slice (NVML failures), every
node whose arbiter reports (Kubernetes, Slurm), how users are kept apart on this host
(per-server cgroups, or why not; users sharing one account), and the node arbiter's
kernels, GPU processes that belong to no server, and latest decisions (who was paused
for whom, queued, refused, over budget, unowned), read from its
socket when the arbiter runs on the Hub's host.

Rendered with the Hub's own templates (``templates/vgpu.html`` extends the Hub's
``page.html``); ``templates/page.html`` adds a "vGPU" link to the Hub's navigation bar
for whoever may open the admin page.
"""

from __future__ import annotations

import asyncio
import datetime

from jupyterhub.handlers.base import BaseHandler
from jupyterhub.scopes import Scope
from tornado import web

from jupyter_vgpu.units import format_bytes

from . import isolation
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
        nodes = hub.nodes.nodes()
        arbiter, arbiter_problem = await arbiter_books(hub.arbiter_socket)
        if not hub.arbiter_socket and nodes:
            arbiter_problem = "The node arbiters run on the nodes (Kubernetes, Slurm): see Nodes above."
        kept_apart = isolation.summary(
            self.settings.get("spawner_class"), self.settings["config"], hub.running(self.users), self.log
        )
        simulate = hub.inventory.simulate
        node_gpus = {
            name: node_cards(name, node, hub.allocator.gpus, simulate) for name, node in nodes.items()
        }
        await hub.devices_checked()
        html = await self.render_template(
            "vgpu.html",
            gpus=gpus,
            problems=hub.problems,
            placement=hub.placement,
            overcommit_ratio=hub.overcommit_ratio,
            isolation=hub.isolation,
            size=format_bytes,
            arbiter=arbiter,
            arbiter_problem=arbiter_problem,
            nodes=nodes,
            node_gpus=node_gpus,
            kept_apart=kept_apart,
            clock=lambda t: datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S"),
        )
        self.finish(html)


def node_cards(name: str, node: dict, gpus: list, simulate: bool = False) -> dict:
    """What the page says of a node's GPUs that slices go on: ``{"text", "simulated",
    "problems"}``. On a node whose GPUs the Hub simulates (``GPUInventory.simulate``: a
    test cluster's GRES on dummy device files), its arbiter's "NVML failed" is what is
    expected there, and said so."""
    mine = sorted((g for g in gpus if g.node == name and g.mig_profile is None), key=lambda g: g.index)
    simulated = all(g.simulated for g in mine) if mine else simulate
    if mine:
        sizes = sorted({g.memory for g in mine})
        each = " / ".join(format_bytes(m) for m in sizes)
        kind = "simulated " if simulated else ""
        text = f"{len(mine)} {kind}GPU{'s' if len(mine) != 1 else ''} of {each} ({mine[0].name})"
    else:
        text = "simulated GPUs (the Hub lists them at the next spawn)" if simulate else ""
    problems = list(node["problems"])
    if simulated:
        text += ": no NVIDIA GPU behind them"
        problems = [
            f"{p} (expected: this node's GPUs are simulated)" if p.startswith("NVML failed") else p
            for p in problems
        ]
    return {"text": text, "simulated": simulated, "problems": problems}


async def arbiter_books(socket: str, timeout: float = 2.0) -> tuple[dict | None, str | None]:
    """``(books, None)`` from the node arbiter at ``socket`` (its kernels and latest
    decisions, newest first), or ``(None, why not)``. The Hub's user may read them: the
    arbiter it runs as a managed service runs as that user."""
    if not socket:
        return None, "No node arbiter runs with this Hub (hub_spawner.setup(c, arbiter=False))."
    from jupyter_vgpu.host.arbiter_control import Control

    def read() -> dict:
        with Control(socket, timeout=timeout) as control:
            return control.books()

    try:
        books = await asyncio.get_running_loop().run_in_executor(None, read)
    except (OSError, ValueError, RuntimeError) as e:
        return None, f"The node arbiter at {socket} does not answer here ({e})."
    books["decisions"] = list(reversed(books["decisions"]))[:30]
    return books, None
