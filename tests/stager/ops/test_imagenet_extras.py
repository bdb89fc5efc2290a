"""The ImageNet ops without the `train` extra: a 422 naming `pip install 'stager[train]'`.

scipy and torch are installed in the test venv, so their absence is simulated: the
daemon gets a ``sitecustomize`` that sets ``sys.modules[name] = None``, which makes
both ``find_spec`` (the pre-flight) and ``import`` (the run) see no such package.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.archive.devkit import import_scipy_io, import_torch
from stager.core.errors import MissingExtra
from tests.daemon import Daemon
from tests.stager.recipes import fakes

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

HINT = "pip install 'stager[train]'"


@pytest.fixture(scope="module")
def imagenet_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("imagenet")
    fakes.make_imagenet(source, classes=2, train_per_class=1, val_per_class=1)
    return source


def without(daemon_factory: Callable[..., Daemon], tmp_path: Path, *hidden: str) -> Daemon:
    """A real daemon whose Python behaves as if `hidden` packages were not installed."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        f"import sys\nsys.modules.update(dict.fromkeys({list(hidden)!r}))\n"
    )
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    return daemon_factory(env={"PYTHONPATH": path})


@pytest.mark.parametrize(
    ("hidden", "named"),
    [(("scipy", "torch"), "scipy"), (("torch",), "torch")],
)
def test_imagenet_request_without_the_extra_is_a_422_naming_it(
    daemon_factory, tmp_path: Path, imagenet_source: Path, hidden: tuple[str, ...], named: str
) -> None:
    daemon = without(daemon_factory, tmp_path, *hidden)
    body = {"name": "imnet", "recipe": "imagenet", "source": str(imagenet_source)}
    with daemon.client() as client:
        response = client.post("/v1/datasets", json=body)
        listed = client.get("/v1/datasets").json()
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["type"] == "missing_dependency"
    assert f"needs {named}, which the daemon's Python lacks" in error["message"]
    assert HINT in error["message"]
    assert listed["count"] == 0  # refused up front, not a staging left to fail


@pytest.mark.parametrize(
    ("importer", "hidden", "named"),
    [(import_scipy_io, ("scipy", "scipy.io"), "scipy"), (import_torch, ("torch",), "torch")],
)
def test_lazy_import_at_run_time_raises_missing_extra(
    monkeypatch: pytest.MonkeyPatch, importer: Callable[[], object], hidden, named: str
) -> None:
    # The pre-flight saw the package, the staging process cannot import it (a broken
    # or half-removed install): still the same sentence, not a bare ImportError.
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingExtra) as caught:
        importer()
    assert caught.value.status == 422 and caught.value.type == "missing_dependency"
    assert f"needs {named}" in caught.value.message and HINT in caught.value.message
    assert isinstance(caught.value.__cause__, ImportError)
