"""Pause and resume: all the GPU memory of a kernel into compressed host memory and back.

The pausable allocator (``native/``, loaded with LD_PRELOAD) puts every device
allocation of the process, whichever API makes it, in a unit whose physical memory can
be released and mapped again at the same addresses (:mod:`.vmm`). A pause (of an idle
kernel: the caller guarantees that nothing runs) does, in order:

1. wait for the device, release PyTorch's cached free segments
   (``torch.cuda.empty_cache()``) and the allocator's own free memory
   (:meth:`~.vmm.VMM.collect`): they hold nothing worth keeping;
2. find the live bytes of every pausable unit (:mod:`.ranges`);
3. store them: on the GPU through nvCOMP (:mod:`..codec.device`) when it is installed
   and a scratch area of ``scratch_bytes`` can be had, else through zstandard on CPU
   threads (:mod:`..codec.host`); on a card too full for the scratch, the smallest
   segments go through the host path first until the scratch fits;
4. release each segment's physical memory as soon as its bytes are on the host.

NVML then shows the process at its CUDA context alone, unless some of its memory cannot
be paused (shared with another process through CUDA IPC, managed memory, memory the
driver allocated inside a graph capture): that stays, and :meth:`PauseEngine.stats` says
how much (the kernel is suspended instead when room is needed). A resume maps new physical
memory at the same addresses, writes every byte back, and checks every chunk's
checksum before the kernel may run: every holder of a pointer (tensors, autograd's
saved tensors, CUDA graphs, DLPack consumers, other threads) sees its bytes again.

Failures leave nothing half done: a pause that fails resumes what it had paused; a
resume that finds no room (:class:`~.vmm.DeviceFull`) or a damaged chunk
(:class:`ResumeError`) releases what it mapped and stays paused, the host copy intact.

A paused kernel's host memory can move to the node's disk tier (:meth:`PauseEngine.spill`,
when the node arbiter asks): the GPU path's pinned slabs to one file (:mod:`.spill`), the
host path's store entries to files of their own; a resume then streams them back
(:func:`.spill.unpack`; :meth:`PauseEngine.stats` says where its time went).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

from jupyter_vgpu import failpoints

from ..codec.device import DeviceCodec, DeviceCodecError
from ..codec.host import HostPath
from ..codec.pinned_arena import PinnedArena
from ..codec.zstd import Codec, CodecError
from . import devmem, spill, vmm
from .local_memory import LocalMemory, LocalMemoryError
from .outcomes import Outcome, PauseError, ResumeError
from .ranges import live_ranges, spans
from .sharing import PieceSharing
from .states import PauseState
from .store import HostStore
from .torch_calls import empty_host_cache, plain_torch, unstored_bytes
from .workarea import WorkArea

log = logging.getLogger("jupyter_vgpu")
MiB = 1 << 20


@dataclasses.dataclass
class _Range:
    address: int  # where its bytes live on the device; it may run past its unit's end
    length: int
    path: str  # "device" or "host": which codec path stored it
    pieces: list


@dataclasses.dataclass
class _Paused:
    segment: vmm.Segment
    ranges: list[_Range]


class PauseEngine:
    """Pauses and resumes every segment of the process's pausable allocator.

    Args:
        torch: the torch module.
        allocator: the process's :class:`~.vmm.VMM` (backend chosen).
        device: CUDA ordinal, or None for the host stand-in (segments are host memory).
        use_nvcomp: store through nvCOMP on the GPU when it is installed.
        scratch_bytes: device scratch of the GPU path, bytes (the pause path's only
            device memory; default 64 MiB).
        host_cap_bytes: host memory the host path may hold before spilling or refusing
            (default: half of MemAvailable).
        spill_dir: where the host path spills past its cap (None: refuse instead).
        threads: CPU threads of the host path (default: one per core).
        among_devices: this engine is one of several, one per device
            (:class:`~.devices.DevicesEngine`): it pauses the units of its own device
            and leaves the others' to theirs. False (one engine for the process): a
            pause refuses while any unit lies on another device, since it would leave
            that memory on its card.
        local_memory: a pause gives back the CUDA context's local memory too, and a
            resume takes it back first (:mod:`.local_memory`); counted in
            :attr:`paused_bytes`.
    """

    def __init__(
        self,
        torch,
        allocator: vmm.VMM,
        device: int | None,
        *,
        use_nvcomp: bool = True,
        scratch_bytes: int = 64 * MiB,
        host_cap_bytes: int | None = None,
        spill_dir=None,
        threads: int | None = None,
        among_devices: bool = False,
        local_memory: bool = False,
    ):
        self.torch, self.vmm, self.device = torch, allocator, device
        self.among_devices = among_devices
        if allocator.backend == 0:
            allocator.init(vmm.HOST if device is None else vmm.CUDA)
        self.scratch_bytes = scratch_bytes
        self.store = HostStore(host_cap_bytes, spill_dir)
        self.zstd = Codec(threads=threads)
        self.host_path = HostPath(torch, device, self.zstd)
        self.arena = PinnedArena(torch)
        self.device_codec: DeviceCodec | None = None
        self.nvcomp_reason: str | None = None
        if device is None:
            self.nvcomp_reason = "no GPU"
        elif not use_nvcomp:
            self.nvcomp_reason = "turned off"
        else:
            try:
                self.device_codec = self._make_device_codec()
            except Exception as e:  # not installed, or an nvCOMP that refuses our settings
                self.nvcomp_reason = str(e)
        self.state = PauseState.ACTIVE
        self.last_pause: Outcome | None = None
        self.last_resume: Outcome | None = None
        self._paused: list[_Paused] = []
        self._lock = threading.Lock()
        self._areas: dict[str, WorkArea] = {}
        self._spill: spill.SpillFile | None = None  # the GPU path's pieces, when on disk
        self.last_spill: Outcome | None = None
        #: the node's shared pieces (:mod:`.sharing`), set by the kernel; None: kept its own
        self.sharing: PieceSharing | None = None
        #: where the time of the last resume from the disk tier went (None before one)
        self.last_resume_disk: spill.DiskResume | None = None
        #: the context's local memory, given back by a pause (None: kept on the card)
        self.local: LocalMemory | None = None
        #: why the local memory stays on the card where it was asked for (None: it is not)
        self.local_reason: str | None = None
        if local_memory and device is not None:
            try:
                self.local = LocalMemory(device)
            except (ImportError, LocalMemoryError) as e:
                self.local_reason = str(e)

    def _make_device_codec(self) -> DeviceCodec:
        piece = 8 * MiB
        while piece > MiB:
            codec = DeviceCodec(self.torch, self.device, piece_bytes=piece)
            if codec.scratch_bytes() <= self.scratch_bytes:
                return codec
            piece //= 2
        return DeviceCodec(self.torch, self.device, piece_bytes=MiB)

    @property
    def codec_name(self) -> str:
        """The codec a pause uses first, for ``%vgpu status``."""
        if self.device_codec is not None:
            return self.device_codec.name
        return f"{self.host_path.name}; nvCOMP not used: {self.nvcomp_reason}"

    # -- helpers -----------------------------------------------------------------------

    def _plain_torch(self):
        return plain_torch(self.torch)

    def _view(self, ptr: int, nbytes: int):
        return devmem.view(self.torch, ptr, nbytes, self.device)

    def _area(self, name: str, nbytes: int):
        """``(area, tensor)`` of the work area ``name`` mapped now (:class:`WorkArea`),
        or None when the device has no room for it."""
        area = self._areas.get(name)
        if area is None:
            area = self._areas[name] = WorkArea(self.vmm, self.device, nbytes)
        ptr = area.take()
        return None if ptr is None else (area, self._view(ptr, nbytes))

    def _scratch(self):
        """``(area, tensor)`` of the GPU path's scratch, bound to the codec, or None when
        the device is full."""
        if self.device_codec is None:
            return None
        scratch = self._area("scratch", self.device_codec.scratch_bytes())
        if scratch is not None:
            self.device_codec.bind(scratch[1])
        return scratch

    def _staging(self):
        """``(area, tensor)`` of device memory for the host path to join byte planes on
        the GPU (one piece), or None: no GPU, the card is full, or no kernels to join with
        (the CPU joins them then)."""
        if self.device is None or self.host_path.gpu_join() is None:
            return None
        return self._area("staging", self.host_path.piece_bytes)

    def _give_back(self, taken) -> None:
        """Give back a work area from :meth:`_scratch` or :meth:`_staging` (None: nothing)."""
        if taken is not None:
            self.torch.cuda.synchronize(self.device)
            taken[0].give_back()

    def _synchronize(self) -> None:
        if self.device is not None:
            self.torch.cuda.synchronize(self.device)

    # -- pause -------------------------------------------------------------------------

    def pause(self) -> Outcome:
        """Move every live byte to the host and release the device memory.

        The caller guarantees the kernel is idle: no code of it runs until
        :meth:`resume` returns.

        Raises:
            PauseError: the pause failed and was undone (the kernel runs on as before).
        """
        with self._lock, self._plain_torch(), self.vmm.machinery():
            if self.state != PauseState.ACTIVE:
                raise PauseError(f"the kernel is {self.state}, not active")
            failpoints.hit("kernel.pause.start")
            t0 = time.perf_counter()
            self._synchronize()
            if self.device is not None:
                self.torch.cuda.empty_cache()
            if self.vmm.backend == vmm.CUDA:
                self.vmm.collect()
            units = self._own([s for s in self.vmm.segments() if s.mapped])
            self._check_coverage(units)
            segments = sorted((s for s in units if s.pausable), key=lambda s: s.size)
            snapshot = self._snapshot()
            live = live_ranges(snapshot, ((s.ptr, s.size) for s in segments))
            paused: list[_Paused] = []  # released units, whatever happens below
            used: set[str] = set()
            scratch = self._scratch()
            try:
                todo = list(segments)
                while todo:
                    if scratch is None and self.device_codec is not None and paused:
                        scratch = self._scratch()  # what was released may make room for it now
                    # one unit at a time only while the GPU path waits for room for its scratch
                    batch = todo if scratch is not None or self.device_codec is None else todo[:1]
                    todo = todo[len(batch) :]
                    self._pause_batch(batch, live, scratch is not None, used, paused)
            except BaseException as e:
                self._give_back(scratch)
                self._paused = paused
                self.state = PauseState.PAUSED
                try:
                    self._resume()
                except Exception as again:
                    log.error("jupyter-vgpu: undoing a failed pause failed too (%s); still paused", again)
                    raise PauseError(
                        f"pausing failed ({e}) and so did undoing it ({again})", still_paused=True
                    ) from e
                raise PauseError(f"pausing failed and was undone: {e}") from e
            self._give_back(scratch)
            self._paused = paused
            self._give_back_local()
            self.state = PauseState.PAUSED
            self.last_pause = Outcome(
                time.perf_counter() - t0,
                self.paused_bytes,
                self._live_bytes(),
                self._stored_bytes(),
                tuple(sorted(used)),
            )
            return self.last_pause

    def _own(self, units: list) -> list:
        """The units of ``units`` this engine pauses: all of them on the host stand-in,
        else those on its device.

        Raises:
            PauseError: a unit lies on another device and no other engine pauses it
                (``among_devices`` False): nothing was paused.
        """
        if self.device is None:
            return units
        elsewhere = sorted({s.device for s in units} - {self.device})
        if elsewhere and not self.among_devices:
            raise PauseError(
                f"this kernel holds memory on device {', '.join(map(str, elsewhere))} as well as on "
                f"device {self.device}, and this engine pauses one device's memory: nothing was paused"
            )
        return [s for s in units if s.device == self.device]

    def _snapshot(self):
        """PyTorch's allocator snapshot, or None where it has none: the host stand-in, and
        the ``cudaMallocAsync`` backend, which does not track blocks (then every unit is
        saved whole)."""
        if self.device is None:
            return None
        try:
            return self.torch.cuda.memory_snapshot()
        except RuntimeError:  # "Calling snapshot with backend:cudaMallocAsync is not meaningful"
            return None

    def _check_coverage(self, units) -> None:
        """Refuse to pause when PyTorch holds device memory the pausable allocator does not
        know: releasing only part of the memory would report a pause that did not happen.

        PyTorch's reserved bytes come from cudaMalloc, its expandable segments
        (cuMemCreate) or its stream-ordered pool, all of which the allocator sees when it
        was preloaded; what it does not know came another way (the message names the
        difference, and the kernel is suspended instead when room is needed)."""
        if self.device is None:
            return
        reserved = self.torch.cuda.memory_reserved(self.device)
        figures = self.vmm.figures()
        known = sum(s.size for s in units if s.device == self.device) + figures.let_through
        if reserved > known:
            raise PauseError(
                f"PyTorch holds {reserved} bytes on the device and the pausable allocator knows "
                f"{known}: {reserved - known} bytes were allocated a way it does not cover, "
                "so this kernel cannot be paused"
            )

    def _pause_batch(self, batch, live, on_device: bool, used: set[str], paused: list[_Paused]) -> None:
        """Store the live bytes of ``batch``, releasing each unit once every span covering it
        is stored; each unit released goes to ``paused`` with the spans it keeps, whether or
        not this returns (the codec's, the allocator's errors, an interrupt), so that the
        caller can undo exactly what was done. A span runs across units side by side (on
        each unit's grid where pieces may be shared: :func:`.ranges.spans`) and is kept with
        the first of its units released, so that an undone pause writes back all it released."""
        shares = on_device and self.sharing is not None and self.sharing.may_share
        grid = self.device_codec.piece_bytes if shares else None
        joined = spans(((seg.ptr, seg.size, seg.device) for seg in batch), live, grid)
        ranges = [(self._view(ptr + off, length), length) for ptr, off, length, _ in joined]
        by_ptr = {seg.ptr: seg for seg in batch}
        pending = {seg.ptr: 0 for seg in batch}  # spans not yet stored, per unit they cover
        for *_, covered in joined:
            for ptr in covered:
                pending[ptr] += 1
        stored: dict[int, _Range] = {}  # span index -> what holds it
        done: dict[int, _Paused] = {}  # released units, in release order
        path = "device" if on_device else "host"

        def release(seg) -> None:
            failpoints.hit("kernel.pause.release")
            self.vmm.unmap(seg.ptr)
            done[seg.ptr] = _Paused(seg, [])

        def keep() -> None:
            for i, r in stored.items():
                holder = next((done[ptr] for ptr in joined[i][3] if ptr in done), None)
                if holder is not None:
                    holder.ranges.append(r)
            paused.extend(done.values())

        def on_range(i: int, pieces: list) -> None:
            ptr, off, length, covered = joined[i]
            stored[i] = _Range(ptr + off, length, path, list(pieces))
            failpoints.hit("kernel.pause.copy")
            for unit in covered:
                pending[unit] -= 1
                if pending[unit] == 0:
                    release(by_ptr[unit])

        packed: list[list] = [[] for _ in ranges]  # the pieces stored so far, per span
        try:
            for seg in batch:  # nothing live in it: nothing to save (an undo maps it back)
                if not pending[seg.ptr]:
                    release(seg)
            if ranges and on_device:
                used.add(self.device_codec.name)
                self.device_codec.pack(ranges, self.arena, on_range, out=packed)
            elif ranges:
                used.add(self.host_path.name)
                self.host_path.pack(ranges, self.store, on_range, out=packed)
        except BaseException:
            if path == "host":  # pieces of spans no released unit needs: their bytes stayed
                for i, pieces in enumerate(packed):
                    if not any(ptr in done for ptr in joined[i][3]):
                        for piece in pieces:
                            self.store.drop(piece.key)
            raise
        finally:
            keep()

    # -- resume ------------------------------------------------------------------------

    @property
    def paused_bytes(self) -> int:
        """Device memory a resume needs (the paused segments, and the context's local
        memory where the pause gave it back), bytes."""
        return sum(p.segment.size for p in self._paused) + (self.local.owed if self.local is not None else 0)

    def _give_back_local(self) -> None:
        """Once the pause has every allocation off the card (the device idle): the
        context's local memory too. Whatever goes wrong leaves it on the card; the pause
        stands (its data is on the host, its units released)."""
        if self.local is None:
            return
        try:
            self.local.give_back()
        except Exception as e:  # an extra of a pause that has happened: it stands
            log.warning("jupyter-vgpu: the CUDA context's local memory stays on the card: %s", e)

    def _live_bytes(self) -> int:
        """Bytes of the paused segments that hold data (stored), wherever they are now."""
        return sum(r.length for p in self._paused for r in p.ranges)

    def _stored_bytes(self) -> int:
        """Bytes stored for the paused segments (compressed), wherever they are now."""
        return sum(piece.stored_bytes for p in self._paused for r in p.ranges for piece in r.pieces)

    def room_needed(self) -> int:
        """Free device memory a resume needs: the segments plus the GPU path's scratch, bytes."""
        if not self._paused:
            return 0
        extra = self.device_codec.scratch_bytes() if self.device_codec is not None else 0
        return self.paused_bytes + extra

    def resume(self) -> Outcome:
        """Bring every paused byte back to its device address.

        Raises:
            vmm.DeviceFull: the device has no room yet (:meth:`room_needed`); still paused.
            ResumeError: host data is damaged or unreadable; still paused, host copy intact.
        """
        with self._lock, self._plain_torch(), self.vmm.machinery():
            return self._resume()

    def _resume(self) -> Outcome:
        if self.state != PauseState.PAUSED:
            return Outcome(0.0, 0, 0, 0, ())
        t0 = time.perf_counter()
        return self._write_back(self._map_back(), t0)

    def _map_back(self) -> tuple[list[_Paused], tuple | None, int]:
        """First half of a resume: the context's local memory taken back, physical memory
        mapped again behind every paused unit (all or none) and the GPU path's scratch
        taken; returns them (the local memory as its bytes) for :meth:`_write_back`, or
        :meth:`_undo_map_back` where the resume goes no further.

        Raises:
            vmm.DeviceFull: no room for the units, the scratch or the context's local
                memory: nothing stays mapped.
            ResumeError: the driver refused the local memory otherwise; still paused.
        """
        local = self.local.owed if self.local is not None else 0
        if self.local is not None:
            try:
                self.local.take_back()  # first: every launch after needs it (DeviceFull)
            except LocalMemoryError as e:
                raise self._resume_failed(e) from e
        try:
            self.vmm.map_many([p.segment.ptr for p in self._paused])  # all or none (DeviceFull)
        except BaseException:
            self._give_back_local()
            raise
        mapped: list[_Paused] = list(self._paused)
        failpoints.hit("kernel.resume.mapped")
        needs_device = any(r.path == "device" for p in self._paused for r in p.ranges)
        scratch = self._scratch() if needs_device else None
        if needs_device and scratch is None:
            self._unmap(mapped)
            raise vmm.DeviceFull(2, f"resuming needs {self.room_needed()} free bytes on device {self.device}")
        return mapped, scratch, local

    def _resume_failed(self, e: BaseException) -> ResumeError:
        """The error of a resume that failed for ``e`` and left the engine paused."""
        return ResumeError(
            f"resuming failed; still paused, the host copy is kept: {e}",
            paused_bytes=self.paused_bytes,
            host_bytes=self._stored_bytes(),
        )

    def _undo_map_back(self, taken: tuple[list[_Paused], tuple | None, int]) -> None:
        """Give back what :meth:`_map_back` took; the engine stays paused, nothing written."""
        mapped, scratch, _ = taken
        self._give_back(scratch)
        self._unmap(mapped)

    def _write_back(self, taken: tuple[list[_Paused], tuple | None, int], t0: float) -> Outcome:
        """Second half of a resume: every stored byte written back and checked, the host
        copy let go, the engine active (figures from ``t0``, :func:`time.perf_counter`).

        Raises:
            ResumeError: damaged or unreadable host data: unmapped again, still paused.
        """
        mapped, scratch, local = taken
        used = set()
        staging = None
        try:
            on_device = [
                (self._view(r.address, r.length), r.pieces)
                for p in self._paused
                for r in p.ranges
                if r.path == "device"
            ]
            on_host = [
                (self._view(r.address, r.length), r.pieces)
                for p in self._paused
                for r in p.ranges
                if r.path == "host"
            ]
            if on_device and self._spill is not None:  # from the disk tier, streamed
                used.add(f"{self.device_codec.name}, from disk")
                before = time.perf_counter() - t0
                self.last_resume_disk = spill.DiskResume(before_s=before)  # kept, a failed one's too
                spill.unpack(
                    self.device_codec,
                    on_device,
                    self._spill,
                    self._pinned,
                    figures=self.last_resume_disk,
                    arena=self.arena,  # pieces the spill left in the node's shared copies
                )
            elif on_device:
                used.add(self.device_codec.name)
                self.device_codec.unpack(on_device, self.arena)
            if on_host:
                used.add(self.host_path.name)
                staging = self._staging()
                self.host_path.unpack(on_host, self.store, staging and staging[1])
            self._synchronize()
        except BaseException as e:  # an interrupt too: whatever was written is not trusted
            self._synchronize()
            self._give_back(scratch)
            self._give_back(staging)
            self._unmap(mapped)
            if isinstance(e, (DeviceCodecError, CodecError, OSError)):
                raise self._resume_failed(e) from e
            raise
        self._give_back(scratch)
        self._give_back(staging)
        live_bytes, host = self._live_bytes(), self._stored_bytes()
        for r in (r for p in self._paused for r in p.ranges if r.path == "host"):
            for piece in r.pieces:
                self.store.drop(piece.key)
        self.arena.clear()
        if self.sharing is not None:
            self.sharing.retire()  # let go in the background (:meth:`let_go_shared`)
        if self._spill is not None:
            self._spill.remove_later()  # its blocks freed off the resume's path
            self._spill = None
        self.last_resume = Outcome(
            time.perf_counter() - t0,
            self.paused_bytes + local,
            live_bytes,
            host,
            tuple(sorted(used)),
        )
        self._paused = []
        self.state = PauseState.ACTIVE
        return self.last_resume

    def _pinned(self, nbytes: int):
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    # -- the disk tier -----------------------------------------------------------------

    def spill(self, directory) -> Outcome:
        """Move the paused data held in host memory to files in ``directory`` (made,
        mode 0700): the GPU path's pinned slabs to one file, the host path's store
        entries to files of their own; the host memory is let go. Pieces read from the
        node's shared copies that other kernels reference too stay there, mapped
        (:meth:`.sharing.PieceSharing.read_by_others`): writing them would give back no
        host memory and put another copy on disk. A resume reads everything back,
        streaming. A kernel writes one file a pause: once on disk, a second call moves
        only the host path's entries. Nothing is done for a kernel that is not paused.

        Raises:
            PauseError: the kernel is not paused.
            spill.SpillError: the GPU path's file could not be written whole (a full or
                failing disk): its pieces stay in host memory.
            OSError: a host path entry could not be written: those moved before it stay
                on disk, the others in memory; none is lost.
        """
        with self._lock, self.vmm.machinery():
            if self.state != PauseState.PAUSED:
                raise PauseError(f"the kernel is {self.state}, not paused: nothing to move to disk")
            t0 = time.perf_counter()
            moved = 0
            # (its range, its index there, the piece, its address); none once on disk
            # already: what stays then is pieces others read too (one file a pause)
            device = [
                (r, i, piece, self.arena.address(piece.slab, piece.start))
                for p in (self._paused if self._spill is None else ())
                for r in p.ranges
                if r.path == "device"
                for i, piece in enumerate(r.pieces)
                if piece.slab >= 0
            ]
            keep: frozenset[int] = frozenset()  # pieces others read from the node's copies too
            if device and self.sharing is not None:
                keep = self.sharing.read_by_others(at for *_, at in device)
                device = [d for d in device if d[3] not in keep]
            if device:
                records = [(at, piece.span, piece.crcs) for _, _, piece, at in device]
                name = f"pause-{id(self):x}-{time.monotonic_ns()}.vgpu"
                written, offsets = spill.SpillFile.write(directory, name, records)
                failpoints.hit("kernel.spill.written")
                for (r, i, piece, _), offset in zip(device, offsets, strict=True):
                    r.pieces[i] = dataclasses.replace(piece, slab=spill.DISK, start=offset)
                    moved += piece.stored_bytes
                self._spill = written
                if keep:  # the kept pieces' slabs (mappings) stay; every slab of its own goes
                    for slab in range(len(self.arena.slabs)):
                        self.arena.release(slab)
                else:
                    self.arena.clear()
                self.arena.trim()  # the host needs the memory: nothing kept warm
                if self.sharing is not None:  # the written pieces' mappings and references go
                    self.sharing.retire(keep)
                    self.sharing.let_go()
                empty_host_cache(self.torch)
            moved += self.store.spill(directory)
            self.last_spill = Outcome(time.perf_counter() - t0, 0, 0, moved, ())
            return self.last_spill

    def pinned_ahead_target(self) -> int:
        """Bytes a pause of the kernel as it is now would store, at most: the pausable
        bytes mapped (:meth:`.vmm.VMM.figures`, ``own`` and ``others``) less PyTorch's
        free blocks (:func:`.torch_calls.unstored_bytes`), which a pause releases
        unstored, those beside live tensors included. Leaving those in (PyTorch's
        ``inactive_split_bytes``, as a release must) set the target of 1 GiB of live bf16
        placed in a 2 GiB cached block at 2 GiB, and the first pause found 1.5 GiB pinned
        (H200, ``tests/gpu/test_pinned_ahead.py``, ``gpu-tests-h200.log``). 0 on the host
        stand-in and on the zstandard path, which store into memory of their own."""
        if self.device is None or self.device_codec is None or self.state != PauseState.ACTIVE:
            return 0
        if self.among_devices:  # this device's share alone
            mapped = sum(
                u.size for u in self.vmm.segments() if u.mapped and u.pausable and u.device == self.device
            )
        else:
            figures = self.vmm.figures()
            mapped = figures.own + figures.others
        return max(0, mapped - unstored_bytes(self.torch, [self.device]))

    def prepare(self, keep_going=lambda: True) -> int:
        """Pin ahead the host memory the next pause stores into
        (:meth:`pinned_ahead_target` bytes, as warm slabs of the arena: counted in
        :meth:`host_held`, let go by :meth:`trim`), so that a first pause does not pin on
        the way (pinning ran at about 2.5 GB/s on the H100 box, against 55 GB/s for the
        copy over the bus). For a thread of its own while the kernel is idle; asks
        ``keep_going()`` before each slab. Returns the bytes pinned.

        Raises:
            whatever pinning raises (host memory exhausted); slabs already pinned stay.
        """
        with self.vmm.machinery():
            return self.arena.prepare(self.pinned_ahead_target(), keep_going)

    def host_held(self) -> int:
        """Host memory held for paused data now, bytes: the pinned slabs (warm ones included),
        the store's entries in memory and the pieces read from the node's shared pieces (each
        whole, shared or not: the node arbiter counts each once against its host budget)."""
        mapped = self.sharing.mapped_bytes() if self.sharing is not None else 0
        return self.arena.held_bytes + self.store.in_memory() + mapped

    def share(self, keep_going=lambda: True) -> int:
        """After a pause, in the background: :meth:`.sharing.PieceSharing.share` of the GPU
        path's paused pieces, until ``keep_going()`` is False or the kernel is wanted back;
        returns the bytes of pinned slabs given back (0: no :attr:`sharing`, or spilled)."""
        with self._lock:
            if self.sharing is None or self.state != PauseState.PAUSED or self._spill is not None:
                return 0
            this = self._paused  # this pause: a later one (after a resume) is another list
            pieces = [(r.pieces, i) for p in this for r in p.ranges if r.path == "device"
                      for i, piece in enumerate(r.pieces) if piece.slab >= 0 and piece.span]  # fmt: skip
        with self.vmm.machinery():
            still = lambda: self._paused is this and self.state == PauseState.PAUSED and self._spill is None  # noqa: E731
            released = self.sharing.share(pieces, self.arena, self._lock, still, keep_going)
            if released:
                empty_host_cache(self.torch)
        return released

    def let_go_shared(self, keep_going=lambda: True) -> int:
        """After a resume, between cells: :meth:`.sharing.PieceSharing.let_go` while
        ``keep_going()``; a pause waits for the references dropped, not the mappings closed."""
        if self.sharing is None:
            return 0
        with self.vmm.machinery():
            closed = self.sharing.close_retired(keep_going)
        with self._lock, self.vmm.machinery():
            self.sharing.drop_references()
        return closed

    def trim(self) -> int:
        """Let go of the pinned slabs kept warm for the next pause (which pins again,
        slowly) and of the host path's pinned staging (:data:`.codec.host.RING` of
        ``piece_bytes``, 96 MiB, made again by its next use); returns the pinned bytes
        given back. Slabs holding paused data stay; the GPU path's work areas are device
        memory, released after each pause and resume."""
        with self._lock, self.vmm.machinery():
            freed = self.arena.trim() + self.host_path.release_buffers()
            if freed:
                empty_host_cache(self.torch)
            return freed

    def disk_bytes(self) -> int:
        """Bytes of paused data in the disk tier (the spill file and the store's files)."""
        return (self._spill.nbytes if self._spill is not None else 0) + self.store.stats()["disk_bytes"]

    def _unmap(self, mapped: list[_Paused]) -> None:
        """Undo a resume's mapping: the units released again, and the context's local
        memory given back again; the engine stays paused as it was."""
        for p in mapped:
            self.vmm.unmap(p.segment.ptr)
        self._give_back_local()

    # -- figures -----------------------------------------------------------------------

    def stats(self) -> dict:
        """``state``, ``paused_bytes`` (device memory released), ``unpausable_bytes``
        (device memory a pause leaves: :attr:`.vmm.Figures.unpausable`), ``host_bytes``
        (stored bytes held in host memory for it), ``disk_bytes`` (bytes of it in the disk
        tier), ``live_bytes``, ``ratio`` (live over stored bytes, wherever they are),
        ``codec``, the last pause's and resume's ``seconds`` (None before the first),
        ``pinned_bytes`` (pinned host memory held, slabs kept warm for the next pause
        included); ``shared`` where the node's pieces held once are used
        (:meth:`.sharing.PieceSharing.figures`); and ``last_resume_disk``: where the time of
        the last resume from the disk tier went, the fields of :class:`.spill.DiskResume`
        (``read_wait_s``, ``unpack_s``, ``read_s``, seconds; ``bytes_read``;
        ``read_bytes_per_s``; ``windows``; ``direct``...), or None before one."""
        live, stored = self._live_bytes(), self._stored_bytes()
        pieces = [piece for p in self._paused for r in p.ranges for piece in r.pieces]
        on_disk = sum(piece.stored_bytes for piece in pieces if getattr(piece, "slab", None) == spill.DISK)
        host = max(0, stored - on_disk - self.store.stats()["disk_bytes"])
        figures = self.vmm.figures()
        return {
            "state": self.state,
            "paused_bytes": self.paused_bytes,
            "unpausable_bytes": figures.unpausable,
            "live_bytes": live,
            "host_bytes": host,
            "disk_bytes": self.disk_bytes(),
            "ratio": live / stored if stored else None,
            "codec": "nvcomp-ans" if self.device_codec is not None else "zstd",
            "codec_name": self.codec_name,
            "last_pause_seconds": self.last_pause.seconds if self.last_pause else None,
            "last_resume_seconds": self.last_resume.seconds if self.last_resume else None,
            "pinned_bytes": self.arena.held_bytes,
            "last_resume_disk": dataclasses.asdict(disk) if (disk := self.last_resume_disk) else None,
            **({"shared": self.sharing.figures()} if self.sharing is not None else {}),
        }

    def close(self) -> None:
        """Stop the host path's threads (the engine cannot pause afterwards)."""
        if self.sharing is not None:
            self.sharing.close()
        self.zstd.close()
        self.store.close()
        self.arena.clear()
        self.arena.trim()
        if self._spill is not None:
            self._spill.remove()
            self._spill = None
        for area in self._areas.values():
            area.free()
