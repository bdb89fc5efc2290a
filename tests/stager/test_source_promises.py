"""What a source can do to a staging, through a real daemon: a special file in the
tree, a link out of ``--allowed-root``, a file rewritten while it is copied. Each
ends in a refusal or a failure with a sentence naming the path, never in a hang or
a dataset reported ready that differs from its source."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.daemon import Daemon
from tests.httpserver import Behaviour, serve_files
from tests.trees import write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

WAIT_S = 60


def settle(client: httpx.Client, body: dict) -> tuple[int, dict]:
    """POST, then (if accepted) wait for the end; the POST's code and the last status."""
    response = client.post("/v1/datasets", json=body)
    if response.status_code not in (200, 202):
        return response.status_code, response.json()
    waited = client.get(
        f"/v1/datasets/{body['name']}/wait", params={"timeout": WAIT_S}, timeout=WAIT_S + 10
    )
    return response.status_code, waited.json()


def test_special_files_are_refused_or_skipped_never_waited_on(
    daemon: Daemon, tmp_path: Path
) -> None:
    src = write_tree(tmp_path / "src", n_files=20)
    fifo = src / "class_1" / "deep" / "pipe"
    fifo.parent.mkdir()
    with daemon.client() as client:
        # While staging: a special file that appears after the request's check (a
        # download holds the first step meanwhile) fails the staging, in time.
        behaviour = Behaviour(files={"/f": b"x"}, hold=threading.Event())
        with serve_files(behaviour) as url:
            steps = [
                {"op": "fetch", "url": f"{url}/f", "dst": "f"},
                {"op": "copy", "src": str(src), "dst": "copied"},
            ]
            response = client.post("/v1/datasets", json={"name": "b", "steps": steps})
            assert response.status_code == 202, response.text
            os.mkfifo(fifo)
            behaviour.hold.set()
            status = client.get(
                "/v1/datasets/b/wait", params={"timeout": WAIT_S}, timeout=WAIT_S + 10
            ).json()
        assert status["state"] == "failed", status
        assert status["error"]["type"] == "special_file"
        assert f"source {fifo} is a FIFO" in status["error"]["message"]
        # At the request: the copy's check walks the tree.
        code, reply = settle(client, {"name": "a", "steps": [{"op": "copy", "src": str(src)}]})
        assert code == 400 and reply["error"]["type"] == "special_file"
        assert f"source {fifo} is a FIFO" in reply["error"]["message"]
        # Left out when the request says so.
        body = {"name": "c", "steps": [{"op": "copy", "src": str(src), "special": "skip"}]}
        code, status = settle(client, body)
        assert status["state"] == "ready", status
        staged = Path(status["path"])
        assert (staged / "class_1" / "deep").is_dir()
        assert not os.path.lexists(staged / "class_1" / "deep" / "pipe")
        assert len(list(staged.rglob("*.jpg"))) == 20


def test_links_out_of_the_allowed_root_are_refused_at_any_depth(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    allowed = tmp_path / "allowed"
    src = write_tree(allowed / "src", n_files=10)
    (tmp_path / "secret.txt").write_text("not for staging")
    hop = allowed / "hop"  # a chain: in the tree -> elsewhere in the root -> outside
    hop.symlink_to(tmp_path / "secret.txt")
    link = src / "class_2" / "deeper" / "innocent.jpg"
    link.parent.mkdir()
    link.symlink_to(hop)
    daemon = daemon_factory(args=["--allowed-root", str(allowed)])
    with daemon.client() as client:
        for name, step in {
            "copied": {"op": "copy", "src": str(src)},
            "linked": {"op": "symlink", "src": str(src), "mode": "tree"},
        }.items():
            code, reply = settle(client, {"name": name, "steps": [step]})
            assert code == 400 and reply["error"]["type"] == "unsafe_path", reply
            assert (
                f"source {link} resolves to {tmp_path / 'secret.txt'}"
                in (reply["error"]["message"])
            )
        hop.unlink()
        hop.symlink_to(src / "class_0")  # now the chain stays inside: staged
        code, status = settle(client, {"name": "ok", "steps": [{"op": "copy", "src": str(src)}]})
        assert status["state"] == "ready", status


WRITER = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY)
open(sys.argv[2], "w").close()  # started
n = 0
while True:
    n += 1
    os.pwrite(fd, n.to_bytes(8, "little"), 0)  # each write moves mtime and ctime
"""


def test_a_file_rewritten_during_the_copy_fails_the_staging(daemon: Daemon, tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    busy = src / "busy.bin"
    busy.write_bytes(os.urandom(32 << 20))  # each copy of it spans many of the writes
    started = tmp_path / "writer-started"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(busy), str(started)])
    try:
        while not started.exists():
            assert writer.poll() is None
        with daemon.client() as client:
            body = {"name": "moving", "steps": [{"op": "copy", "src": str(src)}]}
            code, status = settle(client, body)
    finally:
        writer.kill()
        writer.wait()
    assert status["state"] == "failed", status
    assert status["error"]["type"] == "verify_failed"
    assert f"source {busy} changed while it was copied" in status["error"]["message"]
