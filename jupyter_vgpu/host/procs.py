"""Processes, not PIDs: whom the arbiter acts on.

A PID names a process only while it lives. Once the process ends and its parent reaps
it, the system hands the number to the next process that starts (every few seconds of
forks on a host with 32,768 PIDs). The arbiter runs as root, so a number read once and
acted on later could suspend, restore or end someone else's process. It therefore knows
a process by its :class:`Identity`:

- its PID;
- its start time (``/proc/<pid>/stat`` field 22, clock ticks after boot): two processes
  that share a PID one after the other differ in it;
- its effective uid (``/proc/<pid>/status``), the uid a socket's peer credentials give;
- where Linux gives one, a **pidfd**: a descriptor of that very process
  (``pidfd_open(2)``, Linux 5.3; ``SO_PEERPIDFD``, Linux 6.5, for the peer of a Unix
  socket, taken by the kernel at ``connect``). It does not keep the PID from being
  reused, but it tells whether its process has ended (it polls readable), and a signal
  sent through it (``pidfd_send_signal(2)``) can reach no other process.

An identity is taken once (a socket's peer as it connects, a kernel's children as they
are suspended, a process on a card when first seen) and :meth:`Identity.current` is
asked before every act on it: the process must not have ended, and its start time and
uid must be those taken. A process ``/proc`` cannot tell about is unknown, never
someone else's: the caller does nothing to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import select
import signal
import socket
import struct
import weakref

#: ``SO_PEERPIDFD`` (Linux 6.5, ``asm-generic/socket.h``), absent from Python's socket module before 3.13.
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)


@dataclasses.dataclass(frozen=True)
class Stat:
    """What ``/proc/<pid>/stat`` says of a process (``proc(5)``).

    Attributes:
        state: the state letter (``R``, ``S``, ``D``, ``T``, ``Z``...).
        ppid: its parent's PID (0 for init and kernel threads).
        start: its start time, clock ticks after boot.
    """

    state: str
    ppid: int
    start: int


def stat(pid: int) -> Stat | None:
    """``/proc/<pid>/stat`` of ``pid``, or None when it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        # the command name (field 2) may hold spaces and parentheses: split after the last ')'
        fields = text[text.rindex(")") + 2 :].split()
        return Stat(fields[0], int(fields[1]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks after boot, or None when it is
    gone (a zombie, ended and not yet reaped by its parent, counts as gone)."""
    st = stat(pid)
    return None if st is None or st.state in ("Z", "X") else st.start


def resident_bytes(pid: int) -> int | None:
    """Host memory process ``pid`` has resident (its RSS: ``/proc/<pid>/statm``'s second
    field, pages, times the page size), bytes; None when it cannot be read (gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def status_field(pid: int | str, name: str) -> list[str] | None:
    """The words after ``name:`` on its line of ``/proc/<pid>/status`` (``"Uid"``,
    ``"RssAnon"``...), or None when the file cannot be read or has no such line (gone, a
    kernel without the field). ``pid`` may be ``"self"``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == name:
                    return rest.split()
    except OSError:
        return None
    return None


def private_bytes(pid: int | str) -> int | None:
    """Host memory process ``pid`` alone holds: its resident anonymous memory (``RssAnon``
    of ``/proc/<pid>/status``: heap, stacks, private mappings; not the pages of its
    libraries, which every process that maps them shares), bytes; None when it cannot be
    read (gone, a kernel without the field). ``pid`` may be ``"self"``."""
    words = status_field(pid, "RssAnon")
    try:
        return int(words[0]) * 1024  # kB
    except (TypeError, ValueError, IndexError):
        return None


@dataclasses.dataclass(frozen=True)
class Memory:
    """What a process holds in host memory, bytes, as :func:`memory` read it.

    Attributes:
        rss: resident, all of it (``VmRSS``): ``anon + file + shmem``.
        anon: resident anonymous memory (``RssAnon``: heap, stacks, private mappings;
            what the process alone holds).
        file: resident pages of mapped files (``RssFile``: its libraries, mostly).
        shmem: resident shared memory (``RssShmem``: ``memfd``, ``/dev/shm``, shared
            anonymous mappings).
        swap: swapped out (``VmSwap``).
        locked: locked in memory (``VmLck``: ``mlock``).
        pss: its proportional share (``Pss`` of ``smaps_rollup``: each resident page
            divided by the number of processes mapping it); None where ``smaps_rollup``
            could not be read.
        pss_anon, pss_file, pss_shmem: that share by kind (``Pss_Anon``, ``Pss_File``,
            ``Pss_Shmem``, Linux 5.7); None where not read.
        source: ``"smaps_rollup"`` (with PSS) or ``"status"`` (without).
    """

    rss: int
    anon: int
    file: int
    shmem: int
    swap: int
    locked: int
    pss: int | None = None
    pss_anon: int | None = None
    pss_file: int | None = None
    pss_shmem: int | None = None
    source: str = "status"

    def as_dict(self) -> dict:
        """Its figures as ``{"rss_bytes": ..., "pss_bytes": ..., ..., "source": ...}``."""
        return {(k if k == "source" else f"{k}_bytes"): v for k, v in dataclasses.asdict(self).items()}


#: ``/proc/<pid>/status`` fields of :class:`Memory` (kB there).
_STATUS = {
    "VmRSS": "rss",
    "RssAnon": "anon",
    "RssFile": "file",
    "RssShmem": "shmem",
    "VmSwap": "swap",
    "VmLck": "locked",
}
#: ``/proc/<pid>/smaps_rollup`` fields of :class:`Memory` (kB there).
_ROLLUP = {"Pss": "pss", "Pss_Anon": "pss_anon", "Pss_File": "pss_file", "Pss_Shmem": "pss_shmem"}


def _kb_fields(path: str, names: dict[str, str]) -> dict[str, int]:
    found: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in names:
                found[names[key]] = int(rest.split()[0]) * 1024  # "kB"
    return found


def memory(pid: int | str, rollup: bool = True) -> Memory | None:
    """The host memory process ``pid`` holds, by kind (:class:`Memory`, bytes), read from
    outside it (``proc(5)``): ``VmRSS``, ``RssAnon``, ``RssFile``, ``RssShmem``,
    ``VmSwap`` and ``VmLck`` of ``/proc/<pid>/status``, and, with ``rollup``, ``Pss``,
    ``Pss_Anon``, ``Pss_File`` and ``Pss_Shmem`` of ``/proc/<pid>/smaps_rollup`` (Linux
    4.14; readable by the process's owner and root). None when the process is gone or
    ``status`` lacks the fields. ``pid`` may be ``"self"``.

    Why more than the RSS: the pages of a kernel's libraries (PyTorch's and CUDA's, some
    hundreds of MB) are file-backed and shared by every kernel that maps them, and the RSS
    counts them in each; summed over kernels, RSS overstates what they take from the host.
    The PSS divides each shared page among its sharers, so PSS summed over processes is
    what they take together; the anonymous part (``anon``) is what that process alone
    holds, and what ending or trimming it could give back.

    Cost: ``status`` is a few tens of µs; ``smaps_rollup`` walks the process's page tables,
    about 9 ms for a process that imported torch (220 MiB resident) and 30 to 60 ms at
    1 to 3 GiB resident (measured on a 2-core cloud VM, Linux 6.18): not for hot paths.
    """
    try:
        found = _kb_fields(f"/proc/{pid}/status", _STATUS)
    except (OSError, ValueError, IndexError):
        return None
    if "rss" not in found or "anon" not in found:
        return None
    figures = {name: found.get(name, 0) for name in _STATUS.values()}
    if rollup:
        try:
            shares = _kb_fields(f"/proc/{pid}/smaps_rollup", _ROLLUP)
        except (OSError, ValueError, IndexError):  # an older kernel, or not ours to read
            shares = {}
        if "pss" in shares:
            return Memory(**figures, **shares, source="smaps_rollup")
    return Memory(**figures)


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie has ended)."""
    st = stat(pid)
    return st is not None and st.state not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """The arguments ``pid`` was started with (``/proc/<pid>/cmdline``); [] when gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def environ(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (``/proc/<pid>/environ``: readable by its
    owner and root); {} when it cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (item.partition(b"=") for item in raw.split(b"\0") if item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, _, v in pairs}


def uid_of(pid: int) -> int | None:
    """The effective uid of process ``pid`` (``/proc/<pid>/status``, the ``Uid:`` line's
    second field), or None when it cannot be read."""
    words = status_field(pid, "Uid")
    try:
        return int(words[1])
    except (TypeError, ValueError, IndexError):
        return None


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # gone, or a kernel or Python without pidfds
        return None


def _ended(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has ended (a zombie included)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


class Identity:
    """One process, as it was when first seen.

    Use :meth:`of` for a PID and :meth:`of_peer` for a socket's peer; both return None
    when the process is gone (or, for a peer, when the PID now names a process of
    another uid). Holds a pidfd, closed by :meth:`close` or when the identity is
    garbage collected.

    Attributes:
        pid: the process's PID when seen.
        uid: its effective uid.
        start: its start time, clock ticks after boot.
    """

    def __init__(self, pid: int, uid: int, start: int, pidfd: int | None):
        self.pid, self.uid, self.start = pid, uid, start
        self.pidfd = pidfd
        self._closer = weakref.finalize(self, os.close, pidfd) if pidfd is not None else None

    @classmethod
    def of(cls, pid: int, uid: int | None = None) -> Identity | None:
        """The process ``pid`` is now; None when it is gone, when ``/proc`` cannot say,
        or when its effective uid is not ``uid`` (where given)."""
        pidfd = _pidfd_open(pid)
        return cls._checked(pid, uid, pidfd)

    @classmethod
    def _checked(cls, pid: int, uid: int | None, pidfd: int | None) -> Identity | None:
        start, found = start_time(pid), uid_of(pid)
        # read after the pidfd was taken: while the pidfd's process has not ended, the
        # PID cannot have been handed to another, so what /proc said is of that process
        alive = start is not None and found is not None and (pidfd is None or not _ended(pidfd))
        if not alive or (uid is not None and found != uid):
            if pidfd is not None:
                os.close(pidfd)
            return None
        return cls(pid, found, start, pidfd)

    @classmethod
    def of_peer(cls, sock: socket.socket) -> tuple[int, int, Identity | None]:
        """``(pid, uid, identity)`` of the process at the other end of a connected Unix
        socket. ``pid`` and ``uid`` are the peer credentials the Linux kernel took at
        ``connect`` (``SO_PEERCRED``); the identity is None when that process has ended
        since, or when the PID names a process of another uid now (it changed hands).

        Raises:
            OSError: not a connected Unix socket.
        """
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _ = struct.unpack("3i", raw)
        try:  # the very process that connected, whatever became of its PID since
            pidfd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        except OSError:  # older than Linux 6.5 (ENOPROTOOPT), or the peer has ended (ESRCH)
            pidfd = _pidfd_open(pid)
        return pid, uid, cls._checked(pid, uid, pidfd)

    def ended(self) -> bool:
        """Whether the process has ended (a zombie included), as its pidfd says; where
        there is none, whether ``/proc`` shows another start time or nothing at its PID
        (a PID handed on within one clock tick then reads as the same process)."""
        if self.pidfd is not None:
            return _ended(self.pidfd)
        return start_time(self.pid) != self.start

    def current(self) -> bool:
        """Whether the process is still the one first seen: not ended, same start time,
        same effective uid. False when ``/proc`` cannot say."""
        if self.pidfd is not None and _ended(self.pidfd):
            return False
        return start_time(self.pid) == self.start and uid_of(self.pid) == self.uid

    def send(self, sig: int = signal.SIGKILL) -> bool:
        """Send ``sig`` to this process and no other; False (nothing sent) when it has
        ended or is no longer the one first seen."""
        if not self.current():
            return False
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, sig)
            else:
                os.kill(self.pid, sig)
        except (ProcessLookupError, PermissionError, OSError):
            return False
        return True

    def close(self) -> None:
        """Let go of the pidfd (the identity can no longer be checked through it)."""
        if self._closer is not None:
            self._closer()

    def __repr__(self) -> str:
        return f"Identity(pid={self.pid}, uid={self.uid}, start={self.start})"


def describe(pid: int) -> dict:
    """What ``/proc`` says of a process: its executable, uid and cgroup (None where unreadable)."""
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        exe = None
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = next((line.split(":", 2)[2].strip() for line in f if line.startswith("0::")), None)
    except OSError:
        cgroup = None
    return {"exe": exe, "uid": uid_of(pid), "cgroup": cgroup}


def close_quietly(identities) -> None:
    """Close every identity of ``identities`` (an iterable; None entries skipped)."""
    for ident in identities:
        if ident is not None:
            with contextlib.suppress(OSError):
                ident.close()
