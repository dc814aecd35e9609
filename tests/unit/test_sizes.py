"""Sizes at the Hub's edges: whole bytes or K/M/G/T with ASCII digits, JupyterHub's
ByteSpecification semantics, a minimum, and messages that name the field."""

import pytest

from hub_spawner.sizes import MAX_BYTES, format_size, parse_size

MiB = 2**20


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4294967296, 4 * 2**30),
        ("4294967296", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("512M", 512 * MiB),
        ("1.5G", int(1.5 * 2**30)),
        ("2T", 2 * 2**40),
        ("64K", 64 * 2**10),
        (" 8G ", 8 * 2**30),
        (MAX_BYTES, MAX_BYTES),
    ],
)
def test_parse(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value",
    [
        "-4G",
        "abc",
        "4X",
        "",
        "G",
        "4g",
        True,
        None,
        [4],
        {"G": 4},
        1.5,  # issue 10: 1.5 became 1 byte
        1024.0,
        4294967296.7,  # issue 10: truncated
        "4294967296.7",
        float("nan"),
        float("inf"),
        "1_0G",  # issue 10: Python's float() accepts underscores
        "١٠G",  # issue 10: Arabic-Indic digits
        "１０G",  # fullwidth digits
        "1e3",
        "1e3G",
        "0x10",
        "9" * 5000,  # issue 10: Python's own "Exceeds the limit (4300 digits)"
        "9" * 40 + "G",
    ],
)
def test_refuse_with_a_message_naming_the_field(value):
    with pytest.raises(ValueError, match=r"^memory_limit must be a whole number of bytes") as e:
        parse_size(value, field="memory_limit")
    assert "float" not in str(e.value)
    assert "digits)" not in str(e.value)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("value", [-1, 0, 1, "1", "0G", "0.0000001G", 255 * MiB])
def test_below_the_minimum(value):
    with pytest.raises(ValueError, match=r"^memory_limit must be at least 256\.00 MiB; got"):
        parse_size(value, field="memory_limit", minimum=256 * MiB)


def test_above_the_largest():
    with pytest.raises(ValueError, match="must be at most 9223372036854775807 bytes"):
        parse_size(10**400, field="memory_limit")
    with pytest.raises(ValueError, match="must be at most"):
        parse_size("9999999999999999999", field="memory_limit")


def test_format():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30) == "3.00 GiB"
