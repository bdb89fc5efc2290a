"""Wire models of the HTTP API (v1), shared by the daemon and the client so the contract
cannot drift. Pydantic only, so ``import client`` stays free of FastAPI, uvicorn and torch.
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# Defined with the rest of the progress channel; part of the wire contract all the same.
from stager.wire.progress import ProgressPublic

__all__ = ["ProgressPublic"]  # and every model below

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,127}$"

VERIFY_LEVELS = ("size", "sha256", "none")
# Linux's limits: a file name of 255 bytes, a path of 4096 (NAME_MAX, PATH_MAX).
NAME_MAX, PATH_MAX = 255, 4096
LEASE_TTL_MAX_S = 10 * 365 * 86400  # ten years: longer is a mistake, and overflows dates
# Every number a request carries is bounded where it is declared, far past any real use
# and well inside what the code, the OS and dates take (tests/stager/test_request_bounds).
MAX_BYTES = 1 << 60  # an exbibyte
ByteCount = Annotated[int, Field(ge=0, le=MAX_BYTES)]
TRANSFER_TTL_MAX_S = 7 * 86400  # a reservation or export outliving a week is forgotten
MAX_PARTS = 1_000_000


def checked_path(value: str) -> str:
    """Refuse what no filesystem path can be, so it never reaches a system call."""
    if "\0" in value:
        raise ValueError(f"path {value!r} contains a NUL byte, which no file name may hold")
    encoded = value.encode("utf-8", "surrogateescape")
    if len(encoded) >= PATH_MAX:
        raise ValueError(f"path {value[:60]!r}... is {len(encoded)} bytes; paths are shorter")
    for part in encoded.split(b"/"):
        if len(part) > NAME_MAX:
            raise ValueError(
                f"path {value[:60]!r}... has a component of {len(part)} bytes; file names "
                f"are at most {NAME_MAX}"
            )
    return value


def _absolute(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path")
    return checked_path(value)


AbsolutePath = Annotated[str, AfterValidator(_absolute)]


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
    slurm_job_id: str | None = Field(default=None, pattern=r"^[0-9_]{1,40}$")
    ttl_s: float | None = Field(default=None, gt=0, le=LEASE_TTL_MAX_S, allow_inf_nan=False)


class WhoAmI(BaseModel):
    """Who the daemon takes the caller to be: in the node service, the kernel's word for
    the connection (SO_PEERCRED); per user, the daemon's own user."""

    uid: int
    gid: int
    pid: int = Field(description="the connecting process (0 when not known)")
    user: str = Field(description="the uid's passwd name, or the number")
    root: bool
    mode: Literal["multi-user", "per-user"]


class LeasePublic(BaseModel):
    id: str
    name: str
    key: str
    holder: str
    # None from a daemon older than per-user names.
    owner: int | None = Field(None, description="uid of the user whose dataset name it pins")
    slurm_job_id: str | None = None
    created_at: datetime
    expires_at: datetime | None = None


# ---- multi-node fan-out (docs/multinode.md; the routes: stager.api.routes.fanout) -----

LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


class Origin(BaseModel):
    """How this node's copy arrived: ``staged`` here from the source, or ``broadcast``
    by another node of a job (``node``); the SLURM job that brought it; and whether
    the latest request for this name found it already in the cache (``hit``)."""

    how: Literal["staged", "broadcast"]
    node: str | None = None
    job: str | None = None
    bytes: int = 0  # received from that node (broadcast)
    hit: bool = False


class SourceFile(BaseModel):
    path: str
    size: int


class ProbeResult(BaseModel):
    key: str
    state: str | None = None  # this node's entry for the key; None: it has none
    size_bytes: int = 0
    origin: Origin | None = None
    # Every source when each is a plain file (archives), to broadcast as they are.
    source_files: list[SourceFile] = Field(default_factory=list)
    # Whether this node stages the request as one image (a tree with ``image_fallback``
    # where it cannot mount one). None: a daemon from before this field.
    image: bool | None = None


