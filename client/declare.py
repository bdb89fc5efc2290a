"""``#STAGER`` lines: a job script declares its datasets once, in the words of
``stager-client stage``.

    #!/bin/bash
    #SBATCH --gres=gpu:4
    #STAGER inat --recipe inat2021 --source /network/datasets/inat
    #STAGER imgs --step '{"op": "extract", "src": "/data/imgs.tar"}' --link $SLURM_TMPDIR/imgs
    stager-client stage --from-script --wait

Two readers, one grammar: the planner (``stager plan``) reads the lines while the
job is queued and pre-stages them on its planned nodes; the job's own
``stager-client stage --from-script`` reads them at its start. Both parse each line
with the ``stage`` subcommand's own argparse parser (``client.cli.stage_parser``)
after ``shlex`` has split it, and build the request with ``client.cli.request_from``,
so the job's request has the planner's cache key: a hit.

Rules, checked by both readers (each error names the line and the fix):
- Only the comment block at the top counts, as for ``#SBATCH``: reading stops at the
  first line that is neither blank nor a comment.
- A line holds what says what a dataset is (NAME, --recipe, --source, --param, --step,
  --verify, --fingerprint, --as-image, --image-fallback) and where its link goes
  (--link). How to stage (--wait, --peers, --timeout, --lease, ...) goes on the
  ``--from-script`` command line and applies to every line.
- No ``$VAR`` outside --link: the planner reads the line before the job runs, where
  the job's environment does not exist. --link's variables are expanded in the job.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from stager.wire.schemas import NAME_PATTERN

MARK = "#STAGER"
# What a line may say: what the dataset is, and where its link goes.
DECLARABLE = frozenset(
    {
        "name",
        "recipe",
        "source",
        "param",
        "step",
        "link",
        "verify",
        "fingerprint",
        "as_image",
        "image_fallback",
    }
)
# Part of the cache key: must read the same to the planner and to the job.
LITERAL = ("recipe", "source", "param", "step")
EXAMPLE = "#STAGER inat --recipe inat2021 --source /network/datasets/inat"
# Far past what a dataset's line needs (a recipe with 60 --param is 124 words). The
# parse (argparse) takes time quadratic in the words: a line of 4 KiB of `-v` took 60 ms,
# on the node service's event loop (placement checks each request's words) and in the
# planner; 128 words take about 1 ms.
MAX_WORDS = 128


class BadDeclaration(ValueError):
    """A ``#STAGER`` line that cannot be used; the message names its line and the fix."""


class DeclarationParser(argparse.ArgumentParser):
    """The stage parser, raising instead of exiting: the planner reads many jobs' lines
    and must go on past a bad one."""

    def error(self, message: str) -> NoReturn:
        raise BadDeclaration(message)


@dataclass(frozen=True)
class Declaration:
    line: int  # 1-based, in the script
    words: str  # what follows #STAGER
    args: argparse.Namespace  # as the stage parser reads it

    @property
    def name(self) -> str:
        return self.args.name


def declared_lines(script: str) -> Iterator[tuple[int, str]]:
    """(line number, words) of each ``#STAGER`` line of the script's top comment block."""
    # Lines end at "\n" only, as for sbatch and job_submit.lua (splitlines would also
    # end them at "\r", "\f", "\x1c"...: a line the lua reads whole).
    # Blanks are ASCII spaces and tabs only, as the lua reads them: str.strip() would
    # also take "\x1c" or "\xa0" for blank, and the two readers would disagree on
    # where the comment block ends.
    for number, line in enumerate(script.split("\n"), start=1):
        if line.strip(BLANKS) and not line.startswith("#"):
            return  # the first command: #SBATCH stops here too (as does job_submit.lua)
        if line == MARK or line.startswith((MARK + " ", MARK + "\t")):
            yield number, line[len(MARK) :].strip(BLANKS)


BLANKS = " \t"


def parse_line(
    words: str, number: int, parser: argparse.ArgumentParser, where: str = "line"
) -> Declaration:
    """One line's words, as ``stager-client stage WORDS`` would read them."""
    at = f"{where} {number}"
    try:
        tokens = shlex.split(words)
    except ValueError as exc:  # an unclosed quote
        raise BadDeclaration(f"{at}: {exc} in {words!r}; close the quote") from None
    if not tokens:
        raise BadDeclaration(f"{at}: {MARK} names no dataset; write e.g. `{EXAMPLE}`")
    if len(tokens) > MAX_WORDS:
        raise BadDeclaration(
            f"{at}: {len(tokens)} words, and a {MARK} line has at most {MAX_WORDS}; "
            "declare the dataset with fewer (a --step, or a recipe)"
        )
    if {"-h", "--help"} & set(tokens):
        raise BadDeclaration(f"{at}: --help has no place in a {MARK} line; remove it")
    try:
        args = parser.parse_args(tokens)
    except BadDeclaration as exc:
        raise BadDeclaration(
            f"{at}: {exc} in `{MARK} {words}`; a {MARK} line takes the words of "
            f"`stager-client stage`, e.g. `{EXAMPLE}`"
        ) from None
    _check(args, parser, at, words)
    return Declaration(number, words, args)


