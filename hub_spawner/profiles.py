"""Profile-sized slices: the sizing settings a spawn-form choice may override, and how a
choice and the user's quota settle a slice's sizes.

The Kubernetes and Slurm spawners (:mod:`hub_spawner.kube`, :mod:`hub_spawner.slurm`)
size slices the same way. Admins list choices in ``profile_list``; a choice's overrides
set the spawner's ``vgpu_*`` settings (:class:`ProfileSizedSlice`). A size a choice
leaves unset (None) comes from the user's quota, as on one host, and a choice asking
for more than the quota, field by field, is refused with a message that says which
field and by how much (:class:`QuotaExceeded`). The spawn form ends each choice with
the slice it gives (:func:`describe`).

What differs per platform stays with it: which profiles a spawn chooses and which
settings they may set (:mod:`hub_spawner.kube_profiles`, with KubeSpawner's
``profile_options`` and MIG instances; :mod:`hub_spawner.slurm_profiles`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from jupyterhub.traitlets import ByteSpecification
from traitlets import Bunch, HasTraits, Integer, TraitError, Unicode, ValidateHandler, validate

from jupyter_vgpu.host.socket_path import SOCKET_ENV
from jupyter_vgpu.slice import MAX_GPUS, MAX_PRIORITY, MIN_PRIORITY, compute_share_text

from .sizes import format_size

#: The sizing settings every platform's profiles may override (``vgpu_`` + field).
SIZE_SETTINGS = (
    "vgpu_memory_limit",
    "vgpu_memory_request",
    "vgpu_compute_share",
    "vgpu_priority",
    "vgpu_gpu_count",
)


class QuotaExceeded(ValueError):
    """A choice asks for more than the user's quota; the message says what and how much.

    JupyterHub shows ``jupyterhub_message`` (the message) on the spawn page.
    """

    @property
    def jupyterhub_message(self) -> str:
        return str(self)


@dataclasses.dataclass(frozen=True)
class Size:
    """A slice's sizes as a choice and a quota settle them.

    Attributes:
        memory_limit: budget, bytes.
        memory_request: guaranteed bytes (at most the limit).
        compute_share: percent, 1-100.
        priority: 0-100.
        gpu_count: cards of the slice, from 1 (the budget, request and share hold on each).
    """

    memory_limit: int
    memory_request: int
    compute_share: int
    priority: int
    gpu_count: int = 1


def size(ask: Mapping[str, Any], effective, *, what: str = "This profile") -> Size:
    """Settle a slice's sizes from what a choice asks and the user's quota.

    Args:
        ask: ``memory_limit``, ``memory_request`` (bytes), ``compute_share`` (percent),
            ``priority``, ``gpu_count`` (cards); each None (or absent) for the quota's.
        effective: the user's effective quota (:class:`hub_spawner.quotas.Effective`).
        what: how messages name the choice (``"The profile 'Large GPU'"``).

    Returns:
        The sizes; without a request of its own, the quota's request capped at the limit.

    Raises:
        QuotaExceeded: a field above the quota, or a request above the limit.
    """
    limit = at_most(ask, "memory_limit", effective, what)
    if ask.get("memory_request") is None:
        request = min(effective.memory_request, limit)
    else:
        request = at_most(ask, "memory_request", effective, what)
        if request > limit:
            raise QuotaExceeded(
                f"{what} asks for {format_size(request)} guaranteed, more than its budget of "
                f"{format_size(limit)}; ask an admin to fix the profile."
            )
    return Size(
        limit,
        request,
        at_most(ask, "compute_share", effective, what),
        at_most(ask, "priority", effective, what),
        at_most(ask, "gpu_count", effective, what),
    )


_WORDS = {
    "memory_limit": ("a vGPU budget of", format_size),
    "memory_request": ("a guaranteed", format_size),
    "compute_share": ("a compute share of", lambda v: f"{v}%"),
    "priority": ("priority", str),
    "gpu_count": ("a slice of", lambda v: f"{v} GPU{'s' if v > 1 else ''}"),
}


def at_most(ask: Mapping[str, Any], field: str, effective, what: str) -> int:
    """``ask``'s ``field`` (``memory_limit``, ``memory_request`` in bytes,
    ``compute_share`` in percent, ``priority``, ``gpu_count`` in cards), or the quota's
    where it asks none.

    Raises:
        QuotaExceeded: it asks for more than the quota's.
    """
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


def describe(
    sized: Size,
    isolation: str,
    *,
    mig_profile: str | None = None,
    whole: bool = False,
    enforced_by: str | None = None,
) -> str:
    """One line for the spawn form: what a choice gives (``"vGPU: 8.00 GiB budget,
    4.00 GiB guaranteed; compute share not enforced (time-sliced); priority 50"``; for a
    slice of several cards ``"vGPU: 2 GPUs, 8.00 GiB budget on each, ..."``).

    Args:
        sized: the choice's sizes (bytes, percent, cards).
        isolation: the slice's isolation backend; ``mig``: a whole MIG instance of
            ``mig_profile``.
        whole: the slice is a whole GPU.
        enforced_by: what enforces the compute share where the isolation does not say
            (``"HAMi"``).

    Raises:
        jupyter_vgpu.slice.SliceError: unknown ``isolation``.
    """
    if isolation == "mig":
        head = f"vGPU: a whole MIG {mig_profile} instance ({format_size(sized.memory_limit)})"
    else:
        guaranteed = (
            "all of it guaranteed"
            if sized.memory_request == sized.memory_limit
            else f"{format_size(sized.memory_request)} guaranteed"
        )
        if sized.gpu_count > 1:
            on = " on each, whole GPUs" if whole else " on each"
            head = f"vGPU: {sized.gpu_count} GPUs, {format_size(sized.memory_limit)} budget{on}, {guaranteed}"
        else:
            on = ", on a whole GPU" if whole else ""
            head = f"vGPU: {format_size(sized.memory_limit)} budget{on}, {guaranteed}"
    share = compute_share_text(isolation, sized.compute_share, mig_profile)
    if enforced_by:
        share = f"{sized.compute_share}% (enforced by {enforced_by})"
    return f"{head}; compute share {share}; priority {sized.priority}"


def gpu_memory_setting(help: str) -> ByteSpecification:
    """The ``vgpu_gpu_memory`` setting (bytes or a size like ``'80G'``, or None), with a
    platform's ``help``."""
    return ByteSpecification(None, allow_none=True, help=help).tag(config=True)


