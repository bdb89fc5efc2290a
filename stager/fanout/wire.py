"""Wire models of the fan-out endpoints, shared by the daemon and the client.

pydantic only, like :mod:`stager.schemas`: ``import client`` stays light.

    POST   /v1/datasets/probe            ProbeResult: this node's key and copy, no side effect
    POST   /v1/datasets/{name}/export    ExportPublic: a ready dataset packed for sbcast
    DELETE /v1/exports/{id}              the packed files, once sent
    POST   /v1/incoming                  IncomingPublic: room reserved for a delivery
    DELETE /v1/incoming/{id}             the reservation and whatever was delivered
    POST   /v1/datasets  {"adopt": ...}  stage from a delivery instead of the source
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

LABEL_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"


class Origin(BaseModel):
    """How a node's copy arrived: staged here from the source, or broadcast by another
    node. A cache hit is a request served by an existing copy (``hit`` on the reply)."""

    how: Literal["staged", "broadcast"]
    node: str | None = None  # the node it came from (broadcast) or was staged on
    job: str | None = None  # the SLURM job that brought it


class SourceFile(BaseModel):
    path: str
    size: int


class ProbeResult(BaseModel):
    key: str
    state: str | None = None  # this node's entry for the key; None: it has none
    size_bytes: int = 0
    origin: Origin | None = None
    # Every source of the request when each one is a plain file (archives): they can
    # be broadcast as they are and staged from on every node. Empty otherwise.
    source_files: list[SourceFile] = Field(default_factory=list)


class ExportCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=LABEL_PATTERN)  # names the files, e.g. job-42


class ExportPublic(BaseModel):
    id: str
    key: str
    bundle: str  # a plain tar of the ready tree
    manifest: str  # every path, size and sha256 of it
    manifest_sha256: str
    bundle_bytes: int


class IncomingCreate(BaseModel):
    """Room on the cache disk for files another node broadcasts here; counted by
    admission until adopted, released or expired."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field(pattern=LABEL_PATTERN)  # the same on every node: one sbcast path
    bytes: int = Field(ge=0)
    ttl_s: float = Field(default=3600.0, gt=0)


class IncomingPublic(BaseModel):
    id: str
    path: str  # the folder sbcast writes into
    bytes: int
    expires_at: datetime


class Adopt(BaseModel):
    """``adopt`` of a ``POST /v1/datasets``: the dataset was delivered into reservation
    ``incoming``; stage it from there. Either a bundle (``bundle.tar`` with its
    ``manifest.json``, whose sha256 is given here) or the request's own source files
    (``sources``: source path -> (size, sha256) of the copy, named
    ``delivered_name(path)`` in the folder). The entry keeps the request's cache key,
    which must equal ``origin_key``."""

    model_config = ConfigDict(extra="forbid")

    incoming: str = Field(pattern=LABEL_PATTERN)
    origin_node: str
    origin_key: str
    job: str | None = None
    manifest_sha256: str | None = Field(default=None, pattern=SHA256_PATTERN)
    sources: dict[str, tuple[int, str]] | None = None


BUNDLE_NAME = "bundle.tar"
MANIFEST_NAME = "manifest.json"


def delivered_name(source_path: str) -> str:
    """The file name a broadcast source file gets in the incoming folder."""
    import hashlib

    return "src-" + hashlib.sha256(source_path.encode()).hexdigest()[:16]
