"""The arbiter's socket protocol: one JSON object per line, both ways, version 6.

Kernels (any user) may send:

- ``{"type": "hello", "version": 6, "kernel_id": str, "state": <state>, "resident": int,
  "paused_bytes": int, "host_bytes": int, "disk_bytes": int, "pausable_bytes": int,
  "cached_bytes": int, "budget": int | null, "idle_seconds": number}`` once, first: who
  it is and where its memory is, so that an arbiter started after the kernel (a
  restart, an upgrade) rebuilds its books from the kernels themselves. Figures only,
  like ``state``; ``budget`` is the budget the kernel applies (the slice's is the
  arbiter's). Version 5 is the same (it sends no ``cell``), versions 3 and 4 the same
  without ``cached_bytes``, version 2 without
  ``pausable_bytes`` either; a kernel whose hello an older arbiter refuses speaks the
  version below. Version 1 (``{"type": "hello", "version": 1, "kernel_id": str}``,
  kernels started before an upgrade) is still accepted. The arbiter
  answers ``{"type": "welcome", "slice": <slice> | null, "server": "user/name" | null,
  "disk_dir": str | null}`` (``disk_dir``: where the kernel's disk tier lives), with
  ``"grow": true`` where the arbiter grants growth on demand (``ArbiterApp.grant_on_demand``)
  to a kernel of version 4 or later: it answers ``room`` ``for: grow``, and the kernel's
  allocator asks it.
- ``{"type": "state", "state": "active"|"idle"|"paused"|"suspended", "resident": int,
  "paused_bytes": int, "host_bytes": int, "disk_bytes": int, "pausable_bytes": int,
  "cached_bytes": int, "resume_seconds": number | null}``: figures only; ``resident`` (bytes on the card)
  counts only on a simulated GPU, where NVML has nothing to say, and while suspended
  (what the driver's checkpoint took off the card, NVML's figure just before it: what
  the restore needs back);
  ``host_bytes`` is the host memory the kernel holds for its paused data, ``disk_bytes``
  what it keeps in the disk tier; ``pausable_bytes`` (version 3, a resident kernel on
  the GPU path) what a pause of it as it is now would store at most, before compression
  (:func:`.tiers.host_need` estimates a pause's host memory from it); ``cached_bytes``
  (version 5, a resident kernel on a real card) the free blocks its allocator keeps
  cached on the card, which a ``release`` gives back; ``resume_seconds`` is the last
  resume's duration, once. (``disk_bytes`` may be left out: version 1;
  ``pausable_bytes`` and ``cached_bytes`` where the kernel cannot tell, and before
  versions 3 and 5.)
- ``{"type": "room", "id": int, "for": "run"|"resume"|"restore"|"prefetch", "cell": true}``:
  may I run? (``cell``, version 6, sent only for a cell the user ran: it takes its turn
  on the card, :mod:`.turns`, where ``ArbiterApp.turn_wait`` is set; a kernel whose code
  ran past ``turn_wait`` on a request without it takes turns with every request since.)
  (``prefetch``: may I come back now, ahead of a cell the user is about to run? Answered
  at once, granted only where the card has room once the kernels idle past their
  ``idle_seconds`` are paused, nobody else taken off it.) ``{"type": "room", "id": int,
  "for": "grow", "bytes": int}`` (version 4, on the kernel's grow channel, below): the
  running cell made an allocation of ``bytes`` that the driver found no room for, and
  waits while the arbiter makes it (where ``ArbiterApp.grant_on_demand`` grants a
  starting cell less than its budget; denied at once to a kernel that runs no cell); the
  allocation is then made again. The
  arbiter answers ``{"type": "grant", "id": int}``, possibly after one or more
  ``{"type": "wait", "id": int, "message": str}`` (what it waits for and why, shown in
  the cell's output, the latest replacing the one before), or ``{"type": "deny", "id":
  int, "message": str}`` after its queue timeout, or ``{"type": "failed", "id": int,
  "message": str}`` where deciding failed on a fault of the arbiter's own (the message
  names it): the kernel goes on as it does without an arbiter, at once.
- ``{"type": "reply", "id": int, "ok": bool, "message": str, "released": int | null}``:
  the answer to a request; ``released`` is the device memory a pause or a release gave
  back, or the host memory a trim gave back (bytes; null for a suspend or a spill), a figure only: 0
  spares the arbiter its wait for NVML to drop, and what the card has free is still read
  from NVML before any room is granted.

A kernel granted growth on demand opens a second connection, its grow channel, whose
first line is ``{"type": "channel", "version": 4, "for": "grow"}``: the kernel's
allocator asks for room to grow on it, from the allocating thread, without a word of
Python (a thread of Python waiting on a lock that thread holds would otherwise wait
forever). The arbiter answers ``{"type": "ok"}`` where the process is a connected
kernel's (the same process, by its peer credentials and its identity) and is granted
growth on demand, else an ``error`` and hangs up; the channel then carries ``room``
``for: grow`` alone, and their ``wait``, ``grant``, ``deny`` and ``failed``.

The arbiter sends kernels requests: ``{"type": "pause", "id": int}``, ``{"type":
"suspend", "id": int}`` (pause if needed, hold every message, answer; the arbiter then
checkpoints the process), ``{"type": "spill", "id": int, "dir": str}`` (move the paused
data from host memory to files in ``dir``, the kernel's directory of the disk tier),
``{"type": "trim", "id": int}`` (an idle kernel lets go of the pinned host memory it
keeps warm for its next pause, a paused one of what its process holds for nothing until
its next cell: the host needs it), ``{"type": "release", "id": int}`` (version 5: an idle
kernel gives back the free blocks its allocator keeps cached on the card, PyTorch's
``empty_cache``; nothing is stored and the kernel stays on the card, so its next cell
needs no resume: :meth:`.room.Rooms.make_room` asks it before any pause, where
``ArbiterApp.release_first``), and notices: ``{"type": "slice",
"slice": <slice>}``, ``{"type": "notice", "message": str}``, ``{"type": "node",
"host_used": int, "host_limit": int, "disk_used": int}`` (the host memory the node's
kernels hold for their GPU memory, its budget, and the disk tier's bytes; for ``%vgpu
status`` and the panel).

Trusted clients (the arbiter's own user, or root: the Hub's spawner, a benchmark) may
also send ``{"type": "register", "pid": int, "user": str, "server": str, "slice":
<slice>}`` (the process tree rooted at ``pid`` has that slice; with an optional
``"cgroup": str``, every process in that cgroup, ``PATH`` or ``HIERARCHY:PATH``; with an
optional ``"start": int``, the start time of process ``pid`` when the server started, and
``"uid": int``, the account it runs as: see :meth:`.arbiter.Arbiter.register`), ``{"type":
"unregister", "pid": int}``, ``{"type": "books"}`` (the arbiter's view, for tests and
the Hub's page) and ``{"type": "refresh"}`` (the Hub's slices changed: read them now,
sent by the Hub after a quota change); each is answered ``{"type": "ok", ...}`` or
``{"type": "error", "message": str}``.

Both directions are contracts (:mod:`jupyter_vgpu.contracts`): ``to-arbiter`` is what
clients send, ``from-arbiter`` what the arbiter sends, each defined once as a JSON
Schema and checked where received without jsonschema (:mod:`jupyter_vgpu.contracts.lean`:
the arbiter reads every line of every kernel, and a kernel starts in a second). Here,
:func:`decode` checks every line before anything acts on it: unknown types, missing or
extra fields, wrong types and out-of-range numbers are refused with a message that
names the message's type, the field and what is wrong (``reply.released: must be at
least 0; got -1``), the client may go on; a line longer than :data:`MAX_LINE` bytes
ends the connection. A kernel drops (and logs) a message of the arbiter's that breaks
its contract. A slice inside a message is an object here, checked by
:meth:`jupyter_vgpu.slice.Slice.from_dict` (which also reads version 1, and whose checks
the slice contract's tests hold to its schema).

A kernel checks what it receives against the ``from-arbiter`` it was built with: a field
or a message added to it in a later version must go only to kernels whose hello says
they know it (kernels of version 1 checked nothing, and passed over what they did not
know).
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_vgpu.contracts import ContractError, lean, version

#: The protocol's version (a kernel's hello says which it speaks).
VERSION = version("to-arbiter")
#: The longest line accepted, bytes.
MAX_LINE = 64 * 1024
#: The version from which a kernel asks for room to grow (``room`` ``for: grow``) and is
#: told in its welcome that the arbiter answers it (``grow``).
GROW_VERSION = 4
#: The version from which a kernel says its cached free bytes (``cached_bytes``) and
#: answers ``release``.
RELEASE_VERSION = 5
#: The version from which a kernel says which of its requests for room are for a cell the
#: user ran (``cell``), the ones that take turns.
CELL_VERSION = 6
#: What only trusted clients may send.
TRUSTED = frozenset({"register", "unregister", "books", "refresh"})


class ProtocolError(ValueError):
    """A received message is malformed; the message says what is wrong."""


def decode(line: bytes) -> dict[str, Any]:
    """The message in one received line, checked against the ``to-arbiter`` contract.

    Raises:
        ProtocolError: not JSON, not an object, an unknown type, or a bad field.
    """
    try:
        msg = json.loads(line)
    except (ValueError, RecursionError):
        raise ProtocolError("not a JSON object") from None
    if not isinstance(msg, dict):
        raise ProtocolError("not a JSON object")
    try:
        lean.validate_message("to-arbiter", msg)
    except ContractError as e:
        raise ProtocolError(str(e)) from None
    return msg


def encode(msg: dict[str, Any]) -> bytes:
    """One line for ``msg`` (compact JSON and a newline)."""
    return json.dumps(msg, separators=(",", ":")).encode() + b"\n"
