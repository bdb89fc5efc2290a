"""``#STAGER`` lines: one grammar (stager-client stage's own parser) for the planner
and the job, and the job's ``stage --from-script`` hits what the planner staged."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from client import StagerClient, cli, declare
from client.cli import EXIT_OK, EXIT_USAGE
from stager.prestage.plan.declared import Declarations, encode
from stager.state.dataset import spec_key
from stager.wire.schemas import DatasetCreate, DatasetsPublic
from tests.client.conftest import copy_step, run_cli
from tests.daemon import Daemon

pytestmark = pytest.mark.forked_daemons  # its daemons: tests/daemon_zygote.py

SCRIPT = """\
#!/bin/bash
#SBATCH --time=10

#STAGER inat --recipe inat2021 --source /net/inat
#STAGER imgs --step '{{"op": "copy", "src": "/d/a b"}}' --as-image --link $TMP/imgs
  # an indented line is a command to job_submit.lua too
#STAGER late --recipe inat2021 --source /net/late
"""


def parse(script: str) -> list[declare.Declaration]:
    return declare.parse_script(script, cli.stage_parser())


def test_only_the_top_comment_block_declares_as_for_sbatch() -> None:
    found = parse(SCRIPT.format())
    assert [(d.line, d.name) for d in found] == [(4, "inat"), (5, "imgs")]
    assert found[1].args.step == ['{"op": "copy", "src": "/d/a b"}']  # shlex quoting
    assert found[1].args.as_image is True and found[1].args.link == "$TMP/imgs"


def test_every_stage_flag_is_either_declarable_or_per_run() -> None:
    """A flag added to `stage` must be placed: in a #STAGER line or on the command line."""
    parser = cli.stage_parser()
    dests = {a.dest for a in parser._actions if a.dest != "help"}
    placed = declare.DECLARABLE | set(declare.PER_RUN) | {"request", "from_script"}
    assert dests - placed == set(), "classify the new stage flag in client/declare.py"


@pytest.mark.parametrize(
    ("line", "fix"),
    [
        ("", "names no dataset; write e.g."),
        ("x --recipe r --wait", "--wait says how to stage, not what"),
        ("x --recipe r --peers slurm", "--peers says how to stage"),
        ("x --recipe r --lease me", "--lease says how to stage"),
        ("x --request body.json", "--request says how to stage"),
        ("x --recipe r --from-script", "--from-script says how to stage"),
        ("Inat --recipe r", "must start with the dataset's NAME"),
        ("--recipe r --source /s", "must start with the dataset's NAME"),
        ("x --source /s", "give --recipe with --source, or --step"),
        ("x --recipe r --bogus", "unrecognized arguments: --bogus"),
        ("x --recipe r --source $DATA/x", "names a variable"),
        ("x --step '{", "close the quote"),
        ("x --recipe r --help", "--help has no place"),
    ],
)
def test_a_bad_line_is_named_by_its_number_with_the_fix(line: str, fix: str) -> None:
    with pytest.raises(declare.BadDeclaration) as caught:
        parse(f"#!/bin/bash\n#STAGER ok --recipe r --source /s\n#STAGER {line}\n")
    assert str(caught.value).startswith("line 3: ") and fix in str(caught.value)