def _check(args: argparse.Namespace, parser: argparse.ArgumentParser, at: str, words: str) -> None:
    per_run = sorted(
        f"--{dest.replace('_', '-')}"
        for dest, value in vars(args).items()
        if dest not in DECLARABLE and value != parser.get_default(dest)
    )
    if per_run:
        raise BadDeclaration(
            f"{at}: {', '.join(per_run)} says how to stage, not what; give it on the "
            f"`stager-client stage --from-script` command line, where it applies to every "
            f"{MARK} line"
        )
    if not args.name or not re.match(NAME_PATTERN, args.name):
        raise BadDeclaration(
            f"{at}: `{MARK} {words}` must start with the dataset's NAME ([a-z0-9._-], "
            f"e.g. `{EXAMPLE}`)"
        )
    if not args.recipe and not args.step:
        raise BadDeclaration(f"{at}: give --recipe with --source, or --step, as in `{EXAMPLE}`")
    for dest in LITERAL:
        values = getattr(args, dest)
        for value in values if isinstance(values, list) else [values]:
            if value and "$" in value:
                raise BadDeclaration(
                    f"{at}: --{dest} {value!r} names a variable; the planner reads this line "
                    f"before the job runs, without the job's environment: write the value out "
                    f"(only --link's variables are expanded, in the job)"
                )


def parse_script(
    script: str, parser: argparse.ArgumentParser, where: str = "line"
) -> list[Declaration]:
    """Every declaration of a script, in order; the first bad line raises."""
    found: dict[str, Declaration] = {}
    for number, words in declared_lines(script):
        declaration = parse_line(words, number, parser, where)
        if (earlier := found.get(declaration.name)) is not None:
            raise BadDeclaration(
                f"{where} {number}: dataset {declaration.name!r} is declared already on "
                f"{where} {earlier.line}; give each NAME once"
            )
        found[declaration.name] = declaration
    return list(found.values())


def planned_request(
    declaration: Declaration, request_from: Callable[[argparse.Namespace], dict[str, Any]]
) -> dict[str, Any]:
    """The body the planner sends for a declaration: the job's own request without its
    link (made by the job; its path may hold the job's variables) and without a lease
    (a prefetch holds nothing): neither is part of the cache key."""
    args = argparse.Namespace(**vars(declaration.args))
    args.link, args.lease, args.no_lease = None, None, True
    args.declared = declaration.words  # the node feature's name (stager.prestage.placement)
    return request_from(args)


# ---- in the job: stager-client stage --from-script ------------------------------------

# The per-run flags of the command line that each declaration's stage runs with.
PER_RUN = (
    "wait",
    "peers",
    "broadcast",
    "timeout",
    "retry_for",
    "interval",
    "progress",
    "json",
    "lease",
    "no_lease",
    "url",
    "quiet",
)


def invocations(
    command: argparse.Namespace, parser: argparse.ArgumentParser
) -> list[argparse.Namespace]:
    """One ``stage`` namespace per declaration of ``--from-script``'s script, with the
    command line's per-run flags; raises `BadDeclaration` naming the line."""
    if command.name or command.recipe or command.step or command.request:
        raise BadDeclaration(
            "--from-script stages what the script declares; give no NAME, --recipe, --step "
            "or --request with it (add a #STAGER line instead)"
        )
    where, text = read_script(command.from_script)
    declarations = parse_script(text, parser, where=f"{where} line")
    if not declarations:
        raise BadDeclaration(f"{where} declares no dataset; add a line like `{EXAMPLE}`")
    runs = []
    for declaration in declarations:
        args = argparse.Namespace(**vars(declaration.args))
        for dest in PER_RUN:
            setattr(args, dest, getattr(command, dest, None))
        args.request, args.from_script = None, None
        # The node service names the data's node feature by the line's words, so that
        # jobs declaring the same line prefer the nodes holding it (stager.prestage.placement).
        args.declared = declaration.words
        args.declared_at = f"{where} line {declaration.line}"  # for errors found later
        if args.link:
            args.link = _expand_link(args.link, where, declaration.line)
        runs.append(args)
    return runs


def _expand_link(link: str, where: str, line: int) -> str:
    expanded = os.path.expandvars(link)
    if "$" in expanded:
        raise BadDeclaration(
            f"{where} line {line}: --link {link!r} names a variable this job's environment "
            f"lacks; set it before `stager-client stage --from-script`, or write the path out"
        )
    return expanded


def read_script(path: str) -> tuple[str, str]:
    """(how to name it, its text): the file given, else this SLURM job's batch script as
    slurmctld stored it at submit (what the planner read)."""
    if path:
        try:
            # As the planner decodes it (stager.prestage.plan.declared): UTF-8, any byte kept.
            return path, Path(path).read_text(encoding="utf-8", errors="surrogateescape")
        except (OSError, UnicodeDecodeError) as exc:
            raise BadDeclaration(
                f"--from-script {path}: {exc}; give a readable job script"
            ) from exc
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        raise BadDeclaration(
            "--from-script without SCRIPT reads this SLURM job's batch script, and this is "
            "no SLURM job (no SLURM_JOB_ID); give the script's path: --from-script job.sh"
        )
    command = ["scontrol", "write", "batch_script", job_id, "-"]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="surrogateescape",
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BadDeclaration(
            f"`{' '.join(command)}` failed ({exc}); give the script's path: --from-script job.sh"
        ) from exc
    if done.returncode != 0:
        raise BadDeclaration(
            f"`{' '.join(command)}` failed ({done.stderr.strip()}); a job step that is not "
            f"the batch script has none: give the script's path, --from-script job.sh"
        )
    return f"job {job_id}'s batch script", done.stdout
