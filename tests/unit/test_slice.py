"""The slice contract: one serialised form, parsed in one place, strict about bad input."""

import json

import pytest

from jupyter_vgpu.slice import SLICE_ENV, Slice, SliceError

GiB = 2**30


def make(**changes):
    fields = dict(
        gpu_uuid="GPU-sim-0",
        gpu_index=0,
        gpu_name="NVIDIA H100 80GB HBM3 (simulated)",
        gpu_memory=80 * GiB,
        memory_limit=8 * GiB,
        compute_share=50,
        simulated=True,
    )
    fields.update(changes)
    return Slice(**fields)


def test_round_trip_through_json_and_env():
    s = make(placement="spread", overcommit_ratio=1.5, idle_seconds=30.0, high_watermark=0.8)
    assert Slice.from_json(s.to_json()) == s
    assert Slice.from_env(s.environment()) == s
    assert json.loads(s.to_json())["version"] == 1


def test_from_env_absent_is_none():
    assert Slice.from_env({}) is None


def test_memory_fraction_is_capped_at_one():
    assert make(memory_limit=20 * GiB).memory_fraction == pytest.approx(0.25)
    assert make(memory_limit=120 * GiB).memory_fraction == 1.0


def test_environment_for_frameworks():
    env = make(memory_limit=20 * GiB, simulated=False, gpu_uuid="GPU-1234").environment()
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    assert env["CUPY_GPU_MEMORY_LIMIT"] == str(20 * GiB)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1234"
    assert "CUDA_VISIBLE_DEVICES" not in make().environment()
    assert SLICE_ENV in env


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"memory_limit": 0}, "memory_limit"),
        ({"memory_limit": -1}, "memory_limit"),
        ({"memory_limit": 1.5}, "memory_limit"),
        ({"memory_limit": True}, "memory_limit"),
        ({"compute_share": 0}, "compute_share"),
        ({"compute_share": 101}, "compute_share"),
        ({"placement": "random"}, "placement"),
        ({"overcommit_ratio": 0.5}, "overcommit_ratio"),
        ({"overcommit_ratio": float("nan")}, "overcommit_ratio"),
        ({"gpu_uuid": ""}, "gpu_uuid"),
        ({"idle_seconds": 0}, "idle_seconds"),
        ({"high_watermark": 1.5}, "high_watermark"),
    ],
)
def test_out_of_range_fields_are_refused(changes, message):
    with pytest.raises(SliceError, match=message):
        make(**changes)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"gpu_uuid": "x"}', "missing"),
    ],
)
def test_malformed_text_is_refused(text, message):
    with pytest.raises(SliceError, match=message):
        Slice.from_json(text)


def test_unknown_field_and_version_are_refused():
    data = make().to_dict()
    with pytest.raises(SliceError, match="unknown slice field"):
        Slice.from_dict({**data, "memory_limt": 1})
    with pytest.raises(SliceError, match="version"):
        Slice.from_dict({**data, "version": 2})


def test_replace_validates():
    s = make()
    assert s.replace(memory_limit=4 * GiB).memory_limit == 4 * GiB
    with pytest.raises(SliceError):
        s.replace(compute_share=0)
