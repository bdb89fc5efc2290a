"""A staging process imports nothing after its fork, whatever its job: the job's kind
(a tree, an image), its ops and what unpickling it takes were all imported by the
fork server's preload (stager.engine.preload), so each staging starts in the time of
a fork. A module a job names that the preload missed is imported again in every
staging process (a kind's module did that: 10-20 ms per staging, bench_overhead's
'job-built -> spare-given').

The real daemon runs with a ``sitecustomize`` of the test's on its path, in every
process it starts: from the moment a process is forked (``os.register_at_fork``), it
writes each module it goes looking for to a file. The fork server is itself a fork of
the daemon (stager.core.processes), whose preload's imports are its purpose: its own
lines are set apart.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from tests.daemon import Daemon, stage_ready, unmount_under
from tests.processes import fork_server_of

SITECUSTOMIZE = """
import os
import sys

_LOG = os.environ["STAGER_TEST_FORKED_IMPORTS"]
_forked = []


class _Looked:
    def find_spec(self, name, path=None, target=None):
        if _forked and name not in sys.modules:
            with open(_LOG, "a") as log:
                log.write(f"{os.getpid()} {name}\\n")
        return None


with open(_LOG, "a") as log:
    log.write(f"{os.getpid()} started\\n")
sys.meta_path.insert(0, _Looked())
os.register_at_fork(after_in_child=lambda: _forked.append(True))
"""


def _tar(path: Path) -> Path:
    with tarfile.open(path, "w") as tar:
        for name in ("a/1.txt", "a/2.txt", "b/3.txt"):
            info = tarfile.TarInfo(name)
            info.size = 5
            tar.addfile(info, io.BytesIO(b"hello"))
    return path


def test_a_staging_process_of_each_kind_imports_nothing_after_its_fork(tmp_path: Path) -> None:
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    looked = tmp_path / "forked-imports.txt"
    looked.touch()
    source = tmp_path / "src"
    (source / "tree").mkdir(parents=True)
    for i in range(3):
        (source / "tree" / f"{i}.txt").write_text(str(i))
    archive = _tar(source / "data.tar")
    env = {"PYTHONPATH": str(hook), "STAGER_TEST_FORKED_IMPORTS": str(looked)}
    daemon = Daemon(cache_dir=tmp_path / "cache", extra_env=env).start()
    bodies = [
        {"name": "file", "steps": [{"op": "copy", "src": str(source / "tree" / "0.txt")}]},
        {"name": "tree", "steps": [{"op": "copy", "src": str(source / "tree")}]},
        {"name": "tar", "steps": [{"op": "extract", "src": str(archive)}]},
        {"name": "image", "steps": [{"op": "extract", "src": str(archive)}], "image": True},
        {"name": "again", "steps": [{"op": "copy", "src": str(source)}]},
    ]
    try:
        assert daemon.process is not None
        server = fork_server_of(daemon.process.pid)  # ready: the daemon forked it first
        assert server is not None
        with daemon.client() as client:
            for body in bodies:
                stage_ready(client, body)
    finally:
        daemon.stop()
        unmount_under(tmp_path)  # the image's kernel mount outlives its daemon
    lines = [line.split() for line in looked.read_text().splitlines()]
    started = {int(pid) for pid, what in lines if what == "started"}
    # The hook ran in the daemon; the fork server is a fork of it, no interpreter's start ...
    assert daemon.process.pid in started and server not in started, (server, lines)
    # ... and no forked process but the server looked for a module.
    imported = sorted({what for pid, what in lines if what != "started" and int(pid) != server})
    assert imported == [], f"imported after a fork (add to stager.engine.preload): {imported}"
