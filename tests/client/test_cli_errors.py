"""Every error path of every ``stager-client`` command, against a real daemon: one
sentence in the user's own terms (the client's commands, not HTTP calls), the exit
code docs/client.md gives, and never a traceback."""

from __future__ import annotations

import ast
import re
import select
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.cli import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
)
from client.hints import in_user_terms
from tests.client.conftest import copy_step, fetch_step, run_cli, start_cli
from tests.daemon import Daemon

REPO = Path(__file__).resolve().parents[2]
API_CALL = re.compile(r"\b(GET|POST|DELETE|PUT|PATCH) /v1/")


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """One daemon for the tests that stage under names of their own and leave nothing
    staging (a start is 1.5-3 s of a CI worker); the one that leaves its staging
    running makes its own (``daemon_factory``)."""
    shared = Daemon(cache_dir=tmp_path_factory.mktemp("cli-errors") / "cache")
    try:
        yield shared.start()
    finally:
        shared.cleanup()


def checked(done, code: int, *sentences: str) -> str:
    """The last stderr line, after checking the exit code, the sentences and that no
    traceback and no API call reached the user."""
    err = done.stderr
    assert done.returncode == code, err
    assert "Traceback" not in err, err
    assert not API_CALL.search(err), err
    for sentence in sentences:
        assert sentence in err, err
    return err.strip().splitlines()[-1]


def test_every_error_path_of_every_command(daemon: Daemon, tree: Path, tmp_path: Path) -> None:
    assert run_cli(daemon, "stage", "mycopy", "--step", copy_step(tree), "--wait").returncode == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "f").write_text("x")
    no_train = tmp_path / "imgs"
    (no_train / "cats").mkdir(parents=True)
    (no_train / "cats" / "a.jpg").write_bytes(b"x")

    # status, cancel, release, wait: a name nobody staged, with the close one offered.
    # (wait: after its grace for the stage request, a short one here)
    for command in ("status", "cancel", "release", "wait --await-request 0.5"):
        checked(
            run_cli(daemon, *command.split(), "mycpy"),
            EXIT_REJECTED,
            "no dataset named 'mycpy'; did you mean 'mycopy'? `stager-client ls` lists the "
            "known ones",
        )
    # stage: a taken name is freed with the client's own command.
    checked(
        run_cli(daemon, "stage", "mycopy", "--step", copy_step(other)),
        EXIT_REJECTED,
        "`stager-client cancel mycopy` first, or choose another name",
    )
    # stage: a mistyped recipe, a mistyped parameter, a mistyped op.
    checked(
        run_cli(daemon, "stage", "x", "--recipe", "inat2012", "--source", str(tmp_path)),
        EXIT_REJECTED,
        "recipe 'inat2012' is not known; did you mean 'inat2021'?",
        "`stager-client recipes`",
    )
    checked(
        run_cli(
            daemon,
            "stage",
            "x",
            "--recipe",
            "imagefolder",
            "--source",
            str(no_train),
            "--param",
            "split=all",
        ),  # fmt: skip
        EXIT_REJECTED,
        "has no parameter 'split'; did you mean 'splits'?",
    )
    bad_op = run_cli(daemon, "stage", "x", "--step", '{"op": "cpy", "src": "/tmp"}')
    last = checked(bad_op, EXIT_REJECTED, "unknown op 'cpy'; did you mean 'copy'?")
    assert "adopt" not in last and "check_delivered" not in last  # the daemon's own ops
    # stage: a split whose folder the source lacks fails at request time, naming it.
    checked(
        run_cli(
            daemon,
            "stage",
            "imgs",
            "--recipe",
            "imagefolder",
            "--source",
            str(no_train),
            "--param",
            "splits=train",
        ),  # fmt: skip
        EXIT_REJECTED,
        f"{no_train} has no folder train/ (its folders: cats)",
    )
    # stage: sources that do not exist.
    checked(
        run_cli(daemon, "stage", "x", "--step", copy_step(tmp_path / "gone")),
        EXIT_REJECTED,
        f"{tmp_path / 'gone'}",
    )
    checked(
        run_cli(daemon, "stage", "x", "--recipe", "cifar10", "--source", str(tmp_path / "no")),
        EXIT_REJECTED,
        "does not exist; check --source",
    )
    # Usage errors: argparse's code and a sentence naming the flag.
    checked(run_cli(daemon, "stage", "x", "--step", "{oops"), EXIT_USAGE, "is not valid JSON")
    checked(run_cli(daemon, "stage", "x"), EXIT_USAGE, "give --recipe with --source")
    checked(run_cli(daemon, "stage", "x", "--param", "nokey"), EXIT_USAGE, "KEY=VALUE")
    checked(run_cli(daemon, "wait", "x", "--interval", "0"), EXIT_USAGE, "--interval")
    checked(run_cli(daemon, "recipe"), EXIT_USAGE, "invalid choice: 'recipe'")
    checked(run_cli(daemon, "ls", "--url", "ftp://x"), EXIT_USAGE, "ftp://x")
    # No daemon there: where it looked, and how to start one.
    gone = {"STAGER_URL": f"unix://{tmp_path}/none.sock"}
    for command in (["ls"], ["status", "x"], ["recipes"], ["whoami"]):
        checked(
            run_cli(daemon, *command, env=gone),
            EXIT_UNAVAILABLE,
            f"no stager daemon answers at unix://{tmp_path}/none.sock",
            "stager serve --detach",
        )


