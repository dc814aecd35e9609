"""PIDs across PID namespaces, and the Kubernetes pod a process belongs to.

On Kubernetes every notebook runs in its pod's own PID namespace: its kernels see small
container PIDs (``os.getpid()``, what they write in their reports), while NVML lists the
host's PIDs. The node arbiter runs in the host's PID namespace (``hostPID: true`` in
``deploy/kubernetes/arbiter-daemonset.yaml``), so the PIDs it sees are NVML's: the
Linux kernel translates a socket peer's PID (``SO_PEERCRED``) into the reader's
namespace, and ``/proc`` is the host's. What it needs besides is, for a host PID:

- the process's PID in each namespace down to its own (:func:`ns_pids`, the ``NSpid``
  line of ``/proc/<pid>/status``, Linux 4.1+): the last one is the PID the kernel itself
  sees and reports;
- the pod it runs in (:func:`pod_uid`, from ``/proc/<pid>/cgroup``): the kubelet puts
  every container of a pod under a cgroup named after the pod's uid, with the cgroupfs
  driver (``/kubepods/burstable/pod<uid>/<container>``) and the systemd driver
  (``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/…``),
  on cgroup v1 and v2 alike. A process cannot move itself out of its pod's cgroup (the
  cgroup filesystem is read-only in the container), so the pod identifies a kernel's
  server as firmly as the process tree does on one host;
- the host PID of a PID a pod's process reported about itself (:func:`host_pid`).

In one PID namespace (no containers, the tests) every mapping is the identity.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_POD = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def parse_nspid(status: str) -> list[int]:
    """The PIDs of the ``NSpid:`` line of a ``/proc/<pid>/status`` text, outermost first
    (``"NSpid:\\t4242\\t7"`` -> ``[4242, 7]``); ``[]`` when there is none (Linux < 4.1)."""
    for line in status.splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return []


def parse_pod_uid(cgroup: str) -> str | None:
    """The pod uid in a ``/proc/<pid>/cgroup`` text, dashed (``"0b7e5c1e-1f4c-…"``), or
    None outside a Kubernetes pod. The innermost (last) pod segment wins."""
    found = None
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        for m in _POD.finditer(path):
            found = m[1].replace("_", "-")
    return found


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def ns_pids(pid: int, proc: str = "/proc") -> list[int]:
    """``pid`` (as this process's ``/proc`` sees it) in every PID namespace down to its
    own, outermost first; ``[]`` when the process is gone."""
    text = _read(f"{proc}/{pid}/status")
    if text is None:
        return []
    return parse_nspid(text) or [pid]


def container_pid(pid: int, proc: str = "/proc") -> int | None:
    """The PID process ``pid`` sees for itself (its innermost namespace's), or None."""
    pids = ns_pids(pid, proc)
    return pids[-1] if pids else None


def pod_uid(pid: int, proc: str = "/proc") -> str | None:
    """The uid of the Kubernetes pod process ``pid`` runs in, or None (not in a pod, or
    gone)."""
    text = _read(f"{proc}/{pid}/cgroup")
    return parse_pod_uid(text) if text is not None else None


def host_pid(own_pid: int, candidates: Iterable[int], proc: str = "/proc") -> int | None:
    """Which of ``candidates`` (PIDs as this process sees them: a pod's processes)
    calls itself ``own_pid`` in its innermost namespace; None when none does.

    A kernel's report says ``pid`` 7; its pod's processes seen here are 4242 (NSpid
    ``4242 7``) and 4250: the answer is 4242.
    """
    for pid in candidates:
        if container_pid(pid, proc) == own_pid:
            return pid
    return None
