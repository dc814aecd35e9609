"""The codec: bit-exact round trips, layout choices, corruption detected."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_vgpu.kernel.offload.codec import Codec, CodecError, Kind

rng = np.random.default_rng(0)


@pytest.fixture(scope="module")
def codec():
    c = Codec(chunk_bytes=64 * 1024, threads=2)
    yield c
    c.close()


def roundtrip(codec, data, **kw):
    packed = codec.encode(data, **kw)
    out = np.empty_like(data)
    codec.decode(packed, out)
    assert np.array_equal(out, data)
    return packed


def bf16_weights(n):
    f32 = (rng.standard_normal(n, dtype=np.float32) * 0.02).view(np.uint32)
    return (f32 >> 16).astype(np.uint16).view(np.uint8)


@pytest.mark.parametrize(
    ("dtype", "floating"),
    [
        (np.uint8, False),
        (np.int16, False),
        (np.int32, False),
        (np.int64, False),
        (np.float16, True),
        (np.float32, True),
        (np.float64, True),
    ],
)
def test_every_dtype_round_trips(codec, dtype, floating):
    values = (rng.standard_normal(100_003) * 100).astype(dtype)
    packed = roundtrip(codec, values.view(np.uint8), itemsize=values.itemsize, floating=floating)
    assert packed.nbytes == values.nbytes


def test_bf16_weights_use_byte_planes_and_compress():
    codec = Codec(threads=2)  # the default 1 MiB chunks: smaller ones lose ratio
    data = bf16_weights(1 << 21)
    packed = roundtrip(codec, data, itemsize=2, floating=True)
    plain = codec.encode(data, itemsize=2, floating=False)
    codec.close()
    assert {c.planes for c in packed.chunks} == {2}
    assert packed.ratio > plain.ratio
    assert packed.ratio > 1.4


def test_empty_odd_lengths_and_non_multiple_tails(codec):
    assert roundtrip(codec, np.empty(0, np.uint8)).chunks == ()
    for n in (1, 3, 65_537, 3 * 64 * 1024 + 5):
        roundtrip(codec, rng.integers(0, 4, n, dtype=np.uint8), itemsize=1)
    roundtrip(codec, bf16_weights(70_001), itemsize=2, floating=True)


def test_constant_and_zero_data_store_one_item(codec):
    zeros = np.zeros(4 << 20, np.uint8)
    packed = roundtrip(codec, zeros, itemsize=2, floating=True)
    assert {c.kind for c in packed.chunks} == {Kind.CONST}
    assert packed.ratio > 1000
    ones = np.ones(1 << 18, np.float32).view(np.uint8)
    packed = roundtrip(codec, ones, itemsize=4, floating=True)
    assert packed.stored_bytes == 4 * len(packed.chunks)


def test_incompressible_data_is_stored_raw(codec):
    packed = roundtrip(codec, rng.integers(0, 256, 1 << 20, dtype=np.uint8))
    assert {c.kind for c in packed.chunks} == {Kind.RAW}
    assert packed.stored_bytes == packed.nbytes


@pytest.mark.parametrize("kind", ["zstd", "raw", "const"])
def test_a_corrupt_chunk_is_detected_and_the_packed_data_survives(codec, kind):
    data = {
        "zstd": bf16_weights(1 << 17),
        "raw": rng.integers(0, 256, 1 << 17, dtype=np.uint8),
        "const": np.full(1 << 17, 7, np.uint8),
    }[kind]
    packed = codec.encode(data, itemsize=2, floating=True)
    victim = packed.chunks[1]
    payload = bytearray(victim.payload)
    payload[len(payload) // 2] ^= 0xFF
    bad = dataclasses.replace(
        packed,
        chunks=(packed.chunks[0], dataclasses.replace(victim, payload=bytes(payload)), *packed.chunks[2:]),
    )
    out = np.empty_like(data)
    with pytest.raises(CodecError, match=f"chunk at byte {victim.offset}"):
        codec.decode(bad, out)
    truncated = dataclasses.replace(
        packed, chunks=(dataclasses.replace(victim, payload=victim.payload[:-1]), *packed.chunks[1:])
    )
    with pytest.raises(CodecError):
        codec.decode(truncated, out)
    roundtrip(codec, data, itemsize=2, floating=True)
    codec.decode(packed, out)  # the intact copy still decodes
    assert np.array_equal(out, data)


def test_bad_buffers_are_refused(codec):
    with pytest.raises(ValueError, match="uint8"):
        codec.encode(np.zeros(4, np.float32))
    packed = codec.encode(np.zeros(16, np.uint8))
    with pytest.raises(ValueError, match="holds 8 bytes"):
        codec.decode(packed, np.zeros(8, np.uint8))


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300_000), itemsize=st.sampled_from([1, 2, 4, 8]), floating=st.booleans())
def test_any_bytes_round_trip(codec, data, itemsize, floating):
    arr = np.frombuffer(data, dtype=np.uint8).copy()
    roundtrip(codec, arr, itemsize=itemsize, floating=floating)
