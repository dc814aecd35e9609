"""The offload codec: bit-exact round trips on every value width, the chunk kinds it
chooses, and damage to any chunk caught without harming the packed data."""

import dataclasses

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_vgpu.kernel.codec import zstd
from jupyter_vgpu.kernel.codec.zstd import (
    Codec,
    CodecError,
    Kind,
    Packed,
    join_planes,
    plane_table,
    split_planes,
)

CHUNK = 64 * 1024
rng = np.random.default_rng(4)


@pytest.fixture(scope="module", params=["cffi", "bytes"])
def codec(request):
    """The codec, decoding through zstd's C API into place (zstandard's cffi backend)
    and through zstandard's bytes API (where cffi is missing)."""
    assert zstd._cffi is not None, "zstandard's cffi backend is importable here"
    keep = zstd._cffi
    if request.param == "bytes":
        zstd._cffi = None
    try:
        with Codec(chunk_bytes=CHUNK, threads=2) as c:
            yield c
    finally:
        zstd._cffi = keep


def roundtrip(codec: Codec, data: np.ndarray, **kw) -> Packed:
    packed = codec.encode(data, **kw)
    out = np.full_like(data, 0xA5)
    codec.decode(packed, out)
    assert out.tobytes() == data.tobytes()
    assert codec.decode_bytes(packed) == data.tobytes()
    assert packed.nbytes == data.size
    assert packed.stored_bytes == sum(len(c.payload) for c in packed.chunks)
    return packed


def bf16_weights(n: int) -> np.ndarray:
    """n bf16 values N(0, 0.02) as bytes: float32 truncated to its upper 16 bits."""
    f32 = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return (f32 >> 16).astype(np.uint16).view(np.uint8)


def with_payload(packed: Packed, index: int, payload: bytes) -> Packed:
    chunks = list(packed.chunks)
    chunks[index] = dataclasses.replace(chunks[index], payload=payload)
    return dataclasses.replace(packed, chunks=tuple(chunks))


VALUES = {
    "uint8": (lambda n: rng.integers(0, 256, n, dtype=np.uint8), False),
    "int16": (lambda n: rng.integers(-300, 300, n).astype(np.int16), False),
    "int32": (lambda n: rng.integers(-(10**6), 10**6, n).astype(np.int32), False),
    "int64": (lambda n: rng.integers(0, 10**4, n).astype(np.int64), False),
    "fp16": (lambda n: (rng.standard_normal(n) * 0.02).astype(np.float16), True),
    "bf16": (lambda n: bf16_weights(n).view(np.uint16), True),
    "fp32": (lambda n: (rng.standard_normal(n) * 1e-3).astype(np.float32) ** 2, True),
    "fp64": (lambda n: rng.standard_normal(n), True),
}


@pytest.mark.parametrize("name", VALUES)
@pytest.mark.parametrize("floating", [True, False])
def test_every_value_width_round_trips(codec, name, floating):
    make, _ = VALUES[name]
    values = make(100_003)  # several chunks and a short last one
    packed = roundtrip(codec, values.view(np.uint8), itemsize=values.itemsize, floating=floating)
    assert packed.itemsize == values.itemsize
    assert all(c.length % values.itemsize == 0 for c in packed.chunks)
    planes = {c.planes for c in packed.chunks if c.kind == Kind.ZSTD}
    if floating and values.itemsize > 1:
        assert planes == {values.itemsize}
    else:
        assert planes <= {1}


def test_empty_input(codec):
    packed = roundtrip(codec, np.empty(0, np.uint8), itemsize=2, floating=True)
    assert (packed.chunks, packed.stored_bytes, packed.ratio) == ((), 0, 1.0)


@pytest.mark.parametrize("n", [1, 3, CHUNK - 1, CHUNK + 1, 3 * CHUNK + 7])
@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
def test_lengths_not_a_multiple_of_the_chunk_or_the_value(codec, n, itemsize):
    data = rng.integers(0, 3, n, dtype=np.uint8)
    packed = roundtrip(codec, data, itemsize=itemsize, floating=True)
    assert [c.offset for c in packed.chunks] == list(range(0, n, CHUNK - CHUNK % itemsize))


def test_chunks_never_split_a_value_of_odd_width():
    with Codec(chunk_bytes=100, threads=1) as c:
        data = rng.integers(0, 4, 1000, dtype=np.uint8)
        packed = roundtrip(c, data, itemsize=3)
    assert {ch.length for ch in packed.chunks[:-1]} == {99}


