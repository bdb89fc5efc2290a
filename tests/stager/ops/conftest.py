"""Extraction runs on threads for small archives and on forked worker processes for
large ones; archive tests run both ways (``pool``), so each path is held to the same
results, errors and safety."""

from __future__ import annotations

import pytest

from stager.ops import extract


@pytest.fixture(params=["threads", "processes"])
def pool(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "processes":
        monkeypatch.setattr(extract, "PROCESS_MIN_BYTES", 0)  # every archive is "large"
    return request.param
