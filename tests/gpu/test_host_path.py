"""The host codec path on a GPU: pieces decoded on the CPU threads as byte planes and
joined on the GPU after the copy come back bit-exact, as the CPU's own join does, for
every width and odd size; a damaged piece is still caught."""

import pytest

from jupyter_vgpu.testing.preloaded import run

pytestmark = pytest.mark.gpu


def test_the_gpu_join_and_the_cpu_join_give_back_the_same_bytes():
    got = run(
        """
import json, torch
from jupyter_vgpu.kernel.codec.host import HostPath
from jupyter_vgpu.kernel.codec.zstd import Codec, CodecError
from jupyter_vgpu.kernel.pause.store import HostStore
dev = torch.device("cuda")
torch.manual_seed(0)
MiB = 1 << 20
path = HostPath(torch, 0, Codec(chunk_bytes=MiB), piece_bytes=8 * MiB)
staging = torch.empty(8 * MiB, dtype=torch.uint8, device=dev)
def data(kind, n):
    if kind == "bf16":
        t = (torch.randn(n, device=dev) * 0.02).to(torch.bfloat16)
    elif kind == "fp32":
        t = torch.randn(n, device=dev) ** 2
    elif kind == "fp64":
        t = torch.randn(n, device=dev, dtype=torch.float64)
    else:
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, device=dev)
    return t.view(torch.uint8).view(-1)[:n].clone()
sizes = [1, 3, 4, 7, 4096 + 2, MiB - 1, MiB + 4, 8 * MiB, 8 * MiB + 12, 19 * MiB + 3]
rows = []
for kind in ("bf16", "fp32", "fp64", "uint8"):
    ranges = [data(kind, n) for n in sizes]
    store = HostStore(None, None)
    pieces = path.pack([(t, t.numel()) for t in ranges], store)
    for join in ("gpu", "cpu"):
        back = [torch.full_like(t, 0xA5) for t in ranges]
        path.unpack(list(zip(back, pieces)), store, staging if join == "gpu" else None)
        torch.cuda.synchronize()
        rows.append(dict(kind=kind, join=join, exact=all(torch.equal(a, b) for a, b in zip(ranges, back))))
import dataclasses
from jupyter_vgpu.kernel.codec.host import HostPiece
first = pieces[-1][0]
packed = store.get(first.key)
chunks = list(packed.chunks)
bad = bytearray(chunks[2].payload)
bad[len(bad) // 2] ^= 0x01
chunks[2] = dataclasses.replace(chunks[2], payload=bytes(bad))
other = HostStore(None, None)
key = other.put(dataclasses.replace(packed, chunks=tuple(chunks)))
piece = HostPiece(0, first.length, key, first.stored_bytes)
error = None
try:
    path.unpack([(torch.zeros(first.length, dtype=torch.uint8, device=dev), [piece])], other, staging)
except CodecError as e:
    error = str(e)
print(json.dumps(dict(rows=rows, join_reason=path.join_reason, error=error)))
"""
    )
    assert got["join_reason"] is None, got["join_reason"]
    for row in got["rows"]:
        assert row["exact"], row
    assert got["error"], "a damaged piece must not decode"
    assert "chunk at byte" in got["error"]
