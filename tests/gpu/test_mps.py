"""The ``mps`` backend on the real card: the arbiter's control daemon, and what a client
started with a slice's environment may use.

A client of the daemon the arbiter starts (:class:`jupyter_vgpu.node.mps.MPSDaemons`),
with the environment the spawner gives a server (:meth:`Slice.environment`: 25% compute
share, 2 GiB budget), sees at most a quarter of the SMs, runs a compute-bound loop
slower than a 100% client, and is refused 3 GiB where 1 GiB succeeds, also when it
allocates through the pausable allocator (CUDA's virtual-memory API), as kernels do; and
NVML names a client with what it holds, as the arbiter's books read it.
Each client prints what it measured (``-rA`` shows it).
"""

import json
import math
import os

import pytest

from jupyter_vgpu import nvml
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
