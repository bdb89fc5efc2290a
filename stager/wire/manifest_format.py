"""The manifest's format: what a node's copy of a dataset must be, as bytes.

Every path of the tree, each file's size and sha256, each link's target. The sender
writes it as it packs; receivers check their tree against it (:mod:`stager.fs.manifest`),
and it against its sha256, which reaches them by another path (the job's ``srun``
step). The client imports it too, so it needs the standard library alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

VERSION = 1
HASH_CHUNK = 1 << 20


class NotAManifest(ValueError):
    """Bytes that are not a manifest of this version; the message names where they came from."""


@dataclass
class Manifest:
    files: dict[str, tuple[int, str]] = field(default_factory=dict)  # path -> (size, sha256)
    dirs: set[str] = field(default_factory=set)
    links: dict[str, str] = field(default_factory=dict)  # path -> target

    @property
    def total_bytes(self) -> int:
        return sum(size for size, _ in self.files.values())

    def to_bytes(self) -> bytes:
        # Canonical: the same tree always gives the same bytes, so the same digest.
        document = {
            "version": VERSION,
            "files": {path: list(entry) for path, entry in sorted(self.files.items())},
            "dirs": sorted(self.dirs),
            "links": dict(sorted(self.links.items())),
        }
        return json.dumps(document, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes, label: str) -> Manifest:
        """The manifest ``data`` holds; `NotAManifest` naming ``label`` if it holds none."""
        try:
            document = json.loads(data)
            if document.get("version") != VERSION:
                raise ValueError(f"version {document.get('version')!r}, not {VERSION}")
            files = {str(p): (int(s), str(h)) for p, (s, h) in document["files"].items()}
            dirs, links = document["dirs"], document["links"]
            if not isinstance(dirs, list) or not isinstance(links, dict):
                raise TypeError("'dirs' must be a list and 'links' an object")
            return cls(files, set(map(str, dirs)), dict(links))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise NotAManifest(f"manifest {label} is not a stager manifest ({exc})") from exc


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: str | os.PathLike[str] | int) -> tuple[int, str]:
    """(size, sha256) of one file (a path, or a descriptor it closes); hashlib releases
    the GIL on large chunks."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as stream:
        while chunk := stream.read(HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return size, sha.hexdigest()
