"""Leases: a job's claim on a cache entry, which protects it from eviction."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from stager.state.dataset import now
from stager.wire.schemas import LeaseCreate, LeasePublic


@dataclass
class Lease:
    id: str
    name: str
    key: str  # the entry it protects, fixed at creation (a renamed source keeps the old data)
    holder: str
    owner: int  # the uid whose handle ``name`` is, and who may release it (and root)
    slurm_job_id: str | None = None
    created_at: datetime = field(default_factory=now)
    expires_at: datetime | None = None

    @property
    def handle_id(self) -> tuple[int, str]:
        return (self.owner, self.name)

    @classmethod
    def create(cls, name: str, owner: int, key: str, request: LeaseCreate) -> Lease:
        created = now()
        expires = created + timedelta(seconds=request.ttl_s) if request.ttl_s else None
        return cls(
            id=secrets.token_hex(8),
            name=name,
            key=key,
            holder=request.holder,
            owner=owner,
            slurm_job_id=request.slurm_job_id,
            created_at=created,
            expires_at=expires,
        )

    def expired(self, at: datetime | None = None) -> bool:
        return self.expires_at is not None and (at or now()) >= self.expires_at

    def public(self) -> LeasePublic:
        return LeasePublic(**self.__dict__)
