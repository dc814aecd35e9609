"""The spawn form: a user picks a shared GPU slice or one of the MIG profiles that fit
their quota (JupyterHub's ``Spawner.options_form``).

Shown only on hubs with MIG instances; elsewhere there is nothing to choose. The form
posts ``vgpu=shared`` or ``vgpu=mig:<profile>``; :func:`options_from_form` turns that
into the spawner's ``user_options`` (``{}`` or ``{"mig_profile": "3g.40gb"}``), the
same ``user_options`` a REST spawn (``POST /hub/api/users/{name}/server``) may send.
"""

from __future__ import annotations

from html import escape

from jupyter_vgpu.slice import compute_share_text

from .inventory import MIG_PROFILE
from .sizes import format_size

OPTION = "mig_profile"


def render_form(*, shared: bool, isolation: str, effective, profiles: list[dict]) -> str:
    """The form's HTML (Bootstrap 5 classes, as the Hub's own pages use).

    Args:
        shared: the hub has shared GPUs (a "shared slice" choice is offered).
        isolation: the backend of the shared GPUs, for the compute share's wording.
        effective: the user's effective quota (``hub_spawner.quotas.Effective``).
        profiles: ``Allocator.profiles(effective.memory_limit)`` rows.

    Returns:
        "" when there is no MIG profile to choose from.
    """
    fitting = [p for p in profiles if p["fits"]]
    if not profiles:
        return ""
    default_profile = None if shared else next((p["profile"] for p in fitting if p["free"]), None)
    rows = []
    if shared:
        guaranteed = (
            f" ({format_size(effective.memory_request)} guaranteed)"
            if effective.memory_request != effective.memory_limit
            else ""
        )
        rows.append(
            _choice(
                "shared",
                f"Shared GPU: up to {format_size(effective.memory_limit)}{guaranteed}, "
                f"compute share {compute_share_text(isolation, effective.compute_share)}",
                checked=True,
            )
        )
    for p in fitting:
        free = p["free"]
        share = f", {p['compute_percent']}% of the GPU's SMs" if p["compute_percent"] else ""
        text = (
            f"MIG {p['profile']}: {format_size(p['memory'])}{share}, a hardware partition "
            f"({free} of {p['total']} free)"
        )
        rows.append(
            _choice(f"mig:{p['profile']}", text, checked=p["profile"] == default_profile, disabled=not free)
        )
    larger = [p["profile"] for p in profiles if not p["fits"]]
    note = (
        f'<p class="form-text">Above your quota of {format_size(effective.memory_limit)}: '
        f"{escape(', '.join(larger))}.</p>"
        if larger
        else ""
    )
    if not fitting and not shared:
        note += (
            '<p class="form-text text-danger">No MIG profile of this hub fits your quota of '
            f"{format_size(effective.memory_limit)}: ask an admin.</p>"
        )
    return (
        '<fieldset class="vgpu-options mb-3"><legend class="h5">vGPU slice</legend>'
        + "".join(rows)
        + note
        + "</fieldset>"
    )


def _choice(value: str, text: str, *, checked: bool = False, disabled: bool = False) -> str:
    ident = "vgpu-" + "".join(c if c.isalnum() else "-" for c in value)
    return (
        '<div class="form-check">'
        f'<input class="form-check-input" type="radio" name="vgpu" id="{escape(ident)}" '
        f'value="{escape(value)}"{" checked" if checked else ""}{" disabled" if disabled else ""}>'
        f'<label class="form-check-label" for="{escape(ident)}">{escape(text)}</label>'
        "</div>"
    )


def options_from_form(formdata: dict[str, list[str]]) -> dict[str, str]:
    """``user_options`` from the posted form: ``{}`` for a shared slice,
    ``{"mig_profile": profile}`` for a MIG instance (checked again at spawn)."""
    choice = (formdata.get("vgpu") or ["shared"])[0]
    if choice.startswith("mig:"):
        return {OPTION: choice[len("mig:") :]}
    return {}


def requested_profile(user_options: dict | None) -> str | None:
    """The MIG profile in ``user_options``, or None.

    Raises:
        ValueError: ``mig_profile`` is set but is not a profile name like ``"3g.40gb"``.
    """
    value = (user_options or {}).get(OPTION)
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not MIG_PROFILE.fullmatch(value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:39] + "…"
        raise ValueError(f"{OPTION} must be a MIG profile name like '1g.10gb'; got {shown}")
    return value
