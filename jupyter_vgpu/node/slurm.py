"""The Slurm job a process belongs to, from its cgroup.

On a Slurm node with ``ProctrackType=proctrack/cgroup`` (Slurm's recommended process
tracking) slurmd puts every process of a job, the batch script and every step, in the
job's cgroup, and a process cannot leave it: Slurm signals and kills a job by that
cgroup. So the job identifies a user's server as firmly as the pod does on Kubernetes
(:mod:`.namespaces`), whatever the server's processes do (``setsid``, double forks).

The cgroup paths, one ``job_<id>`` segment each (Slurm's ``cgroup.conf`` manual and
its cgroup/v1 and cgroup/v2 plugins)::

    cgroup v1:  7:freezer:/slurm/uid_1000/job_42/step_batch
                (one slurmd per host in multiple-slurmd mode: /slurm_<node>/uid_…/job_42/…)
    cgroup v2:  0::/system.slice/slurmstepd.scope/job_42/step_0/user/task_0

The node arbiter keys such a server ``"job:<id>"`` in its books.
"""

from __future__ import annotations

import re

_JOB = re.compile(r"/job_([0-9]+)(?=/|$)")


def parse_job_id(cgroup: str) -> str | None:
    """The Slurm job id in a ``/proc/<pid>/cgroup`` text (``"42"``), or None outside a
    Slurm job. The innermost ``job_<id>`` segment of any hierarchy wins; a line is
    ``<id>:<controllers>:<path>``."""
    found = None
    for line in cgroup.splitlines():
        path = line.split(":", 2)[-1]
        for m in _JOB.finditer(path):
            found = m[1]
    return found


def job_id(pid: int, proc: str = "/proc") -> str | None:
    """The id of the Slurm job process ``pid`` runs in, or None (not in a job, or gone)."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return parse_job_id(text)


def job_key(pid: int, proc: str = "/proc") -> str | None:
    """``"job:<id>"`` of process ``pid``'s Slurm job (its key in the arbiter's books and in
    the node report), or None."""
    job = job_id(pid, proc)
    return f"job:{job}" if job else None
