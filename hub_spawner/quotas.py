"""Quotas: stored in the Hub's own database, resolved per user at spawn time.

A quota names a memory limit and a memory request (bytes, on each card), a compute
share (percent), a priority and a card count for one user or one group; a field left
unset (None) is inherited.
Resolution, field by field: the user's own quota, else the largest value among the
user's groups' quotas, else the hub-wide default. The request then defaults to the
limit and never exceeds it.

The rows live in two tables of our own, ``vgpu_user_quotas`` and
``vgpu_group_quotas``, created on the Hub's SQLAlchemy engine (so they share its
database, its backups and its transactions) with our own metadata, leaving
JupyterHub's schema and migrations untouched. Each row points at the Hub's own
``users.id`` / ``groups.id`` with ``ON DELETE CASCADE``: deleting a user or group
through any path of the Hub deletes its quota in the same transaction, renaming keeps
it (the id does not change), and a new user of an old name starts with none. A column
added by a later release (``gpu_count``) is added to tables made before it, empty
(inherit).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from jupyterhub import orm
from sqlalchemy import BigInteger, Column, ForeignKey, Integer, MetaData, Table, delete, inspect, select, text
from sqlalchemy.orm import Session
from traitlets.log import get_logger

from jupyter_vgpu.slice import MAX_GPUS, MAX_PRIORITY, MIN_PRIORITY

from .sizes import format_size, parse_size

KINDS = ("user", "group")
FIELDS = ("memory_limit", "memory_request", "compute_share", "priority", "gpu_count")

metadata = MetaData()


def _columns() -> list[Column]:
    return [
        Column("memory_limit", BigInteger, nullable=True),
        Column("memory_request", BigInteger, nullable=True),
        Column("compute_share", Integer, nullable=True),
        Column("priority", Integer, nullable=True),
        Column("gpu_count", Integer, nullable=True),
    ]


TABLES = {
    "user": Table(
        "vgpu_user_quotas",
        metadata,
        Column("user_id", Integer, ForeignKey(orm.User.__table__.c.id, ondelete="CASCADE"), primary_key=True),
        *_columns(),
    ),
    "group": Table(
        "vgpu_group_quotas",
        metadata,
        Column(
            "group_id", Integer, ForeignKey(orm.Group.__table__.c.id, ondelete="CASCADE"), primary_key=True
        ),
        *_columns(),
    ),
}
OWNERS = {"user": orm.User, "group": orm.Group}


@dataclasses.dataclass(frozen=True)
class Quota:
    """A stored quota; None means "inherit".

    Attributes:
        memory_limit: budget, bytes, or None.
        compute_share: percent 1-100, or None.
        memory_request: guaranteed bytes, or None (the default: the whole limit).
        priority: 0-100, higher wins, or None.
        gpu_count: cards per slice, from 1 (the budget and request hold on each), or None.
    """

    memory_limit: int | None = None
    compute_share: int | None = None
    memory_request: int | None = None
    priority: int | None = None
    gpu_count: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        return {f: getattr(self, f) for f in FIELDS}


@dataclasses.dataclass(frozen=True)
class Effective:
    """The quota that applies to a user, with where each field came from.

    Attributes:
        memory_limit: budget, bytes.
        compute_share: percent.
        memory_request: guaranteed bytes (at most ``memory_limit``).
        priority: 0-100.
        gpu_count: cards per slice, from 1.
        source: per field, ``"user"``, ``"group:<name>"``, ``"default"``, or for the
            request ``"memory_limit"`` (none set: the whole limit) and
            ``"<source>, capped at memory_limit"``.
    """

    memory_limit: int
    compute_share: int
    memory_request: int
    priority: int
    source: Mapping[str, str]
    gpu_count: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {**{f: getattr(self, f) for f in FIELDS}, "source": dict(self.source)}


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:39] + "…"


def _integer(body: Mapping, field: str, low: int, high: int, what: str) -> int:
    value = body[field]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{field} must be {what} from {low} to {high}; got {_shown(value)}")
    return value


def parse_quota(
    body: object,
    *,
    max_memory: int,
    min_memory: int = 1,
    max_request: int | None = None,
    max_gpus: int = 0,
    base: Quota | None = None,
) -> Quota:
    """Validate a REST body into a :class:`Quota`.

    Args:
        body: the decoded JSON, ``{"memory_limit": 4294967296 | "4G" | null,
            "memory_request": ... | null, "compute_share": 1-100 | null,
            "priority": 0-100 | null, "gpu_count": 1-max_gpus | null}``.
        max_memory: the largest limit allowed, bytes (biggest card × overcommit ratio);
            0 when the Hub has no GPU (then not checked).
        min_memory: the smallest limit or request allowed, bytes.
        max_request: the largest request allowed, bytes (the biggest card); default
            ``max_memory``.
        max_gpus: the most cards one slice may span
            (:meth:`hub_spawner.placement.Allocator.most_cards`); 1 is always allowed.
        base: for PATCH, the stored quota the body is merged into; None for PUT.

    Raises:
        ValueError: not an object, no field, an unknown field, a value out of range, or
            a request above the limit; the message names the field and says why.
    """
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object like {"memory_limit": "4G", "compute_share": 50}')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(_shown(u) for u in unknown)}; a quota has {', '.join(FIELDS)}"
        )
    if not body:
        raise ValueError(f"the body names no field; a quota has {', '.join(FIELDS)}")
    max_request = max_memory if max_request is None else max_request
    values = base.to_dict() if base is not None else dict.fromkeys(FIELDS)
    for field in FIELDS:
        if field not in body:
            continue
        if body[field] is None:
            values[field] = None
        elif field in ("memory_limit", "memory_request"):
            size = parse_size(body[field], field=field, minimum=min_memory)
            largest = max_memory if field == "memory_limit" else max_request
            if largest and size > largest:
                why = "card memory × overcommit ratio" if field == "memory_limit" else "the card's memory"
                raise ValueError(
                    f"{field} {format_size(size)} is more than the largest GPU allows "
                    f"({format_size(largest)}, {why})"
                )
            values[field] = size
        elif field == "compute_share":
            values[field] = _integer(body, field, 1, 100, "an integer percentage")
        elif field == "gpu_count":
            count = _integer(body, field, 1, MAX_GPUS, "an integer")
            if count > max(1, max_gpus):
                raise ValueError(
                    f"gpu_count {count} is more than a slice can span on this hub: at most "
                    f"{max(1, max_gpus)}, the GPUs one host shares (leaving out those shared through MPS)"
                )
            values[field] = count
        else:
            values[field] = _integer(body, field, MIN_PRIORITY, MAX_PRIORITY, "an integer")
    limit, request = values["memory_limit"], values["memory_request"]
    if limit is not None and request is not None and request > limit:
        raise ValueError(
            f"memory_request {format_size(request)} is more than memory_limit {format_size(limit)}: "
            "the guaranteed part of a budget cannot exceed it"
        )
    return Quota(**values)


class QuotaStore:
    """Quota rows in the Hub database, through the Hub's own session.

    Args:
        db: the Hub's SQLAlchemy session (``handler.db`` / ``app.db``). The tables are
            created on its engine if missing (and rows of the older name-keyed
            ``vgpu_quotas`` table moved into them).
    """

    # the engines whose tables are made; weak, since an id() of an engine since collected
    # can come back as a new engine's, whose tables would then never be made
    _created_on: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, db: Session):
        self.db = db
        bind = db.get_bind()
        if bind not in self._created_on:
            metadata.create_all(bind)
            _add_new_columns(db)
            _migrate_named_rows(db)
            self._created_on.add(bind)

    def _owner_id(self, kind: str, name: str) -> int | None:
        owner = OWNERS[kind]
        return self.db.execute(select(owner.id).where(owner.name == name)).scalar()

    def get(self, kind: str, name: str) -> Quota | None:
        """The stored quota of a user or group, or None (also when it does not exist)."""
        return self.all(kind, name).get(name)

    def all(self, kind: str, name: str | None = None) -> dict[str, Quota]:
        """Every stored quota of one kind (or the one of ``name``), by name, sorted."""
        table, owner = TABLES[kind], OWNERS[kind]
        key = table.c[f"{kind}_id"]
        query = select(owner.name, *(table.c[f] for f in FIELDS)).join(owner, owner.id == key)
        if name is not None:
            query = query.where(owner.name == name)
        rows = self.db.execute(query.order_by(owner.name)).all()
        return {r[0]: Quota(**dict(zip(FIELDS, r[1:], strict=True))) for r in rows}

    def put(self, kind: str, name: str, quota: Quota) -> None:
        """Store (replace) a quota and commit.

        Raises:
            ValueError: ``kind`` is not ``"user"`` or ``"group"``.
            LookupError: no such user or group.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        owner_id = self._owner_id(kind, name)
        if owner_id is None:
            raise LookupError(f"No such {kind}: {name}")
        table = TABLES[kind]
        key = table.c[f"{kind}_id"]
        self.db.execute(delete(table).where(key == owner_id))
        self.db.execute(table.insert().values({f"{kind}_id": owner_id, **quota.to_dict()}))
        self.db.commit()

    def delete(self, kind: str, name: str) -> bool:
        """Remove a quota and commit; False when there was none."""
        owner_id = self._owner_id(kind, name)
        if owner_id is None:
            return False
        table = TABLES[kind]
        removed = self.db.execute(delete(table).where(table.c[f"{kind}_id"] == owner_id)).rowcount
        self.db.commit()
        return bool(removed)

    def resolve(self, user: str, groups: Iterable[str], default: Quota, *, override: tuple = ()) -> Effective:
        """The effective quota of ``user`` in ``groups``.

        Args:
            user: user name.
            groups: names of the user's groups.
            default: the hub-wide default; every field but ``memory_request`` set.
            override: ``(kind, name, quota)`` to use instead of the stored one, to see
                the effect of a write before committing it.
        """
        stored: dict[tuple[str, str], Quota | None] = {("user", user): self.get("user", user)}
        for g in groups:
            stored[("group", g)] = self.get("group", g)
        if override:
            kind, name, quota = override
            if (kind, name) in stored:
                stored[(kind, name)] = quota
        return resolve(stored, user, default)


