"""PIDs across PID namespaces and the pod of a process: parsing real /proc files and
the cgroup paths the kubelet writes, identity in one namespace, and a real nested PID
namespace (``unshare --pid``) whose process the arbiter sees by its host PID."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest

from jupyter_vgpu.host.peers import peer_credentials
from jupyter_vgpu.node import namespaces
from jupyter_vgpu.testing.waiting import wait_for

UID = "0b7e5c1e-1f4c-4c55-9d2e-2f6f3a0f1a11"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Name:\tpython\nNSpid:\t4242\t7\nNSpgid:\t4242\t7\n", [4242, 7]),
        ("Name:\tpython\nNSpid:\t4242\t99\t1\n", [4242, 99, 1]),
        ("Name:\tpython\nNSpid:\t12\n", [12]),
        ("Name:\tpython\nPid:\t12\n", []),  # Linux before 4.1
    ],
)
def test_nspid_lines(text, expected):
    assert namespaces.parse_nspid(text) == expected


@pytest.mark.parametrize(
    ("cgroup", "expected"),
    [
        # cgroup v2, systemd driver (kubeadm's default): dashes become underscores
        (
            "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0b7e5c1e_1f4c_4c55_9d2e_2f6f3a0f1a11"
            ".slice/cri-containerd-4f2a.scope\n",
            UID,
        ),
        # cgroup v2, cgroupfs driver (k3s, kind)
        (f"0::/kubepods/burstable/pod{UID}/4f2a9c\n", UID),
        # a Guaranteed pod has no QoS folder
        (f"0::/kubepods/pod{UID}/4f2a9c\n", UID),
        # cgroup v1: every controller names it
        (
            f"12:memory:/kubepods/besteffort/pod{UID}/4f2a\n11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/4f2a\n",
            UID,
        ),
        # not in a pod
        ("0::/user.slice/user-1000.slice/session-3.scope\n", None),
        ("0::/\n", None),
        # a folder merely starting with "pod" is not a pod
        ("0::/system.slice/podman.service\n", None),
    ],
)
def test_pod_uid_from_the_cgroup_paths_the_kubelet_writes(cgroup, expected):
    assert namespaces.parse_pod_uid(cgroup) == expected


def test_in_one_namespace_every_mapping_is_the_identity():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert namespaces.ns_pids(child.pid) == [child.pid]
        assert namespaces.container_pid(child.pid) == child.pid
        assert namespaces.host_pid(child.pid, [os.getpid(), child.pid]) == child.pid
        # parent and child share their cgroup, so they are in the same pod or in none
        with open("/proc/self/cgroup") as f:
            mine = namespaces.parse_pod_uid(f.read())
        assert namespaces.pod_uid(child.pid) == mine == namespaces.pod_uid(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert namespaces.ns_pids(child.pid) == []  # gone
    assert namespaces.container_pid(child.pid) is None
    assert namespaces.pod_uid(child.pid) is None


def ended(pid: int) -> bool:
    """Gone, or a zombie waiting for whoever reaps orphans here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _nested_pid_namespace_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--kill-child", "true"], capture_output=True, timeout=30
    )
    return done.returncode == 0


@pytest.mark.skipif(
    not _nested_pid_namespace_works(), reason="cannot make a PID namespace here (unshare --pid)"
)
def test_a_process_in_its_own_pid_namespace_is_seen_by_its_host_pid(tmp_path):
    """As a kernel in a pod: it calls itself PID 1, the arbiter's socket and /proc see
    its host PID, and NSpid joins the two."""
    path = str(tmp_path / "arbiter.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(30)
    client = (
        "import os, socket, time\n"
        f"s = socket.socket(socket.AF_UNIX); s.connect({path!r})\n"
        "s.sendall(str(os.getpid()).encode() + b'\\n'); time.sleep(30)\n"
    )
    # --kill-child: the process in the namespace ends with unshare, which the test ends
    inner = subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-c", client])
    try:
        conn, _ = server.accept()
        with conn:
            said = int(conn.makefile().readline())
            pid, uid, _ = peer_credentials(conn)
        assert said == 1  # what the process itself (a kernel's report) says
        assert pid != said
        assert uid == os.getuid()
        assert namespaces.ns_pids(pid) == [pid, 1]
        assert namespaces.container_pid(pid) == 1
        # the report's PID found among the pod's processes as seen here
        assert namespaces.host_pid(1, [os.getpid(), inner.pid, pid]) == pid
        wait_for(
            lambda: namespaces.ns_pids(inner.pid) == [inner.pid], 10, "unshare's own PID in our namespace"
        )
        inner.kill()
        inner.wait()
        wait_for(lambda: ended(pid), 10, "the process in the namespace to end with unshare")
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        server.close()
