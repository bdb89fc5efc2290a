"""The op table is the one place an op is declared: schema, validation, refusals,
``GET /v1/recipes`` and dispatch in the staging process all follow from it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from stager.ops import table
from tests.daemon import Daemon, stage_ready
from tests.stager import toy_op

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

REPO = Path(__file__).resolve().parents[2]


def test_op_names_are_written_in_the_table_only() -> None:
    """No other module spells an op name as a string the daemon dispatches on."""
    names = table.load().names
    pattern = "|".join(re.escape(f'"{name}"') for name in names)
    found = subprocess.run(
        ["grep", "-rlE", f"Literal\\[({pattern})\\]|OP_NAMES|op == ({pattern})", "stager"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    assert found == [], f"op names outside stager/ops/table.py: {found}"
    assert set(names) >= {"copy", "symlink", "extract", "rename", "fetch", "unpack"}


def test_a_toy_op_from_a_module_appears_everywhere_and_stages(daemon_factory) -> None:
    daemon: Daemon = daemon_factory(env={"STAGER_OP_MODULES": '["tests.stager.toy_op"]'})
    with daemon.client() as client:
        schemas = client.get("/openapi.json").json()["components"]["schemas"]
        assert schemas["ToyStep"]["properties"]["op"]["const"] == "toy"
        ops = {op["name"]: op for op in client.get("/v1/recipes").json()["ops"]}
        assert ops["toy"]["summary"] == "Write ``text`` into a file of the dataset."
        assert ops["toy"]["verify"] == ["none", "size"]
        steps = [{"op": "toy", "dst": "hello/world.txt", "text": "hi there"}]
        status = stage_ready(client, {"name": "toy", "steps": steps})
        assert Path(status.path, "hello", "world.txt").read_text() == "hi there"
        # The table's refusals apply to the new op as to any other.
        refused = client.post(
            "/v1/datasets", json={"name": "toy2", "verify": "sha256", "steps": steps}
        )
        assert refused.status_code == 400
        assert (
            "verify 'sha256' is not carried out by step 1 (toy)"
            in refused.json()["error"]["message"]
        )


def test_a_bug_in_a_staging_tells_the_client_a_sentence_and_the_log_its_traceback(
    daemon_factory,
) -> None:
    """An op that raises what no op should (a bug): the dataset fails as an internal
    error in one sentence, and the traceback, with the paths and code it names, goes to
    the daemon log only."""
    daemon: Daemon = daemon_factory(env={"STAGER_OP_MODULES": '["tests.stager.toy_op"]'})
    steps = [{"op": "toy", "dst": "x.txt", "text": toy_op.BUG}]
    with daemon.client() as client:
        assert client.post("/v1/datasets", json={"name": "bug", "steps": steps}).is_success
        status = client.get("/v1/datasets/bug/wait", params={"timeout": 30}).json()
    assert status["state"] == "failed", status
    error = status["error"]
    assert error["type"] == "internal_error", error
    assert error["message"].startswith("internal error while staging"), error
    for leak in ("Traceback", 'File "', "/home/alice/secret", "ZeroDivisionError", "\n"):
        assert leak not in error["message"], (leak, error["message"])
    log = daemon.log(limit=None)
    assert "Traceback" in log and "/home/alice/secret" in log and "toy_op.py" in log, log


def test_unknown_ops_are_refused_with_the_table_names(daemon: Daemon) -> None:
    with daemon.client() as client:
        response = client.post(
            "/v1/datasets", json={"name": "x", "steps": [{"op": "toy", "dst": "a", "text": "b"}]}
        )
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert "unknown op 'toy'" in message and ", ".join(table.load().public_names) in message
    # The daemon's own ops (a fan-out's adoption) are no choice a request has.
    internal = [op for op in table.load().names if table.load()[op].internal]
    assert internal and not any(f"'{op}'" in message or f" {op}," in message for op in internal)
    with daemon.client() as client:
        listed = {op["name"] for op in client.get("/v1/recipes").json()["ops"]}
    assert listed == set(table.load().public_names)


def test_extract_and_unpack_honour_sha256_through_a_real_staging(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Every op that writes data carries out every verify level (a toy op's refusal is
    tested above); sha256 of an extraction is each file read back against its member."""
    archive = tmp_path / "a.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(REPO), "README.md"], check=True)
    for op in ("extract", "unpack"):
        assert table.load()[op].verify == {"none", "size", "sha256"}
    with daemon.client() as client:
        for op in ("extract", "unpack"):
            steps = [{"op": op, "src": str(archive)}]
            status = stage_ready(client, {"name": op, "verify": "sha256", "steps": steps})
            staged = Path(status.path, "README.md").read_bytes()
            assert staged == (REPO / "README.md").read_bytes()
