"""The slice contract: one serialised form, parsed in one place, strict about bad input."""

import json

import pytest

from jupyter_vgpu.slice import (
    DEFAULT_PRIORITY,
    MAX_GPUS,
    SLICE_ENV,
    Card,
    Slice,
    SliceError,
    compute_share_text,
    mig_profile,
)
from jupyter_vgpu.testing.simulated_slice import simulated_slice

GiB = 2**30


make = simulated_slice


def test_round_trip_through_json_and_env():
    s = make(
        placement="spread",
        overcommit_ratio=1.5,
        idle_seconds=30.0,
        high_watermark=0.8,
        memory_request=2 * GiB,
        priority=80,
        isolation="mps",
    )
    assert Slice.from_json(s.to_json()) == s
    assert Slice.from_env(s.environment()) == s
    assert json.loads(s.to_json())["version"] == 3


def test_request_defaults_to_the_limit_and_follows_it_when_it_was_the_whole_limit():
    s = make()
    assert (s.memory_request, s.priority, s.isolation) == (8 * GiB, DEFAULT_PRIORITY, "time-slicing")
    assert s.replace(memory_limit=4 * GiB).memory_request == 4 * GiB
    burst = make(memory_request=2 * GiB)
    assert burst.replace(memory_limit=4 * GiB).memory_request == 2 * GiB
    with pytest.raises(SliceError, match="must not exceed memory_limit"):
        burst.replace(memory_limit=GiB)
    assert burst.replace(memory_limit=GiB, memory_request=GiB).memory_request == GiB


def test_version_1_documents_are_still_read():
    v1 = {
        "version": 1,
        "gpu_uuid": "GPU-sim-0",
        "gpu_index": 0,
        "gpu_name": "H100",
        "gpu_memory": 80 * GiB,
        "memory_limit": 6 * GiB,
        "compute_share": 30,
        "placement": "binpack",
        "overcommit_ratio": 1.5,
        "simulated": True,
        "idle_seconds": 300.0,
        "high_watermark": 0.9,
    }
    s = Slice.from_dict(v1)
    assert (s.memory_request, s.priority, s.isolation) == (6 * GiB, DEFAULT_PRIORITY, "time-slicing")
    short = {k: v1[k] for k in ("version", "gpu_uuid", "gpu_index", "gpu_name", "gpu_memory", "memory_limit")}
    assert Slice.from_dict({**short, "compute_share": 30}).overcommit_ratio == 1.0
    with pytest.raises(SliceError, match="unknown slice field"):
        Slice.from_dict({**v1, "priority": 10})  # a version-1 document has no priority


def test_version_2_documents_name_every_field():
    data = make().to_dict()
    for name in ("memory_request", "priority", "isolation", "placement"):
        partial = {k: v for k, v in data.items() if k != name}
        with pytest.raises(SliceError, match=f"missing slice field.*{name}"):
            Slice.from_dict(partial)
    with pytest.raises(SliceError, match="memory_request"):
        Slice.from_dict({**data, "memory_request": None})


def test_version_2_documents_are_one_card_slices():
    data = {k: v for k, v in make().to_dict().items() if k != "more_gpus"}
    s = Slice.from_dict({**data, "version": 2})
    assert s.more_gpus == ()
    assert s.gpu_uuids == (s.gpu_uuid,)
    with pytest.raises(SliceError, match=r"unknown slice field.*more_gpus"):
        Slice.from_dict({**data, "version": 2, "more_gpus": []})
    with pytest.raises(SliceError, match=r"missing slice field.*more_gpus"):
        Slice.from_dict({**data, "version": 3})


def two_cards(**changes) -> Slice:
    fields = dict(
        gpu_uuid="GPU-a",
        gpu_index=0,
        memory_limit=40 * GiB,
        simulated=False,
        more_gpus=(Card("GPU-b", 1, 80 * GiB),),
    )
    return make(**{**fields, **changes})


