"""Host memory and disk as tiers of the node: what paused kernels hold, and whom to spill.

Bookkeeping, like :mod:`.books` (the host's own figures are read by
:func:`jupyter_vgpu.host.meminfo.meminfo`). Paused kernels keep their memory in host
memory (pinned slabs of the GPU codec path, the zstandard path's store); nothing else on
the node adds those up, and a host whose paused sessions grow past its RAM meets the
kernel's OOM killer, which takes whole kernels and their only copy of the data with
them. The arbiter therefore counts every kernel's host bytes against a node budget
(``ArbiterApp.host_memory_limit``): paused data, the driver's checkpoints, and the pinned
slabs a kernel keeps warm after a resume so that its next pause need not pin again
(pinning is most of a first pause's time). Before the budget is reached, idle kernels let
their warm slabs go first (:func:`to_trim`: the cost is a slower next pause), then the
coldest paused kernels move to the disk tier (:func:`to_spill`), also before a pause that
would pass the budget (:func:`host_room`); ``ArbiterApp.trim_before_spill`` False turns
the order round. The host's own available memory
(``MemAvailable``) is watched too: below ``host_reserve`` it trims and spills whatever
the budget says.
"""

from __future__ import annotations

import dataclasses

from .books import ACTIVE, IDLE, PAUSED, Kernel


@dataclasses.dataclass(frozen=True)
class HostBudget:
    """The node's host memory budget for paused kernels.

    Attributes:
        limit: bytes paused and suspended kernels may hold in host memory at most.
        spill_at: bytes above which the coldest paused kernels move to disk (below
            ``limit``, so that a pause in progress finds room).
        reserve: bytes of ``MemAvailable`` below which paused kernels move to disk too.
    """

    limit: int
    spill_at: int
    reserve: int


@dataclasses.dataclass(frozen=True)
class Sharing:
    """The node's pieces held once (:mod:`.shared_pieces`), as its host accounting needs
    them. Each kernel counts the pieces it reads whole in its host bytes.

    Attributes:
        saving: bytes counted more than once across kernels, subtracted from their sum
            (:meth:`.shared_pieces.SharedPieces.saving`).
        with_others: by kernel PID, bytes of its pieces that other kernels reference too:
            moving it to disk gives none of them back, as the others still read them.
    """

    saving: int = 0
    with_others: dict[int, int] = dataclasses.field(default_factory=dict)

    def frees(self, kernel: Kernel) -> int:
        """Host bytes moving ``kernel``'s paused data out of host memory gives back."""
        return max(0, kernel.host_bytes - self.with_others.get(kernel.pid, 0))


#: No piece held once: every kernel's host bytes are its own.
NOTHING_SHARED = Sharing()


def host_used(kernels: list[Kernel], shared: Sharing = NOTHING_SHARED) -> int:
    """Host bytes every kernel holds for its GPU memory (:attr:`.books.Kernel.host_held`),
    each shared piece counted once (:attr:`Sharing.saving`)."""
    return max(0, sum(k.host_held for k in kernels) - shared.saving)


def disk_used(kernels: list[Kernel]) -> int:
    """Bytes every kernel keeps in the disk tier."""
    return sum(k.disk_bytes for k in kernels)


def _coldest_holding(kernels: list[Kernel], state: str, now: float, exclude: tuple) -> list[Kernel]:
    """Kernels in ``state`` holding host bytes, ``exclude`` left out, coldest first: longest
    idle, then lowest priority, then most host bytes."""
    found = [k for k in kernels if k.state == state and k.host_bytes > 0 and k not in exclude]
    return sorted(found, key=lambda k: (-k.idle_for(now), k.priority, -k.host_bytes))


def spillable(
    kernels: list[Kernel], now: float, exclude: tuple = (), shared: Sharing = NOTHING_SHARED
) -> list[Kernel]:
    """Paused kernels whose move to disk would give host bytes back (:meth:`Sharing.frees`),
    coldest first (longest idle, then lowest priority, then most bytes): those the disk
    tier takes first. A kernel whose host bytes are all pieces others read too is left
    out: its spill leaves them in the node's copies (the kernel writes only what is its
    own, :meth:`jupyter_vgpu.kernel.pause.engine.PauseEngine.spill`)."""
    return [k for k in _coldest_holding(kernels, PAUSED, now, exclude) if shared.frees(k) > 0]


#: A pause's stored bytes past what the kernel said it would store (``pausable_bytes``):
#: a margin well above the device codec's chunk alignment (16 bytes a chunk) and what
#: an idle kernel's figure may have missed since it was sent. A fraction of the figure,
#: plus this many bytes.
PAUSE_MARGIN_BYTES = 64 * 2**20
PAUSE_MARGIN_FRACTION = 1 / 64


def host_need(kernel: Kernel) -> int:
    """Host bytes taking ``kernel`` off the card may add, at most: a pause's compressed copy,
    or the checkpoint of what a paused kernel has left, is at most its resident bytes; a
    resident kernel that said what its pause would store (:attr:`.books.Kernel.pausable`:
    its live bytes, PyTorch's cached free blocks left out) stores no more than that and
    :data:`PAUSE_MARGIN_BYTES` and :data:`PAUSE_MARGIN_FRACTION` of it. Its pause takes its
    own warm slabs (its host bytes, counted already) first.

    Resident bytes alone overestimated a kernel that had run a cell several times over
    (15.5 GiB for an MLP kernel whose pause stored 1.5 GiB: PyTorch's cache kept its
    activations' blocks), and near the reserve every such pause was refused: 680 "pause
    skipped" in the 48-session MLP run at 17863d2 (``sessions-h100.json``). The figure is
    the kernel's word: one that says too little passes the node's budget with its own
    memory, which its process could take with ``malloc`` as well; the reserve, read from
    ``MemAvailable``, still counts whatever it takes."""
    warm = kernel.host_bytes if kernel.state in (IDLE, ACTIVE) else 0
    bound = kernel.resident
    if kernel.state in (IDLE, ACTIVE) and kernel.pausable is not None:
        said = kernel.pausable + int(kernel.pausable * PAUSE_MARGIN_FRACTION) + PAUSE_MARGIN_BYTES
        bound = min(bound, said)
    return max(0, bound - warm)


