"""One extraction by stager, as a command: for timing it against ``tar -xf`` from outside.

    python -m bench.extract_once ARCHIVE DEST [--workers 2] [--rss-log FILE]

DEST is emptied first. With ``--rss-log``, the peak of the summed resident memory of
this process and its worker processes (sampled every 20 ms from /proc) is appended
to FILE as one line: the "daemon + workers" figure, which a whole-process timer that
reports the largest single process does not give.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
from pathlib import Path

from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

_PAGE = os.sysconf("SC_PAGE_SIZE")


class PeakSampler(threading.Thread):
    """Samples the resident memory of this process and its descendants every 20 ms.

    It shares the GIL with the extraction it measures, so a sample is kept cheap: the
    /proc files are opened once and re-read with ``pread`` (a /proc file is generated
    anew at each read from offset 0), not re-opened through Python's buffered I/O.
    """

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.done = threading.Event()
        self._fds: dict[str, int] = {}

    def run(self) -> None:
        try:
            while not self.done.wait(0.02):
                self.peak = max(self.peak, self._tree_rss(os.getpid()))
        finally:
            for fd in self._fds.values():
                os.close(fd)

    def _read(self, path: str) -> bytes:
        fd = self._fds.get(path)
        if fd is None:
            fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return os.pread(fd, 4096, 0)

    def _tree_rss(self, pid: int) -> int:
        """Resident bytes of ``pid`` and its descendants (threads are one process)."""
        total = 0
        todo = [pid]
        while todo:
            pid = todo.pop()
            try:
                total += int(self._read(f"/proc/{pid}/statm").split()[1]) * _PAGE
                todo.extend(
                    int(child) for child in self._read(f"/proc/{pid}/task/{pid}/children").split()
                )
            except (FileNotFoundError, ProcessLookupError):
                continue
        return total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archive", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rss-log", type=Path)
    args = parser.parse_args()
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    sampler = PeakSampler()
    sampler.start()
    ctx = OpContext(root=args.dest, progress=Progress(), workers=args.workers)
    extract.run(ExtractStep(src=str(args.archive)), ctx)
    sampler.done.set()
    sampler.join()
    if args.rss_log:
        with open(args.rss_log, "a") as log:
            log.write(f"{args.archive.name} peak_rss_sum_mb={sampler.peak / 2**20:.1f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
