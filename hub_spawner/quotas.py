"""Quotas: stored in the Hub's own database, resolved per user at spawn time.

A quota names a memory budget (bytes) and/or a compute share (percent) for one user
or one group; a field left unset (None) is inherited. Resolution, field by field: the
user's own quota, else the largest value among the user's groups' quotas, else the
hub-wide default.

The rows live in our own table, ``vgpu_quotas``, created on the Hub's SQLAlchemy
engine (so they share its database, its backups and its transactions) with our own
metadata, leaving JupyterHub's schema and migrations untouched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import BigInteger, Column, Integer, Unicode
from sqlalchemy.orm import Session, declarative_base

from .sizes import format_size, parse_size

Base = declarative_base()

KINDS = ("user", "group")
FIELDS = ("memory_limit", "compute_share")


class QuotaRow(Base):
    __tablename__ = "vgpu_quotas"
    kind = Column(Unicode(16), primary_key=True)
    name = Column(Unicode(255), primary_key=True)
    memory_limit = Column(BigInteger, nullable=True)
    compute_share = Column(Integer, nullable=True)


@dataclasses.dataclass(frozen=True)
class Quota:
    """A stored quota; None means "inherit".

    Attributes:
        memory_limit: budget, bytes, or None.
        compute_share: percent 1-100, or None.
    """

    memory_limit: int | None = None
    compute_share: int | None = None

    def to_dict(self) -> dict[str, int | None]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Effective:
    """The quota that applies to a user, with where each field came from.

    Attributes:
        memory_limit: budget, bytes.
        compute_share: percent.
        source: per field, ``"user"``, ``"group:<name>"`` or ``"default"``.
    """

    memory_limit: int
    compute_share: int
    source: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {
            "memory_limit": self.memory_limit,
            "compute_share": self.compute_share,
            "source": dict(self.source),
        }


def parse_quota(body: object, *, max_memory: int, base: Quota | None = None) -> Quota:
    """Validate a REST body into a :class:`Quota`.

    Args:
        body: the decoded JSON, ``{"memory_limit": 4294967296 | "4G" | null,
            "compute_share": 1-100 | null}``.
        max_memory: the largest budget allowed, bytes (biggest card × overcommit ratio).
        base: for PATCH, the stored quota the body is merged into; None for PUT.

    Raises:
        ValueError: not an object, no field, an unknown field, or a value out of range;
            the message says which and why.
    """
    if not isinstance(body, dict):
        raise ValueError('the body must be a JSON object like {"memory_limit": "4G", "compute_share": 50}')
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)}; a quota has {', '.join(FIELDS)}")
    if not body:
        raise ValueError(f"the body names no field; a quota has {', '.join(FIELDS)}")
    values = base.to_dict() if base is not None else {f: None for f in FIELDS}
    if body.get("memory_limit") is not None:
        size = parse_size(body["memory_limit"], field="memory_limit")
        if size > max_memory:
            raise ValueError(
                f"memory_limit {format_size(size)} is more than the largest GPU allows "
                f"({format_size(max_memory)}, card memory × overcommit ratio)"
            )
        values["memory_limit"] = size
    elif "memory_limit" in body:
        values["memory_limit"] = None
    if body.get("compute_share") is not None:
        share = body["compute_share"]
        if isinstance(share, bool) or not isinstance(share, int) or not 1 <= share <= 100:
            raise ValueError(f"compute_share must be an integer percentage from 1 to 100; got {share!r}")
        values["compute_share"] = share
    elif "compute_share" in body:
        values["compute_share"] = None
    return Quota(**values)


class QuotaStore:
    """Quota rows in the Hub database, through the Hub's own session.

    Args:
        db: the Hub's SQLAlchemy session (``handler.db`` / ``app.db``). The table is
            created on its engine if missing.
    """

    _created_on: set[int] = set()

    def __init__(self, db: Session):
        self.db = db
        bind = db.get_bind()
        if id(bind) not in self._created_on:
            Base.metadata.create_all(bind)
            self._created_on.add(id(bind))

    def get(self, kind: str, name: str) -> Quota | None:
        """The stored quota of a user or group, or None."""
        row = self.db.get(QuotaRow, (kind, name))
        return None if row is None else Quota(row.memory_limit, row.compute_share)

    def all(self, kind: str) -> dict[str, Quota]:
        """Every stored quota of one kind, by name."""
        rows = self.db.query(QuotaRow).filter(QuotaRow.kind == kind).order_by(QuotaRow.name)
        return {r.name: Quota(r.memory_limit, r.compute_share) for r in rows}

    def put(self, kind: str, name: str, quota: Quota) -> None:
        """Store (replace) a quota and commit.

        Raises:
            ValueError: ``kind`` is not ``"user"`` or ``"group"``.
        """
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}")
        row = self.db.get(QuotaRow, (kind, name)) or QuotaRow(kind=kind, name=name)
        row.memory_limit = quota.memory_limit
        row.compute_share = quota.compute_share
        self.db.add(row)
        self.db.commit()

    def delete(self, kind: str, name: str) -> bool:
        """Remove a quota and commit; False when there was none."""
        row = self.db.get(QuotaRow, (kind, name))
        if row is None:
            return False
        self.db.delete(row)
        self.db.commit()
        return True

    def resolve(self, user: str, groups: Iterable[str], default: Quota, *, override: tuple = ()) -> Effective:
        """The effective quota of ``user`` in ``groups``.

        Args:
            user: user name.
            groups: names of the user's groups.
            default: the hub-wide default; both fields must be set.
            override: ``(kind, name, quota)`` to use instead of the stored one, to see
                the effect of a write before committing it.
        """
        stored = {("user", user): self.get("user", user)}
        for g in groups:
            stored[("group", g)] = self.get("group", g)
        if override:
            kind, name, quota = override
            if (kind, name) in stored:
                stored[(kind, name)] = quota
        return resolve(stored, user, default)


def resolve(stored: Mapping[tuple[str, str], Quota | None], user: str, default: Quota) -> Effective:
    """Field-by-field resolution over ``stored`` quotas (keys ``(kind, name)``)."""
    values: dict[str, int] = {}
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
    return Effective(values["memory_limit"], values["compute_share"], source)
