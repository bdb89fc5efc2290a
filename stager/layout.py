"""Where a cache entry lives under ``data/``: the one place that says it.

* **Shared** entries, and every entry of a per-user daemon: ``data/<key>`` (and an
  image's file beside it, ``data/<key>.erofs``). Anyone may read them anyway.
* **A user's own copy** in the node service: ``data/u/<T>/<N>``, where ``T`` names the
  user and ``N`` the entry, each an HMAC under the node's secret (``<cache>/secret``,
  32 random bytes, root's 0600, made at the first start). Nobody else can compute
  either name, from a uid or from a key they worked out from public facts, so the
  names the kernel's mount table shows (``/proc/mounts`` lists every image's mount
  point and file) say neither whose nor what.
* ``data/u/`` is root's 0711: searchable, not listable. ``data/u/<T>`` is root's with
  an access ACL that lets its user search it (``--x``) and nobody else anything: the
  user reaches the paths the API gives them, lists nothing, writes nothing (they own
  nothing in the cache, so they can rename or replace nothing); everyone else gets
  EACCES at ``data/u/<T>``, so no ``stat``, ``statfs`` or ``getfacl`` of what lies
  inside (a tree's top, an image's mount point or file) tells them its size, entry
  count or times. What that folder's ACL still says, to whoever learns ``T`` from the
  mount table, is whose it is: the mount table is every user's, and any gate that
  lets one user in names them to everyone who can look it up (docs/multiuser.md).

A private image is mounted from its file, not a loop device, where the kernel can
(EROFS, Linux 6.12+): a loop device's size is in ``/sys/block/loopN/size`` for all.

An earlier release kept private copies at ``data/<key>``; :meth:`Layout.old_place`
names that, and the registry moves them at its start (stager.lifecycle).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from stager.cache import private_owner
from stager.dataset import Entry
from stager.fs.seal import ACL_XATTR, gate_acl
from stager.image import mount as image_mount
from stager.settings import Settings

USERS = "u"  # data/u/: the users' own folders
SECRET_BYTES = 32


class Layout:
    def __init__(self, data_dir: Path, secret: bytes | None = None) -> None:
        self.data_dir = data_dir
        self.users_dir = data_dir / USERS
        self._secret = secret  # None: a per-user daemon, every entry at data/<key>

    @classmethod
    def load(cls, settings: Settings) -> Layout:
        """The node service's layout, with its secret (made now if this is the first
        start); a per-user daemon's, without one. Blocks: called through ``run_io``."""
        if not settings.multi_user:
            return cls(settings.data_dir)
        return cls(settings.data_dir, _secret(settings.cache_dir / "secret"))

    def final(self, entry: Entry) -> Path:
        """Where ``entry``'s tree is published, or its image mounted."""
        owner = private_owner(entry)
        if owner is None or self._secret is None:
            return self.data_dir / entry.key
        return self.user_folder(owner) / self._name("entry", entry.key)

    def user_folder(self, uid: int) -> Path:
        assert self._secret is not None
        return self.users_dir / self._name("user", str(uid))

    def old_place(self, entry: Entry) -> Path:
        """Where an earlier release put ``entry``: ``data/<key>``."""
        return self.data_dir / entry.key

    def prepare(self, entry: Entry) -> None:
        """The folders ``entry``'s place needs, made and their rights set (again: an
        admin's chmod is undone): for a private copy, its user's folder. Blocks."""
        owner = private_owner(entry)
        if owner is None or self._secret is None:
            return
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.users_dir, 0o700)
        os.chmod(self.users_dir, 0o711)
        folder = self.user_folder(owner)
        with contextlib.suppress(FileExistsError):
            os.mkdir(folder, 0o700)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.setxattr(fd, ACL_XATTR, gate_acl(owner))  # sets the mode bits too
        finally:
            os.close(fd)

    def backing(self, entry: Entry, configured: str) -> str:
        """How the kernel mounts ``entry``'s image: a private one from its file where the
        kernel can (no loop device, whose size every user may read), else as set."""
        if private_owner(entry) is not None and image_mount.erofs_from_files():
            return "file"
        return configured

    def _name(self, kind: str, value: str) -> str:
        assert self._secret is not None
        digest = hmac.new(self._secret, f"{kind}:{value}".encode(), hashlib.sha256)
        return digest.hexdigest()[:24]


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
