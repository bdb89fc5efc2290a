"""A download that brings bytes below the rate floor fails as stalled and frees its
worker slot. A server trickling bytes keeps a staging's counters moving, so the
stall timeout alone never ends it: two downloads at 2 KB/s once held both slots for
ever. The server here is real and sends 200 bytes every 0.1 s.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.daemon import Daemon, stage
from tests.httpserver import Behaviour, serve_files

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


def fetch(name: str, url: str) -> dict:
    return {"name": name, "steps": [{"op": "fetch", "url": url, "dst": "blob"}]}


def test_trickling_downloads_fail_as_stalled_naming_their_url_and_free_their_slots(
    daemon_factory: Callable[..., Daemon],
) -> None:
    daemon = daemon_factory(
        env={
            "STAGER_MAX_WORKERS": "2",
            "STAGER_MIN_DOWNLOAD_RATE": "20000",
            "STAGER_DOWNLOAD_RATE_WINDOW": "1",
        }
    )
    names = ("slow1", "slow2")
    files = {f"/blob?sig=secret-{name}": bytes(1 << 20) for name in names}
    behaviour = Behaviour(files={**files, "/steady": bytes(300_000)}, bytes_per_s=2000, piece=200)
    with serve_files(behaviour) as base, daemon.client() as client:
        for name in names:  # both worker slots
            response = stage(client, fetch(name, f"{base}/blob?sig=secret-{name}"))
            assert response.status_code == 202, response.text
        for name in names:
            status = client.get(f"/v1/datasets/{name}/wait", params={"timeout": 10}).json()
            assert status["state"] == "failed", status
            assert status["error"]["type"] == "stalled", status
            message = status["error"]["message"]
            assert f"downloading {base}/blob?*** (step 1)" in message, message
            assert "secret" not in message
            assert "--min-download-rate" in message and "in the last 1 s" in message
        # The slots are free, and a download above the floor for longer than the window
        # (3 s at 100 KB/s) is not taken for stalled.
        behaviour.bytes_per_s, behaviour.piece = 100_000, 5000
        response = stage(client, fetch("steady", f"{base}/steady"))
        assert response.status_code == 202, response.text
        status = client.get("/v1/datasets/steady/wait", params={"timeout": 20}).json()
        assert status["state"] == "ready", status