def test_bf16_weights_reach_the_ratio_goal_with_byte_planes():
    with Codec(threads=2) as c:  # default chunks
        data = bf16_weights(1 << 21)
        planes = roundtrip(c, data, itemsize=2, floating=True)
        whole = roundtrip(c, data, itemsize=2, floating=False)
    assert planes.ratio >= 1.45  # the goal; 1.46 measured on the H100 box
    assert planes.ratio > whole.ratio + 0.1


def test_zeros_and_constant_floats_store_one_value_per_chunk(codec):
    zeros = np.zeros(4 << 20, np.uint8)
    packed = roundtrip(codec, zeros, itemsize=2, floating=True)
    assert {c.kind for c in packed.chunks} == {Kind.CONST}
    assert packed.ratio >= 1000
    ones = np.full(1 << 18, 1.0, np.float32).view(np.uint8)
    packed = roundtrip(codec, ones, itemsize=4, floating=True)
    assert {c.payload for c in packed.chunks} == {ones[:4].tobytes()}
    assert packed.stored_bytes == 4 * len(packed.chunks)


def test_a_pattern_that_repeats_with_the_value_width_is_constant(codec):
    data = np.tile(np.array([1, 2], np.uint8), 3 * CHUNK)  # every int16 value is 0x0201
    assert {c.kind for c in roundtrip(codec, data, itemsize=2).chunks} == {Kind.CONST}
    shifted = np.concatenate([data[1:], data[:1]])  # every int32 value is 0x01020102
    packed = roundtrip(codec, shifted, itemsize=4)
    assert {c.kind for c in packed.chunks} == {Kind.CONST}
    assert {c.payload for c in packed.chunks} == {bytes([2, 1, 2, 1])}
    data[CHUNK + 5] = 9  # one value off: that chunk is no longer constant
    packed = roundtrip(codec, data, itemsize=2)
    assert [c.kind for c in packed.chunks][:3] == [Kind.CONST, Kind.ZSTD, Kind.CONST]


def test_incompressible_data_is_stored_raw(codec):
    data = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    packed = roundtrip(codec, data, itemsize=2, floating=True)
    assert {c.kind for c in packed.chunks} == {Kind.RAW}
    assert packed.stored_bytes == packed.nbytes


def test_min_saving_decides_between_zstd_and_raw():
    data = bf16_weights(1 << 16)  # saves about a third with byte planes
    with Codec(chunk_bytes=CHUNK, threads=1, min_saving=0.05) as c:
        assert {ch.kind for ch in c.encode(data, itemsize=2, floating=True).chunks} == {Kind.ZSTD}
    with Codec(chunk_bytes=CHUNK, threads=1, min_saving=0.5) as c:
        assert {ch.kind for ch in roundtrip(c, data, itemsize=2, floating=True).chunks} == {Kind.RAW}


