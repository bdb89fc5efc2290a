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
from stager.progress import Progress

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (threads are one process)."""
    total = 0
    todo = [pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/statm") as statm:
                total += int(statm.read().split()[1]) * _PAGE
            with open(f"/proc/{pid}/task/{pid}/children") as children:
                todo.extend(int(child) for child in children.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


class PeakSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            self.peak = max(self.peak, _tree_rss(os.getpid()))


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
