"""A server known by its process tree is that very process, not its PID and start time.

Start times are clock ticks (10 ms): a process handed the PID of a server that ended
within the same tick reads as the server, and the ``server-pid-reuse`` attack got the
victim's slice in one run of eight so. The registry holds the server process's pidfd from
its registration. Here the tick is taken out of chance: the server's start time on record
is set to that of the process now at its PID, as if both had started in one tick; only
the pidfd can tell them apart. Real processes; needs root (``ns_last_pid``)."""

import subprocess

from jupyter_vgpu.host import procs
from jupyter_vgpu.node.books import Server
from jupyter_vgpu.node.registry import Registry
from jupyter_vgpu.testing.security_scene import SLICE, python_sleeping, take_pid


def test_a_process_on_an_ended_servers_pid_is_not_the_server_even_at_its_start_time():
    server_process = subprocess.Popen(python_sleeping())
    newcomer = None
    try:
        seen = procs.Identity.of(server_process.pid)
        assert seen is not None
        server = Server(server_process.pid, "victim", "", SLICE, start=seen.start, process=seen)
        assert Registry._still_started(server)
        server_process.kill()
        server_process.wait(10)
        newcomer = take_pid(server.pid, lambda: subprocess.Popen(python_sleeping()))
        assert newcomer is not None, "the scene is wrong: the PID went to another process"
        same_tick = Server(
            server.pid, "victim", "", SLICE, start=procs.start_time(newcomer.pid), process=seen
        )
        assert not Registry._still_started(same_tick)
        # without the pidfd, as when the server had ended before its registration: the
        # start time alone, which this one shares
        assert Registry._still_started(Server(server.pid, "victim", "", SLICE, start=same_tick.start))
    finally:
        for p in (server_process, newcomer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
