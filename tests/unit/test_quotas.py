"""Quota storage in a real Hub database (JupyterHub's own schema), validation, resolution,
and rows that follow the Hub's users and groups."""

import logging

import pytest
from jupyterhub import orm
from sqlalchemy import text
from traitlets.log import get_logger

from hub_spawner.quotas import Quota, QuotaStore, parse_quota, resolve

GiB = 2**30
MiB = 2**20
DEFAULT = Quota(8 * GiB, 50, None, 50)


@pytest.fixture
def db(tmp_path):
    """A session on a new Hub database, as JupyterHub creates it (foreign keys on)."""
    session = orm.new_session_factory(f"sqlite:///{tmp_path / 'hub.sqlite'}")()
    for name in ("ada", "bob"):
        session.add(orm.User(name=name))
    for name in ("students", "staff", "small", "big"):
        session.add(orm.Group(name=name))
    session.commit()
    yield session
    session.close()


@pytest.fixture
def store(db):
    return QuotaStore(db)


def test_store_round_trip_and_delete(store):
    store.put("user", "ada", Quota(4 * GiB, None, 2 * GiB, 70))
    store.put("group", "students", Quota(None, 25))
    assert store.get("user", "ada") == Quota(4 * GiB, None, 2 * GiB, 70)
    assert store.all("group") == {"students": Quota(None, 25)}
    store.put("user", "ada", Quota(2 * GiB, 10))
    assert store.get("user", "ada") == Quota(2 * GiB, 10)
    assert store.delete("user", "ada")
    assert not store.delete("user", "ada")
    assert store.get("user", "ada") is None
    with pytest.raises(LookupError, match="No such user: nobody"):
        store.put("user", "nobody", Quota(GiB))


def test_quotas_persist_across_sessions(tmp_path):
    url = f"sqlite:///{tmp_path / 'hub.sqlite'}"
    first = orm.new_session_factory(url)()
    first.add(orm.User(name="ada"))
    first.commit()
    QuotaStore(first).put("user", "ada", Quota(GiB, 5))
    assert QuotaStore(orm.new_session_factory(url)()).get("user", "ada") == Quota(GiB, 5)


def test_deleting_a_user_or_group_deletes_its_quota_and_a_new_one_of_that_name_starts_clean(db, store):
    store.put("user", "ada", Quota(4 * GiB))
    store.put("group", "students", Quota(12 * GiB))
    db.delete(orm.User.find(db, "ada"))
    db.delete(orm.Group.find(db, "students"))
    db.commit()
    assert store.all("user") == {}
    assert store.all("group") == {}
    db.add(orm.User(name="ada"))
    db.add(orm.Group(name="students"))
    db.commit()
    assert store.get("user", "ada") is None
    assert store.get("group", "students") is None
    assert db.execute(text("SELECT count(*) FROM vgpu_user_quotas")).scalar() == 0


def test_renaming_a_user_or_group_keeps_its_quota(db, store):
    store.put("user", "ada", Quota(4 * GiB))
    store.put("group", "students", Quota(12 * GiB))
    orm.User.find(db, "ada").name = "ada-lovelace"
    orm.Group.find(db, "students").name = "alumni"
    db.commit()
    assert store.all("user") == {"ada-lovelace": Quota(4 * GiB)}
    assert store.all("group") == {"alumni": Quota(12 * GiB)}


