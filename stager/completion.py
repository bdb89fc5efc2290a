"""Shell completion for the three commands: ``stager completion bash``,
``stager-client completion bash``, ``stager-train completion bash`` (shtab writes the
script from the parser itself, so it knows every flag and choice).

On the wire layer beside the models: the client and the trainer use it too.
"""

from __future__ import annotations

import argparse


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
    import shtab

    print(shtab.complete(args.completion_of, shell=args.shell))
    return 0
