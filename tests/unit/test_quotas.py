"""Quota storage in a real SQLAlchemy database, validation and resolution."""

import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from hub_spawner.quotas import Quota, QuotaStore, parse_quota, resolve

GiB = 2**30
DEFAULT = Quota(8 * GiB, 50)


@pytest.fixture
def store(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    return QuotaStore(sessionmaker(bind=engine)())


def test_store_round_trip_and_delete(store):
    store.put("user", "ada", Quota(4 * GiB, None))
    store.put("group", "students", Quota(None, 25))
    assert store.get("user", "ada") == Quota(4 * GiB, None)
    assert store.all("group") == {"students": Quota(None, 25)}
    store.put("user", "ada", Quota(2 * GiB, 10))
    assert store.get("user", "ada") == Quota(2 * GiB, 10)
    assert store.delete("user", "ada")
    assert not store.delete("user", "ada")
    assert store.get("user", "ada") is None


def test_quotas_persist_across_sessions(tmp_path):
    engine = create_engine(f"sqlite:///{tmp_path / 'hub.sqlite'}")
    QuotaStore(sessionmaker(bind=engine)()).put("user", "ada", Quota(GiB, 5))
    assert QuotaStore(sessionmaker(bind=engine)()).get("user", "ada") == Quota(GiB, 5)


def test_resolution_user_then_largest_group_then_default(store):
    store.put("group", "small", Quota(2 * GiB, 90))
    store.put("group", "big", Quota(16 * GiB, None))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.memory_limit, e.compute_share) == (16 * GiB, 90)
    assert dict(e.source) == {"memory_limit": "group:big", "compute_share": "group:small"}
    store.put("user", "ada", Quota(None, 5))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.memory_limit, e.compute_share) == (16 * GiB, 5)
    assert e.source["compute_share"] == "user"
    e = store.resolve("bob", [], DEFAULT)
    assert (e.memory_limit, e.compute_share) == (8 * GiB, 50)
    assert set(e.source.values()) == {"default"}


def test_resolution_override_sees_a_write_before_it_is_stored(store):
    e = store.resolve("ada", [], DEFAULT, override=("user", "ada", Quota(GiB, None)))
    assert e.memory_limit == GiB
    assert store.get("user", "ada") is None
    assert resolve({}, "ada", DEFAULT).memory_limit == 8 * GiB


def test_parse_quota_put_and_patch():
    assert parse_quota({"memory_limit": "4G", "compute_share": 50}, max_memory=80 * GiB) == Quota(4 * GiB, 50)
    assert parse_quota({"memory_limit": 4 * GiB}, max_memory=80 * GiB) == Quota(4 * GiB, None)
    base = Quota(4 * GiB, 50)
    assert parse_quota({"compute_share": 10}, max_memory=80 * GiB, base=base) == Quota(4 * GiB, 10)
    assert parse_quota({"memory_limit": None}, max_memory=80 * GiB, base=base) == Quota(None, 50)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1], "JSON object"),
        ("4G", "JSON object"),
        ({}, "names no field"),
        ({"memory": 1}, "unknown field"),
        ({"memory_limit": -1}, "positive number of bytes"),
        ({"memory_limit": 0}, "positive number of bytes"),
        ({"memory_limit": "lots"}, "positive number of bytes"),
        ({"memory_limit": "81G"}, "more than the largest GPU allows"),
        ({"compute_share": 0}, "1 to 100"),
        ({"compute_share": 101}, "1 to 100"),
        ({"compute_share": 50.5}, "1 to 100"),
        ({"compute_share": "50"}, "1 to 100"),
        ({"compute_share": True}, "1 to 100"),
    ],
)
def test_parse_quota_refuses(body, message):
    with pytest.raises(ValueError, match=message):
        parse_quota(body, max_memory=80 * GiB)
