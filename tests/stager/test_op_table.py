"""The op table is the one place an op is declared: schema, validation, refusals,
``GET /v1/recipes`` and dispatch in the staging process all follow from it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from stager.ops import table
from tests.daemon import Daemon, stage_ready

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


def test_unknown_ops_are_refused_with_the_table_names(daemon: Daemon) -> None:
    with daemon.client() as client:
        response = client.post(
            "/v1/datasets", json={"name": "x", "steps": [{"op": "toy", "dst": "a", "text": "b"}]}
        )
    assert response.status_code == 422
    message = response.json()["error"]["message"]
    assert "unknown op 'toy'" in message and ", ".join(table.load().names) in message


def test_verify_an_op_cannot_carry_out_is_refused_when_the_request_arrives(
    daemon: Daemon, tmp_path: Path
) -> None:
    archive = tmp_path / "a.tar"
    subprocess.run(["tar", "-cf", str(archive), "-C", str(REPO), "README.md"], check=True)
    unhonoured = [
        lvl for lvl in ("size", "sha256", "none") if lvl not in table.load()["extract"].verify
    ]
    with daemon.client() as client:
        for level in unhonoured:
            steps = [{"op": "extract", "src": str(archive)}]
            response = client.post(
                "/v1/datasets", json={"name": "x", "verify": level, "steps": steps}
            )
            assert response.status_code == 400, response.text
            message = response.json()["error"]["message"]
            assert f"verify {level!r} is not carried out by step 1 (extract)" in message
            assert client.get("/v1/datasets/x").status_code == 404  # nothing half-created
