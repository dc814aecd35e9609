"""The contracts: one JSON Schema per document, checked where documents are received,
the TypeScript types derived from them, and the kernel's own slice checks in step."""

import json
import math
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jupyter_vgpu import contracts
from jupyter_vgpu.contracts import typescript
from jupyter_vgpu.slice import Slice, SliceError

GiB = 2**30


@pytest.mark.parametrize("name", contracts.names())
def test_every_contract_is_a_versioned_2020_12_schema(name):
    schema = contracts.schema(name)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["$id"] == f"urn:jupyter-vgpu:{name}"
    assert isinstance(schema["version"], int)
    assert schema["title"]
    assert schema["description"]
    jsonschema.Draft202012Validator.check_schema(schema)


def test_the_committed_typescript_is_generated_from_the_schemas():
    committed = typescript.TARGET.read_text(encoding="utf-8")
    assert committed == typescript.render(), (
        "labextension/src/contracts.ts is out of date: run python -m jupyter_vgpu.contracts.typescript"
    )
    assert typescript.main(["--check"]) == 0


def test_the_generator_refuses_what_it_does_not_translate(monkeypatch):
    real = contracts.schema

    def patched(name):
        s = real(name)
        return {**s, "properties": {**s["properties"], "x": {"oneOf": [{"type": "string"}]}}}

    monkeypatch.setattr(typescript, "schema", patched)
    with pytest.raises(typescript.UnsupportedSchema, match="oneOf"):
        typescript.render()


def test_unknown_contract():
    with pytest.raises(KeyError, match="no contract named 'nope'"):
        contracts.validate("nope", {})


SLICE = Slice("GPU-sim-0", 0, "H100", 80 * GiB, 8 * GiB, 50, simulated=True).to_dict()


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({**SLICE, "memory_limit": 10**400}, "memory_limit: must be at most 9223372036854775807; got 1000"),
        ({**SLICE, "memory_limit": 1.0}, "memory_limit: must be an integer, not a number with a fraction"),
        ({**SLICE, "idle_seconds": math.nan}, "idle_seconds: must be a number, not NaN or infinite"),
        ({**SLICE, "idle_seconds": math.inf}, "idle_seconds: must be a number, not NaN or infinite"),
        ({**SLICE, "isolation": "x"}, 'isolation: must be one of "time-slicing", "mps", "mig"; got "x"'),
        ({**SLICE, "surprise": 1}, 'unknown field(s): "surprise"'),
        ({**SLICE, "gpu_name": "x" * 10_000}, "gpu_name: must be at most 256 characters long"),
        ({k: v for k, v in SLICE.items() if k != "priority"}, "missing field(s): priority"),
        ([], "must be an object, not an array"),
    ],
)
def test_errors_name_the_field_and_never_dump_huge_values(document, message):
    with pytest.raises(contracts.ContractError) as e:
        contracts.validate("slice", document)
    assert message in str(e.value)
    assert len(str(e.value)) < 300


def test_nested_errors_carry_the_whole_path():
    usage = {
        "version": 1,
        "slice": SLICE,
        "simulated": True,
        "pressure": False,
        "timestamp": 1.0,
        "gpu": None,
        "totals": {"used": 0, "reserved": 0, "offloaded": 0, "offloaded_compressed": 0},
        "kernels": [],
    }
    contracts.validate("usage-report", {"server_name": "", "usage": usage})
    bad = {**usage, "kernels": [{"id": "k"}]}
    with pytest.raises(
        contracts.ContractError, match=r"^body\.usage\.kernels\[0\]: missing field\(s\): name"
    ):
        contracts.validate("usage-report", {"server_name": "", "usage": bad}, field="body")
    bad = {**usage, "slice": {**SLICE, "priority": 500}}
    with pytest.raises(contracts.ContractError, match=r"^usage\.slice\.priority: must be at most 100"):
        contracts.validate("usage-report", {"server_name": "", "usage": bad})


