"""What the three command lines share: their version, "did you mean" for a mistyped
command or flag, shell completion, and the recipes as text. On the wire layer (the
standard library only) because the client and the trainer use it.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from stager import __version__
from stager.wire.suggest import did_you_mean

__all__ = [
    "SuggestingParser",
    "__version__",
    "add_completion",
    "format_listing",
    "print_completion",
]


FLAG_CUTOFF = 0.75


class SuggestingParser(argparse.ArgumentParser):
    """argparse, whose errors for a mistyped subcommand or flag name the close match
    (``stauts`` -> 'status', ``--wiat`` -> '--wait'). Its subparsers are of this class too."""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        choices = action.choices
        if choices is not None and isinstance(value, str) and value not in choices:
            shown = ", ".join(map(repr, choices))
            hint = did_you_mean(value, map(str, choices))
            hint = f"; {hint}" if hint else " "
            raise argparse.ArgumentError(
                action, f"invalid choice: {value!r}{hint}(choose from {shown})"
            )
        super()._check_value(action, value)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._unrecognized(parsed, extras)
        return parsed

    def _unrecognized(self, parsed: argparse.Namespace, extras: list[str]) -> NoReturn:
        flags = _flags_in_use(self, parsed)
        # Flags share their "--" and often a word: offer only a close one ("--wiat" is
        # '--wait', not '--quiet').
        hints = "".join(
            did_you_mean(word.partition("=")[0], flags, cutoff=FLAG_CUTOFF)
            for word in extras
            if word.startswith("-")
        )
        self.error(
            f"unrecognized arguments: {' '.join(extras)}" + (hints and f"; {hints.rstrip()}")
        )


def _flags_in_use(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> set[str]:
    """The option strings of ``parser`` and of the subcommands ``parsed`` went through."""
    flags: set[str] = set()
    for action in parser._actions:
        flags.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(parsed, action.dest or "", None) or "")
            if chosen is not None:
                flags |= _flags_in_use(chosen, parsed)
    return flags


def add_completion(commands: argparse._SubParsersAction, parser: argparse.ArgumentParser) -> None:
    """``PROG completion bash``: a completion script for the shell (shtab)."""
    sub = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description=f'Print a completion script: `eval "$({parser.prog} completion bash)"` '
        "in ~/.bashrc, or save it in the shell's completion folder.",
    )
    sub.add_argument("shell", choices=["bash", "zsh", "tcsh"], help="the shell")
    sub.set_defaults(completion_of=parser)


def print_completion(args: argparse.Namespace) -> int:
    import shtab  # only when a script is printed

    print(shtab.complete(args.completion_of, shell=args.shell))
    return 0


def format_listing(listing: list[dict[str, Any]]) -> str:
    """``GET /v1/recipes`` as ``stager recipes`` and ``stager-client recipes`` print it."""
    blocks = []
    for recipe in listing:
        lines = [f"{recipe['name']}: {recipe['description']}", f"  file: {recipe['file']}"]
        for param in recipe["params"]:
            choices = "|".join(map(str, param.get("choices") or [])) or param["type"]
            lines.append(f"  param {param['name']} = {param.get('default')!r}  ({choices})")
        for split, info in recipe["splits"].items():
            files = ", ".join(f if f != "." else "the source itself" for f in info["files"])
            calls = "; ".join(_call(u) for u in info["usage"]) or "-"
            lines.append(f"  split {split}: needs {files or '-'} -> {calls}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _call(usage: dict[str, Any]) -> str:
    root = "root" if usage["root"] in ("", ".") else f"root + '/{usage['root']}'"
    args = "".join(f", {k}={v!r}" for k, v in usage["kwargs"].items())
    return f"{usage['class']}({root}{args})"
