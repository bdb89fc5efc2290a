"""A staging process starts in about the time of a fork: its fork server (set up by
stager.core.processes, with stager.engine.preload) has imported what a staging needs before its
first step, down to what multiprocessing needs to unpickle the staging's arguments."""

from __future__ import annotations

import subprocess
import sys

from tests.imports import REPO

# A process started as blocking.run_staging starts one (the fork server exits with it).
PROBE = """
from stager.staging.blocking import Processes
from stager.wire.progress import SharedCounters
from tests import fork_probe

context = Processes(separate_users=False).context
context.set_forkserver_preload(["stager.engine.preload", "tests.fork_probe"])
receiver, sender = context.Pipe(duplex=False)
args = (SharedCounters(context), context.Event(), sender)
process = context.Process(target=fork_probe.imported_since_preload, args=args)
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
