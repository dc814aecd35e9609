"""Slice sizes on KubeSpawner's spawn form: what a ``profile_list`` choice asks for, and
whether the user's quota allows it.

Admins size slices the way KubeSpawner users already size everything else: a profile
(or one of its ``profile_options`` choices) sets the spawner's ``vgpu_*`` settings in
its ``kubespawner_override``::

    c.KubeSpawner.profile_list = [
        {"display_name": "Small GPU", "kubespawner_override": {"vgpu_memory_limit": "4G"}},
        {"display_name": "MIG 3g.40gb",
         "kubespawner_override": {"vgpu_mode": "mig", "vgpu_mig_profile": "3g.40gb"}},
    ]

A setting a choice leaves out comes from the user's quota (as on a single host), so a
profile list without any ``vgpu_*`` key gives every user their quota. What a choice
asks for may not exceed the quota, field by field: the spawn form names the size of
each profile and marks those above the quota, and a spawn that asks for more is
refused with a message saying which field and by how much (:class:`QuotaExceeded`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from html import escape
from typing import Any

from jupyter_vgpu.slice import compute_share_text

from .kube_modes import mig_compute, mig_memory
from .sizes import format_size

#: The spawner settings a profile may override to size a slice (``vgpu_`` + field).
SLICE_SETTINGS = (
    "vgpu_mode",
    "vgpu_memory_limit",
    "vgpu_memory_request",
    "vgpu_compute_share",
    "vgpu_priority",
    "vgpu_mig_profile",
    "vgpu_dra_sharing",
    "vgpu_gpu_memory",
)


class QuotaExceeded(ValueError):
    """A profile asks for more than the user's quota; the message says what and how much.

    JupyterHub shows ``jupyterhub_message`` on the spawn page.
    """

    def __init__(self, message: str):
        super().__init__(message)
        self.jupyterhub_message = message


@dataclasses.dataclass(frozen=True)
class Size:
    """A slice's sizes as a profile and a quota settle them.

    Attributes:
        memory_limit: budget, bytes.
        memory_request: guaranteed bytes (at most the limit).
        compute_share: percent, 1-100.
        priority: 0-100.
    """

    memory_limit: int
    memory_request: int
    compute_share: int
    priority: int


def chosen_overrides(spawner, user_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``vgpu_*`` overrides a spawn's ``user_options`` select, without applying them.

    Follows KubeSpawner's own order (its ``profile_list`` help): the profile's
    ``kubespawner_override``, then each of its ``profile_options`` in order (the chosen
    choice, an unlisted choice with ``{value}`` filled in, or the default choice).
    Callable values are called with ``spawner``, as KubeSpawner calls them.

    Args:
        spawner: a :class:`kubespawner.KubeSpawner` (its ``profile_list``).
        user_options: ``{"profile": slug, <option>: <choice>, ...}``; ``{}`` or None for
            the default profile.

    Returns:
        ``{setting: value}`` for the settings of :data:`SLICE_SETTINGS` the choice sets;
        ``{}`` without a profile list.

    Raises:
        ValueError: no such profile (KubeSpawner's message).
    """
    from kubespawner.utils import recursive_format

    profiles = spawner._sorted_dict_values(spawner.profile_list)
    if callable(profiles) or not profiles:
        return {}
    profiles = spawner._get_initialized_profile_list(profiles)
    options = dict(user_options or {})
    profile = spawner._get_profile(options.get("profile"), profiles)
    layers = [profile.get("kubespawner_override", {})]
    for name, option in profile.get("profile_options", {}).items():
        unlisted = options.get(f"{name}--unlisted-choice")
        choice = options.get(name)
        if unlisted:
            layers.append(
                recursive_format(option["unlisted_choice"].get("kubespawner_override", {}), value=unlisted)
            )
        elif choice:
            layers.append(option["choices"][choice].get("kubespawner_override", {}))
        elif option.get("choices"):
            default = next(c for c in option["choices"].values() if c.get("default"))
            layers.append(default.get("kubespawner_override", {}))
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in SLICE_SETTINGS:
                out[key] = value(spawner) if callable(value) else value
    return out


