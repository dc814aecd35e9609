"""A process's host memory by kind (:func:`jupyter_vgpu.host.procs.memory`), read from
``/proc`` on the test process itself: anonymous memory it touches shows as ``anon``, a
shared ``memfd`` mapping as ``shmem``, and pages two processes share are halved in PSS."""

import mmap
import os
import subprocess
import sys

from jupyter_vgpu.host import procs

MiB = 2**20


def touched(m: mmap.mmap) -> mmap.mmap:
    for off in range(0, len(m), mmap.PAGESIZE):
        m[off] = 1
    return m


def test_anonymous_memory_the_process_touches_shows_as_its_own():
    before = procs.memory("self")
    m = touched(mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    try:
        after = procs.memory("self")
        assert after.source == "smaps_rollup"  # Linux 4.14 and later: PSS read
        assert after.anon - before.anon >= 60 * MiB, (before, after)
        assert after.pss - before.pss >= 60 * MiB, (before, after)  # its own pages: all of them its share
        assert after.shmem - before.shmem < 8 * MiB, (before, after)
        assert after.pss <= after.rss
        assert abs(after.rss - (after.anon + after.file + after.shmem)) < 4 * MiB, after
    finally:
        m.close()


def test_a_shared_memfd_mapping_shows_as_shmem_not_anonymous():
    before = procs.memory("self")
    fd = os.memfd_create("test-shmem")
    try:
        os.ftruncate(fd, 64 * MiB)
        m = touched(mmap.mmap(fd, 64 * MiB, flags=mmap.MAP_SHARED))
        after = procs.memory("self")
        assert after.shmem - before.shmem >= 60 * MiB, (before, after)
        assert after.anon - before.anon < 8 * MiB, (before, after)
        assert after.pss_shmem - before.pss_shmem >= 60 * MiB, (before, after)
        m.close()
    finally:
        os.close(fd)


def test_pages_two_processes_share_count_half_in_each_ones_pss():
    """A forked child reads every page of a touched shared mapping: both have its 64 MiB
    resident, each is charged half of it in PSS, and all of it in RSS."""
    m = touched(mmap.mmap(-1, 64 * MiB, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS))
    alone = procs.memory("self")
    ready_r, ready_w = os.pipe()
    done_r, done_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read every page, say so, wait to be told to go
        sum(m[off] for off in range(0, len(m), mmap.PAGESIZE))
        os.write(ready_w, b"x")
        os.read(done_r, 1)
        os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        shared = procs.memory("self")
        theirs = procs.memory(pid)
        assert alone.pss_shmem - shared.pss_shmem >= 28 * MiB, (alone, shared)  # half is the child's
        assert abs(shared.shmem - alone.shmem) < 4 * MiB, (alone, shared)  # RSS counts it whole in each
        assert theirs.shmem >= 60 * MiB, theirs
        assert theirs.pss_shmem < theirs.shmem - 28 * MiB, theirs
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, done_r, done_w):
            os.close(fd)
        m.close()


def test_a_process_that_is_gone_has_no_figures():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(10)
    assert procs.memory(child.pid) is None
    assert procs.memory(child.pid, rollup=False) is None


def test_without_the_rollup_the_status_fields_alone_are_read():
    m = procs.memory("self", rollup=False)
    assert m.source == "status"
    assert m.pss is None
    assert m.pss_anon is None
    assert m.rss > 0
    assert m.anon > 0
    d = m.as_dict()
    assert d["rss_bytes"] == m.rss
    assert d["pss_bytes"] is None
    assert d["source"] == "status"
