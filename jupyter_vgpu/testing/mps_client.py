"""A process that reports what its MPS slice gives it, for the MPS tests and benchmark
(``tests/gpu/test_mps.py``, ``tests/gpu/test_two_gpus.py``, ``benchmarks/mps.py``), and
control daemons of their own for them (:func:`own_daemons`).

It reports, as one JSON line: ``sms``, the streaming multiprocessors it sees; ``matmul_s``,
seconds of 100 bf16 8192x8192 matmuls after three warm ones; ``uuid``, its card's UUID;
``1_gib`` and ``3_gib`` (the sizes in ``JUPYTER_VGPU_CLIENT_GIB``, comma-separated,
where the environment has it), ``"allocated"`` or ``"refused: <the error's first line>"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence

from jupyter_vgpu.node.mps import MPSDaemons
from jupyter_vgpu.slice import Slice
from jupyter_vgpu.testing.preloaded import environment

CLIENT = """
import json, os, time, torch
sms = torch.cuda.get_device_properties(0).multi_processor_count
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ a
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(100):
    a @ a
torch.cuda.synchronize()
result = {"sms": sms, "matmul_s": time.perf_counter() - start,
          "uuid": "GPU-" + str(torch.cuda.get_device_properties(0).uuid)}
for gib in [int(g) for g in os.environ.get("JUPYTER_VGPU_CLIENT_GIB", "1,3").split(",")]:
    try:
        x = torch.empty(gib << 30, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        torch.cuda.synchronize()
        result[f"{gib}_gib"] = "allocated"
        del x
    except torch.OutOfMemoryError as e:
        result[f"{gib}_gib"] = "refused: " + str(e).splitlines()[0][:120]
    torch.cuda.empty_cache()
print(json.dumps(result))
"""


def run(env: dict[str, str], timeout: float = 300) -> dict:
    """The report of a client started with ``env`` (the slice's environment, MPS's pipe
    directory), waiting up to ``timeout`` seconds.

    Raises:
        RuntimeError: the client failed; the message ends with its stderr.
        subprocess.TimeoutExpired: it ran past ``timeout``.
    """
    done = subprocess.run(
        [sys.executable, "-c", CLIENT], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"an MPS client failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def client_environment(slice_: Slice, pipe: str, preload: bool) -> dict[str, str]:
    """The environment of a client of ``slice_`` whose MPS daemon listens in ``pipe``
    (``CUDA_MPS_PIPE_DIRECTORY``), with the pausable allocator preloaded or not."""
    base = environment() if preload else {**os.environ}
    return {**base, **slice_.environment(), "CUDA_MPS_PIPE_DIRECTORY": pipe}


@contextlib.contextmanager
def own_daemons(uuids: Sequence[str]) -> Iterator[MPSDaemons]:
    """MPS control daemons on the cards ``uuids``, started as the arbiter starts them
    (:meth:`MPSDaemons.ensure`) for an arbiter socket in a new temporary directory, short
    enough for the daemons' Unix sockets (``sun_path``), and stopped with the directory
    removed when the block ends. Yields the daemons (their pipe directories:
    :meth:`MPSDaemons.directories`).

    Raises:
        MPSUnavailable: a daemon did not start.
    """
    directory = tempfile.mkdtemp(prefix="vgpu-")
    daemons = MPSDaemons(os.path.join(directory, "arbiter.sock"))
    try:
        for uuid in uuids:
            daemons.ensure(uuid)
        yield daemons
    finally:
        for uuid in uuids:
            daemons.stop(uuid)
        shutil.rmtree(directory, ignore_errors=True)
