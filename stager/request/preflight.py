"""Checks run when a request arrives, before anything is queued: fast, blocking, and
what looks at a request's paths runs as the caller and answers in JSON. A failure is
a 4xx with a sentence naming the bad input.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeGuard

import httpx

from stager.core import downloads
from stager.core.errors import BadRequest, SourceUnreadable, UnsafePath
from stager.core.settings import Settings
from stager.fs import mounts
from stager.fs.credentials import path_readable_by_everyone
from stager.fs.seal import check_acls
from stager.fs.sources import Roots, within
from stager.ops import table
from stager.ops.base import CheckContext
from stager.request import recipes
from stager.request.fingerprint import sources_fingerprint
from stager.state.dataset import private_key, spec_key


@contextmanager
def _request_paths() -> Iterator[None]:
    """The one place a system call's error on a request's path becomes a 400."""
    try:
        yield
    except PermissionError as exc:
        where = exc.filename or "a path of the request"
        raise SourceUnreadable(
            f"{where} is not readable by the user who asked (the kernel refused); fix its "
            "permissions, or stage it as a user who may read it"
        ) from exc
    except OSError as exc:
        where = exc.filename or "a path of the request"
        raise BadRequest(f"{where}: {exc.strerror}; check that path in the request") from exc


def look(
    dumped_steps: list[dict[str, Any]],
    settings: Settings,
    deep: bool,
    link: str | None,
    recipe: tuple[str, dict[str, Any], str | None] | None = None,
    vouched: bool = False,
    check: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What the daemon must know of a request's paths, found as the caller: the recipe's
    files, the sources' fingerprint, whether every user may share the staging, for a
    ``vouched`` copy whether its sources are the same on every node, and that the link
    can be made. With ``check`` (``spec``, ``verify``, ``uid`` and the ``known`` keys a
    request joins or hits): a miss is checked and sized too, in the same trip."""
    if recipe is not None:
        recipes.check_sources(*recipe, settings)
    steps = table.for_settings(settings).validate_steps(dumped_steps)
    with _request_paths():
        for source in (getattr(step, "src", None) for step in steps):
            if _absolute(source):  # before a deep fingerprint would walk the cache
                check_not_around_cache(source, settings)
        fingerprint = sources_fingerprint(steps, deep)
        shared = settings.multi_user and shareable(steps, settings)
    if shared:
        versions = download_versions(steps)
        shared = versions is not None
        if versions:
            fingerprint = hashlib.sha256("\n".join([fingerprint, *versions]).encode()).hexdigest()
            fingerprint = fingerprint[:24]
    check_link(link, settings)
    estimate = None
    if check is not None:
        key = spec_key({"spec": check["spec"], "sources": fingerprint})
        if not {key, private_key(key, check["uid"])} & set(check["known"]):
            estimate = _check_steps(steps, check["verify"], settings)
    return {
        "fingerprint": fingerprint,
        "shareable": shared,
        "cluster_wide": shared and vouched and on_cluster_storage(steps, settings),
        "estimate": estimate,
    }


def on_cluster_storage(steps: list[Any], settings: Settings) -> bool:
    """Whether every source of ``steps`` is on a network filesystem or under the admin's
    ``cluster_storage_dirs``: a node-local path may hold other bytes elsewhere."""
    tops = [os.path.realpath(top) for top in settings.cluster_storage_dirs]
    for source in (getattr(step, "src", None) for step in steps):
        if not _absolute(source):
            continue
        real = os.path.realpath(source)
        if not (mounts.on_network(real) or any(within(real, top) for top in tops)):
            return False
    return True


def download_versions(steps: list[Any]) -> list[str] | None:
    """Each download's version for the cache key of a shared staging; None when one may
    not be shared (its URL names this node, or it has no sha256 and no version)."""
    versions = []
    for step in steps:
        url = getattr(step, "url", None)
        if url is None:
            continue
        if downloads.names_this_node(httpx.URL(url).host):
            return None
        if getattr(step, "sha256", None):
            continue  # the digest is the version
        version = downloads.validator(url)
        if version is None:
            return None
        versions.append(f"{url}\0{version}")
    return versions


def check_steps(dumped_steps: list[dict[str, Any]], verify: str, settings: Settings) -> int:
    """Validate every step's source; return the estimated bytes the staging writes."""
    return _check_steps(table.for_settings(settings).validate_steps(dumped_steps), verify, settings)