def test_rows_of_the_name_keyed_table_move_and_orphans_are_dropped(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    db = orm.new_session_factory(url)()
    db.add(orm.User(name="ada"))
    db.commit()
    db.execute(
        text(
            "CREATE TABLE vgpu_quotas (kind VARCHAR(16), name VARCHAR(255), memory_limit BIGINT, "
            "compute_share INTEGER, PRIMARY KEY (kind, name))"
        )
    )
    db.execute(text(f"INSERT INTO vgpu_quotas VALUES ('user', 'ada', {4 * GiB}, 30), ('user', 'gone', 1, 1)"))
    db.commit()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hub_log = get_logger()  # the Hub's log in a Hub; alembic replaced the root's handlers
    hub_log.addHandler(handler)
    try:
        store = QuotaStore(db)
    finally:
        hub_log.removeHandler(handler)
    assert store.all("user") == {"ada": Quota(4 * GiB, 30)}
    assert any("dropping the quota of user 'gone'" in r.getMessage() for r in records)
    assert not db.execute(text("SELECT name FROM sqlite_master WHERE name = 'vgpu_quotas'")).all()


def test_resolution_user_then_largest_group_then_default(store):
    store.put("group", "small", Quota(2 * GiB, 90, None, 80))
    store.put("group", "big", Quota(16 * GiB, None, 4 * GiB))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.memory_limit, e.compute_share, e.memory_request, e.priority) == (16 * GiB, 90, 4 * GiB, 80)
    assert dict(e.source) == {
        "memory_limit": "group:big",
        "compute_share": "group:small",
        "memory_request": "group:big",
        "priority": "group:small",
        "gpu_count": "default",
    }
    store.put("user", "ada", Quota(None, 5))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.memory_limit, e.compute_share) == (16 * GiB, 5)
    assert e.source["compute_share"] == "user"
    e = store.resolve("bob", [], DEFAULT)
    assert (e.memory_limit, e.compute_share, e.memory_request, e.priority) == (8 * GiB, 50, 8 * GiB, 50)
    assert e.source == {
        "memory_limit": "default",
        "compute_share": "default",
        "memory_request": "memory_limit",
        "priority": "default",
        "gpu_count": "default",
    }


def test_a_request_from_elsewhere_is_capped_at_the_limit(store):
    store.put("group", "big", Quota(None, None, 16 * GiB))
    store.put("user", "ada", Quota(4 * GiB))
    e = store.resolve("ada", ["big"], DEFAULT)
    assert (e.memory_limit, e.memory_request) == (4 * GiB, 4 * GiB)
    assert e.source["memory_request"] == "group:big, capped at memory_limit"


def test_the_card_count_resolves_like_any_field_and_defaults_to_one(store):
    assert store.resolve("ada", [], DEFAULT).gpu_count == 1
    store.put("group", "big", Quota(gpu_count=2))
    store.put("group", "small", Quota(gpu_count=1))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.gpu_count, e.source["gpu_count"]) == (2, "group:big")
    store.put("user", "ada", Quota(gpu_count=1))
    e = store.resolve("ada", ["small", "big"], DEFAULT)
    assert (e.gpu_count, e.source["gpu_count"]) == (1, "user")
    assert e.to_dict()["gpu_count"] == 1
    assert store.get("group", "big") == Quota(gpu_count=2)


