"""/docs works on a node without internet: every script and style it loads is served
by the daemon itself (on 989b0ea the page loaded them from a CDN and was blank)."""

from __future__ import annotations

import re

from tests.daemon import Daemon


def test_docs_loads_only_what_the_daemon_serves(daemon: Daemon) -> None:
    with daemon.client() as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]""", page.text)
        assert any(a.endswith("swagger-ui-bundle.js") for a in assets), page.text
        assert not [a for a in assets if "//" in a], f"loads from elsewhere: {assets}"
        for asset in assets:
            served = client.get(asset)
            assert served.status_code == 200 and len(served.content) > 1000, asset
        assert "url: '/openapi.json'" in page.text or '"/openapi.json"' in page.text
        assert client.get("/openapi.json").json()["info"]["title"] == "stager"
