"""The ``mps`` backend on the real card: the arbiter's control daemon, and what a client
started with a slice's environment may use.

A client of the daemon the arbiter starts (:class:`jupyter_vgpu.node.mps.MPSDaemons`),
with the environment the spawner gives a server (:meth:`Slice.environment`: 25% compute
share, 2 GiB budget), sees at most a quarter of the SMs, runs a compute-bound loop
slower than a 100% client, and is refused 3 GiB where 1 GiB succeeds, also when it
allocates through the pausable allocator (CUDA's virtual-memory API), as kernels do;
NVML names a client with what it holds, as the arbiter's books read it; and a client
that clears those limits still meets the daemon's, the card's ceiling the arbiter sets.
Each client prints what it measured (``-rA`` shows it).
"""

import asyncio
import json
import math
import os
import shutil
import tempfile

import pytest

from jupyter_vgpu import nvml
from jupyter_vgpu.node.app import ArbiterApp
from jupyter_vgpu.node.arbiter import Arbiter
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing import card_holder
from jupyter_vgpu.testing.mps_client import client_environment, own_daemons
from jupyter_vgpu.testing.mps_client import run as client

pytestmark = pytest.mark.gpu
GiB = 2**30


@pytest.fixture
def daemon():
    gpu = nvml.list_gpus()[0]
    with own_daemons([gpu.uuid]) as daemons:
        assert daemons.running(gpu.uuid)
        yield gpu, daemons


def test_a_25_percent_2_gib_slice_gets_a_quarter_of_the_sms_and_no_more_than_its_budget(daemon):
    gpu, daemons = daemon
    pipe = str(daemons.directories(gpu.uuid)[0])
    full = Slice.on_card(gpu, gpu.memory_total, 100, isolation="mps")
    quarter = Slice.on_card(gpu, 2 * GiB, 25, isolation="mps")

    def env(slice_: Slice, preload: bool) -> dict[str, str]:
        return client_environment(slice_, pipe, preload)

    whole = client(env(full, False))
    plain = client(env(quarter, False))
    pausable = client(env(quarter, True))
    print(json.dumps({"full": whole, "quarter": plain, "quarter_pausable_allocator": pausable}))

    assert plain["sms"] <= math.ceil(0.25 * whole["sms"]) + 2, (plain, whole)
    # slower than the whole card; the 2x is benchmarks/mps.py's to measure
    assert plain["matmul_s"] > 1.5 * whole["matmul_s"], (plain, whole)
    for measured in (plain, pausable):
        assert measured["1_gib"] == "allocated", measured
        assert measured["3_gib"].startswith("refused"), measured
    assert whole["3_gib"] == "allocated", whole


def test_nvml_names_each_client_with_its_own_memory(daemon):
    """The arbiter's books read a kernel's card memory from NVML by its PID
    (:func:`jupyter_vgpu.nvml.process_memory`): an MPS client is listed by NVML's MPS
    query, not its compute one, and must be found there with what it holds."""
    gpu, daemons = daemon
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": gpu.uuid,
        "CUDA_MPS_PIPE_DIRECTORY": str(daemons.directories(gpu.uuid)[0]),
    }
    holder = card_holder.hold(GiB, env=env)
    try:
        used = nvml.process_memory(gpu.uuid)
        print(json.dumps({"client": holder.pid, "process_memory": used}))
        assert used.get(holder.pid, 0) >= GiB, used
    finally:
        holder.stdin.close()
        holder.wait(30)


def test_a_client_that_clears_its_limits_still_meets_the_daemons():
    """A user's process may clear ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` or ask for the whole card; the arbiter gives the
    card's daemon the largest share and budget of its ``mps`` slices
    (:meth:`jupyter_vgpu.node.mps.MPSDaemons.set_limits`), which no client passes: first
    as the default of the server a first client gets, then, as a larger slice registers,
    as the limit of that server, running."""
    gpu = nvml.list_gpus()[0]
    directory = tempfile.mkdtemp(prefix="vgpu-")
    arbiter = Arbiter(ArbiterApp(registrars="none", socket_path=os.path.join(directory, "arbiter.sock")))
    cleared = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    env = {**cleared, "CUDA_VISIBLE_DEVICES": gpu.uuid}
    card_mib = gpu.memory_total // 2**20  # the whole card, asked for
    asks_all = {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={card_mib}M",
    }

    async def register(pid: int, share: int, budget: int) -> None:
        arbiter.register(pid, f"user{pid}", "", Slice.on_card(gpu, budget, share, isolation="mps"))
        while arbiter._inflight:
            await asyncio.gather(*list(arbiter._inflight))

    try:
        whole = client(env)  # no daemon yet: a context of its own, the whole card
        asyncio.run(register(os.getpid(), 25, 2 * GiB))
        assert arbiter.mps.running(gpu.uuid), list(arbiter.decisions)
        pipe = {"CUDA_MPS_PIPE_DIRECTORY": str(arbiter.mps.directories(gpu.uuid)[0])}
        first = client({**env, **pipe})  # its server starts with the daemon's defaults
        servers = arbiter.mps.servers(gpu.uuid)
        asyncio.run(register(os.getppid(), 50, 4 * GiB))
        then = client({**env, **pipe, **asks_all, "JUPYTER_VGPU_CLIENT_GIB": "1,3,5"})
        decisions = [d for d in arbiter.decisions if d["what"].startswith("mps")]
        print(
            json.dumps(
                {
                    "whole": whole,
                    "cleared": first,
                    "asks_all": then,
                    "servers": servers,
                    "decisions": decisions,
                }
            )
        )
        assert [d["what"] for d in decisions] == ["mps daemon", "mps limits", "mps limits"], decisions
        assert first["sms"] <= math.ceil(0.25 * whole["sms"]) + 2, (first, whole)
        assert first["1_gib"] == "allocated", first
        assert first["3_gib"].startswith("refused"), first
        assert math.ceil(0.25 * whole["sms"]) + 2 < then["sms"] <= math.ceil(0.5 * whole["sms"]) + 2, (
            then,
            whole,
        )
        assert then["3_gib"] == "allocated", then  # within the 4 GiB now the card's ceiling
        assert then["5_gib"].startswith("refused"), then
    finally:
        arbiter.mps.stop(gpu.uuid)
        shutil.rmtree(directory, ignore_errors=True)
