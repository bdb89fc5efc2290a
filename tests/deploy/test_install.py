"""`deploy/install.sh`, the admin's one command: installs the node service into a
prefix, writes its unit and an example stager.env, and the service then starts the
way the unit's ExecStart starts it; a second run upgrades in place. systemd does not
run here, so the test reads the unit and does what systemd would."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from stager.core.settings import Settings, env_name
from tests.users import User

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "deploy" / "install.sh"
SLURM = REPO / "deploy" / "slurm"
SYSTEMD = REPO / "deploy" / "systemd"
DEBIAN_PYTHON = Path("/usr/bin/python3.11")

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


@contextlib.contextmanager
def reachable_folder() -> Iterator[Path]:
    """A folder every user may enter (pytest's own are under a 0700 folder of root's):
    users run what is installed there. Removed after."""
    folder = Path(tempfile.mkdtemp(prefix="stg-install-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def reachable() -> Iterator[Path]:
    with reachable_folder() as folder:
        yield folder


def install(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(INSTALL), *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})  # fmt: skip


@dataclass
class Installed:
    """A node service install.sh made on a machine whose python3.11 on PATH is root's
    own (``hidden``, as pyenv in root's 0700 home), over the venv the old install.sh
    made on that interpreter: it passed that one over and rebuilt the venv on Debian's."""

    prefix: Path
    etc: Path
    units: Path
    hidden: Path  # the folder users cannot enter, its python3.11 first on PATH
    args: list[str]  # what install.sh was given: the same again upgrades in place
    env: dict[str, str]  # and its environment (PATH), the same again
    done: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def node_install(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    """The first install of the node service, made once for the module: the test of an
    interpreter users cannot run reads it; the test of the node service reads it, then
    upgrades it; the planner's test installs the planner into the same prefix, as on a
    host that has both (a fresh venv took 16.7 s on a quiet machine, most of it pip; an
    upgrade in place reuses the venv and its packages, and a venv rebuilt for another
    interpreter is made as a fresh one is: the module pays for one)."""
    if not DEBIAN_PYTHON.exists():
        pytest.skip("needs Debian's python3.11")
    tmp_path = tmp_path_factory.mktemp("node-install")
    hidden = Path(tempfile.mkdtemp(prefix="stg-root-only-"))  # 0700, as root's home
    try:
        (hidden / "python3.11").symlink_to(os.path.realpath(sys._base_executable))
        with reachable_folder() as reachable:
            prefix, etc, units = reachable / "opt", tmp_path / "etc", tmp_path / "units"
            args = ["--prefix", str(prefix), "--etc", str(etc), "--unit-dir", str(units)]
            args += ["--no-systemd"]
            env = {"PATH": f"{hidden}{os.pathsep}{os.environ['PATH']}"}
            # What the old install.sh made: a venv on the PATH's interpreter.
            subprocess.run([str(hidden / "python3.11"), "-m", "venv", "--without-pip",
                            str(prefix / "venv")], check=True)  # fmt: skip
            done = install(*args, **env)
            yield Installed(prefix, etc, units, hidden, args, env, done)
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


def start_line(stdout: str) -> str:
    """The command install.sh prints for a node without systemd (the line after its
    sentence)."""
    lines = stdout.splitlines()
    (at,) = [i for i, line in enumerate(lines) if "systemd does not run here" in line]
    return lines[at + 1].strip()


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


def test_the_planners_unit_and_example_set_only_settings() -> None:
    known = {env_name(n) for n in Settings.model_fields}
    named = set(environment_of(SYSTEMD / "stager-plan.service", []))
    named |= {line.lstrip("#").split("=", 1)[0]
              for line in (SYSTEMD / "stager-plan.env").read_text().splitlines()
              if line.lstrip("#").startswith("STAGER_")}  # fmt: skip
    assert named and named <= known, sorted(named - known)


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_install_planner_then_start_as_its_unit_does(
    tmp_path: Path, node_install: Installed
) -> None:
    """--planner: the planner's unit and plan.env; started as the unit says, it plans
    (here squeue has no cluster to ask: it says so each interval and goes on), and
    SIGTERM stops it within a second, exit 0. Into the node service's prefix (its venv
    upgraded in place, as on a host with both): the venv is made alike either way."""
    made = node_install.done
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    prefix, etc, units = node_install.prefix, tmp_path / "etc", tmp_path / "units"
    args = ["--prefix", str(prefix), "--etc", str(etc), "--unit-dir", str(units), "--no-systemd"]
    done = install(*args, "--python", str(DEBIAN_PYTHON), "--planner")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"install.sh: upgrading stager in {prefix}/venv" in done.stdout
    unit = units / "stager-plan.service"
    assert unit_lines(unit, "ExecStart") == [f"{prefix}/venv/bin/stager plan"]
    assert unit_lines(unit, "EnvironmentFile") == [f"-{etc}/plan.env"]
    assert env_file(etc / "plan.env") == {}  # the example: every line a comment
    assert not (units / "stager.service").exists()  # a controller gets no node service
    (etc / "plan.env").write_text(
        f"STAGER_PLAN_INTERVAL=1\nSTAGER_PLAN_STATE={tmp_path}/plan.json\n"
    )
    argv = ["sh", "-c", f"exec {start_line(done.stdout)}"]  # SIGTERM to the planner itself
    planner = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)  # fmt: skip
    try:
        first = planner.stdout.readline() if planner.stdout else ""
        assert "stager plan: planning every 1 s" in first, first
        second = planner.stdout.readline() if planner.stdout else ""
        assert "no plan this interval" in second or "interval:" in second, second
        began = time.monotonic()
        planner.send_signal(signal.SIGTERM)
        assert planner.wait(5) == 0
        # well under an interval (30 s): it does not finish the interval first; the
        # bound is loose because a loaded CI machine slows the interpreter's exit
        assert time.monotonic() - began < 5.0
    finally:
        if planner.poll() is None:
            os.killpg(planner.pid, signal.SIGKILL)
            planner.wait(10)


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_install_then_start_as_the_unit_does_then_upgrade_in_place(
    tmp_path: Path, node_install: Installed
) -> None:
    prefix, etc, units, args = (node_install.prefix, node_install.etc, node_install.units,
                                node_install.args)  # fmt: skip
    first = node_install.done
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    # (a venv made where there was none: test_a_first_build_whose_pip_fails_leaves_no_venv)
    assert f"install.sh: using the interpreter {DEBIAN_PYTHON} (Python 3." in first.stdout
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
    out = served(service, run, prefix)
    assert '"level": "INFO"' in out and "stager 0.1.0 starting" in out

    (etc / "stager.env").write_text("STAGER_MAX_WORKERS=3\n")  # the admin's own
    again = install(*args, **node_install.env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"install.sh: upgrading stager in {prefix}/venv (was stager 0.1.0)" in again.stdout
    assert (etc / "stager.env").read_text() == "STAGER_MAX_WORKERS=3\n"  # never overwritten
    version = subprocess.run(
        [str(prefix / "venv" / "bin" / "stager"), "--version"], capture_output=True, text=True
    )
    assert version.stdout.strip() == "stager 0.1.0"

    # Without systemd, the printed line starts the service as the unit does: the unit's
    # environment, the site's stager.env over it, the same command.
    run = Path(tempfile.mkdtemp(prefix="stg-"))
    (etc / "stager.env").write_text(
        f"STAGER_RUNTIME_DIR={run}\nSTAGER_CACHE_DIR={tmp_path / 'cache2'}\n"
        "STAGER_LOG_FORMAT=json\n"
    )
    line = start_line(again.stdout)
    assert line.startswith("env STAGER_RUNTIME_DIR=/run/stager STAGER_CACHE_DIR=/var/cache/stager")
    service = subprocess.Popen(
        ["bash", "-c", line], env={"PATH": os.environ["PATH"]}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    out = served(service, run, prefix)
    assert '"level": "INFO"' in out  # the site's file was read
    assert (tmp_path / "cache2" / "state.db").exists()


def served(service: subprocess.Popen[str], run: Path, prefix: Path) -> str:
    """Waits for the service ``service`` to answer on ``run``'s socket as the node
    service, stops it, and returns its output."""
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
    return out


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_an_interpreter_users_cannot_run_is_passed_over_refused_and_replaced(
    node_install: Installed, reachable: Path, users: tuple[User, User]
) -> None:
    """As on machines whose python3.11 is root's own (pyenv in root's 0700 home): the
    install must not give users a venv whose interpreter they cannot execute. The
    module's install is this machine's (node_install): its venv was the old one's."""
    alice, _ = users
    hidden, prefix, args = node_install.hidden, node_install.prefix, node_install.args
    done = node_install.done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"not using {hidden}/python3.11: users cannot run it" in done.stdout
    assert f"using the interpreter {DEBIAN_PYTHON} (Python 3.11." in done.stdout
    assert (
        f"rebuilding {prefix}/venv: it runs {hidden}/python3.11, not {DEBIAN_PYTHON}" in done.stdout
    )
    assert not (prefix / "venv.old").exists()  # the old one, once the new one was whole
    client = str(prefix / "venv" / "bin" / "stager-client")
    version = alice.run([client, "--version"])
    assert version.returncode == 0 and version.stdout.startswith("stager-client "), version
    # No daemon: the documented exit and sentence, not the shell's 126.
    nowhere = alice.run([client, "--url", "unix:///nonexistent/stager.sock", "ls"])
    assert nowhere.returncode == 5 and "no stager daemon answers" in nowhere.stderr

    refused = install(*args, "--no-packages", "--python", str(hidden / "python3.11"),
                      **node_install.env)  # fmt: skip
    assert refused.returncode == 2
    assert f"refusing the interpreter {hidden}/python3.11 (--python or PYTHON=): users " \
        "cannot run it" in refused.stderr  # fmt: skip
    old = reachable / "python3.10"
    old.write_text("#!/bin/sh\necho 3.10.12 /usr/bin/python3.10\n")
    old.chmod(0o755)
    too_old = install(*args, "--no-packages", PYTHON=str(old))
    assert too_old.returncode == 2
    assert "it is Python 3.10.12, and stager needs 3.11 or newer" in too_old.stderr
    assert "--python PATH" in install("--help").stdout
    assert "PYTHON=PATH" in install("--help").stdout


def test_a_stager_users_cannot_execute_ends_the_job_with_exit_5_and_a_sentence(
    tmp_path: Path, reachable: Path, users: tuple[User, User]
) -> None:
    """What an install on a root-only interpreter left: the prolog logged "could not
    start the daemon", and the job's client exited 126 with "Permission denied". The
    prolog says why, and job.sh ends with stager-client's exit 5 and a sentence."""
    alice, _ = users
    hidden = Path(tempfile.mkdtemp(prefix="stg-root-only-"))  # 0700, as root's home
    try:
        (hidden / "python3.11").symlink_to(os.path.realpath(sys._base_executable))
        bin_dir = reachable / "bin"
        bin_dir.mkdir()
        for tool in ("stager", "stager-client", "stager-train"):
            (bin_dir / tool).write_text(f"#!{hidden}/python3.11\nprint('ran')\n")
            (bin_dir / tool).chmod(0o755)
        shutil.copytree(SLURM, reachable / "slurm", ignore=shutil.ignore_patterns("local-*"))
        state = reachable / "node"
        config = reachable / "slurm.env"
        config.write_text(
            f"STAGER_BIN_DIR={bin_dir}\nSTAGER_SLURM_RUNTIME_DIR={state}/rt-%U\n"
            f"STAGER_SLURM_CACHE_DIR={state}/cache-%U\nSTAGER_SLURM_TMPDIR={state}/job-%j\n"
            f"STAGER_NODE_SOCKET=\nSTAGER_SLURM_LOG={state}/log\n"
            f"STAGER_SLURM_STATE_DIR={state}/state\n"
        )
        slurmd = {"PATH": os.environ["PATH"], "STAGER_SLURM_CONFIG": str(config),
                  "SLURM_JOB_ID": "7", "SLURM_JOB_USER": alice.name,
                  "SLURM_JOB_UID": str(alice.uid), "SLURM_JOB_GID": str(alice.gid)}  # fmt: skip
        prolog = subprocess.run(["bash", str(reachable / "slurm" / "prolog.sh")], env=slurmd,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert prolog.returncode == 0, prolog.stderr
        assert (
            f"not starting the daemon: {alice.name} cannot execute {bin_dir}/stager: its "
            f"interpreter {hidden}/python3.11 is in a folder users cannot enter; reinstall "
            "stager with deploy/install.sh" in (state / "log").read_text()
        )
        job = alice.run(["bash", str(reachable / "slurm" / "job.sh")], cwd="/", env={
            "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7",
            "SLURM_TMPDIR": f"{state}/job-7", "OUTPUT_DIR": f"/tmp/{alice.name}/out"})  # fmt: skip
        assert job.returncode == 5, job
        assert (
            f"error: {alice.name} cannot execute {bin_dir}/stager (its interpreter: "
            f"{hidden}/python3.11): a folder above it is closed to users" in job.stderr
        )
    finally:
        shutil.rmtree(hidden, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_an_interpreter_others_can_write_is_refused(reachable: Path) -> None:
    """The root daemon runs the venv's interpreter: one in a folder a group may write
    (a group-writable /usr/local or conda install) would run that group's code as root."""
    shared = reachable / "conda" / "bin"
    shared.mkdir(parents=True)
    shared.chmod(0o775)  # group-writable, as a shared install often is
    (shared / "python3.11").symlink_to(DEBIAN_PYTHON)
    refused = install("--prefix", str(reachable / "opt"), "--no-packages", "--no-systemd",
                      "--python", str(shared / "python3.11"))  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        f"refusing the interpreter {shared}/python3.11 (--python or PYTHON=): {shared} can be "
        "written by another than root (root:root drwxrwxr-x); make it and the folders above "
        "it root's and writable by root alone" in refused.stderr
    )
    assert not (reachable / "opt" / "venv").exists()


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_a_rebuild_whose_pip_fails_leaves_the_old_venv_working(
    tmp_path: Path, reachable: Path
) -> None:
    """The venv is rebuilt for another interpreter, and pip cannot reach its index: the
    service's old venv stays, whole (it was deleted first)."""
    venv = reachable / "opt" / "venv"
    other = os.path.realpath(sys._base_executable)
    assert other != str(DEBIAN_PYTHON)
    subprocess.run([other, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / "bin" / "stager").write_text("#!/bin/sh\necho stager 0.0.1\n")
    (venv / "bin" / "stager").chmod(0o755)
    failed = install_offline(tmp_path, reachable)
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert f"rebuilding {venv}: it runs {other}, not {DEBIAN_PYTHON}" in failed.stdout
    version = subprocess.run([str(venv / "bin" / "stager"), "--version"], capture_output=True,
                             text=True)  # fmt: skip
    assert version.stdout.strip() == "stager 0.0.1"
    assert os.readlink(venv / "bin" / "python").endswith(os.path.basename(other))
    assert not (reachable / "opt" / "venv.old").exists()
    assert f"building the new venv failed (see above); {venv} is the one it was" in failed.stderr


def install_offline(tmp_path: Path, reachable: Path) -> subprocess.CompletedProcess:
    """install.sh into ``reachable``/opt on Debian's python3.11, with pip's index out of
    reach: its venv's build fails."""
    offline = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}
    return install("--prefix", str(reachable / "opt"), "--etc", str(tmp_path / "etc"),
                   "--unit-dir", str(tmp_path / "units"), "--no-packages", "--no-systemd",
                   "--python", str(DEBIAN_PYTHON), **offline)  # fmt: skip


@pytest.mark.slow
@pytest.mark.skipif(not DEBIAN_PYTHON.exists(), reason="needs Debian's python3.11")
def test_a_first_build_whose_pip_fails_leaves_no_venv(tmp_path: Path, reachable: Path) -> None:
    """A prefix with no venv: install.sh says it creates one, and when pip cannot reach
    its index it leaves none behind (a half-made one would be taken for an install by
    the next run) and says to run it again."""
    venv = reachable / "opt" / "venv"
    failed = install_offline(tmp_path, reachable)
    assert failed.returncode == 1, failed.stdout[-3000:] + failed.stderr[-3000:]
    assert f"install.sh: creating {venv}" in failed.stdout
    assert f"building {venv} failed (see above); fix the cause and run this again" in (
        failed.stderr
    )
    assert not venv.exists() and not (reachable / "opt" / "venv.old").exists()