# The kernel parses slices without jsonschema (see jupyter_vgpu.slice): its checks and
# the schema must agree on every field. Candidates straddle each boundary.
CANDIDATES = {
    "gpu_uuid": ["GPU-1", "x" * 128, "", "x" * 129, 5, None],
    "gpu_index": [0, 4096, -1, 4097, 1.0, True, "0"],
    "gpu_name": ["", "x" * 256, "x" * 257, None],
    "gpu_memory": [1, 80 * GiB, 2**63 - 1, 0, 2**63, 1.0, True, "1"],
    "memory_limit": [1, 8 * GiB, 2**63 - 1, 0, -1, 2**63, 10**400, 8.0 * GiB, None],
    "memory_request": [1, 4 * GiB, 0, 4.0 * GiB, None, "4G"],
    "compute_share": [1, 100, 0, 101, 50.0, None],
    "priority": [0, 100, 50, -1, 101, 50.0, False],
    "isolation": ["time-slicing", "mps", "mig", "vmware", None],
    "placement": ["binpack", "spread", "random"],
    "overcommit_ratio": [1, 1.0, 1.5, 1000, 0.99, 1000.5, math.nan, math.inf, True, 10**400],
    "simulated": [True, False, 0, "true"],
    "idle_seconds": [1e-9, 300, 31536000, 0, 31536001, math.nan, -1],
    "high_watermark": [1e-9, 0.5, 1, 0, 1.01, math.nan],
    "version": [2, 3, 4],
    "more_gpus": [
        None,  # absent
        [],
        [{"uuid": "GPU-2", "index": 2, "memory": 80 * GiB}],
        [{"uuid": "GPU-1", "index": 2, "memory": 80 * GiB}],  # the first card's UUID again
        [{"uuid": "GPU-2", "index": 2, "memory": 1}],  # too small for the request
        [{"uuid": "GPU-2", "index": 2}],
        [{"uuid": "GPU-2", "index": 2, "memory": 80 * GiB, "x": 1}],
        [{"uuid": "GPU-2", "index": -1, "memory": 80 * GiB}],
        [{"uuid": f"GPU-{i}", "index": i, "memory": 80 * GiB} for i in range(2, 18)],
        {"uuid": "GPU-2", "index": 2, "memory": 80 * GiB},
    ],
}


@settings(max_examples=600, deadline=None)
@given(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in CANDIDATES.items()}))
def test_the_kernels_slice_checks_agree_with_the_schema(fields):
    document = {k: v for k, v in fields.items() if not (k == "more_gpus" and v is None)}
    try:
        contracts.validate("slice", document)
        schema_ok = True
    except contracts.ContractError:
        schema_ok = False
    try:
        Slice.from_dict(document)
        python_ok = True
    except SliceError:
        python_ok = False
    if python_ok:
        assert schema_ok, document
    elif schema_ok:
        # The rules across fields that JSON Schema does not express.
        over_request = document["memory_request"] > document["memory_limit"]
        mig_overcommit = document["isolation"] == "mig" and document["overcommit_ratio"] != 1
        cards = document.get("more_gpus") or []
        uuids = [document["gpu_uuid"], *(c["uuid"] for c in cards)]
        indices = [document["gpu_index"], *(c["index"] for c in cards)]
        twice = len(set(uuids)) < len(uuids) or len(set(indices)) < len(indices)
        mig_cards = bool(cards) and document["isolation"] == "mig"
        small_card = any(c["memory"] < document["memory_request"] for c in cards)
        assert over_request or mig_overcommit or twice or mig_cards or small_card, document


def test_a_valid_slice_passes_both_and_round_trips():
    s = Slice("MIG-1", 1, "H100 MIG 1g.10gb", 10 * GiB, 10 * GiB, 14, isolation="mig", priority=70)
    contracts.validate("slice", json.loads(s.to_json()))
    assert Slice.from_json(s.to_json()) == s


def test_documents_reached_through_a_reference_keep_the_strict_types():
    usage = {
        "version": 1,
        "slice": {**SLICE, "idle_seconds": math.inf},
        "simulated": True,
        "pressure": False,
        "timestamp": math.nan,
        "gpu": None,
        "totals": {"used": 1.0, "reserved": 0, "offloaded": 0, "offloaded_compressed": 0},
        "kernels": [],
    }
    for path, message in [
        ("timestamp", "usage.timestamp: must be a number, not NaN"),
        ("totals", "usage.totals.used: must be an integer"),
        ("slice", "usage.slice.idle_seconds: must be a number, not NaN or infinite"),
    ]:
        good = {
            "timestamp": 1.0,
            "totals": {"used": 0, "reserved": 0, "offloaded": 0, "offloaded_compressed": 0},
            "slice": SLICE,
        }
        bad = {**usage, **{k: v for k, v in good.items() if k != path}}
        with pytest.raises(contracts.ContractError, match=re.escape(message)):
            contracts.validate("usage-report", {"server_name": "", "usage": bad})
