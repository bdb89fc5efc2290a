"""Wire models of the HTTP API (v1), shared by the daemon and the client.

One module imported by both sides rather than two copies: the shapes are a
contract, and a single definition cannot drift. It depends on pydantic only, so
``import client`` stays free of FastAPI, uvicorn and torch.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Defined with the rest of the progress channel; part of the wire contract all the same.
from stager.progress import ProgressPublic

__all__ = ["ProgressPublic"]  # and every model below

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"

VERIFY_LEVELS = ("size", "sha256", "none")


class State(StrEnum):
    QUEUED = "queued"  # accepted, waiting for a worker slot
    STAGING = "staging"  # steps running in the partial directory
    READY = "ready"  # published by atomic rename; complete and verified
    FAILED = "failed"  # a step failed; partial data removed, error says why
    CANCELLED = "cancelled"  # a client cancelled it; partial data removed
    EVICTED = "evicted"  # was ready, removed from the cache to free space

    @property
    def terminal(self) -> bool:
        return self not in (State.QUEUED, State.STAGING)


class LeaseCreate(BaseModel):
    """Pin a dataset while a job uses it. Leases of jobs SLURM no longer knows, or past
    their TTL, are dropped by the daemon's sweep."""

    model_config = ConfigDict(extra="forbid")

    holder: str = Field(min_length=1, max_length=200)  # e.g. "slurm-job-42" or a user's tag
    slurm_job_id: str | None = Field(default=None, pattern=r"^[0-9_]+$")
    ttl_s: float | None = Field(default=None, gt=0)


class LeasePublic(BaseModel):
    id: str
    name: str
    key: str
    holder: str
    slurm_job_id: str | None = None
    created_at: datetime
    expires_at: datetime | None = None


class DatasetCreate(BaseModel):
    """Body of ``POST /v1/datasets``: a recipe with its source, or raw steps."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    recipe: str | None = None
    source: str | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    # Each step is ``{"op": NAME, ...its fields}``. The daemon types them from its op
    # table (``OpTable.request_model``), so its OpenAPI document shows every op's fields.
    steps: list[dict[str, Any]] = Field(default_factory=list)
    link: str | None = None
    verify: Literal["size", "sha256", "none"] = "size"  # VERIFY_LEVELS
    # How sources are compared with the cached copy: "cheap" stats files and the top
    # level of trees; "deep" stats every file of every tree.
    fingerprint: Literal["cheap", "deep"] = "cheap"
    lease: LeaseCreate | None = None

    @model_validator(mode="after")
    def _recipe_or_steps(self) -> DatasetCreate:
        if self.recipe and self.steps:
            raise ValueError("give either 'recipe' (with 'source') or 'steps', not both")
        if not self.recipe and not self.steps:
            raise ValueError("give a 'recipe' with its 'source', or a non-empty 'steps' list")
        if self.link is not None and not self.link.startswith("/"):
            raise ValueError(f"link {self.link!r} must be an absolute path")
        return self

    def spec(self) -> dict[str, Any]:
        """What identifies the content: everything but the handle and the link."""
        return self.model_dump(mode="json", exclude={"name", "link", "lease"})


class ErrorInfo(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorInfo


class TorchvisionUsage(BaseModel):
    """How to load a staged recipe with torchvision, e.g. INaturalist(root, version=...)."""

    model_config = ConfigDict(populate_by_name=True)

    class_: str = Field(alias="class")  # e.g. "torchvision.datasets.INaturalist"
    kwargs: dict[str, Any] = Field(default_factory=dict)  # besides root
    root: str = "."  # relative to the dataset's path
    code: str | None = None  # a ready-to-paste Python line, filled in by the daemon


class DatasetPublic(BaseModel):
    name: str
    key: str
    state: State
    path: str | None = None
    link: str | None = None
    progress: ProgressPublic = Field(default_factory=ProgressPublic)
    error: ErrorInfo | None = None
    usage: list[TorchvisionUsage] = Field(default_factory=list)
    leases: list[LeasePublic] = Field(default_factory=list)
    size_bytes: int = 0  # on the node-local disk, once ready
    created_at: datetime
    updated_at: datetime


class DatasetsPublic(BaseModel):
    data: list[DatasetPublic]
    count: int


class GcRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    all: bool = False  # also evict ready entries that still have a name, when unleased


class GcResult(BaseModel):
    evicted: list[str]  # keys
    freed_bytes: int
    leases_dropped: int
