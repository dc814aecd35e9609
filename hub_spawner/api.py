"""The Hub REST API for quotas and slices, served at ``/hub/api/vgpu/...``.

Handlers subclass JupyterHub's ``APIHandler``: tokens, cookies, RBAC, JSON errors
(``{"status": N, "message": "..."}``, the message never null) and the database session
are the Hub's own.

Permissions use JupyterHub's built-in scopes, so the admin role already holds them:

- reading a user's quota or slices: ``read:users`` on that user (every user holds it
  for themselves; so does the server's own API token, see the spawner);
- reading every quota or slice: ``read:users`` unfiltered (admins);
- writing a user's quota: ``admin:users`` on that user; a group's: ``admin:groups``;
- reporting a server's usage: that server's own API token, and nothing else (not the
  user's own tokens, not an admin's).

Every write is validated in full, and checked against the running slices it would
change, before anything is stored: bad input answers 400/404 and a change that no
longer fits on a GPU answers 409, with nothing written.
"""

from __future__ import annotations

import json
import threading
from http.client import responses

from jupyterhub import orm
from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import Scope, has_scope
from jupyterhub.utils import compare_token
from tornado import web

from jupyter_vgpu import contracts
from jupyter_vgpu.slice import compute_share_text

from .config import VGPUHub
from .nodes import MAX_REPORT_BYTES as MAX_NODE_REPORT_BYTES
from .nodes import parse_report as parse_node_report
from .placement import PlacementError
from .quotas import Quota, QuotaStore, parse_quota
from .usage import MAX_REPORT_BYTES, parse_report, slice_summary

#: The scope a node arbiter's token needs to report its node (registered by ``setup``).
NODES_SCOPE = "custom:vgpu-nodes:write"


