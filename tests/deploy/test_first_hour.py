"""The first hour, scripted: `make demo`, then a researcher's steps from README.md,
then an admin's, each output checked, as a newcomer would run them on this machine
(the admin's install is tests/deploy/test_install.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


class Shell:
    """Runs commands as a person's shell would: the venv's programs on PATH, the
    daemon's places in the environment, nothing else of the test's."""

    def __init__(self, home: Path, run: Path) -> None:
        self.env = {
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(home),
            "STAGER_RUNTIME_DIR": str(run),
            "STAGER_CACHE_DIR": str(home / "cache"),
            "STAGER_MIN_FREE_BYTES": "0",
            "STAGER_URL": f"unix://{run}/stager.sock",
        }

    def __call__(
        self, *argv: str, ok: bool = True, cwd: Path = REPO, **env: str
    ) -> subprocess.CompletedProcess:
        done = subprocess.run(argv, env={**self.env, **env}, capture_output=True, text=True,
                              timeout=300, cwd=cwd)  # fmt: skip
        assert "Traceback" not in done.stderr, done.stderr
        if ok:
            assert done.returncode == 0, f"{argv}: {done.stderr[-2000:]}"
        return done


def stop_what_runs(run: Path) -> None:
    """Stops the daemon a test left on ``run`` (one that failed before its own stop). A
    daemon's pid file is there from before its socket answers until it stops: where
    there is none, nothing runs, and no `stager stop` is started (an interpreter's
    start and stager's imports, about 1 s of CPU)."""
    if (run / "stager.pid").exists() or (run / "stager.sock").exists():
        subprocess.run([str(BIN / "stager"), "stop", "--runtime-dir", str(run)],
                       env={"PATH": os.environ["PATH"]}, capture_output=True,
                       timeout=60)  # fmt: skip


@pytest.fixture
def places(tmp_path: Path):
    run = Path(tempfile.mkdtemp(prefix="stg-"))  # short: a socket's path is limited
    yield tmp_path, run
    stop_what_runs(run)
    shutil.rmtree(run, ignore_errors=True)


@pytest.mark.slow
def test_the_first_hour(places) -> None:
    home, run = places
    sh = Shell(home, run)

    # ---- make demo: the whole job on this machine, the accuracy shown ----------------
    work = home / "demo"
    # Two training steps, not the 20 of 2 cores: the whole job still runs and shows its
    # accuracy (its figure is README's for the default steps; 12 s less CPU here).
    demo = sh("make", "demo", f"DEMO_ARGS=--work-dir {work} --steps 2")
    assert "train resnet18 for 2 steps" in demo.stdout
    assert re.search(r"training      : epoch 0: train loss [\d.]+, val top-1 [\d.]+%", demo.stdout)
    assert "cache         : miss - staged now" in demo.stdout
    assert not (work / "run" / "stager.sock").exists()  # the demo stopped its daemon
    shared = work / "shared" / "inat"

    # ---- a researcher: README's job-script pattern ------------------------------------
    assert "stager started" in sh("stager", "serve", "--detach").stdout
    job = home / "job"
    data = sh("stager-client", "stage", "inat", "--recipe", "inat2021", "--source", str(shared),
              "--link", str(job / "inat"), "--wait", "--timeout", "600").stdout.strip()  # fmt: skip
    assert Path(data).is_dir() and (job / "inat").resolve() == Path(data)
    status = sh("stager-client", "status", "inat").stdout
    assert f"inat: ready at {data}" in status
    assert f"usage: torchvision.datasets.INaturalist(root='{data}', version='2021_train')" in status
    assert "inat2021:" in sh("stager-client", "recipes").stdout
    assert "split 2021_valid: needs val.tar.gz" in sh("stager", "recipes").stdout
    # Raw steps, as README shows them.
    imgs = home / "imgs"
    (imgs / "cls").mkdir(parents=True)
    (imgs / "cls" / "a.jpg").write_bytes(b"jpeg")
    with tarfile.open(home / "imgs.tar.gz", "w:gz") as archive:
        archive.add(imgs, arcname="imgs")
    extract = json.dumps({"op": "extract", "src": str(home / "imgs.tar.gz")})
    rename = json.dumps({"op": "rename", "src": "imgs", "dst": "train"})
    staged = sh("stager-client", "stage", "imgs", "--wait", "--step", extract, "--step", rename)
    assert (Path(staged.stdout.strip()) / "train" / "cls" / "a.jpg").read_bytes() == b"jpeg"
    waited = sh("stager-client", "wait", "inat", "imgs", "--timeout", "3600").stdout.split()
    assert waited[0] == data and len(waited) == 2
    listed = sh("stager-client", "ls").stdout
    assert "inat: ready at" in listed and "imgs: ready at" in listed
    # The same request again: a cache hit.
    again = sh("stager-client", "stage", "inat", "--recipe", "inat2021", "--source", str(shared),
               "--wait").stdout.strip()  # fmt: skip
    assert again == data
    assert "this request was a cache hit" in sh("stager-client", "status", "inat").stdout
    # README's Python.
    code = (
        "from client import StagerClient\n"
        "with StagerClient() as stager:\n"
        "    print(stager.wait('imgs', timeout=3600).path)\n"
    )
    assert sh(sys.executable, "-c", code).stdout.strip() == staged.stdout.strip()
    # A typo is caught with the fix, in the client's own terms.
    typo = sh("stager-client", "status", "inta", ok=False)
    assert typo.returncode == 3
    assert "did you mean 'inat'? `stager-client ls` lists the known ones" in typo.stderr
    assert "freed" in sh("stager", "gc").stdout
    assert "stager stopped" in sh("stager", "stop").stdout
    assert not (run / "stager.sock").exists()

    # ---- an admin: settings by the environment, the API's document, metrics, the log ---
    (home / "ok").mkdir()
    admin = {"STAGER_CAPACITY_BYTES": "10G", "STAGER_ALLOWED_ROOTS": f"{shared},{home / 'ok'}"}
    assert "STAGER_CAPACITY_BYTES" in sh("stager", "serve", "--help").stdout
    sh("stager", "serve", "--detach", **admin)
    outside = sh("stager-client", "stage", "x", "--step", extract, ok=False)
    assert outside.returncode == 3 and "STAGER_ALLOWED_ROOTS" in outside.stderr, outside.stderr
    transport = httpx.HTTPTransport(uds=str(run / "stager.sock"))
    with httpx.Client(transport=transport, base_url="http://stager") as http:
        assert http.get("/openapi.json").json()["info"]["title"] == "stager"
        assert "swagger-ui-bundle.js" in http.get("/docs").text
        metrics = http.get("/metrics").text
    assert "stager_cache_capacity_bytes 1e+10" in metrics
    assert 'stager_datasets{state="ready"} 2.0' in metrics
    sh("stager", "stop")
    log = run / "stager.log"
    assert oct(log.stat().st_mode & 0o777) == "0o600"
    text = log.read_text()
    assert re.search(r"^\d{4}-\d\d-\d\dT[\d:.]+[+-]\d\d:\d\d INFO stager: stager .* starting", text,
                     re.M)  # fmt: skip
    assert "(limit 9.3 GiB)" in text
    assert (run / "stager.log.1").exists()  # the researcher's run, kept by the rotation
    assert "dataset 'inat' of" in (run / "stager.log.1").read_text()


def a_small_archive(home: Path, name: str) -> str:
    """A --step that extracts a new one-file archive: staging it needs the fork server."""
    (home / name).mkdir()
    (home / name / "a.jpg").write_bytes(b"jpeg")
    with tarfile.open(home / f"{name}.tar.gz", "w:gz") as archive:
        archive.add(home / name, arcname="imgs")
    return json.dumps({"op": "extract", "src": str(home / f"{name}.tar.gz")})


def test_the_daemon_starts_in_a_folder_holding_modules_named_as_its_own(places) -> None:
    """The parent of a clone holds stager/; a user's folder may hold anything. The
    daemon started there (--detach, or in the foreground, with its fork server) must
    read none of it: each decoy fails its import."""
    home, run = places
    sh = Shell(home, run)
    folder = home / "src"
    for name in ("stager", "multiprocessing", "uvicorn", "fastapi"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(f"raise ImportError('the decoy {name}')\n")
    started = sh("stager", "serve", "--detach", cwd=folder)
    assert "stager started" in started.stdout
    step = a_small_archive(home, "one")
    staged = sh("stager-client", "stage", "one", "--wait", "--step", step, cwd=folder)
    assert (Path(staged.stdout.strip()) / "imgs" / "a.jpg").read_bytes() == b"jpeg"
    sh("stager", "stop", cwd=folder)

    foreground = subprocess.Popen(
        [str(BIN / "stager"), "serve"], env=sh.env, cwd=folder, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        step = a_small_archive(home, "two")
        staged = sh("stager-client", "stage", "two", "--wait", "--step", step, cwd=folder)
        assert (Path(staged.stdout.strip()) / "imgs" / "a.jpg").read_bytes() == b"jpeg"
    finally:
        foreground.terminate()
        out, _ = foreground.communicate(timeout=60)
    assert "decoy" not in out, out


def test_a_relative_cache_folder_or_an_allowed_root_that_is_not_there_is_refused(places) -> None:
    """Both were taken silently: the first named another folder for a daemon started
    elsewhere, the second refused every source, and only at the first request."""
    home, run = places
    sh = Shell(home, run)
    relative = sh("stager", "serve", "--detach", "--cache-dir", "cache", ok=False, cwd=home)
    assert relative.returncode == 2
    assert relative.stderr == (
        f"stager: --cache-dir: cache is a relative path; give an absolute one (e.g. {home}/cache)\n"
    )
    by_env = sh("stager", "serve", "--detach", ok=False, STAGER_CACHE_DIR="cache")
    assert by_env.returncode == 2 and "STAGER_CACHE_DIR" in by_env.stderr
    nowhere = sh("stager", "serve", "--detach", ok=False,
                 STAGER_ALLOWED_ROOTS=f"{home},{home / 'nope'}")  # fmt: skip
    assert nowhere.returncode == 2
    assert f"STAGER_ALLOWED_ROOTS '{home},{home}/nope': {home}/nope is not a folder" in (
        nowhere.stderr
    )
    flag = sh("stager", "serve", "--detach", "--allowed-root", "data", ok=False)
    assert flag.returncode == 2 and "--allowed-roots: data is a relative path" in flag.stderr
    assert not (run / "stager.sock").exists()


def test_the_trainer_without_torch_answers_help_and_names_the_fix(tmp_path: Path) -> None:
    """The node service's venv has stager and not the `train` extra: --help answered, a
    run one sentence, no traceback. A venv of the bare interpreter, this checkout in it."""
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "checkout.pth").write_text(f"{REPO}\n")
    python = str(venv / "bin" / "python")
    assert subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 1

    def train(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([python, "-m", "trainer", *argv], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)  # fmt: skip

    for argv in (["--help"], ["find-lr", "--help"], ["shard", "--help"]):
        shown = train(*argv)
        assert shown.returncode == 0 and shown.stdout.startswith("usage: stager-train"), shown
    for argv in (["--dataset", "fake"], ["exit-status", "--output-dir", str(tmp_path)]):
        run = train(*argv)
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
        assert run.stderr.count("\n") == 1 and "pip install 'stager[train]'" in run.stderr
        assert f"the trainer needs torch, which {python} cannot import" in run.stderr


def test_stop_without_a_folder_names_the_daemon_that_runs_elsewhere(places) -> None:
    """`stager serve --runtime-dir X` then a plain `stager stop` said no daemon runs and
    exited 0: it names the one that runs, with the flag that stops it, and fails."""
    home, run = places
    sh = Shell(home, run)
    elsewhere = Path(tempfile.mkdtemp(prefix="stg-"))
    try:
        sh("stager", "serve", "--detach", "--runtime-dir", str(elsewhere))
        plain = {**sh.env, "XDG_RUNTIME_DIR": str(home)}  # its default folder: an empty one
        del plain["STAGER_RUNTIME_DIR"]
        stop = subprocess.run([str(BIN / "stager"), "stop"], env=plain, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert stop.returncode == 1, stop
        assert stop.stderr.startswith(
            f"stager: no stager daemon runs for the runtime folder {home}/stager-{os.getuid()};"
        )
        assert (
            f"yours runs on {elsewhere}/stager.sock (pid "
            f"{(elsewhere / 'stager.pid').read_text().strip()}): stop it with "
            f"`stager stop --runtime-dir {elsewhere}`" in stop.stderr
        )
        assert "stager stopped" in sh("stager", "stop", "--runtime-dir", str(elsewhere)).stdout
        # A folder named, and nothing runs there: nothing to do, as before.
        again = sh("stager", "stop", "--runtime-dir", str(elsewhere))
        assert again.stdout == f"no stager daemon running for {elsewhere}\n"
    finally:
        stop_what_runs(elsewhere)
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_the_readmes_way_to_reclaim_a_cache_by_hand_frees_it(places) -> None:
    """deploy/slurm/README.md said to delete <cache>/data by hand: sealed trees refuse a
    user's rm, and image mounts any rm. The command it names now is run as written."""
    home, run = places
    sh = Shell(home, run)
    readme = (REPO / "deploy" / "slurm" / "README.md").read_text()
    (command,) = re.findall(r"^    (stager gc --all --runtime-dir \S+)", readme, re.M)
    assert "<cache>/data" not in readme
    sh("stager", "serve", "--detach", "--runtime-dir", str(run))
    staged = sh("stager-client", "stage", "one", "--wait", "--step", a_small_archive(home, "one"))
    assert Path(staged.stdout.strip()).is_dir()
    argv = command.replace("/tmp/stager-$UID", str(run)).split()
    assert sh(*argv).stdout.startswith("evicted 1 dataset(s), freed ")
    assert not Path(staged.stdout.strip()).exists()
    assert sh("stager-client", "ls").stdout == "one: evicted\n"


def test_the_docs_name_one_install_path() -> None:
    """They named /opt/stager/.venv and /opt/stager/venv: the one deploy/install.sh
    makes, everywhere."""
    install = (REPO / "deploy" / "install.sh").read_text()
    assert "PREFIX=/opt/stager\n" in install and "VENV=$PREFIX/venv\n" in install
    texts = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "deploy").rglob("*")]
    named = {}
    for path in texts:
        if path.is_file() and path.suffix not in (".png", ".gz", ".tar"):
            for venv in re.findall(
                r"/opt/stager/([^/\s`'\")]*venv)", path.read_text(errors="replace")
            ):
                named.setdefault(venv, []).append(str(path.relative_to(REPO)))
    assert set(named) == {"venv"}, named
