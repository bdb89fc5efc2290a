"""An image file's identity: what a cache hit checks instead of walking its files.

An image is one file, read-only by construction (mounted ``ro``; the file 0444 and,
in the node service, root's). Its identity is its SHA-256, measured once (when it is
built, adopted or first trusted), and the kernel's stamps of the file: device,
inode, size, mtime and ctime. Any write, truncate, chmod, chown or replacement of
the file changes its ctime (which only the kernel sets) or its inode, so a hit
compares one ``stat`` with the stamps instead of reading the image again. A
prebuilt image the admin trusts is checked against the SHA-256 pinned in settings
before it is ever mounted.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from stager.core.errors import StagerError

_CHUNK = 4 << 20


class ImageChanged(StagerError):
    """An image file is not the one measured: changed, replaced, or another image."""

    type = "image_changed"


@dataclass(frozen=True)
class ImageIdentity:
    sha256: str  # "" until measured (an image the service built is hashed when sent)
    size: int
    device: int
    inode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def measure(cls, path: str) -> ImageIdentity:
        """Hash ``path`` (never through a link) and stamp it; a file changed while it
        was read is refused, so the hash and the stamps describe the same bytes."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            before = os.fstat(fd)
            digest = hashlib.sha256()
            while data := os.read(fd, _CHUNK):
                digest.update(data)
            after = os.fstat(fd)
        finally:
            os.close(fd)
        if _stamps(before) != _stamps(after):
            raise ImageChanged(f"{path} changed while it was hashed; build or copy it again")
        return cls(digest.hexdigest(), *_stamps(after))

    @classmethod
    def stamp(cls, path: str, sha256: str = "") -> ImageIdentity:
        """The stamps of ``path`` (never through a link), with a hash known already or
        none: a file the service itself just wrote needs no second read."""
        return cls(sha256, *_stamps(os.lstat(path)))

    def to_dict(self) -> dict[str, int | str]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, data: dict[str, int | str]) -> ImageIdentity:
        return cls(**data)  # type: ignore[arg-type]

    def same_file(self, device: int, inode: int) -> bool:
        return (self.device, self.inode) == (device, inode)

    def check(self, path: str) -> None:
        """Raise unless ``path`` is still the file measured (one ``lstat``)."""
        try:
            now = _stamps(os.lstat(path))
        except FileNotFoundError:
            raise ImageChanged(f"image {path} is gone; stage the dataset again") from None
        if now != (self.size, self.device, self.inode, self.mtime_ns, self.ctime_ns):
            raise ImageChanged(
                f"image {path} changed since it was measured (size, inode or times differ); "
                "it is not served: evict it and stage the dataset again"
            )

    def renamed(self, path: str) -> ImageIdentity:
        """The stamps of this file after root renamed it to ``path`` (a rename sets its
        ctime): the same file, size and mtime, or ImageChanged."""
        now = ImageIdentity.stamp(path, self.sha256)
        if (now.size, now.device, now.inode, now.mtime_ns) != (
            self.size,
            self.device,
            self.inode,
            self.mtime_ns,
        ):
            raise ImageChanged(f"image {path} is not the file measured; stage it again")
        return now

    def check_pinned(self, expected_sha256: str, path: str) -> None:
        """Raise unless the measured hash is the one the admin pinned."""
        if self.sha256 != expected_sha256.lower():
            raise ImageChanged(
                f"image {path} has sha256 {self.sha256}, not the pinned {expected_sha256}; "
                "it is not mounted: publish the right image or pin its new hash"
            )


def _stamps(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_size, st.st_dev, st.st_ino, st.st_mtime_ns, st.st_ctime_ns