def test_a_slice_of_two_cards_carries_both_into_the_server():
    s = two_cards(memory_request=30 * GiB)
    assert s.gpu_uuids == ("GPU-a", "GPU-b")
    assert s.gpu_indices == (0, 1)
    assert Slice.from_json(s.to_json()) == s
    assert json.loads(s.to_json())["more_gpus"] == [{"uuid": "GPU-b", "index": 1, "memory": 80 * GiB}]
    env = s.environment()
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-a,GPU-b"
    assert Slice.from_env(env) == s
    assert s.memory_fractions() == (0.5, 0.5)
    mps = s.replace(isolation="mps").environment()
    assert mps["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M,1=40960M"
    # cards of different sizes: each has its own fraction; JAX takes the smallest
    small = two_cards(more_gpus=(Card("GPU-b", 1, 160 * GiB),))
    assert small.memory_fractions() == (0.5, 0.25)
    assert small.environment()["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"more_gpus": (Card("GPU-a", 1, 80 * GiB),)}, "each card once"),
        ({"more_gpus": (Card("GPU-b", 0, 80 * GiB),)}, "each card once"),
        ({"more_gpus": (Card("GPU-b", 1, 80 * GiB), Card("GPU-b", 2, 80 * GiB))}, "each card once"),
        ({"more_gpus": tuple(Card(f"GPU-{i}", i, 80 * GiB) for i in range(1, MAX_GPUS + 1))}, "at most 16"),
        ({"more_gpus": (Card("GPU-b", 1, 8 * GiB),), "memory_request": 10 * GiB}, "fit on each card"),
        ({"isolation": "mig", "overcommit_ratio": 1.0}, "MIG instance"),
        ({"more_gpus": ({"uuid": "GPU-b", "index": 1},)}, "exactly the fields"),
        ({"more_gpus": ({"uuid": "", "index": 1, "memory": 1},)}, "uuid must be"),
        ({"more_gpus": ({"uuid": "GPU-b", "index": -1, "memory": 1},)}, "index must be"),
        ({"more_gpus": ({"uuid": "GPU-b", "index": 1, "memory": 0},)}, "memory must be"),
        ({"more_gpus": ("GPU-b",)}, "must be a JSON object"),
        ({"more_gpus": "GPU-b"}, "must be a list"),
    ],
)
def test_bad_cards_are_refused(changes, message):
    with pytest.raises(SliceError, match=message):
        two_cards(**changes)


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
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
    assert SLICE_ENV in env


def test_mps_slices_carry_the_mps_client_limits():
    env = make(isolation="mps", compute_share=25, memory_limit=2 * GiB).environment()
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=2048M"


def test_mig_slices_are_whole_instances_without_overcommit():
    name = "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    s = make(gpu_uuid="MIG-1234", gpu_name=name, gpu_memory=40 * GiB, memory_limit=40 * GiB, isolation="mig")
    assert mig_profile(s.gpu_name) == "3g.40gb"
    assert s.compute_share_text == "MIG instance 3g.40gb (hardware partition)"
    with pytest.raises(SliceError, match="MIG instance"):
        s.replace(overcommit_ratio=1.5)
    assert mig_profile("NVIDIA H100 80GB HBM3") is None


def test_compute_share_reads_as_what_each_backend_enforces():
    assert make().compute_share_text == "not enforced (time-sliced)"
    assert (
        make(isolation="mps", compute_share=25).compute_share_text
        == "25% under MPS, not enforced (set in the server's environment)"
    )
    with pytest.raises(SliceError, match="isolation"):
        compute_share_text("vmware", 10)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"memory_limit": 0}, "memory_limit"),
        ({"memory_limit": -1}, "memory_limit"),
        ({"memory_limit": 1.5}, "memory_limit"),
        ({"memory_limit": True}, "memory_limit"),
        ({"memory_limit": 10**400}, "memory_limit"),
        ({"memory_request": 0}, "memory_request"),
        ({"memory_request": 9 * GiB}, "must not exceed memory_limit"),
        ({"compute_share": 0}, "compute_share"),
        ({"compute_share": 101}, "compute_share"),
        ({"priority": -1}, "priority"),
        ({"priority": 101}, "priority"),
        ({"priority": 5.0}, "priority"),
        ({"isolation": "vmware"}, "isolation"),
        ({"placement": "random"}, "placement"),
        ({"overcommit_ratio": 0.5}, "overcommit_ratio"),
        ({"overcommit_ratio": float("nan")}, "overcommit_ratio"),
        ({"overcommit_ratio": 10**400}, "overcommit_ratio"),
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
        ('{"gpu_uuid": "x"}', "version None is not supported"),
        ('{"version": 2, "gpu_uuid": "x"}', "missing"),
        ('{"version": 4}', "version 4 is not supported"),
        ('{"version": true}', "version True is not supported"),
    ],
)
def test_malformed_text_is_refused(text, message):
    with pytest.raises(SliceError, match=message):
        Slice.from_json(text)


def test_unknown_field_is_refused():
    data = make().to_dict()
    with pytest.raises(SliceError, match="unknown slice field"):
        Slice.from_dict({**data, "memory_limt": 1})


def test_replace_validates():
    s = make()
    assert s.replace(memory_limit=4 * GiB).memory_limit == 4 * GiB
    with pytest.raises(SliceError):
        s.replace(compute_share=0)
