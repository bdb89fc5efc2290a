"""The daemon's log, as an admin reads it: timestamps, one line per state change
naming the dataset and its owner, JSON on request, no secret, no console hints."""

from __future__ import annotations

import getpass
import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon import Daemon, stage, stage_ready
from tests.httpserver import Behaviour, serve_files
from tests.trees import write_tree

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

STAMP = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


def test_one_timestamped_line_per_state_change_naming_the_dataset(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemon_factory()
    src = write_tree(tmp_path / "src", n_files=5, max_size=2000)
    me = getpass.getuser()
    with daemon.client() as client, serve_files(Behaviour()) as base:
        ready = stage_ready(client, {"name": "imgs", "steps": [{"op": "copy", "src": str(src)}]})
        # A download whose URL carries a password fails (404, not retried): the reason
        # is logged, the password never.
        url = f"{base.replace('//', '//alice:s3cret@')}/data.tar?X-Amz-Signature=abc"
        body = {"name": "priv", "steps": [{"op": "fetch", "url": url, "dst": "d.tar"}]}
        assert stage(client, body).status_code in (200, 202)
        client.get("/v1/datasets/priv/wait", params={"timeout": 30})
        assert client.delete("/v1/datasets/imgs").status_code == 200
    daemon.stop()
    log = daemon.log(limit=None)
    lines = log.splitlines()
    assert all(re.match(rf"{STAMP} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ", line)
               for line in lines), log  # fmt: skip
    named = f"dataset 'imgs' of {me} (key {ready.key})"
    for event in ("queued: 1 step(s) (copy)", "staging: attempt", "ready: in ", "evicted: "):
        assert any(f"{named} {event}" in line for line in lines), (event, log)
    assert re.search(rf"{re.escape(named)} ready: in \d+\.\d s, \d", log), log
    assert "evicted: on request (stager-client cancel)" in log
    failed = [line for line in lines if "dataset 'priv'" in line and " failed: " in line]
    assert len(failed) == 1 and "127.0.0.1" in failed[0], log
    assert "s3cret" not in log and "Signature=abc" not in log
    assert "CTRL+C" not in log
    assert "stager 0.1.0 starting" in log


def test_the_json_format_is_one_object_a_line_with_the_state_changes_fields(
    daemon_factory: Callable[..., Daemon], tmp_path: Path
) -> None:
    daemon = daemon_factory(env={"STAGER_LOG_FORMAT": "json"})
    src = write_tree(tmp_path / "src", n_files=3, max_size=1000)
    with daemon.client() as client:
        stage_ready(client, {"name": "imgs", "steps": [{"op": "copy", "src": str(src)}]})
    daemon.stop()
    records = [json.loads(line) for line in daemon.log(limit=None).splitlines()]
    assert all({"time", "level", "logger", "message"} <= set(r) for r in records)
    ready = [r for r in records if r.get("event") == "ready"]
    assert len(ready) == 1, records
    assert ready[0]["datasets"] == [{"name": "imgs", "owner": getpass.getuser()}]
    assert ready[0]["size_bytes"] > 0 and ready[0]["seconds"] >= 0
    assert re.fullmatch(STAMP, ready[0]["time"])


def test_a_stop_mid_staging_logs_interrupted_then_resumed(
    daemon_factory: Callable[..., Daemon],
) -> None:
    behaviour = Behaviour(files={"/big.bin": b"x" * 300_000}, bytes_per_s=100_000)
    daemon = daemon_factory(env={"STAGER_SHUTDOWN_TIMEOUT": "1"})
    with serve_files(behaviour) as base:
        body = {"name": "slow", "steps": [{"op": "fetch", "url": f"{base}/big.bin", "dst": "b"}]}
        with daemon.client() as client:
            assert stage(client, body).status_code == 202
            deadline = time.monotonic() + 20
            while client.get("/v1/datasets/slow").json()["state"] != "staging":
                assert time.monotonic() < deadline
                time.sleep(0.1)
        daemon.restart()
        with daemon.client() as client:
            waited = client.get("/v1/datasets/slow/wait", params={"timeout": 30}).json()
        assert waited["state"] == "ready", waited
    daemon.stop()
    log = daemon.log(limit=None)
    said = re.findall(r"dataset 'slow' of \S+ \(key \w+\) (\w+)", log)
    assert said == ["queued", "staging", "interrupted", "resumed", "staging", "ready"], log
    assert "resumed where it stopped" in log, log
