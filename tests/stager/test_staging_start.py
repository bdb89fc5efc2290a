"""A staging process starts in about the time of a fork: its fork server (set up by
stager.worker) has imported what a staging needs before its first step, down to what
multiprocessing needs to unpickle the staging's arguments."""

from __future__ import annotations

import subprocess
import sys

from tests.imports import REPO

# A process started as blocking.run_staging starts one (the fork server exits with it).
PROBE = """
from stager import worker
from stager.progress import SharedCounters
from tests import fork_probe

worker.CONTEXT.set_forkserver_preload(["stager.worker", "tests.fork_probe"])
receiver, sender = worker.CONTEXT.Pipe(duplex=False)
args = (SharedCounters(worker.CONTEXT), worker.CONTEXT.Event(), sender)
process = worker.CONTEXT.Process(target=fork_probe.imported_since_preload, args=args)
process.start()
sender.close()
print(receiver.recv())
process.join()
"""


def test_a_staging_process_imports_nothing_before_its_first_line() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
