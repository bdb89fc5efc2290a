"""Every command README.md and docs/ show is one the real parsers accept, and every
``STAGER_*`` variable they name is one that stager reads: docs that are true."""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "deploy").rglob("*.md"))]  # fmt: skip
PROGRAMS = ("stager", "stager-client", "stager-train")
# Where a command ends inside a shell line.
ENDS = {"|", "||", "&&", ";", ")", ">", ">>", "2>&1", "#"}


def code_lines(text: str) -> Iterator[str]:
    """Shell lines of fenced code blocks (continuations joined), and inline code spans
    that read as a whole command with a flag (not a synopsis with NAME, [...], a|b)."""
    for block in shell_blocks(text):
        lines = (line.split(" # ")[0] for line in block.replace("\\\n", " ").splitlines())
        yield from (line for line in lines if whole(line))
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        if " --" in span and len(span.split()) >= 3 and whole(span):
            yield span


def shell_blocks(text: str) -> Iterator[str]:
    """The fenced blocks marked as shell, or not marked at all."""
    language, lines = None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if language is None:
                language, lines = line[3:].strip() or "sh", []
                continue
            if language in ("bash", "sh", "shell", "console"):
                yield "\n".join(lines)
            language = None
        elif language is not None:
            lines.append(line)


def whole(line: str) -> bool:
    """Not a synopsis (NAME, [optional], {a,b}, ...) or a diagram."""
    synopsis = r"\[-|\[[A-Z]|\{[a-z]+,|\b(NAME|FILE|JSON|DIR)\b|\.\.\.|…| / |\(only "
    return not re.search(synopsis, line)


def commands(text: str) -> Iterator[tuple[str, list[str]]]:
    """(program, its arguments) for each stager command in ``text``."""
    for line in code_lines(text):
        line = line.split(" # ")[0].strip().removeprefix("$ ")
        try:
            words = shlex.split(line, comments=False)
        except ValueError:
            continue  # not shell (a Python line, a JSON fragment)
        for index, word in enumerate(words):
            name = word.split("$(")[-1].rsplit("/", 1)[-1]
            if word == "trainer" and index and words[index - 1] == "-m":
                name = "stager-train"  # python -m trainer, torchrun ... -m trainer
            elif index and words[index - 1] not in ("srun", "exec", "time") and "$(" not in word:
                continue
            if name not in PROGRAMS:
                continue
            args = []
            for arg in words[index + 1 :]:
                if arg in ENDS or arg.startswith("#"):
                    break
                if arg.endswith(")") and not arg.startswith("$("):  # the end of a $(...)
                    args.append(arg[:-1])
                    break
                args.append(arg)
            yield name, args


def parser_of(program: str) -> Callable[[list[str]], object]:
    if program == "stager":
        from stager.cli import build_parser

        return build_parser().parse_args
    if program == "stager-client":
        from client.cli import build_parser

        return build_parser().parse_args
    from trainer import cli

    def train(argv: list[str]) -> object:
        if argv and argv[0] in cli.SUBCOMMANDS:
            command, rest = argv[0], argv[1:]
            if command == "find-lr":
                return cli.get_find_lr_parser().parse_args(rest)
            if command == "shard":
                return cli.get_shard_parser().parse_args(rest)
            return None  # exit-status, completion: a word or two
        return cli.parse_train_args(argv)

    return train


def shown() -> list[tuple[str, str, list[str]]]:
    found = []
    for doc in DOCS:
        for program, args in commands(doc.read_text()):
            found.append((doc.relative_to(REPO).as_posix(), program, args))
    return found


def test_the_docs_show_commands_of_each_program() -> None:
    programs = {program for _, program, _ in shown()}
    assert programs == set(PROGRAMS), programs


@pytest.mark.parametrize(
    ("doc", "program", "args"),
    [pytest.param(*c, id=f"{c[0]}: {c[1]} {' '.join(c[2])}"[:120]) for c in shown()],
)
def test_every_command_shown_parses(doc: str, program: str, args: list[str], capsys) -> None:
    parse = parser_of(program)
    try:
        parse(args)
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 0, f"{doc}: `{program} {' '.join(args)}` is refused: {err}"


def variables_read() -> set[str]:
    """Every STAGER_* variable something of stager reads: the daemon's settings (and
    their earlier names), and every one the client, the trainer, the deploy scripts
    and the tests' own knobs name in their code."""
    from stager.core.settings import Settings, env_name, old_env_names

    names = {env_name(n) for n in Settings.model_fields}
    names |= {old for n in Settings.model_fields for old in old_env_names(n)}
    for folder, patterns in (
        ("client", ("*.py",)),
        ("trainer", ("*.py",)),
        ("deploy", ("*.sh", "*.env", "*.py", "*.in")),
        ("tests", ("*.py",)),
        ("bench", ("*.py", "*.sh")),
    ):
        for pattern in patterns:
            for path in (REPO / folder).rglob(pattern):
                names |= set(re.findall(r"\bSTAGER_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    return names


def test_every_variable_the_docs_name_is_read_by_stager() -> None:
    read = variables_read()
    unknown = []
    for doc in DOCS:
        for name in set(re.findall(r"\bSTAGER_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text())):
            if name not in read:
                unknown.append(f"{doc.relative_to(REPO)}: {name}")
    assert not unknown, "the docs name variables nothing reads:\n" + "\n".join(sorted(unknown))
