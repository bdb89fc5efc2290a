"""--stager-wait: the trainer waits on the client before it builds the dataset.

The client library is written concurrently; these tests use a stand-in
``client`` package that follows its contract (``StagerClient().wait(name,
timeout)`` -> model with .state/.path; ``client.errors.StagingFailed`` /
``WaitTimeout`` under ``StagerError``). The daemon-staged variant comes with the
integration work; `test_real_client_api` checks the real package when present.
"""

from __future__ import annotations

import json

import pytest

from tests.trainer.conftest import REPO, make_imagefolder, run_trainer, tiny_args, trainer_env

STUB_INIT = """
import json, os
from types import SimpleNamespace
from client.errors import StagingFailed

class StagerClient:
    def wait(self, name, timeout=None):
        spec = json.loads(os.environ["STUB_STAGER"])
        with open(spec["log"], "a") as f:
            f.write(f"{name} {os.environ.get('RANK', '0')}\\n")
        if spec.get("fail"):
            raise StagingFailed(spec["fail"])
        return SimpleNamespace(state="ready", path=spec["path"])
"""
STUB_ERRORS = """
class StagerError(Exception): pass
class StagingFailed(StagerError): pass
class WaitTimeout(StagerError): pass
"""


def _stub_env(tmp_path, spec: dict) -> dict[str, str]:
    # The runs use cwd=tmp_path so the repository's own client/ does not shadow the stub.
    pkg = tmp_path / "stub" / "client"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STUB_INIT)
    (pkg / "errors.py").write_text(STUB_ERRORS)
    spec = dict(spec, log=str(tmp_path / "waits.log"))
    return trainer_env(PYTHONPATH=f"{tmp_path / 'stub'}:{REPO}", STUB_STAGER=json.dumps(spec))


def _args(tmp_path):
    args = tiny_args(tmp_path / "out", "--epochs", "1", "--stager-wait", "imgs",
                     "--data-root", "tree", "--crop-size", "16")  # fmt: skip
    i = args.index("fake")
    args[i] = "imagefolder"
    return args


@pytest.mark.slow
def test_stager_wait_reads_the_staged_path(tmp_path):
    make_imagefolder(tmp_path / "staged" / "tree", "train", per_class=4)
    env = _stub_env(tmp_path, {"path": str(tmp_path / "staged")})
    done = run_trainer(_args(tmp_path), nproc=2, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "dataset 'imgs' ready at" in done.stderr
    # Local rank 0 waits first; rank 1 asks only once the data is ready.
    assert open(tmp_path / "waits.log").read().split() == ["imgs", "0", "imgs", "1"]


def test_staging_failure_is_one_clear_line(tmp_path):
    sentence = "source /network/inat/train.tar.gz does not exist; check --source"
    env = _stub_env(tmp_path, {"fail": sentence})
    done = run_trainer(_args(tmp_path), env=env, cwd=tmp_path)
    assert done.returncode == 1
    assert f"dataset 'imgs' is not available: {sentence}" in done.stderr
    assert "Traceback" not in done.stderr


def test_real_client_api():
    client = pytest.importorskip("client", reason="client not available yet")
    if not hasattr(client, "StagerClient"):
        pytest.skip("client not available yet")
    errors = pytest.importorskip("client.errors", reason="client not available yet")
    assert issubclass(errors.StagingFailed, errors.StagerError)
    assert issubclass(errors.WaitTimeout, errors.StagerError)
