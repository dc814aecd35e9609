"""Moving a storage's bytes between the device and the codec, through pinned buffers.

Bytes move in pieces of ``piece_bytes`` through two reusable pinned host buffers, so
the copy of one piece overlaps the encoding (or decoding) of the other. Pinned memory
moved about 55 GB/s each way on the H100 box against 10-15 GB/s for pageable memory
(design map, Copies).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MiB = 1 << 20


class Transfer:
    """Pinned staging for one device.

    Args:
        device: the device tensors live on (``cuda:N``; ``cpu`` for the CPU stand-in).
        piece_bytes: bytes per piece (two pinned buffers of this size are kept).
    """

    def __init__(self, device: torch.device, piece_bytes: int = 128 * MiB):
        self.device = torch.device(device)
        self.piece_bytes = piece_bytes
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._cuda = self.device.type == "cuda"

    def _buffer(self, i: int) -> torch.Tensor:
        buf = self._buffers[i % 2]
        if buf is None:
            buf = torch.empty(self.piece_bytes, dtype=torch.uint8, pin_memory=self._cuda)
            self._buffers[i % 2] = buf
        return buf

    def pieces(self, nbytes: int) -> list[tuple[int, int]]:
        return [
            (start, min(self.piece_bytes, nbytes - start)) for start in range(0, nbytes, self.piece_bytes)
        ]

    def download(self, src: torch.Tensor, encode: Callable[[torch.Tensor], object]) -> list:
        """Copy ``src`` (uint8, 1-D, on the device) to the host piece by piece and
        return ``[encode(host_piece) for each piece]``; ``encode`` must be done with
        its argument when it returns."""
        spans = self.pieces(src.numel())
        if not spans:
            return []
        events = [None] * len(spans)

        def issue(i):
            start, length = spans[i]
            self._buffer(i)[:length].copy_(src[start : start + length], non_blocking=self._cuda)
            if self._cuda:
                events[i] = torch.cuda.Event()
                events[i].record()

        issue(0)
        out = []
        for i, (_, length) in enumerate(spans):
            if i + 1 < len(spans):
                issue(i + 1)
            if events[i] is not None:
                events[i].synchronize()
            out.append(encode(self._buffer(i)[:length]))
        return out

    def upload(self, dst: torch.Tensor, pieces: list, decode: Callable[[object, torch.Tensor], None]) -> None:
        """Fill ``dst`` (uint8, 1-D, on the device): ``decode(piece, host_buffer)`` writes
        each piece into a pinned buffer, which is then copied to the device."""
        spans = self.pieces(dst.numel())
        events = [None] * len(spans)
        for i, ((start, length), piece) in enumerate(zip(spans, pieces, strict=True)):
            if i >= 2 and events[i - 2] is not None:
                events[i - 2].synchronize()  # the buffer's previous copy is done
            buf = self._buffer(i)[:length]
            decode(piece, buf)
            dst[start : start + length].copy_(buf, non_blocking=self._cuda)
            if self._cuda:
                events[i] = torch.cuda.Event()
                events[i].record()
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()