def test_tables_made_before_the_card_count_get_its_column(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.sqlite'}"
    db = orm.new_session_factory(url)()
    db.add(orm.User(name="ada"))
    db.commit()
    for kind in ("user", "group"):
        db.execute(
            text(
                f"CREATE TABLE vgpu_{kind}_quotas ({kind}_id INTEGER PRIMARY KEY, memory_limit BIGINT, "
                "memory_request BIGINT, compute_share INTEGER, priority INTEGER)"
            )
        )
    ada = db.execute(text("SELECT id FROM users WHERE name = 'ada'")).scalar()
    db.execute(text(f"INSERT INTO vgpu_user_quotas VALUES ({ada}, {4 * GiB}, NULL, 30, NULL)"))
    db.commit()
    store = QuotaStore(db)
    assert store.get("user", "ada") == Quota(4 * GiB, 30)
    store.put("user", "ada", Quota(4 * GiB, 30, gpu_count=2))
    assert QuotaStore(orm.new_session_factory(url)()).get("user", "ada").gpu_count == 2


def test_resolution_override_sees_a_write_before_it_is_stored(store):
    e = store.resolve("ada", [], DEFAULT, override=("user", "ada", Quota(GiB, None)))
    assert e.memory_limit == GiB
    assert store.get("user", "ada") is None
    assert resolve({}, "ada", DEFAULT).memory_limit == 8 * GiB


def test_parse_quota_put_and_patch():
    kw = {"max_memory": 80 * GiB, "min_memory": 256 * MiB}
    assert parse_quota({"memory_limit": "4G", "compute_share": 50}, **kw) == Quota(4 * GiB, 50)
    assert parse_quota({"memory_limit": 4 * GiB}, **kw) == Quota(4 * GiB, None)
    assert parse_quota({"memory_request": "1G", "priority": 0}, **kw) == Quota(None, None, GiB, 0)
    base = Quota(4 * GiB, 50, 2 * GiB, 60)
    assert parse_quota({"compute_share": 10}, base=base, **kw) == Quota(4 * GiB, 10, 2 * GiB, 60)
    assert parse_quota({"memory_limit": None}, base=base, **kw) == Quota(None, 50, 2 * GiB, 60)
    with pytest.raises(ValueError, match=r"memory_request 2.00 GiB is more than memory_limit 1.00 GiB"):
        parse_quota({"memory_limit": "1G"}, base=base, **kw)
    # without GPUs (max 0) sizes are not capped: the quota is stored, spawns are refused
    assert parse_quota({"memory_limit": "1T"}, max_memory=0) == Quota(2**40)
    assert parse_quota({"gpu_count": 4}, max_gpus=4, **kw) == Quota(gpu_count=4)
    assert parse_quota({"gpu_count": 1}, **kw) == Quota(gpu_count=1)  # always, even with no GPU
    assert parse_quota({"gpu_count": None}, base=Quota(gpu_count=2), **kw) == Quota()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([1], "JSON object"),
        ("4G", "JSON object"),
        ({}, "names no field"),
        ({"memory": 1}, "unknown field"),
        ({"memory_limit": -1}, "memory_limit must be at least 256.00 MiB"),
        ({"memory_limit": 0}, "memory_limit must be at least 256.00 MiB"),
        ({"memory_limit": "1"}, "memory_limit must be at least 256.00 MiB"),
        ({"memory_limit": "0.0000001G"}, "memory_limit must be at least 256.00 MiB"),
        ({"memory_limit": 1.5}, "memory_limit must be a whole number of bytes"),
        ({"memory_limit": 4294967296.7}, "memory_limit must be a whole number of bytes"),
        ({"memory_limit": "1_0G"}, "memory_limit must be a whole number of bytes"),
        ({"memory_limit": "١٠G"}, "memory_limit must be a whole number of bytes"),
        ({"memory_limit": "lots"}, "memory_limit must be a whole number of bytes"),
        ({"memory_limit": "81G"}, "memory_limit 81.00 GiB is more than the largest GPU allows"),
        ({"memory_request": "100M"}, "memory_request must be at least 256.00 MiB"),
        ({"memory_request": "81G"}, "memory_request 81.00 GiB is more than the largest GPU allows"),
        ({"memory_limit": "2G", "memory_request": "3G"}, "memory_request 3.00 GiB is more than memory_limit"),
        ({"compute_share": 0}, "compute_share must be an integer percentage from 1 to 100"),
        ({"compute_share": 101}, "1 to 100"),
        ({"compute_share": 50.5}, "1 to 100"),
        ({"compute_share": "50"}, "1 to 100"),
        ({"compute_share": True}, "1 to 100"),
        ({"priority": -1}, "priority must be an integer from 0 to 100"),
        ({"priority": 101}, "priority must be an integer from 0 to 100"),
        ({"priority": 1e3}, "priority must be an integer from 0 to 100"),
        ({"gpu_count": 0}, "gpu_count must be an integer from 1 to 16"),
        ({"gpu_count": 17}, "gpu_count must be an integer from 1 to 16"),
        ({"gpu_count": 2.0}, "gpu_count must be an integer from 1 to 16"),
        ({"gpu_count": "2"}, "gpu_count must be an integer from 1 to 16"),
        ({"gpu_count": True}, "gpu_count must be an integer from 1 to 16"),
        (
            {"gpu_count": 3},
            "gpu_count 3 is more than a slice can span on this hub: at most 2, the GPUs one host",
        ),
    ],
)
def test_parse_quota_refuses(body, message):
    with pytest.raises(ValueError, match=message):
        parse_quota(body, max_memory=80 * GiB, min_memory=256 * MiB, max_gpus=2)