def _check_steps(steps: list[Any], verify: str, settings: Settings) -> int:
    with _request_paths():
        for step in steps:
            src = getattr(step, "src", None)
            if _absolute(src):  # relative: an earlier step's output
                check_allowed_root(src, settings)
        ctx = CheckContext(allowed_roots=tuple(settings.allowed_roots), verify=verify)
        return table.for_settings(settings).check(steps, ctx)


def shareable(steps: list[Any], settings: Settings) -> bool:
    """Whether the node service may stage these steps once for every user: ops that
    read only their sources, each readable by everyone (the staging checks every file)."""
    if not steps or not table.for_settings(settings).shareable(steps):
        return False
    sources = [s for s in (getattr(step, "src", None) for step in steps) if _absolute(s)]
    return all(path_readable_by_everyone(s) for s in sources)


def _absolute(src: object) -> TypeGuard[str]:
    return isinstance(src, str) and src.startswith("/")


def check_allowed_root(source: str, settings: Settings) -> None:
    """The request's own source path, resolved; what lies below it the ops confine."""
    if Roots.of(settings.allowed_roots).contains(os.path.realpath(source)):
        return
    listed = ", ".join(str(r) for r in settings.allowed_roots)
    raise UnsafePath(
        f"source {source} is outside the allowed source roots ({listed}); "
        "stage from one of them or ask the admin to add it to STAGER_ALLOWED_ROOTS"
    )


def check_not_around_cache(source: str, settings: Settings) -> None:
    """A source that holds the cache would be copied into itself: refused, as GNU cp
    refuses (paths resolved, so a link to such a folder is refused too)."""
    cache = settings.cache_dir.resolve()
    if within(str(cache), os.path.realpath(source)):
        raise BadRequest(
            f"source {source} holds the cache folder {cache}: staging it would copy the "
            "cache into itself; stage a folder that does not hold the cache, or put the "
            "cache elsewhere (STAGER_CACHE_DIR)"
        )


def check_link(link: str | None, settings: Settings) -> None:
    """A link may replace an old symlink, never a real file or folder, and must be
    creatable: it is made when the data is ready, when nobody can be told."""
    if link is None:
        return
    path = Path(link)
    with _request_paths():
        cache = settings.cache_dir.resolve()
        # The folder it goes in, not the link: an existing link (our own, from an earlier
        # request) points into the cache by design, and is replaced.
        where = path.parent.resolve() / path.name
        if where == cache or cache in where.parents:
            raise UnsafePath(f"link {link} is inside the cache directory; choose a path outside it")
        if os.path.lexists(path) and not path.is_symlink():
            raise BadRequest(
                f"link {link} already exists and is not a symlink; remove it or choose "
                "another --link"
            )
        folder = path.parent
        while not os.path.lexists(folder):
            folder = folder.parent  # made when the link is
        # Checked with this process's rights (the caller's, in the node service), as
        # creating the link will be.
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK, effective_ids=True):
            raise BadRequest(
                f"link {link} cannot be created: {folder} is not a folder you can "
                "write; choose a --link path under one"
            )


def free_bytes(settings: Settings) -> int:
    return shutil.disk_usage(settings.cache_dir).free


def free_inodes(settings: Settings) -> int | None:
    """Inodes the cache's disk has free for an unprivileged writer; None where it keeps
    no count (btrfs, some network filesystems report 0 of 0)."""
    st = os.statvfs(settings.cache_dir)
    return st.f_favail if st.f_files else None


def ensure_dirs(settings: Settings) -> None:
    for folder in (
        settings.cache_dir,
        settings.data_dir,
        settings.partial_dir,
        settings.incoming_dir,
        settings.outgoing_dir,
    ):
        folder.mkdir(parents=True, exist_ok=True)
    if not settings.multi_user:
        os.chmod(settings.cache_dir, 0o700)  # one user's: nobody else's business
        return
    # The node service: data/, incoming/ and outgoing/ are searchable, not listable: a
    # user reaches the paths the API gave them and learns nothing of others'. Set at
    # every start, so a cache an earlier release made 0755 is closed too.
    os.chmod(settings.cache_dir, 0o755)
    for passage in (settings.data_dir, settings.incoming_dir, settings.outgoing_dir):
        os.chmod(passage, 0o711)  # searchable, not listable: nobody sees others' labels
    os.chmod(settings.partial_dir, 0o700)
    check_acls(settings.partial_dir)  # private copies' tops need them (stager.fs.seal)