class ExportCreate(BaseModel):
    """Pack part ``part`` of a dataset (parts are asked for in order, from 0). With
    ``early``, of a dataset still staging: files it finished a while ago, sent while it
    stages the rest; the first part asked for without ``early`` then plans what the
    ready tree still needs (see ``stager.fanout.early``)."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=LABEL_PATTERN)  # names the files, e.g. job-42
    part: int = Field(default=0, ge=0, le=MAX_PARTS)
    # With part 0: about how many bytes of file data each part holds (32 MiB).
    part_bytes: int | None = Field(default=None, ge=1 << 16, le=MAX_BYTES)
    early: bool = False
    # A ready image dataset goes as its image file (one part, ``image``) unless ``tree``
    # asks for its tree in parts with a manifest (each receiver then builds its image).
    tree: bool = False


class ImageSent(BaseModel):
    """An image dataset's file as the source node sends it (docs/multinode.md): its size
    and sha256, measured by that node's service from the very bytes sbcast reads, its
    format, and (node service) that service's credential for them (stager.core.vouch)."""

    model_config = ConfigDict(extra="forbid")

    size: ByteCount
    sha256: str = Field(pattern=SHA256_PATTERN)
    format: Literal["erofs", "squashfs"] = "erofs"
    credential: str | None = Field(default=None, max_length=4096)


class ExportPublic(BaseModel):
    id: str
    key: str
    part: int
    parts: int  # how many there are in all (an early export: packed so far)
    # This part: a plain tar of whole files. None: an early export has no part now
    # (``more``: ask again after ``retry_after_s``; else the staging ended, and the
    # ready tree's parts follow from part ``parts``).
    path: str | None = None
    bytes: int = 0  # this part's size
    total_bytes: int  # all parts together, about
    data_bytes: int  # the dataset's file data (what the receivers will write)
    # With the last part: every path, size and sha256 of the tree, and its sha256.
    manifest: str | None = None
    manifest_sha256: str | None = None
    # The node service vouches for the manifest (stager.core.vouch): the last part comes
    # with ``manifest_credential``, which lets receiving node services share the copy.
    vouched: bool = False
    manifest_credential: str | None = None
    more: bool = False
    retry_after_s: float = 0.0
    # A ready image dataset is sent as one file (``path``, the only part), no manifest:
    # its size and sha256, measured by this node's service from the bytes at ``path``.
    image: ImageSent | None = None


class IncomingCreate(BaseModel):
    """Room on the cache disk for files another node broadcasts here; counted by
    admission until adopted, released or expired."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=LABEL_PATTERN)  # the same on every node: one sbcast path
    bytes: ByteCount
    ttl_s: float = Field(default=3600.0, gt=0, le=TRANSFER_TTL_MAX_S)


class TransferPublic(BaseModel):
    """Room on the cache disk held for a broadcast: a delivery's folder (sbcast writes
    into it) or an export's."""

    id: str
    path: str
    bytes: int
    expires_at: datetime


class Adopt(BaseModel):
    """``adopt`` of a ``POST /v1/datasets``: stage from what is delivered into
    reservation ``incoming`` instead of from the sources. Either the prepared tree, in
    parts that may still be arriving (``bundle_bytes``: its file data; see
    ``stager.ops.adopt`` for the files that say a part is whole and that the last one
    came), or the request's own source files (``sources``: source path -> (size,
    sha256) of the copy, named ``delivered_name(path)`` in the folder), or an image
    dataset's image file, whole (``image``: its size and sha256 as the source node's
    service measured them, delivered as ``IMAGE_DELIVERY_NAME``). The entry keeps the
    request's cache key, which must equal ``origin_key``."""

    model_config = ConfigDict(extra="forbid")

    incoming: str = Field(pattern=LABEL_PATTERN)
    origin_node: str
    origin_key: str
    job: str | None = None
    bundle_bytes: ByteCount | None = None
    sources: dict[str, tuple[ByteCount, str]] | None = None
    # An image dataset's one file, delivered whole as ``IMAGE_DELIVERY_NAME``.
    image: ImageSent | None = None
    # The origin node's service vouches for the prepared tree's manifest (its export
    # said ``vouched``): the end file will carry its credential. Only then may a node
    # service share the adopted copy with every user; else it stays the asker's own.
    vouched: bool = False

    @model_validator(mode="after")
    def _one_kind(self) -> Adopt:
        given = [self.bundle_bytes, self.sources, self.image]
        if sum(v is not None for v in given) != 1:
            raise ValueError("give one of 'bundle_bytes' (a prepared tree), 'sources' or 'image'")
        return self


# The files of a delivery folder of a prepared tree. A part is whole once its ``.ok``
# file exists; the end file ({"parts": n, "manifest_sha256": ...} or {"abort": why})
# says that no more come.
MANIFEST_NAME = "manifest.json"
# An image dataset's delivery folder holds one file, this one.
IMAGE_DELIVERY_NAME = "image.img"
END_NAME = "end.json"
READY_SUFFIX = ".ok"