def test_recipes_lists_what_the_daemon_knows(daemon: Daemon) -> None:
    """On 989b0ea `stager-client recipes` was an invalid choice (exit 2)."""
    done = run_cli(daemon, "recipes")
    assert done.returncode == EXIT_OK, done.stderr
    assert "inat2021:" in done.stdout and "split 2021_train: needs train.tar.gz" in done.stdout
    assert "INaturalist(root, version='2021_train')" in done.stdout


def test_a_failed_staging_names_its_archive_by_its_path(
    daemon: Daemon, truncated_archive: Path
) -> None:
    step = f'{{"op": "extract", "src": "{truncated_archive}"}}'
    last = checked(run_cli(daemon, "stage", "cut", "--step", step, "--wait"), EXIT_FAILED)
    assert (
        last.startswith("stager-client: dataset 'cut' failed: ") and str(truncated_archive) in last
    )


def test_ctrl_c_during_wait_says_the_staging_goes_on_and_how_to_cancel(
    daemon_factory, slow_url: str
) -> None:
    daemon = daemon_factory()  # its staging goes on after the test
    waiting = start_cli(daemon, "stage", "slow", "--step", fetch_step(slow_url), "--wait")
    # Interrupted once it waits (its first status line), not while Python still imports
    # it on a busy machine.
    assert waiting.stderr is not None
    assert select.select([waiting.stderr], [], [], 30)[0], "stage --wait said nothing"
    first = waiting.stderr.readline()
    waiting.send_signal(signal.SIGINT)
    _, err = waiting.communicate(timeout=15)
    err = first + err
    assert waiting.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        "stager-client: interrupted; the daemon goes on staging slow (if it was requested): "
        "`stager-client wait slow` waits again, `stager-client cancel slow` stops it"
    )
    with daemon.client() as http:
        assert http.get("/v1/datasets/slow").json()["state"] in ("queued", "staging", "ready")


def api_calls_in_daemon_sentences() -> list[str]:
    """Every API call that a sentence the daemon raises can name (from the source: each
    string in a ``raise``), with its path parameters filled in."""
    calls = set()
    for path in (REPO / "stager").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            text = " ".join(_strings(node.exc))
            for found in re.finditer(r"\b(?:GET|POST|DELETE) /v1/[^\s;,)'\"`]*", text):
                calls.add(found.group(0).replace("{x}", "ds").replace("{name}", "ds"))
    return sorted(calls)


def _strings(node: ast.AST) -> list[str]:
    """The text of every string in ``node``; an f-string's fields as ``{x}``."""
    if isinstance(node, ast.JoinedStr):
        return ["".join(v.value if isinstance(v, ast.Constant) else "{x}" for v in node.values)]
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    return [text for child in ast.iter_child_nodes(node) for text in _strings(child)]


def test_every_api_call_a_daemon_sentence_names_has_a_command() -> None:
    calls = api_calls_in_daemon_sentences()
    assert "GET /v1/datasets" in calls and "GET /v1/recipes" in calls  # the finder finds
    untranslated = [c for c in calls if API_CALL.search(in_user_terms(f"run {c} now"))]
    assert not untranslated, f"client/hints.py has no command for {untranslated}"


@pytest.mark.parametrize(
    ("sentence", "said"),
    [
        ("no dataset named 'x'; GET /v1/datasets lists the known ones",
         "no dataset named 'x'; `stager-client ls` lists the known ones"),
        ("DELETE /v1/datasets/my.copy-2 first", "`stager-client cancel my.copy-2` first"),
        ("(see GET /v1/datasets/a_b)", "(see `stager-client status a_b`)"),
        ("(GET /v1/recipes describes them)", "(`stager-client recipes` describes them)"),
    ],
)  # fmt: skip
def test_api_calls_become_commands(sentence: str, said: str) -> None:
    assert in_user_terms(sentence) == said