def arbiter_socket_setting(help: str) -> Unicode:
    """The ``vgpu_arbiter_socket`` setting (a path on every GPU node), with a platform's
    ``help``."""
    return Unicode("/run/jupyter-vgpu/arbiter.sock", help=help).tag(config=True)


class ProfileSizedSlice(HasTraits):
    """The sizing settings of a spawner whose ``profile_list`` choices size its slices,
    and what a choice asks for. Mixed in beside :class:`hub_spawner.spawner.VGPUSpawnerMixin`
    (``class S(VGPUSpawnerMixin, ProfileSizedSlice, BaseSpawner)``), whose quota it reads.

    A platform names the settings its choices may override in :attr:`vgpu_profile_settings`
    (its mode setting, :attr:`vgpu_mode_setting`, among them) and says how a spawn's
    ``user_options`` choose them (:meth:`vgpu_overrides`, :meth:`vgpu_what`), what a
    slice's isolation is (:meth:`vgpu_isolation`) and how the form words a choice
    (:meth:`vgpu_describe_choice`). A subclass may define a setting again where its help
    differs per platform.
    """

    vgpu_memory_limit = ByteSpecification(
        None,
        allow_none=True,
        help="""The slice's budget, bytes or a size like '8G'; None: the user's quota.
        Above the quota is refused.""",
    ).tag(config=True)

    vgpu_memory_request = ByteSpecification(
        None,
        allow_none=True,
        help="""The slice's guaranteed memory, bytes or a size; None: the user's quota
        (capped at the budget). Above the quota is refused.""",
    ).tag(config=True)

    vgpu_compute_share = Integer(
        None, allow_none=True, help="Compute share, percent 1-100; None: the user's quota."
    ).tag(config=True)

    vgpu_priority = Integer(
        None,
        allow_none=True,
        help=f"Priority {MIN_PRIORITY}-{MAX_PRIORITY}; None: the user's quota. Above the quota is refused.",
    ).tag(config=True)

    vgpu_gpu_count = Integer(
        None,
        allow_none=True,
        help=f"""Cards of the slice, 1-{MAX_GPUS} on one node (the budget, request and compute
        share hold on each card); None: the user's quota. Above the quota is refused.""",
    ).tag(config=True)

    vgpu_gpu_memory = gpu_memory_setting(
        """Memory of the GPUs slices land on while their node arbiter has not reported
        the real card, bytes or a size like '80G'."""
    )

    vgpu_arbiter_socket = arbiter_socket_setting(
        """The node arbiter's socket on every GPU node, named to servers and kernels in
        JUPYTER_VGPU_ARBITER; '' names none."""
    )

    #: The settings a choice may override to size a slice; an ask names each by what
    #: follows ``vgpu_`` (the mode setting: ``mode``).
    vgpu_profile_settings: tuple[str, ...] = ("vgpu_mode", *SIZE_SETTINGS)
    #: The setting that names the platform's mode (the ask's ``mode``).
    vgpu_mode_setting = "vgpu_mode"
    #: The modes that give a slice several cards; in the others a slice has one card
    #: (:meth:`vgpu_size`), and a choice asking for several is misconfigured (:meth:`vgpu_ask`).
    vgpu_multi_card_modes: tuple[str, ...] = ()

    @validate("vgpu_compute_share", "vgpu_priority", "vgpu_gpu_count")
    def _vgpu_check_range(self, proposal):
        name, value = proposal.trait.name, proposal.value
        low, high = {
            "vgpu_compute_share": (1, 100),
            "vgpu_priority": (MIN_PRIORITY, MAX_PRIORITY),
            "vgpu_gpu_count": (1, MAX_GPUS),
        }[name]
        if value is not None and not low <= value <= high:
            raise TraitError(f"{name} must be {low}-{high}, not {value}")
        return value

    def vgpu_setting(self, name: str, value: Any) -> Any:
        """``value`` as setting ``name`` would take it (a choice's override), not set:
        the setting's own conversion (sizes like ``'4G'`` become bytes), then the
        class's ``@validate`` checks of it, as an assignment runs them.

        Raises:
            traitlets.TraitError: ``value`` is not valid for ``name`` (a compute share
                outside 1-100 percent, a priority outside 0-100, a malformed size).
            KeyError: no setting ``name``.
        """
        trait = self.traits()[name]
        if value is None and trait.allow_none:
            return None
        if hasattr(trait, "validate"):
            value = trait.validate(self, value)
        # every handler, then filtered: trait_events(name) fails on a class with an
        # @default handler (traitlets 5.16: it reads trait_names of each)
        for handler in self.trait_events().values():
            if isinstance(handler, ValidateHandler) and name in handler.trait_names:
                value = handler(self, Bunch(trait=trait, value=value, owner=self))
        return value

    def vgpu_ask(self, overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What this spawner's settings ask for, with ``overrides`` (``vgpu_*`` keys;
        others are not the slice's and left alone) in place of the settings they name.

        Returns:
            ``{"mode": ..., "memory_limit": ..., ...}``, each of
            :attr:`vgpu_profile_settings` without ``vgpu_``; sizes in bytes, None where
            the quota's.

        Raises:
            traitlets.TraitError: an override is not valid for its setting.
            ValueError: several cards in a mode that gives one
                (:attr:`vgpu_multi_card_modes`; :meth:`vgpu_multi_card_refusal` says why).
        """
        values = {name: getattr(self, name) for name in self.vgpu_profile_settings}
        for name, value in (overrides or {}).items():
            if name in values:
                values[name] = self.vgpu_setting(name, value)
        ask = {}
        for name, value in values.items():
            if value is not None and isinstance(self.traits()[name], ByteSpecification):
                value = int(value)
            ask["mode" if name == self.vgpu_mode_setting else name[len("vgpu_") :]] = value
        if (ask.get("gpu_count") or 1) > 1 and ask.get("mode") not in self.vgpu_multi_card_modes:
            raise ValueError(self.vgpu_multi_card_refusal(ask))
        return ask

    def vgpu_multi_card_refusal(self, ask: Mapping[str, Any]) -> str:
        """Why ``ask``'s mode cannot give it several cards (a misconfigured choice's words)."""
        modes = " or ".join(map(repr, self.vgpu_multi_card_modes)) or "none here"
        return (
            f"a slice of {ask['gpu_count']} GPUs needs {self.vgpu_mode_setting} {modes} "
            f"(mode {ask.get('mode')!r} gives one device)"
        )

    def vgpu_size(self, ask: Mapping[str, Any], effective, what: str) -> Size:
        """The sizes ``ask`` gets under the quota ``effective`` (:func:`size`); one card
        in a mode that gives one (not in :attr:`vgpu_multi_card_modes`), whatever count
        the quota allows.

        Raises:
            QuotaExceeded: it asks for more than the quota.
        """
        sized = size(ask, effective, what=what)
        if ask.get("mode") not in self.vgpu_multi_card_modes:
            return dataclasses.replace(sized, gpu_count=1)
        return sized

    def vgpu_isolation(self, ask: Mapping[str, Any]) -> str:
        """The slice's isolation backend under ``ask``'s mode (``time-slicing`` here)."""
        return "time-slicing"

    def vgpu_describe_choice(self, ask: Mapping[str, Any], sized: Size) -> str:
        """The spawn form's line for a choice that fits the quota (:func:`describe`)."""
        return describe(sized, self.vgpu_isolation(ask))

    def vgpu_overrides(self, user_options: Mapping[str, Any] | None) -> dict[str, Any]:
        """The overrides a spawn's ``user_options`` choose ({} here: no profiles).

        Raises:
            ValueError: no such profile.
        """
        return {}

    def vgpu_what(self, user_options: Mapping[str, Any] | None) -> str:
        """How messages name the choice ``user_options`` make."""
        slug = (user_options or {}).get("profile")
        return f"The profile {slug!r}" if slug else "Your server's profile"

    def vgpu_check_choice(self, user_options: Mapping[str, Any] | None) -> Size:
        """The sizes a spawn's ``user_options`` would get.

        Raises:
            QuotaExceeded: the choice asks for more than the quota.
            ValueError: no such profile, or the choice is misconfigured.
            traitlets.TraitError: an override is not valid for its setting.
        """
        ask = self.vgpu_ask(self.vgpu_overrides(user_options))
        return self.vgpu_size(ask, self.vgpu_resolve(), self.vgpu_what(user_options))

    def vgpu_node_env(self, env: dict[str, str], socket: str) -> dict[str, str]:
        """``env`` (the mixin's) for a server on a cluster's node: without the Hub host's
        ``CUDA_VISIBLE_DEVICES``, arbiter socket and MPS pipe directory, which mean
        nothing there, and with the node arbiter's ``socket`` in ``JUPYTER_VGPU_ARBITER``
        while a slice runs ('' names none)."""
        for name in ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", SOCKET_ENV):
            env.pop(name, None)
        if self.vgpu_slice is not None and socket:
            env[SOCKET_ENV] = socket
        return env

    def vgpu_choice_line(self, slug: str, effective) -> str:
        """The line the spawn form ends profile ``slug`` with: the slice it gives, why it
        is above the quota ``effective``, or that it is misconfigured (logged)."""
        try:
            ask = self.vgpu_ask(self.vgpu_overrides({"profile": slug}))
            sized = self.vgpu_size(ask, effective, "It")
        except QuotaExceeded as e:
            return f"Above your vGPU quota: {e}"
        except (ValueError, TraitError) as e:
            self.log.error("vGPU: profile %r is misconfigured: %s", slug, e)
            return f"Misconfigured, ask an admin: {e}"
        return self.vgpu_describe_choice(ask, sized)