def trimmable(kernels: list[Kernel], now: float, exclude: tuple = ()) -> list[Kernel]:
    """Idle kernels keeping warm pinned slabs, coldest first (longest idle, lowest
    priority, most bytes): those asked first to let them go. A resident kernel's host
    bytes are its warm slabs alone; a running one is left to its cell."""
    return _coldest_holding(kernels, IDLE, now, exclude)


def paused_to_trim(kernels: list[Kernel], now: float, exclude: tuple = ()) -> list[Kernel]:
    """Paused kernels not asked to trim since their pause (:attr:`.books.Kernel.trim_asked`),
    coldest first: asked once the host itself is short (its available memory under the
    reserve). What they give back, pinned memory past their paused data and the free
    pages of their heap, is not in the books' host bytes (a paused kernel trims on its own
    once paused, ``VGPUKernel.trim_when_paused``), so only ``MemAvailable`` shows it, and
    the budget alone is no reason to ask."""
    found = [k for k in kernels if k.state == PAUSED and k.trim_asked < k.since and k not in exclude]
    return sorted(found, key=lambda k: (-k.idle_for(now), k.priority, -k.host_bytes))


def to_trim(
    kernels: list[Kernel], budget: HostBudget, available: int, now: float, shared: Sharing = NOTHING_SHARED
) -> list:
    """Idle kernels to ask to let their warm slabs go now, coldest first: until the node's
    host bytes are under ``budget.spill_at`` and the host's available memory is back above
    ``budget.reserve``, as :func:`to_spill` counts (trimming comes first by default: it
    loses no data and costs only a slower next pause, ``ArbiterApp.trim_before_spill``);
    then, while the available memory is under the reserve, :func:`paused_to_trim`."""
    idle = _until_under(trimmable(kernels, now), kernels, budget, available, shared)
    return idle + (paused_to_trim(kernels, now) if available < budget.reserve else [])


def past_mark(used: int, available: int, budget: HostBudget) -> bool:
    """Whether the node is past its spill mark: ``used`` host bytes (its kernels') over
    ``budget.spill_at``, or ``available`` (bytes, ``MemAvailable``) under ``budget.reserve``."""
    return used > budget.spill_at or available < budget.reserve


def _until_under(todo: list, kernels: list, budget: HostBudget, available: int, shared: Sharing) -> list:
    used = host_used(kernels, shared)
    out = []
    for k in todo:
        if not past_mark(used, available, budget):
            break
        out.append(k)
        freed = shared.frees(k)
        used -= freed
        available += freed
    return out


def to_spill(
    kernels: list[Kernel], budget: HostBudget, available: int, now: float, shared: Sharing = NOTHING_SHARED
) -> list:
    """Paused kernels to move to the disk tier now, coldest first: until the node's host
    bytes are under ``budget.spill_at`` and the host's available memory (``available``,
    bytes, from ``MemAvailable``) is back above ``budget.reserve``, counting each spill as
    giving back its host bytes less its pieces others still read (:meth:`Sharing.frees`:
    as the node holds them now; a piece whose other readers are chosen too is counted as
    staying, so that the list errs on the side of one spill more)."""
    return _until_under(spillable(kernels, now, shared=shared), kernels, budget, available, shared)


def strands(
    victim: Kernel,
    kernels: list[Kernel],
    budget: HostBudget,
    need: int,
    available: int,
    shared: Sharing = NOTHING_SHARED,
) -> bool:
    """Whether suspending ``victim`` now would keep in host memory paused data the disk
    tier should take: ``victim`` is paused with data in host memory that spilling would
    give back (:meth:`Sharing.frees`), and the node, the suspend's ``need`` bytes (its
    checkpoint) counted, is past its spill mark (:func:`past_mark`).

    A suspended kernel cannot move its paused data: its CUDA calls, the release of its
    pinned slabs among them, wait for its restore. Suspended first, it holds that memory
    until it runs again, out of reach of every spill. Measured on an H200 standing in
    for the H100 (``benchmarks/results/sessions-h100.json``, 48 MLP sessions at 17863d2):
    the arbiter suspended 45 paused kernels to give their CUDA contexts back to the card;
    the host was then past its reserve with 41 GiB of paused data no spill could reach,
    and five cells waited three minutes for pauses the host had no room for."""
    if victim.state != PAUSED or shared.frees(victim) <= 0:
        return False
    return past_mark(host_used(kernels, shared) + need, available - need, budget)


def host_room(
    kernels: list[Kernel], budget: HostBudget, need: int, available: int, shared: Sharing = NOTHING_SHARED
) -> tuple[int, int]:
    """``(bytes over the budget, bytes into the reserve)`` were ``need`` more bytes put in
    host memory now (0, 0: it fits). The budget is the node's target, which spilling
    holds; the reserve (``available``, bytes, from ``MemAvailable``, against
    ``budget.reserve``) is what keeps the host's OOM killer away."""
    over_budget = host_used(kernels, shared) + need - budget.limit
    over_reserve = need - (available - budget.reserve)
    return max(0, over_budget), max(0, over_reserve)
