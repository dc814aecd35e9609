"""The Hub REST API for quotas and slices, served at ``/hub/api/vgpu/...``.

Handlers subclass JupyterHub's ``APIHandler``: tokens, cookies, RBAC, JSON errors
(``{"status": N, "message": "..."}``) and the database session are the Hub's own.

Permissions use JupyterHub's built-in scopes, so the admin role already holds them:

- reading a user's quota or slices: ``read:users`` on that user (every user holds it
  for themselves; so does the server's own API token, see the spawner);
- reading every quota or slice: ``read:users`` unfiltered (admins);
- writing a user's quota: ``admin:users`` on that user; a group's: ``admin:groups``.

Every write is validated in full, and checked against the running slices it would
change, before anything is stored: bad input answers 400/404 and a change that no
longer fits on a GPU answers 409, with nothing written.
"""

from __future__ import annotations

import json

from jupyterhub import orm
from jupyterhub.apihandlers.base import APIHandler
from jupyterhub.scopes import Scope, has_scope
from tornado import web

from .config import VGPUHub
from .placement import PlacementError
from .quotas import Quota, QuotaStore, parse_quota
from .usage import parse_report, slice_summary


class VGPUAPIHandler(APIHandler):
    @property
    def vgpu_hub(self) -> VGPUHub:
        return VGPUHub.instance(config=self.settings["config"])

    @property
    def store(self) -> QuotaStore:
        return QuotaStore(self.db)

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
            "ready": bool(spawner.ready),
            "slice": spawner.vgpu_slice.to_dict(),
        }

    def quota_body(self, kind: str, name: str) -> Quota:
        """Parse the request body for a PUT or PATCH (400 on anything wrong)."""
        body = self.get_json_body()
        base = None
        if self.request.method == "PATCH":
            base = self.store.get(kind, name) or Quota()
        try:
            return parse_quota(body, max_memory=self.vgpu_hub.allocator.largest_budget(), base=base)
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
                hub.allocator.check_resize(spawner.vgpu_key, effective.memory_limit)
            except PlacementError as e:
                raise web.HTTPError(409, str(e)) from None
            changes.append((spawner, effective))
        if quota is None:
            self.store.delete(kind, name)
        else:
            self.store.put(kind, name, quota)
        for spawner, effective in changes:
            spawner.vgpu_update(effective.memory_limit, effective.compute_share)
            self.log.info(
                "vGPU slice of %s now %d bytes, %d%% compute",
                spawner._log_name,
                effective.memory_limit,
                effective.compute_share,
            )


class QuotasHandler(VGPUAPIHandler):
    """``GET /hub/api/vgpu/quotas``: the default and every group and user quota (admins)."""

    def get(self):
        self.require("read:users")
        hub = self.vgpu_hub
        self.write_json(
            {
                "default": hub.default_quota.to_dict(),
                "placement": hub.placement,
                "overcommit_ratio": hub.overcommit_ratio,
                "max_memory_limit": hub.allocator.largest_budget(),
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
        return {"kind": "user", "name": user.name, **stored.to_dict(), "effective": effective.to_dict()}

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
        user = self.find(user_name)
        if self.store.get("user", user.name) is None:
            raise web.HTTPError(404, f"User {user_name} has no vGPU quota")
        self.apply_to_running("user", user.name, None)
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
        group = self.find(group_name)
        if self.store.get("group", group.name) is None:
            raise web.HTTPError(404, f"Group {group_name} has no vGPU quota")
        self.apply_to_running("group", group.name, None)
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

    def get(self):
        if self.current_user is None:
            raise web.HTTPError(403, "Missing or invalid credentials.")
        if self.parsed_scopes.get("read:users") == Scope.ALL:
            rows, gpus = self.vgpu_hub.snapshot(self.users)
            self.write_json({"slices": rows, "gpus": gpus})
            return
        name = self.current_user.name
        self.require("read:users", user=name)
        rows, _ = self.vgpu_hub.snapshot(self.users, {name})
        self.write_json({"slices": rows})


class UserUsageHandler(VGPUAPIHandler):
    """``/hub/api/vgpu/usage/users/{name}``: GET that user's slices with usage; POST a
    server's usage report (the server's own token holds ``users:activity`` on its user)."""

    def get(self, user_name):
        self.require("read:users", user=user_name)
        if self.find_user(user_name) is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        rows, _ = self.vgpu_hub.snapshot(self.users, {user_name})
        self.write_json({"slices": rows})

    def post(self, user_name):
        self.require("users:activity", user=user_name)
        user = self.find_user(user_name)
        if user is None:
            raise web.HTTPError(404, f"No such user: {user_name}")
        try:
            server_name, report = parse_report(self.get_json_body())
        except ValueError as e:
            raise web.HTTPError(400, str(e)) from None
        spawner = user.spawners.get(server_name)
        if spawner is None or getattr(spawner, "vgpu_slice", None) is None:
            raise web.HTTPError(404, f"{user_name} has no running server {server_name!r} with a vGPU slice")
        self.vgpu_hub.usage.record(spawner.vgpu_key, report)
        self.set_status(204)
        self.finish()


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
]
