"""Slice sizes on KubeSpawner's spawn form: which ``vgpu_*`` settings a ``profile_list``
choice sets, and the sizes of a MIG instance.

Admins size slices the way KubeSpawner users already size everything else: a profile
(or one of its ``profile_options`` choices) sets the spawner's ``vgpu_*`` settings in
its ``kubespawner_override``::

    c.KubeSpawner.profile_list = [
        {"display_name": "Small GPU", "kubespawner_override": {"vgpu_memory_limit": "4G"}},
        {"display_name": "MIG 3g.40gb",
         "kubespawner_override": {"vgpu_mode": "mig", "vgpu_mig_profile": "3g.40gb"}},
    ]

A setting a choice leaves out comes from the user's quota (as on a single host), so a
profile list without any ``vgpu_*`` key gives every user their quota. How a choice and
the quota settle the sizes, field by field, and how the form words them, is the same on
Slurm: :mod:`hub_spawner.profiles`. Here is what only Kubernetes has: the choice read
in KubeSpawner's order (:func:`chosen_overrides`), the sizes of a whole MIG instance
(:func:`mig_size`), and the vGPU line in KubeSpawner's own form (:func:`annotate`)."""

from __future__ import annotations

from collections.abc import Mapping
from html import escape
from typing import Any

from .kube_modes import mig_compute, mig_memory
from .profiles import SIZE_SETTINGS, QuotaExceeded, Size, at_most
from .sizes import format_size

#: The spawner settings a profile may override to size a slice (``vgpu_`` + field).
SLICE_SETTINGS = (
    "vgpu_mode",
    *SIZE_SETTINGS,
    "vgpu_mig_profile",
    "vgpu_dra_sharing",
    "vgpu_gpu_memory",
)


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


def mig_size(ask: Mapping[str, Any], effective, *, what: str = "This profile") -> Size:
    """The sizes of a whole MIG instance of ``ask["mig_profile"]`` (mode ``mig``): its
    memory (bytes) as budget and guarantee, its share of the GPU's SMs (percent), and
    ``ask``'s priority (or the quota's).

    Raises:
        QuotaExceeded: the instance's memory, or the priority, is above the quota.
        ValueError: a malformed MIG profile.
    """
    profile = ask.get("mig_profile")
    memory = mig_memory(profile)
    if memory > effective.memory_limit:
        raise QuotaExceeded(
            f"{what} asks for a MIG {profile} instance ({format_size(memory)}), more than your vGPU "
            f"quota of {format_size(effective.memory_limit)}; choose a smaller profile or ask an admin."
        )
    return Size(memory, memory, mig_compute(profile), at_most(ask, "priority", effective, what))


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