def test_zstd_chunks_are_standard_frames_with_checksums(codec):
    data = np.repeat(rng.integers(0, 256, CHUNK // 16, dtype=np.uint8), 16)
    (chunk,) = codec.encode(data).chunks
    assert chunk.kind == Kind.ZSTD
    assert chunk.planes == 1
    params = zstandard.get_frame_parameters(chunk.payload)
    assert params.has_checksum
    assert params.content_size == data.size
    assert zstandard.ZstdDecompressor().decompress(chunk.payload) == data.tobytes()


DAMAGE = {
    "zstd": lambda: bf16_weights(CHUNK),
    "zstd-whole": lambda: np.repeat(rng.integers(0, 256, CHUNK // 8, dtype=np.uint8), 16),
    "raw": lambda: rng.integers(0, 256, 2 * CHUNK, dtype=np.uint8),
    "const": lambda: np.full(2 * CHUNK, 7, np.uint8),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_flipped_byte_is_caught_naming_the_chunk_and_the_packed_data_survives(codec, kind):
    data = DAMAGE[kind]()
    floating = kind == "zstd"
    packed = codec.encode(data, itemsize=2, floating=floating)
    victim = packed.chunks[1]
    for where in {0, len(victim.payload) // 2, len(victim.payload) - 1}:
        payload = bytearray(victim.payload)
        payload[where] ^= 0x10
        out = np.zeros_like(data)
        with pytest.raises(CodecError, match=f"chunk at byte {victim.offset} \\(number 1, "):
            codec.decode(with_payload(packed, 1, bytes(payload)), out)
        payload[where] ^= 0x10  # the byte restored: the same record decodes again
        codec.decode(with_payload(packed, 1, bytes(payload)), out)
        assert out.tobytes() == data.tobytes()
    codec.decode(packed, out)  # the packed data itself was never touched
    assert out.tobytes() == data.tobytes()


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_truncated_or_missing_payload_is_caught(codec, kind):
    data = DAMAGE[kind]()
    packed = codec.encode(data, itemsize=2, floating=kind == "zstd")
    victim = packed.chunks[0]
    out = np.empty_like(data)
    for payload in (victim.payload[:-1], victim.payload[: len(victim.payload) // 2], b"", None):
        with pytest.raises(CodecError, match="chunk at byte 0 "):
            codec.decode(with_payload(packed, 0, payload), out)
    roundtrip(codec, data, itemsize=2, floating=kind == "zstd")


def test_records_that_do_not_tile_the_output_are_refused_before_writing(codec):
    data = rng.integers(0, 3, 3 * CHUNK, dtype=np.uint8)
    packed = codec.encode(data)
    out = np.zeros_like(data)
    gap = dataclasses.replace(packed, chunks=packed.chunks[:1] + packed.chunks[2:])
    with pytest.raises(CodecError, match="does not follow byte"):
        codec.decode(gap, out)
    short = dataclasses.replace(packed, chunks=packed.chunks[:2], nbytes=data.size)
    with pytest.raises(CodecError, match="cover"):
        codec.decode(short, out)
    assert not out.any()


def test_bad_buffers_and_settings_are_refused(codec):
    with pytest.raises(ValueError, match="uint8"):
        codec.encode(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="uint8"):
        codec.encode(np.zeros((2, 8), np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        codec.encode(np.zeros(16, np.uint8)[::2])
    with pytest.raises(ValueError, match="itemsize"):
        codec.encode(np.zeros(16, np.uint8), itemsize=0)
    packed = codec.encode(np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="holds 8 bytes"):
        codec.decode(packed, np.zeros(8, np.uint8))
    for kw in ({"chunk_bytes": 8}, {"min_saving": 1.0}, {"threads": 0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Codec(**kw)


def test_encode_keeps_no_reference_to_the_input(codec):
    data = bf16_weights(3 * CHUNK)
    expected = data.tobytes()
    packed = codec.encode(data, itemsize=2, floating=True)
    data[:] = 0  # the engine reuses its pinned buffer at once
    assert codec.decode_bytes(packed) == expected


@pytest.mark.parametrize("planes", [2, 4, 8])
def test_byte_planes_split_and_join_back(planes):
    data = rng.integers(0, 256, 64 * planes, dtype=np.uint8)
    split = split_planes(data, planes).reshape(planes, -1)
    assert np.array_equal(split, data.reshape(-1, planes).T)
    out = np.empty_like(data)
    join_planes(split, out)
    assert np.array_equal(out, data)


@settings(max_examples=80, deadline=None)
@given(
    data=st.binary(max_size=5 * 4096 + 13),
    itemsize=st.sampled_from([1, 2, 3, 4, 8]),
    floating=st.booleans(),
    runs=st.integers(0, 3),
)
def test_any_bytes_round_trip(data, itemsize, floating, runs):
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    if runs and arr.size:  # long constant stretches, so CONST chunks appear too
        arr[: arr.size // (runs + 1)] = arr[0]
    with Codec(chunk_bytes=4096, threads=2) as c:
        roundtrip(c, arr, itemsize=itemsize, floating=floating)


def test_a_planar_decode_leaves_each_split_chunk_as_its_planes(codec):
    """What the GPU joins: chunks split into byte planes stay planes, every other chunk
    is final, and the table says which is which."""
    data = np.concatenate(
        [
            bf16_weights(CHUNK),
            np.zeros(CHUNK, np.uint8),
            rng.integers(0, 256, CHUNK, dtype=np.uint8),
            bf16_weights(99),
        ]
    )
    packed = codec.encode(data, itemsize=2, floating=True)
    out = np.full_like(data, 0xA5)
    codec.decode(packed, out, planar=True)
    table = plane_table(packed)
    assert sorted(set(table[:, 2].tolist())) == [1, 2]
    joined = out.copy()
    for offset, length, planes in table:
        if planes > 1:
            join_planes(out[offset : offset + length].reshape(planes, -1), joined[offset : offset + length])
    assert joined.tobytes() == data.tobytes()
    damaged = with_payload(packed, 0, packed.chunks[0].payload[:-1] + b"\x00")
    with pytest.raises(CodecError, match="chunk at byte 0 "):
        codec.decode(damaged, out, planar=True)
