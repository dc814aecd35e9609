"""A process started from a JupyterLab terminal belongs to its server in the arbiter's
eyes: the watchdog's owner lookup (the code the arbiter runs on every look) maps it to
the server's slice, so its GPU memory counts against that budget like a kernel's."""

import re

from jupyter_vgpu.host import peers
from jupyter_vgpu.node.books import Server
from jupyter_vgpu.node.watchdog import Owner, owners
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.lab_client import LabClient
from jupyter_vgpu.testing.server_process import TERMINALS_ON, JupyterServer

GiB = 2**30
HOLD = "python3 -c \"import os, time; print('pid', os.getpid(), 'up', flush=True); time.sleep(120)\""


def test_a_terminal_process_is_owned_by_its_server(tmp_path):
    server = JupyterServer(tmp_path / "alice", {}, args=[TERMINALS_ON])
    other = JupyterServer(tmp_path / "bob", {})
    try:
        slice_ = Slice("GPU-sim-0", 0, "Simulated GPU", 80 * GiB, 2 * GiB, 100, simulated=True)
        books = [Server(server.proc.pid, "alice", "", slice_), Server(other.proc.pid, "bob", "", slice_)]
        lab = LabClient(server.url + "/", server.token)
        _, text = lab.terminal(HOLD, until=" up")
        pid = int(re.search(r"pid (\d+) up", text).group(1))
        owner = owners(books, lambda p: (peers.root_in(p, [s.root for s in books]), "tree"))
        expected = Owner(server.proc.pid, books[0].key, 2 * GiB, "tree")
        assert owner(pid) == expected, (pid, peers.ancestors(pid))
        assert server.proc.pid in peers.ancestors(pid)
        assert other.proc.pid not in peers.ancestors(pid)
    finally:
        server.stop()
        other.stop()
