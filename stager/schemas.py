"""Wire models of the HTTP API (v1), shared by the daemon and the client.

One module imported by both sides rather than two copies: the shapes are a
contract, and a single definition cannot drift. It depends on pydantic only, so
``import client`` stays free of FastAPI, uvicorn and torch.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"

ARCHIVE_FORMATS = ("auto", "tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip")


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


def _absolute_source(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"source {value!r} must be an absolute path")
    return value


def _relative_destination(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts:
        raise ValueError(
            f"destination {value!r} must be relative to the dataset directory, without '..'"
        )
    return value


AbsoluteSource = Annotated[str, AfterValidator(_absolute_source)]
RelativePath = Annotated[str, AfterValidator(_relative_destination)]


class _Step(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CopyStep(_Step):
    """Copy a file or a directory tree into the dataset."""

    op: Literal["copy"]
    src: AbsoluteSource
    dst: RelativePath = "."


class SymlinkStep(_Step):
    """Link a source into the dataset: one link, or a mirrored tree of per-file links."""

    op: Literal["symlink"]
    src: AbsoluteSource
    dst: RelativePath = "."
    mode: Literal["link", "tree"] = "link"


class ExtractStep(_Step):
    """Extract an archive; ``nested`` also extracts archives found inside it."""

    op: Literal["extract"]
    src: AbsoluteSource
    dst: RelativePath = "."
    format: Literal["auto", "tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip"] = "auto"
    strip_components: int = Field(default=0, ge=0)
    nested: bool = False


class RenameStep(_Step):
    """Rename a path inside the dataset directory."""

    op: Literal["rename"]
    src: RelativePath
    dst: RelativePath


class FetchStep(_Step):
    """Download an HTTP(S) URL into the dataset, resuming with Range requests."""

    op: Literal["fetch"]
    url: str
    dst: RelativePath
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"url {value!r} must start with http:// or https://")
        return value


class UnpackStep(_Step):
    """Bring an archive into the dataset and extract it: straight from the source
    (``direct``), from a local copy (``copy``) or through a link (``symlink``) kept at
    ``keep``. A directory source is copied (``direct``/``copy``) or tree-linked."""

    op: Literal["unpack"]
    src: AbsoluteSource
    dst: RelativePath = "."
    mode: Literal["direct", "copy", "symlink"] = "direct"
    keep: RelativePath | None = None  # where the copy or link goes; default: src's name
    format: Literal["auto", "tar", "tar.gz", "tar.bz2", "tar.xz", "tar.zst", "zip"] = "auto"
    strip_components: int = Field(default=0, ge=0)
    nested: bool = False
    md5: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{32}$")  # of the release
    verify_md5: bool = False  # one extra pass over the archive; off unless asked


class ImagenetDevkitStep(_Step):
    """Write torchvision's ImageNet ``meta.bin`` from ``ILSVRC2012_devkit_t12.tar.gz``."""

    op: Literal["imagenet_devkit"]
    src: AbsoluteSource  # the devkit archive
    dst: RelativePath = "meta.bin"


class ImagenetValStep(_Step):
    """Sort the flat ImageNet val images in ``dst`` into ``dst/<wnid>/`` by the devkit."""

    op: Literal["imagenet_val"]
    src: AbsoluteSource  # the devkit archive
    dst: RelativePath = "val"


Step = Annotated[
    CopyStep
    | SymlinkStep
    | ExtractStep
    | RenameStep
    | FetchStep
    | UnpackStep
    | ImagenetDevkitStep
    | ImagenetValStep,
    Field(discriminator="op"),
]
OP_NAMES = (
    "copy",
    "symlink",
    "extract",
    "rename",
    "fetch",
    "unpack",
    "imagenet_devkit",
    "imagenet_val",
)


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
    steps: list[Step] = Field(default_factory=list)
    link: str | None = None
    verify: Literal["size", "sha256", "none"] = "size"
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


class ProgressPublic(BaseModel):
    step: str | None = None
    step_index: int = 0
    steps_total: int = 0
    bytes_done: int = 0
    bytes_total: int = 0
    files_done: int = 0
    files_total: int | None = None
    rate_bytes_per_s: float = 0.0
    eta_s: float | None = None


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