def test_a_line_of_more_words_than_a_declaration_needs_is_refused_before_it_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The stage parser's time grows as the square of the words (60 ms for 4 KiB of
    `-v`, on the node service's event loop): a line past MAX_WORDS never reaches it, for
    the job's client, the planner and the node's placement alike (one parse_line)."""
    parser = cli.stage_parser()
    calls = []
    monkeypatch.setattr(parser, "parse_args", lambda words: calls.append(words))
    many = "x " + "-v " * 1360  # 4 KiB: what job_submit.lua and the request schema allow
    with pytest.raises(declare.BadDeclaration, match="1361 words, and a #STAGER line has at most"):
        declare.parse_script(f"#STAGER {many}\n", parser)
    assert calls == []
    wanted, why = Declarations().parse(encode([many]))
    assert wanted == () and "at most 128" in str(why)
    # A line of the most words allowed still parses, as the job's client reads it.
    params = " ".join(f"--param k{i}=v" for i in range((declare.MAX_WORDS - 5) // 2))
    [ok] = parse(f"#STAGER ok --recipe r --source /s {params}\n")
    assert len(shlex.split(ok.words)) <= declare.MAX_WORDS


def test_a_name_declared_twice_names_both_lines() -> None:
    with pytest.raises(declare.BadDeclaration, match="line 3: .*'a' is declared already on line 2"):
        parse("#!/bin/sh\n#STAGER a --recipe r --source /s\n#STAGER a --recipe q --source /t\n")


def test_the_job_hits_what_the_planner_staged(daemon: Daemon, tree: Path, tmp_path: Path) -> None:
    """The planner's request (from job_submit.lua's AdminComment) and the job's
    `stage --from-script` (from the script) are one cache entry: a hit, same key."""
    (tmp_path / "links").mkdir()
    words = [
        f"imgs --step '{copy_step(tree, 'imgs')}' --link $LINKS/imgs",
        f"raw --step '{copy_step(tree)}' --verify sha256",
    ]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\n" + "".join(f"#STAGER {w}\n" for w in words) + "true\n")
    wanted, why = Declarations().read(encode(words))
    assert why is None
    with StagerClient(daemon.url) as client:
        staged = {w.name: client.submit(w.request()) for w in wanted}
        for name in staged:
            staged[name] = client.wait(name, timeout=60)
    links = {"LINKS": str(tmp_path / "links")}
    done = run_cli(daemon, "stage", "--from-script", str(script), "--wait", "--json", env=links)
    assert done.returncode == EXIT_OK, done.stderr
    answer = TypeAdapter(DatasetsPublic).validate_json(done.stdout)
    assert [s.name for s in answer.data] == ["imgs", "raw"]
    for status in answer.data:
        assert status.origin is not None and status.origin.hit, status
        assert status.key == staged[status.name].key
    assert (tmp_path / "links" / "imgs").resolve() == Path(answer.data[0].path).resolve()
    # The same key by the daemon's own rule, from both bodies.
    job_bodies = [cli.request_from(a) for a in _runs(script, links)]
    for body, planned in zip(job_bodies, wanted, strict=True):
        assert _key(body) == _key(planned.request())


def _runs(script: Path, env: dict[str, str]) -> list:
    args = cli.build_parser().parse_args(["stage", "--from-script", str(script), "--no-lease"])
    args.url, args.quiet = None, True
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        return declare.invocations(args, cli.stage_parser())


def _key(body: dict) -> str:
    return spec_key(DatasetCreate.model_validate(body).spec())


def test_from_script_plain_paths_in_line_order(daemon: Daemon, tree: Path, tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        f"#!/bin/bash\n#STAGER b --step '{copy_step(tree)}'\n#STAGER a --step '{copy_step(tree)}'\n"
    )
    done = run_cli(daemon, "stage", "--from-script", str(script), "--wait")
    assert done.returncode == EXIT_OK, done.stderr
    paths = done.stdout.split()
    assert len(paths) == 2 and all(Path(p).is_dir() for p in paths)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--from-script"], "no SLURM job (no SLURM_JOB_ID); give the script's path"),
        (["x", "--from-script", "JOB"], "give no NAME, --recipe, --step or --request with it"),
        (["--from-script", "/nonexistent/job.sh"], "/nonexistent/job.sh"),
        (["--from-script", "EMPTY"], "declares no dataset; add a line like"),
        (["--from-script", "BAD"], "BAD line 2: --step 'nope' is not valid JSON"),
    ],
)
def test_from_script_usage_errors_exit_2_naming_the_fix(
    refusing_daemon: Daemon, tmp_path: Path, args: list[str], says: str
) -> None:
    daemon = refusing_daemon
    (tmp_path / "EMPTY").write_text("#!/bin/bash\necho\n")
    (tmp_path / "BAD").write_text("#!/bin/bash\n#STAGER x --step nope\n")
    (tmp_path / "JOB").write_text("#!/bin/bash\n#STAGER x --recipe r --source /s\n")
    env = {"SLURM_JOB_ID": ""}
    argv = [str(tmp_path / a) if a.isupper() else a for a in args]  # JOB, EMPTY, BAD
    done = run_cli(daemon, "stage", *argv, env=env)
    assert done.returncode == EXIT_USAGE, done.stderr
    assert says.replace("BAD", str(tmp_path / "BAD")) in done.stderr
    with StagerClient(daemon.url) as client:
        assert client.list() == []  # nothing was requested


def test_blanks_are_ascii_spaces_and_tabs_as_job_submit_lua_reads_them() -> None:
    """A line of "\\x1c" or "\\xa0" is a command to the lua (it ends the comment block):
    the job's own reader must agree, or it stages what was never pre-staged."""
    for odd in ("\x1c", "\xa0", "\x85"):
        assert list(declare.declared_lines(f"#!/bin/bash\n{odd}\n#STAGER b --recipe r\n")) == []
    found = list(declare.declared_lines("#!/bin/bash\n \t\n#STAGER\tb --recipe r \t\n"))
    assert found == [(3, "b --recipe r")]


def test_a_step_nested_past_jsons_recursion_is_a_usage_error() -> None:
    deep = "[" * 5000
    done = run_cli(None, "stage", "x", "--step", deep, env={"STAGER_URL": "unix:///none.sock"})
    assert done.returncode == EXIT_USAGE and "nested too deep" in done.stderr
    assert "Traceback" not in done.stderr
