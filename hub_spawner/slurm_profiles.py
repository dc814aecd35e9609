"""The Slurm spawner's ``profile_list``: choices on the spawn form, in KubeSpawner's shape.

Pure functions, no I/O. batchspawner has no profile list of its own; admins who know
KubeSpawner's write the same dicts (``display_name``, ``slug``, ``description``,
``default``), with ``spawner_override`` in place of ``kubespawner_override``::

    c.VGPUSlurmSpawner.profile_list = [
        {"display_name": "Small GPU", "default": True, "spawner_override": {"vgpu_memory_limit": "4G"}},
        {"display_name": "Whole GPU", "spawner_override": {"vgpu_gres": "gpu", "req_runtime": "8:00:00"}},
    ]

Sizes are settled and described by :mod:`hub_spawner.profiles` (the quota caps every
field), as on Kubernetes, so the two spawners' forms say the same things.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from html import escape

from .profiles import SIZE_SETTINGS

#: The settings a profile may override to size a slice (``vgpu_gres`` is the ask's
#: ``mode``, the others ``vgpu_`` + field); other overrides (batchspawner's ``req_*``)
#: are not the slice's.
SLICE_SETTINGS = ("vgpu_gres", *SIZE_SETTINGS)


def slug(text: str) -> str:
    """A profile's slug from its display name (``"Small GPU"`` -> ``"small-gpu"``)."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "profile"


def normalized(profiles: list[dict]) -> list[dict]:
    """Copies of ``profiles``, each with a ``slug`` (given, or from its display name)."""
    return [
        {**p, "slug": p.get("slug") or slug(p.get("display_name", f"profile {i + 1}"))}
        for i, p in enumerate(profiles)
    ]


def chosen(profiles: list[dict], user_options: Mapping | None) -> dict | None:
    """The profile ``user_options`` (``{"profile": slug}``) choose, else the default one,
    else the first; None without profiles.

    Raises:
        ValueError: no profile of that slug.
    """
    profiles = normalized(profiles)
    if not profiles:
        return None
    wanted = (user_options or {}).get("profile")
    if wanted:
        for p in profiles:
            if p["slug"] == wanted:
                return p
        raise ValueError(f"No profile {wanted!r}; the profiles: {', '.join(p['slug'] for p in profiles)}")
    return next((p for p in profiles if p.get("default")), profiles[0])


def render(profiles: list[dict], lines: Mapping[str, str], checked: str) -> str:
    """The form: one radio button per profile (name ``profile``, value its slug), its
    description (HTML, the admin's) and its vGPU line (``lines`` by slug, escaped here);
    the ``checked`` slug selected."""
    rows = []
    for p in normalized(profiles):
        key = escape(p["slug"])
        mark = " checked" if p["slug"] == checked else ""
        rows.append(
            f'<div class="form-check mb-2"><input class="form-check-input" type="radio" name="profile" '
            f'id="profile-{key}" value="{key}"{mark}><label class="form-check-label" for="profile-{key}">'
            f"<strong>{escape(p.get('display_name', p['slug']))}</strong>"
            + (f"<br>{p['description']}" if p.get("description") else "")
            + f'<br><span class="vgpu-size">{escape(lines.get(p["slug"], ""))}</span></label></div>'
        )
    return '<div class="vgpu-profiles">' + "".join(rows) + "</div>"