class VGPUAPIHandler(APIHandler):
    @property
    def vgpu_hub(self) -> VGPUHub:
        return VGPUHub.instance(config=self.settings["config"])

    @property
    def store(self) -> QuotaStore:
        return QuotaStore(self.db)

    def write_error(self, status_code, **kwargs):
        """JupyterHub's JSON error, with a message even where tornado gives none
        (405, a 404 without text): ``{"status": N, "message": "..."}``."""
        exception = (kwargs.get("exc_info") or (None, None, None))[1]
        if isinstance(exception, web.HTTPError) and not exception.log_message:
            if status_code == 405:
                message = (
                    f"{self.request.method} is not allowed on {self.request.path}; "
                    f"allowed: {', '.join(self.allowed_methods())}"
                )
            else:
                message = responses.get(status_code, "Error")
            exception.jupyterhub_message = message
        super().write_error(status_code, **kwargs)

    def allowed_methods(self) -> list[str]:
        """The HTTP methods this handler answers (for 405 messages)."""
        base = web.RequestHandler
        return [
            m
            for m in ("GET", "POST", "PUT", "PATCH", "DELETE")
            if getattr(type(self), m.lower()) is not getattr(base, m.lower())
        ]

    def require(self, scope: str, *, user: str | None = None, group: str | None = None) -> None:
        """403 unless the request holds ``scope`` on that user or group (on every
        resource when neither is given).

        Checked before the resource is looked up, so the answer is 403 whether or not
        the user or group exists: a refusal says nothing about who exists. (JupyterHub's
        own ``needs_scope`` answers 404 there instead; our API promises 403.)
        """
        if self.current_user is None:
            raise web.HTTPError(403, "Missing or invalid credentials.")
        if user is not None:
            allowed = has_scope(f"{scope}!user={user}", self.parsed_scopes, db=self.db)
        elif group is not None:
            allowed = has_scope(f"{scope}!group={group}", self.parsed_scopes, db=self.db)
        else:
            allowed = self.parsed_scopes.get(scope) == Scope.ALL
        if not allowed:
            target = f" on {user or group}" if user or group else ""
            raise web.HTTPError(
                403, f"Action is not authorized with current scopes; requires {scope}{target}"
            )

    def write_json(self, data, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data))

    def running_spawners(self, user_names=None):
        """``(user, spawner)`` for every server holding a slice."""
        return self.vgpu_hub.running(self.users, user_names)

    def slice_model(self, user, spawner) -> dict:
        return {
            **slice_summary(user.name, spawner),
            **spawner.vgpu_listing(),
            "ready": bool(spawner.ready),
            # the server's process on its host, for the node arbiter (None when not local)
            "pid": getattr(spawner, "pid", None) or None,
            "slice": spawner.vgpu_slice.to_dict(),
        }

    def quota_body(self, kind: str, name: str) -> Quota:
        """Parse the request body for a PUT or PATCH (400 on anything wrong)."""
        body = self.get_json_body()
        base = None
        if self.request.method == "PATCH":
            base = self.store.get(kind, name) or Quota()
        allocator = self.vgpu_hub.allocator
        try:
            return parse_quota(
                body,
                max_memory=allocator.largest_budget(),
                max_request=allocator.largest_request(),
                max_gpus=allocator.most_cards(),
                min_memory=int(self.vgpu_hub.min_memory_limit),
                base=base,
            )
        except ValueError as e:
            raise web.HTTPError(400, str(e)) from None

    def apply_to_running(self, kind: str, name: str, quota: Quota | None) -> None:
        """Store ``quota`` (None: delete) and resize the running slices it changes.

        Every affected slice is checked first; if one no longer fits, 409 and nothing
        is stored or resized.
        """
        hub = self.vgpu_hub
        if kind == "user":
            members = {name}
        else:
            group = orm.Group.find(self.db, name)
            members = {u.name for u in group.users}
        changes = []
        for user, spawner in self.running_spawners(members):
            groups = [g.name for g in user.groups]
            effective = self.store.resolve(user.name, groups, hub.default_quota, override=(kind, name, quota))
            try:
                spawner.vgpu_check_update(effective)
            except PlacementError as e:
                raise web.HTTPError(409, str(e)) from None
            changes.append((spawner, effective))
        if quota is None:
            self.store.delete(kind, name)
        else:
            self.store.put(kind, name, quota)
        for spawner, effective in changes:
            spawner.vgpu_update(effective)
            self.log.info("vGPU slice of %s now %s", spawner._log_name, spawner.vgpu_describe())
        if changes:
            tell_arbiter(hub.arbiter_socket, self.log)


def tell_arbiter(socket: str, log) -> None:
    """Ask the node arbiter to read the running slices now, so that a quota change
    reaches kernels at once rather than at its next read (``hub_poll_seconds``). Runs
    in a thread; an arbiter that does not answer is logged, and catches up by itself."""
    if not socket:
        return

    def send() -> None:
        from jupyter_vgpu.host.arbiter_control import Control

        try:
            with Control(socket, timeout=5) as control:
                control.refresh()
        except (OSError, ValueError, RuntimeError) as e:
            log.warning("the node arbiter at %s did not take the quota change: %s", socket, e)

    threading.Thread(target=send, name="vgpu-tell-arbiter", daemon=True).start()


class QuotasHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/quotas``: the default and every group and user quota (admins)."""

    async def get(self):
        self.require("read:users")
        hub = self.vgpu_hub
        allocator = hub.allocator
        await hub.devices_checked()
        default = hub.default_quota
        self.write_json(
            {
                "default": default.to_dict(),
                "placement": hub.placement,
                "overcommit_ratio": hub.overcommit_ratio,
                "isolation": hub.isolation,
                "compute_share_text": compute_share_text(hub.isolation, default.compute_share),
                "min_memory_limit": int(hub.min_memory_limit),
                "max_memory_limit": allocator.largest_budget(),
                "max_memory_request": allocator.largest_request(),
                "max_gpu_count": max(1, allocator.most_cards()),
                "mig_profiles": allocator.profiles(allocator.largest_budget()),
                "problems": hub.problems,
                "groups": {n: q.to_dict() for n, q in self.store.all("group").items()},
                "users": {n: q.to_dict() for n, q in self.store.all("user").items()},
            }
        )


class UserQuotaHandler(VGPUAPIHandler):
    """``/hub/api/vgpu/quotas/users/{name}``: one user's stored and effective quota."""

    def model(self, user) -> dict:
        stored = self.store.get("user", user.name) or Quota()
        groups = [g.name for g in user.groups]
        effective = self.store.resolve(user.name, groups, self.vgpu_hub.default_quota)
        return {
            "kind": "user",
            "name": user.name,
            **stored.to_dict(),
            "effective": {
                **effective.to_dict(),
                "compute_share_text": compute_share_text(self.vgpu_hub.isolation, effective.compute_share),
            },
        }

    def find(self, user_name):
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        return user

    def get(self, user_name):
        self.require("read:users", user=user_name)
        self.write_json(self.model(self.find(user_name)))

    def put(self, user_name):
        self.require("admin:users", user=user_name)
        user = self.find(user_name)
        self.apply_to_running("user", user.name, self.quota_body("user", user.name))
        self.write_json(self.model(user))

    patch = put

    def delete(self, user_name):
        self.require("admin:users", user=user_name)
        if self.store.get("user", user_name) is None:
            self.find(user_name)  # 404 "No such user" first, when it is that
            raise web.HTTPError(404, f"User {user_name} has no vGPU quota")
        self.apply_to_running("user", user_name, None)
        self.set_status(204)
        self.finish()


class GroupQuotaHandler(VGPUAPIHandler):
    """``/hub/api/vgpu/quotas/groups/{name}``: one group's quota."""

    def model(self, group) -> dict:
        stored = self.store.get("group", group.name) or Quota()
        return {"kind": "group", "name": group.name, **stored.to_dict()}

    def find(self, group_name):
        group = orm.Group.find(self.db, group_name)
        if group is None:
            raise web.HTTPError(404, f"No such group: {group_name}")
        return group

    def get(self, group_name):
        self.require("read:groups", group=group_name)
        self.write_json(self.model(self.find(group_name)))

    def put(self, group_name):
        self.require("admin:groups", group=group_name)
        group = self.find(group_name)
        self.apply_to_running("group", group.name, self.quota_body("group", group.name))
        self.write_json(self.model(group))

    patch = put

    def delete(self, group_name):
        self.require("admin:groups", group=group_name)
        if self.store.get("group", group_name) is None:
            self.find(group_name)
            raise web.HTTPError(404, f"Group {group_name} has no vGPU quota")
        self.apply_to_running("group", group_name, None)
        self.set_status(204)
        self.finish()


class SlicesHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/slices``: every running slice (admins)."""

    def get(self):
        self.require("read:users")
        self.write_json([self.slice_model(u, s) for u, s in self.running_spawners()])


class UserSlicesHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/slices/users/{name}``: one user's running slices."""

    def get(self, user_name):
        self.require("read:users", user=user_name)
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        self.write_json([self.slice_model(u, s) for u, s in self.running_spawners({user.name})])


class UsageHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/usage``: every running slice with its latest usage, and every
    GPU (admins); a user gets their own slices only."""

    async def get(self):
        if self.current_user is None:
            raise web.HTTPError(403, "Missing or invalid credentials.")
        if self.parsed_scopes.get("read:users") == Scope.ALL:
            await self.vgpu_hub.devices_checked()
            rows, gpus = self.vgpu_hub.snapshot(self.users)
            self.write_json({"slices": rows, "gpus": gpus, "problems": self.vgpu_hub.problems})
            return
        name = self.current_user.name
        self.require("read:users", user=name)
        rows, _ = self.vgpu_hub.snapshot(self.users, {name})
        self.write_json({"slices": rows})


class UserUsageHandler(VGPUAPIHandler):
    """``/hub/api/vgpu/usage/users/{name}``: GET that user's slices with usage; POST a
    server's usage report, with that server's own API token only."""

    def get(self, user_name):
        self.require("read:users", user=user_name)
        if self.find_user(user_name) is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        rows, _ = self.vgpu_hub.snapshot(self.users, {user_name})
        self.write_json({"slices": rows})

    def reporting_spawner(self, user):
        """The spawner whose own API token made this request, or None.

        A server's API token is also the secret of its OAuth client, which the Hub keeps
        hashed in its database; no other token (the user's own, an admin's) matches it.
        """
        token = self.get_auth_token()
        if not token:
            return None
        for spawner in user.spawners.values():
            client = self.db.query(orm.OAuthClient).filter_by(identifier=spawner.oauth_client_id).first()
            if client is not None and client.secret and compare_token(client.secret, token):
                return spawner
        return None

    def post(self, user_name):
        self.require("users:activity", user=user_name)
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        reporter = self.reporting_spawner(user)
        if reporter is None:
            raise web.HTTPError(
                403, f"Only the API token of one of {user_name}'s servers may report that server's usage"
            )
        if len(self.request.body) > MAX_REPORT_BYTES:
            raise web.HTTPError(400, f"the report is larger than {MAX_REPORT_BYTES} bytes")
        try:
            server_name, report = parse_report(self.get_json_body())
        except contracts.ContractError as e:
            raise web.HTTPError(400, f"the usage report breaks its contract: {e}") from None
        if server_name != reporter.name:
            raise web.HTTPError(
                403, f"this token belongs to server {reporter.name!r}, which may only report for itself"
            )
        if getattr(reporter, "vgpu_slice", None) is None:
            raise web.HTTPError(404, f"{user_name} has no running server {server_name!r} with a vGPU slice")
        self.vgpu_hub.usage.record(reporter.vgpu_key, report)
        self.set_status(204)
        self.finish()


class NodesHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/nodes``: every Kubernetes GPU node as its arbiter (or its Node
    object) describes it (admins)."""

    def get(self):
        self.require("read:users")
        self.write_json({"nodes": self.vgpu_hub.nodes.nodes()})


class NodeReportHandler(VGPUAPIHandler):
    """``POST /hub/api/vgpu/nodes/{node}``: a node arbiter's report (the contract
    ``node-report``), with a token holding ``custom:vgpu-nodes:write``. Slices on that
    node whose GPU was not yet known take it from the report."""

    def post(self, node):
        self.require(NODES_SCOPE)
        if len(self.request.body) > MAX_NODE_REPORT_BYTES:
            raise web.HTTPError(400, f"the report is larger than {MAX_NODE_REPORT_BYTES} bytes")
        try:
            report = parse_node_report(node, self.get_json_body())
        except contracts.ContractError as e:
            raise web.HTTPError(400, f"the node report breaks its contract: {e}") from None
        board = self.vgpu_hub.nodes
        board.record(node, report)
        for _, spawner in self.running_spawners():
            if spawner.vgpu_listing().get("node") == node:
                spawner.vgpu_relocate(board)
        self.set_status(204)
        self.finish()


class NotFoundHandler(VGPUAPIHandler):
    """Anything else under ``/hub/api/vgpu``: 404 with a message, whatever the method."""

    def _not_found(self, *args):
        raise web.HTTPError(404, f"No vGPU API at {self.request.path}; the API is described in the README")

    get = post = put = patch = delete = head = _not_found


_name = r"([^/]+)"

#: ``(pattern, handler)`` pairs relative to the Hub prefix, for ``JupyterHub.extra_handlers``.
handlers = [
    (r"/api/vgpu/quotas", QuotasHandler),
    (rf"/api/vgpu/quotas/users/{_name}", UserQuotaHandler),
    (rf"/api/vgpu/quotas/groups/{_name}", GroupQuotaHandler),
    (r"/api/vgpu/slices", SlicesHandler),
    (rf"/api/vgpu/slices/users/{_name}", UserSlicesHandler),
    (r"/api/vgpu/usage", UsageHandler),
    (rf"/api/vgpu/usage/users/{_name}", UserUsageHandler),
    (r"/api/vgpu/nodes", NodesHandler),
    (rf"/api/vgpu/nodes/{_name}", NodeReportHandler),
    (r"/api/vgpu(?:/.*)?", NotFoundHandler),
]
