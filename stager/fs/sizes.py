"""The bytes of a finished staging's tree, counted on every core.

A staging ends by measuring what it built (the entry's size, for the cache's
accounting): one ``fstatat`` per entry. (A one-step staging whose op counted
its bytes as it made them, a copy or a symlink farm, skips this: see stager.ops.base.)
On one process that took 1.3 s for 300,000 links, 1.0 s here
(docs/benchmarks.md, "Million-file walks"). Here the walk lists folders and the
forked workers of :mod:`stager.fs.forked` stat their entries, a folder chunk at
a time; the sizes come back through the workers' shared byte counters, so
nothing per file is kept or sent back.

Counted as ``stager.fs.sources.sum_sizes`` counts: files, links and special files
as themselves, not folders, never following a link.
"""

from __future__ import annotations

import os
from pathlib import Path

from stager.fs import forked
from stager.fs.sources import DIR_FLAGS, Folder, Visitor, open_child, open_top_unconfined

# Entries per chunk handed to a worker.
BATCH = 1024
# Trees with fewer entries are measured on the walking process.
PARALLEL_AFTER = 20_000


def tree_bytes(root: Path, workers: int) -> int:
    total = _Total()
    measure = _Measure(forked.Workers(forked.cores(workers), total, PARALLEL_AFTER))
    top = open_top_unconfined(str(root))
    try:
        measure.workers.walk(top, measure, "skip", flush=measure.submit)
    finally:
        os.close(top.fd)
    return total.nbytes


class _Total:
    """The ProgressSink the workers' counters are summed into."""

    def __init__(self) -> None:
        self.nbytes = 0

    def add_total(self, nbytes: int = 0, files: int = 0) -> None:
        pass

    def advance(self, nbytes: int = 0, files: int = 0) -> None:
        self.nbytes += nbytes


class _Measure(Visitor):
    def __init__(self, workers: forked.Workers) -> None:
        self.workers = workers
        self.pending: dict[int, list[str]] = {}  # by folder descriptor: names to stat
        self.groups: list[tuple[str, list[str]]] = []
        self.count = 0

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        names = self.pending.get(folder.fd)
        if names is None:
            names = self.pending[folder.fd] = []
        names.append(entry.name)
        if len(names) >= BATCH:
            self.leave(folder)

    link = special = file  # type: ignore[assignment]  # as themselves

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        return open_child(folder, entry.name)

    def leave(self, folder: Folder) -> None:
        names = self.pending.pop(folder.fd, None)
        if names:
            self.groups.append((folder.path, names))
            self.count += len(names)
            if self.count >= BATCH:
                self.submit()

    def submit(self) -> None:
        if self.groups:
            groups, count = self.groups, self.count
            self.groups, self.count = [], 0
            self.workers.submit(_stat_all, groups, files=count)


def _stat_all(groups: list[tuple[str, list[str]]]) -> None:
    """A chunk, on a worker: the summed ``lstat`` sizes of each folder's names."""
    for path, names in groups:
        if forked.stopping():
            return
        dfd = os.open(path, DIR_FLAGS | os.O_NOFOLLOW)
        try:
            stat = os.stat
            nbytes = sum(stat(name, dir_fd=dfd, follow_symlinks=False).st_size for name in names)
        finally:
            os.close(dfd)
        forked.report(nbytes, len(names))
