"""Per-op cost of one piece of the GPU codec: GPU time and Python time to enqueue.

Written against the codec layout of commit 073bdef (two slots, a ``packed`` buffer, the
device gather by ``torch.cat``); its figures (``benchmarks/results/codec-stages-h100.jsonl``)
led to the batched copy-out that replaced the gather, so it runs only with that
commit's ``jupyter_vgpu/kernel/codec/device.py``
(``git show 073bdef:jupyter_vgpu/kernel/codec/device.py``). Kept as the record of how
the figures were taken.

Usage (GPU machine, that commit): ``python benchmarks/codec_stages.py out.jsonl``
"""

import json
import sys
import time

sys.path.insert(0, "benchmarks")
sys.path.insert(0, ".")
import numpy as np
import torch
from gpu_common import GiB, make

from jupyter_vgpu.kernel.codec import device as D

out = open(sys.argv[1], "w")  # noqa: SIM115 - written line by line until the end


def emit(**kw):
    print(json.dumps(kw), flush=True)
    out.write(json.dumps(kw) + "\n")
    out.flush()


gen = torch.Generator(device="cuda").manual_seed(0)
SIZE = 2 * GiB
t = make(torch, "bf16_weights", SIZE, gen).view(torch.uint8)
check = t[:: 1 << 16].cpu()


def gpu_time(fn, reps=50):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    c0 = time.perf_counter()
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    c1 = time.perf_counter()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1000 / reps, (c1 - c0) * 1e6 / reps  # us gpu, us cpu enqueue


def per_op(chunk=128 << 10, piece=8 << 20):
    codec = D.DeviceCodec(torch, 0, chunk_bytes=chunk, piece_bytes=piece)
    scratch = torch.empty(codec.scratch_bytes(), dtype=torch.uint8, device="cuda")
    codec.bind(scratch)
    cu = codec.cu
    slot = codec._slots[0]
    n = codec.max_chunks
    lengths = codec._lengths(piece)
    host = slot.host_meta.numpy()
    k = np.arange(n, dtype=np.int64)
    host[D.IN_PTRS] = slot.planar.data_ptr() + k * chunk
    host[D.IN_SIZES] = lengths
    host[D.OUT_PTRS] = slot.comp.data_ptr() + k * codec.ans.max_compressed_bytes
    stream = torch.cuda.current_stream()
    s = int(stream.cuda_stream)
    cus = cu.stream(s)
    cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), D.ROWS * 8 * n, cus)
    src = t[:piece]
    row = codec._row
    ops = {}
    ops["split"] = gpu_time(lambda: codec._split(slot.planar, src, piece))
    ops["ans_compress"] = gpu_time(
        lambda: codec.ans.compress(
            n, row(slot, D.IN_PTRS), row(slot, D.IN_SIZES), row(slot, D.OUT_PTRS), row(slot, D.OUT_SIZES),
            row(slot, D.STATUS_CRC), 0, s)
    )  # fmt: skip
    ops["crc_planar"] = gpu_time(
        lambda: codec.crc.compute(n, row(slot, D.IN_PTRS), row(slot, D.IN_SIZES), row(slot, D.RAW_CRC), s)
    )
    ops["crc_comp"] = gpu_time(
        lambda: codec.crc.compute(
            n, row(slot, D.OUT_PTRS), row(slot, D.OUT_SIZES), row(slot, D.STATUS_CRC), s
        )
    )
    torch.cuda.synchronize()
    cu.copy(slot.host_meta.data_ptr(), slot.meta.data_ptr(), D.ROWS * 8 * n, cus)
    torch.cuda.synchronize()
    sizes = host[D.OUT_SIZES, :n].copy()
    padded = (sizes + 15) // 16 * 16
    span = int(padded.sum())
    mc = codec.ans.max_compressed_bytes

    def gather():
        parts = [slot.comp[i * mc : i * mc + int(padded[i])] for i in range(n)]
        torch.cat(parts, out=slot.packed[:span])

    ops["gather_cat"] = gpu_time(gather)
    # masked gather alternative: compacting with a mask built on the GPU
    pad_dev = torch.from_numpy(padded).cuda()
    ar = torch.arange(mc, device="cuda")

    def gather_mask():
        m = ar[None, :] < pad_dev[:, None]
        torch.masked_select(slot.comp[: n * mc].view(n, mc), m)

    ops["gather_mask"] = gpu_time(gather_mask, reps=20)
    pinned = torch.empty(piece * 2, dtype=torch.uint8, pin_memory=True)
    ops["d2h_span"] = gpu_time(lambda: cu.copy(pinned.data_ptr(), slot.packed.data_ptr(), span, cus))
    ops["h2d_span"] = gpu_time(lambda: cu.copy(slot.packed.data_ptr(), pinned.data_ptr(), span, cus))
    ops["d2h_piece"] = gpu_time(lambda: cu.copy(pinned.data_ptr(), slot.planar.data_ptr(), piece, cus))
    # decompress from comp (fixed stride) into planar
    host[D.IN_PTRS, :n] = slot.comp.data_ptr() + k * mc
    host[D.IN_SIZES, :n] = sizes
    host[D.CAPACITY, :n] = lengths
    host[D.OUT_PTRS, :n] = slot.planar.data_ptr() + k * chunk
    cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), D.ROWS * 8 * n, cus)
    ops["ans_decompress"] = gpu_time(
        lambda: codec.ans.decompress(
            n, row(slot, D.IN_PTRS), row(slot, D.IN_SIZES), row(slot, D.CAPACITY), row(slot, D.OUT_SIZES),
            row(slot, D.OUT_PTRS), row(slot, D.STATUS_CRC), 0, s)
    )  # fmt: skip
    dst = torch.empty(piece, dtype=torch.uint8, device="cuda")
    ops["join"] = gpu_time(lambda: codec._join(dst, slot.planar, piece, 4))
    ops["cu_copy_meta"] = gpu_time(
        lambda: cu.copy(slot.meta.data_ptr(), slot.host_meta.data_ptr(), D.ROWS * 8 * n, cus)
    )
    ev = cu.event()
    ops["record"] = gpu_time(lambda: cu.record(ev, cus))
    # python-side host work of one resume iteration (numpy)
    offsets = np.concatenate(([0], np.cumsum(padded[:-1])))
    ans = np.ones(n, bool)

    def host_work():
        m = int(ans.sum())
        host[D.IN_PTRS, :m] = 5 + offsets[ans]
        host[D.IN_SIZES, :m] = sizes[ans]
        host[D.CAPACITY, :m] = lengths[ans]
        host[D.OUT_PTRS, :m] = 7 + np.flatnonzero(ans) * chunk
        host[D.CRC_PTRS, :n] = 5 + offsets
        host[D.CRC_SIZES, :n] = sizes

    a = time.perf_counter()
    for _ in range(1000):
        host_work()
    ops["numpy_resume_meta"] = (0, (time.perf_counter() - a) * 1e3)
    emit(op_us={k: [round(v[0], 1), round(v[1], 1)] for k, v in ops.items()}, chunk=chunk, piece=piece,
         ratio=piece / int(sizes.sum()))  # fmt: skip
    del scratch


per_op()
per_op(chunk=64 << 10)
per_op(piece=32 << 20)
emit(done=True)