def part_name(index: int) -> str:
    return f"part-{index:05d}.tar"


def delivered_name(source_path: str) -> str:
    """The file name a broadcast source file gets in the incoming folder."""
    return "src-" + hashlib.sha256(source_path.encode()).hexdigest()[:16]


class DatasetCreate(BaseModel):
    """Body of ``POST /v1/datasets``: a recipe with its source, or raw steps."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    recipe: str | None = None
    source: AbsolutePath | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    # Each step is ``{"op": NAME, ...its fields}``. The daemon types them from its op
    # table (``OpTable.request_model``), so its OpenAPI document shows every op's fields.
    steps: list[dict[str, Any]] = Field(default_factory=list)
    link: AbsolutePath | None = None
    verify: Literal["size", "sha256", "none"] = "size"  # VERIFY_LEVELS
    # How sources are compared with the cached copy: "cheap" stats files and the top
    # level of trees; "deep" stats every file of every tree.
    fingerprint: Literal["cheap", "deep"] = "cheap"
    lease: LeaseCreate | None = None
    # Stage from what another node of a SLURM job broadcast here (docs/multinode.md).
    adopt: Adopt | None = None
    # Image mode (docs/image-mode.md): the dataset as one read-only image mounted at its
    # path; an image and a tree of the same data are two entries. A step ``image`` (a
    # prebuilt image file) implies it.
    image: bool = False
    # Where this daemon cannot mount an image (a user's daemon with no FUSE reader of
    # it), stage a tree instead of failing; the answer's ``notice`` says so.
    image_fallback: bool = False
    # The words of the #STAGER line this request comes from (stage --from-script, the
    # planner's prefetches): the node service names the data's node feature by them,
    # once it has checked that they declare this very request (stager.prestage.placement).
    declared: str | None = Field(None, max_length=4096)

    @model_validator(mode="after")
    def _recipe_or_steps(self) -> DatasetCreate:
        if self.recipe and self.steps:
            raise ValueError("give either 'recipe' (with 'source') or 'steps', not both")
        if not self.recipe and not self.steps:
            raise ValueError("give a 'recipe' with its 'source', or a non-empty 'steps' list")
        return self

    def spec(self) -> dict[str, Any]:
        """What identifies the content: everything but the handle, the link, the lease,
        the declaration's words, and where the bytes come from (a node adopting a
        broadcast copy keys it as the node that staged it from the source). ``image``
        only when asked for, so a tree's key is what it was before image mode;
        ``image_fallback`` never: a tree given instead is keyed as the tree it is."""
        exclude = {"name", "link", "lease", "adopt", "image_fallback", "declared"}
        if not self.image:
            exclude.add("image")
        return self.model_dump(mode="json", exclude=exclude)


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


class ImagePublic(BaseModel):
    """An image dataset's image (docs/image-mode.md): one read-only file under the
    cache, mounted at the dataset's ``path``."""

    file: str
    format: Literal["erofs", "squashfs"]
    mount: Literal["kernel", "fuse"]
    size_bytes: int = 0
    files: int = 0  # files, links and hard links in it (0: not counted)
    sha256: str | None = None  # known once measured (prebuilt, or sent by a fan-out)


class DatasetPublic(BaseModel):
    name: str
    # None from a daemon older than per-user names.
    owner: int | None = Field(
        None, description="uid of the user this name belongs to (names are per user)"
    )
    key: str
    state: State
    path: str | None = None
    link: str | None = None
    progress: ProgressPublic = Field(default_factory=ProgressPublic)
    error: ErrorInfo | None = None
    usage: list[TorchvisionUsage] = Field(default_factory=list)
    leases: list[LeasePublic] = Field(default_factory=list)
    size_bytes: int = 0  # on the node-local disk, once ready
    origin: Origin | None = None  # how this node's copy arrived
    image: ImagePublic | None = Field(
        None, description="set for an image dataset once ready: its file, format and mount"
    )
    created_at: datetime
    updated_at: datetime
    outcome: str | None = Field(
        None,
        description="what a DELETE did, in a sentence: to the name, and to the data (which "
        "stays while another name uses it)",
    )
    notice: str | None = Field(
        None,
        description="what a stage request was given other than it asked, in a sentence "
        "(an image asked for, a tree staged because this daemon cannot mount one)",
    )
    prestaged_for_job: int | None = Field(
        None, description="the Slurm job this data was pre-staged for on this node, if any"
    )


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
