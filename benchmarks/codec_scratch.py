"""Does what the GPU codec stores depend on a piece's bytes alone? Piece sharing (issue 42)
finds equal pieces of two kernels by their keys (CRC-32s and sizes of the stored chunks),
and two kernels' codec scratch holds different bytes.

The same bf16 weights (64 whole 8 MiB pieces, and a range of 20 whole pieces and a tail) are
packed through one codec after its scratch held zeros, the last pack's leftovers, random
bytes and 0xFF; the keys of each pack are compared with those of the first pack after
zeros. Both ways the codec can run: with the compressor's output slots zeroed before each
piece (``zeroed``: the codec since a3c2822) and without (``not_zeroed``: ``Driver.zero``
made a no-op, the codec before it: nvCOMP's ANS leaves bytes of a chunk's output
unwritten). Then 2 GiB of the weights are packed eight times each way, three rounds, the
warm arena kept: the median of the last six packs, in seconds.

Writes JSON: the provenance keys; ``pieces`` (per pack); ``keys_alike``: per way, per
scratch before (``zeros``, ``leftovers``, ``random``, ``ones``), the pieces whose keys
equal the first pack's; ``pack_s``: per way, the median per round (seconds);
``pack_gbps``: 2 GiB over the median of the rounds' medians; ``zeroing_added``: per round,
zeroed over not zeroed, less 1. Needs a GPU and nvCOMP::

    python benchmarks/codec_scratch.py --out benchmarks/results/codec-scratch-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import provenance
from gpu_common import require_gpu

MiB = 1 << 20
RULE = "numpy.median"
SCRATCH = ("zeros", "leftovers", "random", "ones")


def codec(torch, zeroed: bool):
    from jupyter_vgpu.kernel.codec.device import DeviceCodec

    c = DeviceCodec(torch, 0)
    if not zeroed:  # the codec before a3c2822: the output slots keep what they held
        c.cu.zero = lambda *args: None
    scratch = torch.empty(c.scratch_bytes(), dtype=torch.uint8, device="cuda")
    c.bind(scratch)
    return c, scratch


def keys_alike(torch, zeroed: bool, ranges) -> tuple[int, dict[str, int]]:
    from jupyter_vgpu.host.pieces import piece_key
    from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena

    c, scratch = codec(torch, zeroed)
    before = {
        "zeros": scratch.zero_,
        "leftovers": lambda: None,
        "random": lambda: scratch.random_(0, 256),
        "ones": lambda: scratch.fill_(0xFF),
    }

    def keys(fill) -> list[bytes]:
        fill()
        torch.cuda.synchronize()
        pieces = c.pack([(t, t.numel()) for t in ranges], PinnedArena(torch))
        return [piece_key(p.length, p.planes, p.kinds, p.sizes, p.crcs, p.fills) for ps in pieces for p in ps]

    first = keys(before["zeros"])
    alike = {}
    for name in SCRATCH:
        alike[name] = sum(a == b for a, b in zip(keys(before[name]), first, strict=True))
    return len(first), alike


def pack_seconds(torch, zeroed: bool, weights, packs: int = 8) -> float:
    import numpy as np

    from jupyter_vgpu.kernel.codec.pinned_arena import PinnedArena

    c, _ = codec(torch, zeroed)
    arena = PinnedArena(torch)
    took = []
    for _ in range(packs):
        arena.clear()
        torch.cuda.synchronize()
        t = time.perf_counter()
        c.pack([(weights, weights.numel())], arena)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - t)
    return float(np.median(took[2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    require_gpu(parser)
    import numpy as np
    import torch

    doc = provenance.record()
    torch.manual_seed(0)
    weights = (torch.randn(2048 * MiB // 2, device="cuda") * 0.02).to(torch.bfloat16)
    flat = weights.view(torch.uint8).view(-1)
    ranges = [flat[: 64 * 8 * MiB], flat[: 20 * 8 * MiB + 3 * 4096 + 36].clone()]
    doc["keys_alike"] = {}
    for way, zeroed in (("zeroed", True), ("not_zeroed", False)):
        doc["pieces"], doc["keys_alike"][way] = keys_alike(torch, zeroed, ranges)
    rounds = [(pack_seconds(torch, True, flat), pack_seconds(torch, False, flat)) for _ in range(args.rounds)]
    doc["pack_s"] = {"zeroed": [z for z, _ in rounds], "not_zeroed": [n for _, n in rounds]}
    doc["pack_gbps"] = {
        way: round(flat.numel() / float(np.median(doc["pack_s"][way])) / 1e9, 1) for way in doc["pack_s"]
    }
    doc["zeroing_added"] = [round(z / n - 1, 4) for z, n in rounds]
    doc["percentile_rule"] = RULE
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("pieces", "keys_alike", "pack_gbps", "zeroing_added")}))


if __name__ == "__main__":
    main()
