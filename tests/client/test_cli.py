"""``stager-client`` against a real ``stager serve`` process, as a job script runs it."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from client import StagerClient
from client.cli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_TIMEOUT,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    main,
)
from stager.wire.schemas import DatasetPublic, DatasetsPublic, ErrorResponse, LeasePublic
from tests.client.conftest import SLOWER_SIZE, copy_step, fetch_step, run_cli, start_cli
from tests.daemon import Daemon
from tests.trees import digest

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the module's tests that stage under names of their own, leave
    nothing staging and look at nothing else it holds: a start is 1.5-3 s of a CI
    worker. A test that stops or kills its daemon, leaves a staging running, or reads
    what the daemon holds in all (`ls`, the names a sentence lists) makes its own
    (``daemon_factory``)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("cli") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


def stage(daemon: Daemon, name: str, step: str) -> None:
    """Set-up stagings go through the library in-process: a CLI process costs ~0.4 s."""
    with StagerClient(daemon.url) as client:
        client.stage(name, steps=[json.loads(step)])


def test_stage_wait_prints_the_path_of_the_staged_copy(daemon: Daemon, tree: Path) -> None:
    done = run_cli(daemon, "stage", "imgs", "--step", copy_step(tree, "imgs"), "--wait")
    assert done.returncode == EXIT_OK, done.stderr
    path = Path(done.stdout.strip())
    assert digest(path / "imgs") == digest(tree)
    # Not a terminal: a plain log line, no bar escape codes.
    assert "imgs: ready at" in done.stderr and "\x1b[" not in done.stderr


def test_failed_staging_exits_1_with_the_daemons_sentence(
    daemon: Daemon, truncated_archive: Path
) -> None:
    step = f'{{"op": "extract", "src": "{truncated_archive}"}}'
    done = run_cli(daemon, "stage", "cut", "--step", step, "--wait")
    assert done.returncode == EXIT_FAILED, done.stderr
    with daemon.client() as http:
        sentence = http.get("/v1/datasets/cut").json()["error"]["message"]
    assert str(truncated_archive) in sentence
    assert (
        done.stderr.strip().splitlines()[-1] == f"stager-client: dataset 'cut' failed: {sentence}"
    )
    assert done.stdout == ""


def test_timeout_exits_4_and_says_where_staging_is(daemon_factory, slow_url: str) -> None:
    daemon = daemon_factory()  # its staging is still running at the end
    stage(daemon, "slow", fetch_step(slow_url))
    done = run_cli(daemon, "wait", "slow", "--timeout", "0.5")
    assert done.returncode == EXIT_TIMEOUT, done.stderr
    assert "dataset 'slow' is still staging after 0.5 s" in done.stderr
    assert "--timeout" in done.stderr


def test_wait_started_before_the_stage_request_waits_for_it(daemon: Daemon, tree: Path) -> None:
    """The prolog stages while the batch script already waits: the wait must not lose
    that race when asked to (--await-request). It says once that the name is not
    requested yet, then succeeds."""
    waiting = start_cli(daemon, "wait", "late", "--timeout", "30", "--await-request", "30")
    time.sleep(1.5)  # several polls find no such name
    assert waiting.poll() is None
    assert run_cli(daemon, "stage", "late", "--step", copy_step(tree)).returncode == 0
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == EXIT_OK, err
    assert Path(out.strip()).is_dir()
    assert err.count("dataset 'late' has not been requested yet") == 1


def test_wait_for_a_name_never_requested_times_out_listing_the_known_names(
    daemon_factory, tree: Path
) -> None:
    """A --timeout shorter than the grace for the stage request ends the wait: exit 4."""
    daemon = daemon_factory()  # the sentence lists every name it holds
    assert run_cli(daemon, "stage", "inat", "--step", copy_step(tree), "--wait").returncode == 0
    done = run_cli(daemon, "wait", "inta", "--timeout", "1")
    assert done.returncode == EXIT_TIMEOUT, done.stderr
    assert "dataset 'inta' was never requested in 1 s (the daemon knows: inat)" in done.stderr


def test_wait_for_a_name_nobody_requested_fails_at_once_with_did_you_mean(
    daemon_factory, tree: Path
) -> None:
    """On 989b0ea `wait nosuch` with no --timeout waited forever; --await-request 0 gives
    its stage request no time at all."""
    daemon = daemon_factory()  # its guess is among every name it holds
    assert run_cli(daemon, "stage", "inat", "--step", copy_step(tree), "--wait").returncode == 0
    started = time.monotonic()
    done = run_cli(daemon, "wait", "inta", "--await-request", "0")
    assert time.monotonic() - started < 10
    assert done.returncode == EXIT_REJECTED, done.stderr
    assert done.stderr.strip() == (
        "stager-client: no dataset named 'inta'; did you mean 'inat'? `stager-client ls` lists "
        "the known ones; if its stage request is still on its way, give --await-request S"
    )


def test_wait_started_before_the_daemon_succeeds_once_it_is_up(daemon_factory, tree: Path) -> None:
    daemon = daemon_factory()  # stopped and started again
    assert run_cli(daemon, "stage", "early", "--step", copy_step(tree), "--wait").returncode == 0
    daemon.stop()
    waiting = start_cli(daemon, "wait", "early", "--retry-for", "20")
    time.sleep(1.0)  # it is retrying against a missing socket now
    assert waiting.poll() is None
    daemon.start()
    out, err = waiting.communicate(timeout=20)
    assert waiting.returncode == EXIT_OK, err
    assert Path(out.strip()).is_dir()


def test_stage_wait_started_before_a_fresh_daemon_succeeds(daemon_factory, tree: Path) -> None:
    daemon = daemon_factory(wait=False)
    waiting = start_cli(daemon, "stage", "fresh", "--step", copy_step(tree), "--wait")
    out, err = waiting.communicate(timeout=30)
    assert waiting.returncode == EXIT_OK, err
    assert digest(Path(out.strip())) == digest(tree)


def test_daemon_killed_during_wait_exits_5_with_a_clear_message(
    daemon_factory, slow_url: str
) -> None:
    daemon = daemon_factory()  # killed
    stage(daemon, "slow", fetch_step(slow_url))
    waiting = start_cli(daemon, "wait", "slow", "--retry-for", "1")
    time.sleep(0.5)
    daemon.kill()
    _, err = waiting.communicate(timeout=15)
    assert waiting.returncode == EXIT_UNAVAILABLE, err
    message = err.strip().splitlines()[-1]
    assert message.startswith(f"stager-client: no stager daemon answers at {daemon.url}")
    # It reports the time it really spent: at least --retry-for, give or take one backoff
    # pause and a refused connect on a loaded machine.
    retried = re.search(r"did not come back after (\d+\.\d) s of retries", message)
    assert retried, message
    assert 1.0 <= float(retried.group(1)) < 3.0, message
    assert "stager serve --detach" in message


def test_daemon_restart_during_wait_is_tolerated(daemon_factory, slower_served) -> None:
    # A short graceful-shutdown time keeps the test quick; the open long-poll is broken
    # off when it runs out, as with the default, only sooner.
    daemon = daemon_factory(env={"STAGER_SHUTDOWN_TIMEOUT_S": "1"})
    slower_url, served = slower_served
    step = fetch_step(slower_url, "bigger.bin")
    stage(daemon, "slow", step)
    waiting = start_cli(daemon, "wait", "slow", "--timeout", "40", "--quiet")
    time.sleep(1.5)  # the waiter is up and its long-poll (40 s) open on the daemon
    daemon.restart()  # SIGTERM, then a new daemon resumes the interrupted staging
    with daemon.client() as http:
        assert http.get("/v1/datasets/slow").json()["state"] in ("queued", "staging")
    assert waiting.poll() is None
    served.bytes_per_s = None  # the restart is behind it: the rest need not trickle (~5 s)
    out, err = waiting.communicate(timeout=45)
    assert waiting.returncode == EXIT_OK, err
    assert (Path(out.strip()) / "bigger.bin").stat().st_size == SLOWER_SIZE


def test_several_names_at_once_print_paths_in_order(daemon: Daemon, tmp_path: Path) -> None:
    sources = {}
    for name in ("c", "a", "b"):
        sources[name] = tmp_path / f"src-{name}"
        (sources[name] / "f").mkdir(parents=True)
        (sources[name] / "f" / "data.txt").write_text(name)
        stage(daemon, name, copy_step(sources[name]))
    done = run_cli(daemon, "wait", "c", "a", "b", "--timeout", "20")
    assert done.returncode == EXIT_OK, done.stderr
    paths = [Path(p) for p in done.stdout.split()]
    assert [(p / "f" / "data.txt").read_text() for p in paths] == ["c", "a", "b"]


def test_one_failure_among_several_names_fails_fast(
    daemon_factory, tree: Path, truncated_archive: Path, slower_url: str
) -> None:
    daemon = daemon_factory()  # its slow staging is still running at the end
    step = f'{{"op": "extract", "src": "{truncated_archive}"}}'
    stage(daemon, "slow", fetch_step(slower_url))
    stage(daemon, "cut", step)
    done = run_cli(daemon, "wait", "slow", "cut")
    assert done.returncode == EXIT_FAILED, done.stderr
    assert "dataset 'cut' failed: archive" in done.stderr
    # It did not sit out the slow one: that one is still on its way.
    with StagerClient(daemon.url) as client:
        assert client.status("slow").state in ("queued", "staging")


def test_json_outputs_validate_against_the_api_models(daemon_factory, tree: Path) -> None:
    daemon = daemon_factory()  # `ls` lists every name it holds
    done = run_cli(daemon, "stage", "j", "--step", copy_step(tree), "--wait", "--json")
    staged = DatasetPublic.model_validate_json(done.stdout)
    assert staged.state == "ready" and done.stderr == ""
    status = DatasetPublic.model_validate_json(run_cli(daemon, "status", "j", "--json").stdout)
    assert status.path == staged.path
    listed = DatasetsPublic.model_validate_json(run_cli(daemon, "ls", "--json").stdout)
    assert [d.name for d in listed.data] == ["j"] and listed.count == 1
    waited = DatasetsPublic.model_validate_json(run_cli(daemon, "wait", "j", "--json").stdout)
    assert waited.data[0].path == staged.path
    missing = run_cli(daemon, "status", "nope", "--json")
    assert missing.returncode == EXIT_REJECTED
    assert ErrorResponse.model_validate_json(missing.stdout).error.type == "not_found"


def test_plain_log_lines_without_a_terminal(daemon: Daemon, slow_url: str) -> None:
    done = run_cli(
        daemon, "stage", "slow", "--step", fetch_step(slow_url), "--wait", "--interval", "0.5"
    )
    assert done.returncode == EXIT_OK, done.stderr
    lines = done.stderr.strip().splitlines()
    staging = [line for line in lines if "slow: staging" in line or "slow: queued" in line]
    assert len(staging) >= 3, lines  # ~3 s of staging, a line every 0.5 s
    assert "step 1/1 fetch" in "".join(staging) and "/s, eta" in "".join(staging)
    assert lines[-1].endswith(")") and "slow: ready at" in lines[-1]
    assert all(line.startswith("[") for line in lines)  # each line is timestamped
    assert "\r" not in done.stderr and "\x1b[" not in done.stderr


def test_quiet_prints_only_the_path(daemon: Daemon, tree: Path) -> None:
    done = run_cli(daemon, "stage", "q", "--step", copy_step(tree), "--wait", "--quiet")
    assert done.returncode == EXIT_OK and done.stderr == ""
    assert Path(done.stdout.strip()).is_dir()


def test_unknown_recipe_is_rejected_with_the_daemons_sentence(daemon: Daemon) -> None:
    done = run_cli(
        daemon, "stage", "inat", "--recipe", "no-such-recipe", "--source", "/network/inat",
        "--param", 'splits=["2021_train"]', "--param", "version=2021",
    )  # fmt: skip
    assert done.returncode == EXIT_REJECTED
    assert done.stderr.startswith("stager-client: recipe 'no-such-recipe' is not known")


def test_bad_usage_exits_2(daemon: Daemon, capsys, monkeypatch) -> None:
    monkeypatch.setenv("STAGER_URL", daemon.url)
    for argv in (
        ["stage", "x", "--step", "{not json"],
        ["stage", "x"],  # neither a recipe nor steps
        ["wait"],
        ["wait", "x", "--timeout", "soon"],
        ["--url", "ftp://x", "ls"],
    ):
        assert _exit_code(argv) == EXIT_USAGE, argv
    assert "ftp://x" in capsys.readouterr().err
    # A request the daemon refuses (relative source) is a rejection, with its sentence.
    assert _exit_code(["stage", "x", "--step", '{"op": "copy", "src": "rel"}']) == EXIT_REJECTED
    assert "give an absolute source path" in capsys.readouterr().err


def test_interval_below_a_tenth_of_a_second_is_bad_usage(capsys) -> None:
    # Rejected while parsing, before any daemon is asked: no daemon needed.
    for value in ("0", "-1", "0.05"):
        for argv in (["wait", "x"], ["stage", "x", "--wait"]):
            assert _exit_code([*argv, "--interval", value]) == EXIT_USAGE, (argv, value)
            err = capsys.readouterr().err
            assert f"argument --interval: '{value}' would poll the daemon" in err
            assert "give --interval 0.1 or more" in err


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own usage errors
        return int(exc.code or 0)


def test_request_file_and_flags_merge(daemon: Daemon, tree: Path, tmp_path: Path) -> None:
    body = {"name": "fromfile", "steps": [{"op": "copy", "src": str(tree)}], "verify": "none"}
    (tmp_path / "req.json").write_text(json.dumps(body))
    link = tmp_path / "link"
    done = run_cli(daemon, "stage", "--request", str(tmp_path / "req.json"), "--link", str(link),
                   "--wait")  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    assert link.resolve() == Path(done.stdout.strip()).resolve()


def test_unreachable_daemon_fails_fast_for_status(tmp_path: Path) -> None:
    env = {"STAGER_URL": f"unix://{tmp_path}/none.sock", "PATH": "/usr/bin:/bin"}
    started = time.monotonic()
    done = run_cli(None, "status", "x", env=env)
    assert done.returncode == EXIT_UNAVAILABLE
    assert f"no stager daemon answers at unix://{tmp_path}/none.sock" in done.stderr
    assert time.monotonic() - started < 5


def test_cancel_makes_the_waiter_exit_1(daemon: Daemon, slow_url: str) -> None:
    stage(daemon, "doomed", fetch_step(slow_url))
    waiting = start_cli(daemon, "wait", "doomed")
    time.sleep(0.3)
    cancelled = run_cli(daemon, "cancel", "doomed", "--json")
    assert DatasetPublic.model_validate_json(cancelled.stdout).state == "cancelled"
    _, err = waiting.communicate(timeout=15)
    assert waiting.returncode == EXIT_FAILED
    assert "dataset 'doomed' cancelled: staging was cancelled by a request" in err


def test_lease_on_stage_and_release(daemon: Daemon, tree: Path) -> None:
    done = run_cli(daemon, "stage", "l", "--step", copy_step(tree), "--lease", "job-7", "--wait",
                   env={"SLURM_JOB_ID": "7"})  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    status = DatasetPublic.model_validate_json(run_cli(daemon, "status", "l", "--json").stdout)
    assert [(x.holder, x.slurm_job_id) for x in status.leases] == [("job-7", "7")]
    refused = run_cli(daemon, "cancel", "l")
    assert refused.returncode == EXIT_REJECTED and "leased by job-7" in refused.stderr
    released = run_cli(daemon, "release", "l", "--holder", "job-7", "--json")
    leases = TypeAdapter(list[LeasePublic]).validate_json(released.stdout)
    assert [x.holder for x in leases] == ["job-7"]
    assert run_cli(daemon, "cancel", "l").stdout.strip() == (
        "evicted 'l': its data is deleted from this node's cache"
    )


def test_tcp_with_the_token_file(daemon_factory, tree: Path) -> None:
    from tests.daemon import free_port

    daemon = daemon_factory(args=["--host", "127.0.0.1", "--port", str(free_port())])
    done = run_cli(daemon, "stage", "t", "--step", copy_step(tree), "--wait")
    assert done.returncode == EXIT_OK, done.stderr  # token read from <runtime_dir>/token
    wrong = run_cli(daemon, "ls", env={"STAGER_TOKEN": "wrong"})
    assert wrong.returncode == EXIT_REJECTED and "bearer token" in wrong.stderr


def test_inside_a_slurm_job_stage_leases_for_the_job_unless_told_not_to(
    daemon: Daemon, tree: Path
) -> None:
    done = run_cli(daemon, "stage", "j", "--step", copy_step(tree), "--wait",
                   env={"SLURM_JOB_ID": "9"})  # fmt: skip
    assert done.returncode == EXIT_OK, done.stderr
    status = DatasetPublic.model_validate_json(run_cli(daemon, "status", "j", "--json").stdout)
    assert [(x.holder, x.slurm_job_id) for x in status.leases] == [("slurm-job-9", "9")]
    bare = run_cli(daemon, "stage", "k", "--step", copy_step(tree), "--wait", "--no-lease",
                   env={"SLURM_JOB_ID": "9"})  # fmt: skip
    assert bare.returncode == EXIT_OK, bare.stderr
    status = DatasetPublic.model_validate_json(run_cli(daemon, "status", "k", "--json").stdout)
    assert status.leases == []


def test_a_wait_started_before_the_daemon_and_its_stage_request_gets_ready(
    tmp_path: Path, tree: Path
) -> None:
    """A rank waits while another rank asks, in a job whose daemon is still starting:
    with no flag, the wait gives the request its default grace (60 s from the daemon's
    first answer). Before, it exited 3 at the daemon's first answer."""
    daemon = Daemon(cache_dir=tmp_path / "cache")
    waiting = start_cli(daemon, "wait", "early", "--timeout", "120")
    try:
        time.sleep(1.0)  # it retries a daemon that is not there
        daemon.start()
        time.sleep(2.0)  # the daemon answers: no dataset named 'early', several times
        assert waiting.poll() is None, waiting.communicate()[1]
        stage(daemon, "early", copy_step(tree))
        out, err = waiting.communicate(timeout=60)
    finally:
        if waiting.poll() is None:
            waiting.kill()
        daemon.cleanup()
    assert waiting.returncode == EXIT_OK, err
    assert digest(Path(out.strip())) == digest(tree)
    assert "dataset 'early' has not been requested yet; waiting up to 60 s" in err


def test_a_wait_for_a_name_never_asked_for_exits_3_after_its_grace(tmp_path: Path) -> None:
    """The grace counts from the daemon's first answer (a daemon still starting does not
    use it up), then the wait fails as an unknown name does: exit 3, the daemon's
    sentence. Before, --await-request counted from the start and ended in exit 4."""
    daemon = Daemon(cache_dir=tmp_path / "cache")
    waiting = start_cli(daemon, "wait", "nosuch", "--await-request", "2")
    try:
        time.sleep(3.0)  # longer than the grace, with no daemon yet
        daemon.start()
        up = time.monotonic()
        _, err = waiting.communicate(timeout=60)
        waited = time.monotonic() - up
    finally:
        if waiting.poll() is None:
            waiting.kill()
        daemon.cleanup()
    assert waiting.returncode == EXIT_REJECTED, err
    assert waited >= 1.5, f"the grace ended {waited:.1f} s after the daemon came up"
    assert err.strip().splitlines()[-1] == (
        "stager-client: no dataset named 'nosuch'; `stager-client ls` lists the known ones; "
        "no stage request for it came in 2 s (--await-request S waits longer)"
    )
