"""Sizes at the Hub's edges, with JupyterHub's ByteSpecification semantics."""

import pytest

from hub_spawner.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4294967296, 4 * 2**30),
        ("4294967296", 4 * 2**30),
        ("4G", 4 * 2**30),
        ("512M", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        ("2T", 2 * 2**40),
        ("64K", 64 * 2**10),
        (" 8G ", 8 * 2**30),
        (1024.0, 1024),
    ],
)
def test_parse(value, expected):
    assert parse_size(value) == expected


@pytest.mark.parametrize(
    "value", [0, -1, "-4G", "0G", "abc", "4X", "", "G", True, None, [4], float("nan"), float("inf")]
)
def test_refuse(value):
    with pytest.raises(ValueError, match="memory_limit must be a positive number of bytes"):
        parse_size(value, field="memory_limit")


def test_format():
    assert format_size(512) == "512 B"
    assert format_size(3 * 2**30) == "3.00 GiB"
