"""`deploy/install.sh`, the admin's one command: installs the node service into a
prefix, writes its unit and an example stager.env, and the service then starts the
way the unit's ExecStart starts it; a second run upgrades in place. systemd does not
run here, so the test reads the unit and does what systemd would."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from stager.settings import Settings, env_name

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "deploy" / "install.sh"
SYSTEMD = REPO / "deploy" / "systemd"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the node service runs as root")


def unit_lines(path: Path, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in path.read_text().splitlines()
            if line.startswith(f"{key}=")]  # fmt: skip


def env_file(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]  # fmt: skip
    return {k.strip(): v.strip() for k, v in pairs}


def environment_of(unit: Path, drop_ins: list[Path]) -> dict[str, str]:
    """What systemd gives ExecStart: Environment= of the unit, then of its drop-ins, and
    the EnvironmentFile= over them."""
    env: dict[str, str] = {}
    for path in (unit, *drop_ins):
        for assignment in unit_lines(path, "Environment"):
            key, value = assignment.split("=", 1)
            env[key] = value
    for name in unit_lines(unit, "EnvironmentFile"):
        path = Path(name.removeprefix("-"))
        if path.exists():
            env.update(env_file(path))
    return env


def test_every_variable_the_unit_its_example_and_drop_in_set_is_a_setting() -> None:
    known = {env_name(n) for n in Settings.model_fields}
    drop_in = SYSTEMD / "stager.service.d" / "local-disk.conf"
    named = set(environment_of(SYSTEMD / "stager.service", [drop_in]))
    example = SYSTEMD / "stager.env"
    named |= {line.lstrip("#").split("=", 1)[0] for line in example.read_text().splitlines()
              if line.lstrip("#").startswith("STAGER_")}  # fmt: skip
    assert named and named <= known, sorted(named - known)
    assert "ReadWritePaths" not in "".join(
        line for line in (SYSTEMD / "stager.service").read_text().splitlines()
        if not line.startswith("#")
    )  # fmt: skip


@pytest.mark.slow
def test_install_then_start_as_the_unit_does_then_upgrade_in_place(tmp_path: Path) -> None:
    prefix, etc, units = tmp_path / "opt", tmp_path / "etc", tmp_path / "units"
    args = ["--prefix", str(prefix), "--etc", str(etc), "--unit-dir", str(units), "--no-systemd"]
    first = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert f"install.sh: creating {prefix}/venv" in first.stdout
    assert "systemd does not run here: start the service with:" in first.stdout
    unit = units / "stager.service"
    (exec_start,) = unit_lines(unit, "ExecStart")
    assert exec_start == f"{prefix}/venv/bin/stager serve --multi-user"
    assert env_file(etc / "stager.env") == {}  # the example: every line a comment
    assert (prefix / "docs" / "multiuser.md").exists()

    # A drop-in, as an admin's `systemctl edit stager` writes one: here, folders of the
    # test's own (a socket's path is limited in length, so a short one).
    run = Path(tempfile.mkdtemp(prefix="stg-"))
    drop_in = units / "stager.service.d" / "test.conf"
    drop_in.parent.mkdir()
    drop_in.write_text(
        f"[Service]\nEnvironment=STAGER_RUNTIME_DIR={run}\n"
        f"Environment=STAGER_CACHE_DIR={tmp_path / 'cache'}\nEnvironment=STAGER_LOG_FORMAT=json\n"
    )
    env = {"PATH": os.environ["PATH"], **environment_of(unit, [drop_in])}
    service = subprocess.Popen(shlex.split(exec_start), env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        socket = run / "stager.sock"
        deadline = time.monotonic() + 30
        while not socket.exists() and time.monotonic() < deadline:
            assert service.poll() is None, service.stdout.read() if service.stdout else ""
            time.sleep(0.1)
        client = [str(prefix / "venv" / "bin" / "stager-client"), "--url", f"unix://{socket}"]
        who = subprocess.run([*client, "whoami"], capture_output=True, text=True, timeout=30)
        assert who.returncode == 0, who.stderr
        assert who.stdout.startswith("root (uid 0, gid 0) on the multi-user daemon"), who.stdout
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(socket)),
                          base_url="http://stager") as http:  # fmt: skip
            assert http.get("/readyz").status_code == 200
    finally:
        service.send_signal(signal.SIGTERM)
        out, _ = service.communicate(timeout=30)
        subprocess.run(["rm", "-rf", str(run)], check=False)
    assert service.returncode == 0, out
    assert '"level": "INFO"' in out and "stager 0.1.0 starting" in out

    (etc / "stager.env").write_text("STAGER_MAX_WORKERS=3\n")  # the admin's own
    again = subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                           timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"install.sh: upgrading stager in {prefix}/venv (was stager 0.1.0)" in again.stdout
    assert (etc / "stager.env").read_text() == "STAGER_MAX_WORKERS=3\n"  # never overwritten
    version = subprocess.run(
        [str(prefix / "venv" / "bin" / "stager"), "--version"], capture_output=True, text=True
    )
    assert version.stdout.strip() == "stager 0.1.0"