def size(ask: Mapping[str, Any], effective, *, what: str = "This profile") -> Size:
    """Settle a slice's sizes from what a profile asks and the user's quota.

    Args:
        ask: ``mode``, ``memory_limit``, ``memory_request`` (bytes or None),
            ``compute_share``, ``priority`` (or None: the quota's), ``mig_profile``
            (``mig`` mode).
        effective: the user's effective quota (:class:`hub_spawner.quotas.Effective`).
        what: how messages name the choice (``"The profile 'Large GPU'"``).

    Raises:
        QuotaExceeded: a field above the quota, or a request above the limit.
    """
    if ask["mode"] == "mig":
        profile = ask.get("mig_profile")
        memory = mig_memory(profile)
        if memory > effective.memory_limit:
            raise QuotaExceeded(
                f"{what} asks for a MIG {profile} instance ({format_size(memory)}), more than your vGPU "
                f"quota of {format_size(effective.memory_limit)}; choose a smaller profile or ask an admin."
            )
        return Size(memory, memory, mig_compute(profile), _at_most(ask, "priority", effective, what))
    limit = _at_most(ask, "memory_limit", effective, what)
    if ask.get("memory_request") is None:
        request = min(effective.memory_request, limit)
    else:
        request = _at_most(ask, "memory_request", effective, what)
        if request > limit:
            raise QuotaExceeded(
                f"{what} asks for {format_size(request)} guaranteed, more than its budget of "
                f"{format_size(limit)}; ask an admin to fix the profile."
            )
    return Size(
        limit,
        request,
        _at_most(ask, "compute_share", effective, what),
        _at_most(ask, "priority", effective, what),
    )


_WORDS = {
    "memory_limit": ("a vGPU budget of", format_size),
    "memory_request": ("a guaranteed", format_size),
    "compute_share": ("a compute share of", lambda v: f"{v}%"),
    "priority": ("priority", str),
}


def _at_most(ask: Mapping[str, Any], field: str, effective, what: str) -> int:
    quota = getattr(effective, field)
    value = ask.get(field)
    if value is None:
        return quota
    if value > quota:
        words, shown = _WORDS[field]
        raise QuotaExceeded(
            f"{what} asks for {words} {shown(value)}, more than your quota's {shown(quota)}; "
            "choose a smaller profile or ask an admin."
        )
    return value


def describe(ask: Mapping[str, Any], sized: Size, isolation: str) -> str:
    """One line for the spawn form: what a choice gives (``"vGPU: 8.00 GiB budget,
    4.00 GiB guaranteed; compute share 50% (enforced by MPS); priority 50"``)."""
    if ask["mode"] == "mig":
        head = f"vGPU: a whole MIG {ask.get('mig_profile')} instance ({format_size(sized.memory_limit)})"
    else:
        guaranteed = (
            "all of it guaranteed"
            if sized.memory_request == sized.memory_limit
            else f"{format_size(sized.memory_request)} guaranteed"
        )
        whole = ", on a whole GPU" if ask["mode"] == "whole" else ""
        head = f"vGPU: {format_size(sized.memory_limit)} budget{whole}, {guaranteed}"
    share = compute_share_text(isolation, sized.compute_share, ask.get("mig_profile"))
    if ask["mode"] == "hami":
        share = f"{sized.compute_share}% (enforced by HAMi)"
    return f"{head}; compute share {share}; priority {sized.priority}"


def annotate(profiles: list[dict], lines: Mapping[str, str]) -> list[dict]:
    """A copy of an initialized profile list whose descriptions end with each profile's
    vGPU line (``lines`` by slug, HTML-escaped here)."""
    out = []
    for profile in profiles:
        profile = dict(profile)
        line = lines.get(profile.get("slug"))
        if line:
            before = profile.get("description") or ""
            joint = "<br>" if before else ""
            profile["description"] = f'{before}{joint}<span class="vgpu-size">{escape(line)}</span>'
        out.append(profile)
    return out
