"""Where a cache entry lives under ``data/``: the one place that says it.

Shared entries, and a per-user daemon's trees: ``data/<key>`` (an image's file beside
it). A user's own copy in the node service, and in a user's own daemon an entry whose
kind's place is a mount: ``data/u/<G>/dataset``, behind a gate ``data/u/<G>`` that only
its user may search, ``G`` an HMAC of the key under the node's secret (root's 0600), so
that neither the mount table nor a ``stat`` of a key worked out from public facts tells
whose data it is (docs/multiuser.md, "Protected data"). An earlier release kept
these at ``data/<key>`` (:meth:`Layout.old_place`); the registry moves them at its start.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from collections.abc import Callable
from pathlib import Path

from stager.core.settings import Settings
from stager.fs.seal import ACL_XATTR, gate_acl
from stager.image import mount as image_mount
from stager.state.cache import private_owner
from stager.state.dataset import Entry

USERS = "u"  # data/u/: the gates of users' own copies
PLACE = "dataset"  # a private copy's tree or mount point, in its gate
SECRET_BYTES = 32


class Layout:
    def __init__(
        self,
        data_dir: Path,
        secret: bytes | None = None,
        mounted: Callable[[Entry], bool] | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.users_dir = data_dir / USERS
        self._secret = secret  # None: every entry at data/<key>
        # None: the node service, where a user's own copy is gated; else a per-user
        # daemon, where an entry whose kind's place is a mount is.
        self._mounted = mounted
        self._gates: dict[str, Path] = {}  # key -> its gate, as computed once

    @classmethod
    def load(cls, settings: Settings, mounted: Callable[[Entry], bool]) -> Layout:
        """This daemon's layout, with its secret (made at the first start). Blocks."""
        secret = _secret(settings.cache_dir / "secret")
        return cls(settings.data_dir, secret, None if settings.multi_user else mounted)

    def final(self, entry: Entry) -> Path:
        return self.top(entry) / PLACE if self._private(entry) else self.top(entry)

    def top(self, entry: Entry) -> Path:
        """What holds all of ``entry`` under ``data/``, and goes with it in one rename."""
        if not self._private(entry):
            return self.data_dir / entry.key
        gate = self._gates.get(entry.key)
        if gate is None:  # once per key: a listing asks for every entry's path
            assert self._secret is not None
            digest = hmac.new(self._secret, f"entry:{entry.key}".encode(), hashlib.sha256)
            gate = self._gates[entry.key] = self.users_dir / digest.hexdigest()[:24]
        return gate

    def old_place(self, entry: Entry) -> Path:
        return self.data_dir / entry.key

    def prepare(self, entry: Entry) -> None:
        """``entry``'s gate, made and its rights set (again: an admin's chmod is undone)."""
        if not self._private(entry):
            return
        owner = private_owner(entry)  # None in a per-user daemon: every folder its user's
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.users_dir, 0o700)
        os.chmod(self.users_dir, 0o700 if owner is None else 0o711)
        gate = self.top(entry)
        with contextlib.suppress(FileExistsError):
            os.mkdir(gate, 0o700)
        if owner is None:
            os.chmod(gate, 0o700)
            return
        fd = os.open(gate, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.setxattr(fd, ACL_XATTR, gate_acl(owner))  # sets the mode bits too
        finally:
            os.close(fd)

    def release(self, entry: Entry) -> None:
        """A private copy's gate, once its dataset is gone: removed (if empty)."""
        if self._private(entry):
            with contextlib.suppress(OSError):  # gone, or not empty
                os.rmdir(self.top(entry))

    def backing(self, entry: Entry, configured: str) -> str:
        """How the kernel mounts ``entry``'s image: a private one from its file if it can."""
        if private_owner(entry) is not None and image_mount.erofs_from_files():
            return "file"
        return configured

    def _private(self, entry: Entry) -> bool:
        if self._secret is None:
            return False
        if self._mounted is not None:
            return self._mounted(entry)
        return private_owner(entry) is not None


def _secret(path: Path) -> bytes:
    """The node's secret: read, or made (0600, root's) at the first start."""
    with contextlib.suppress(FileNotFoundError):
        with open(path, "rb") as existing:
            value = existing.read()
        if len(value) != SECRET_BYTES:
            raise OSError(
                f"{path} holds {len(value)} bytes, not the {SECRET_BYTES} of the node's "
                "secret; restore it from a backup, or delete it (users' own copies are "
                "then staged again)"
            ) from None
        return value
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a start of the same pid that died here
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    value = secrets.token_bytes(SECRET_BYTES)
    try:
        os.write(fd, value)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # whole or not there: a start that dies mid-way leaves no stub
    except FileExistsError:
        pass  # another start made it first: theirs counts
    finally:
        os.unlink(tmp)
    return _secret(path)