def resolve(stored: Mapping[tuple[str, str], Quota | None], user: str, default: Quota) -> Effective:
    """Field-by-field resolution over ``stored`` quotas (keys ``(kind, name)``)."""
    values: dict[str, int | None] = {}
    source: dict[str, str] = {}
    for field in FIELDS:
        own = stored.get(("user", user))
        if own is not None and getattr(own, field) is not None:
            values[field], source[field] = getattr(own, field), "user"
            continue
        best = None
        for (kind, name), quota in sorted(stored.items()):
            value = None if quota is None or kind != "group" else getattr(quota, field)
            if value is not None and (best is None or value > best[0]):
                best = (value, f"group:{name}")
        if best is not None:
            values[field], source[field] = best
        else:
            values[field], source[field] = getattr(default, field), "default"
    if values["memory_request"] is None:
        values["memory_request"], source["memory_request"] = values["memory_limit"], "memory_limit"
    elif values["memory_request"] > values["memory_limit"]:
        values["memory_request"] = values["memory_limit"]
        source["memory_request"] += ", capped at memory_limit"
    return Effective(
        values["memory_limit"],
        values["compute_share"],
        values["memory_request"],
        values["priority"],
        source,
        values["gpu_count"] or 1,
    )


def _add_new_columns(db: Session) -> None:
    """Add the columns a later release gave the quota tables to tables made before it
    (``ALTER TABLE ... ADD COLUMN``, nullable: existing rows inherit the field)."""
    bind = db.get_bind()
    for table in TABLES.values():
        have = {c["name"] for c in inspect(bind).get_columns(table.name)}
        for column in table.columns:
            if column.name not in have:
                kind = column.type.compile(dialect=bind.dialect)
                db.execute(text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
                get_logger().info("vGPU: added column %s to %s", column.name, table.name)
    db.commit()


def _migrate_named_rows(db: Session) -> None:
    """Move rows of the name-keyed ``vgpu_quotas`` table (before quotas followed users
    and groups by id) into the id-keyed tables; rows whose user or group is gone are
    dropped, and logged."""
    if not inspect(db.get_bind()).has_table("vgpu_quotas"):
        return
    log = get_logger()  # the Hub's own log
    rows = db.execute(text("SELECT kind, name, memory_limit, compute_share FROM vgpu_quotas")).all()
    for kind, name, memory_limit, compute_share in rows:
        owner = OWNERS.get(kind)
        owner_id = db.execute(select(owner.id).where(owner.name == name)).scalar() if owner else None
        if owner_id is None:
            log.warning("vGPU: dropping the quota of %s %r, who no longer exists", kind, name)
            continue
        db.execute(
            TABLES[kind]
            .insert()
            .values({f"{kind}_id": owner_id, "memory_limit": memory_limit, "compute_share": compute_share})
        )
    db.execute(text("DROP TABLE vgpu_quotas"))
    db.commit()
    log.info("vGPU: moved %d quota row(s) to vgpu_user_quotas / vgpu_group_quotas", len(rows))
