"""``stager``: run and stop the node's staging daemon; build and mount images.

Thin: parse flags into ``Settings`` and call ``stager.api.server``. The flags of
``serve`` (and the location flags of ``stop`` and ``gc``) are derived from the
settings fields (``stager.core.settings.cli_flags``), so each has the environment
variable ``STAGER_<FLAG>``. Exit codes: ``EPILOG`` and docs/settings.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

from pydantic import ValidationError

from stager import __version__
from stager.core import prestart, processes
from stager.core.settings import Settings, cli_flags, describe_error, environment_warnings
from stager.image import command as image_command
from stager.prestage.plan import command as plan_command
from stager.wire.cli_common import SuggestingParser, add_completion, print_completion

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

EPILOG = """\
examples:
  stager serve --detach                  # background daemon on the default Unix socket
  stager serve --host 127.0.0.1 --port 8765 --cache-dir /local/scratch/stager
  stager serve --capacity-bytes 800G --allowed-roots /network/datasets,/home
  stager stop
  stager serve --multi-user              # as root: the node service for every user
  stager image build train.tar -o train.erofs   # a read-only image, no daemon needed

Every flag can also be set as STAGER_<FLAG> in the environment (e.g.
STAGER_CACHE_DIR=/local/scratch/stager, STAGER_USER_QUOTA=200G); flags win over the
environment. Lists take commas, sizes take units (500M, 10G, 1.5TiB). Every setting:
docs/settings.md.

exit codes: 0 success  1 could not start, stop or reach the daemon  2 bad usage or settings
"""

# What a flag of its own means to the command, not a setting.
COMMAND_ONLY = {"command", "detach", "all", "json", "shell"}


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="stager",
        description="Per-node dataset staging and caching daemon for deep-learning jobs.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"stager {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the daemon",
        description="Run the staging daemon: in the foreground, or with --detach in the "
        "background once it answers.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_settings(serve, "serve")
    serve.add_argument(
        "--detach",
        action="store_true",
        help="start in the background, wait until it answers, then return",
    )

    stop = commands.add_parser(
        "stop",
        help="stop the daemon started for this runtime folder",
        description="Stop the daemon of this runtime folder gracefully (SIGTERM); stagings "
        "under way resume at its next start. Removes a socket no daemon answers on.",
    )
    _add_settings(stop, "stop")
    stop.add_argument("--json", action="store_true", help="print the outcome as JSON")

    gc_parser = commands.add_parser(
        "gc",
        help="drop leases of ended jobs and evict superseded datasets from the cache",
        description="Ask the running daemon to drop expired leases and leases of jobs SLURM "
        "no longer knows, then evict ready datasets that no name refers to any more (older "
        "copies of changed sources). With --all, evict every unleased ready dataset.",
    )
    _add_settings(gc_parser, "gc")
    gc_parser.add_argument(
        "--all",
        action="store_true",
        default=None,
        help="also evict named datasets that no job holds a lease on",
    )
    gc_parser.add_argument("--json", action="store_true", help="print the daemon's answer as JSON")
    recipes = commands.add_parser(
        "recipes",
        help="list the dataset recipes, their parameters and expected source files",
        description="List the recipes this node's daemon knows: the shipped ones and those in "
        "STAGER_RECIPE_DIRS / --recipe-dirs. Reads the files directly (no daemon needed), so "
        "it also checks a recipe file you are writing.",
    )
    _add_settings(recipes, "recipes")
    recipes.add_argument("--json", action="store_true", help="print JSON, as GET /v1/recipes")
    image_command.add_parser(commands)
    plan_command.add_parser(commands)
    add_completion(commands, parser)
    return parser


def _add_settings(parser: argparse.ArgumentParser, command: str) -> None:
    for _, options, keywords in cli_flags(command):
        parser.add_argument(*options, **keywords)


def given_flags(args: argparse.Namespace) -> dict[str, object]:
    """The flags given: they override ``STAGER_*`` variables."""
    return {
        k: v
        for k, v in vars(args).items()
        if k not in COMMAND_ONLY and k != "completion_of" and v is not None
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if not (args.command == "serve" and not args.detach):
        gc.enable()  # off while `python -m stager` imported (stager.__main__); serve's: later
    if args.command == "completion":
        return print_completion(args)
    if args.command == "image":  # no daemon, no settings
        return image_command.run(args)
    if args.command == "plan":  # controller side: no daemon
        return plan_command.run(args)
    try:
        settings = Settings(**given_flags(args))
    except ValidationError as exc:
        print(f"stager: {describe_error(exc, given_flags(args))}", file=sys.stderr)
        return EXIT_USAGE
    if not (args.command == "serve" and not args.detach):  # serve logs them itself
        for warning in environment_warnings():
            print(f"stager: warning: {warning}", file=sys.stderr)
    if args.command == "recipes":
        return _recipes(settings, as_json=args.json)
    return _daemon_command(args, argv, settings)


def _daemon_command(args: argparse.Namespace, argv: list[str], settings: Settings) -> int:
    if args.command == "serve" and not args.detach:
        if not settings.host and (refusal := prestart.already_serving(settings.socket_path)):
            print(f"stager: {refusal}", file=sys.stderr)
            return EXIT_FAILED
    from stager.api import server  # uvicorn and the app load only for commands that need them

    if args.command == "serve" and not args.detach:
        # A fork of the daemon now (stager.core.processes): it has imported all but ~40 of
        # the modules the server's preload imports; if the daemon cannot start, it ends
        # with it.
        processes.start_fork_server(keep_in=settings.private_dir)

    try:
        if args.command == "serve" and args.detach:
            server.detach(settings, [a for a in argv[1:] if a != "--detach"])
        elif args.command == "serve":
            server.serve(settings)
        elif args.command == "gc":
            _print_gc(server.gc(settings, evict_all=bool(args.all)), args.json)
        elif args.command == "stop":
            pid = server.read_pid(settings)
            stopped = server.stop(settings)
            if not stopped and (elsewhere := _daemons_elsewhere(settings)):
                raise server.ServeError(elsewhere)
            _print_stop(settings, pid if stopped else None, args.json)
    except server.ServeError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": {"type": "start_error", "message": str(exc)}}))
        print(f"stager: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _print_gc(result: dict, as_json: bool) -> None:
    from stager.core.settings import format_size

    if as_json:
        print(json.dumps(result))
        return
    print(
        f"evicted {len(result['evicted'])} dataset(s), freed {format_size(result['freed_bytes'])}, "
        f"dropped {result['leases_dropped']} lease(s)"
    )


def _daemons_elsewhere(settings: Settings) -> str | None:
    """When no daemon runs in the runtime folder ``stop`` looked in, and the user named
    no folder, the sentence naming the daemons that do run: the user's own elsewhere
    (started with --runtime-dir), and the node service."""
    if {"runtime_dir", "socket"} & settings.model_fields_set:
        return None  # a folder was chosen, and nothing runs there: that is the answer
    from stager.core import daemons

    uid = os.getuid()
    found = []
    for daemon in daemons.running(exclude=os.getpid()):
        if settings.socket_path in daemon.sockets:
            continue
        at = f"on {', '.join(map(str, daemon.sockets))} " if daemon.sockets else ""
        if daemon.uid == uid:
            sockets = [s for s in daemon.sockets if s.name == "stager.sock"]
            how = (
                f"`stager stop --runtime-dir {sockets[0].parent}`"
                if sockets
                else f"`kill {daemon.pid}` (a graceful stop)"
            )
            found.append(f"yours runs {at}(pid {daemon.pid}): stop it with {how}")
        elif "--multi-user" in daemon.argv:
            found.append(
                f"the node service runs (pid {daemon.pid}, uid {daemon.uid}), serving every "
                "user: its admin stops it (`systemctl stop stager`)"
            )
    if not found:
        return None
    return f"no stager daemon runs for the runtime folder {settings.runtime_dir}; " + "; ".join(
        found
    )


def _print_stop(settings: Settings, pid: int | None, as_json: bool) -> None:
    if as_json:
        stopped = {"stopped": pid is not None, "pid": pid, "runtime_dir": str(settings.runtime_dir)}
        print(json.dumps(stopped))
    elif pid is not None:
        print(f"stager stopped (pid {pid})")
    else:
        print(f"no stager daemon running for {settings.runtime_dir}")


def _recipes(settings: Settings, as_json: bool) -> int:
    from stager.request import recipes
    from stager.wire.cli_common import format_listing

    try:
        listing = recipes.available(settings)
    except recipes.RecipeFileError as exc:
        print(f"stager: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        print(json.dumps({"data": listing, "count": len(listing)}, indent=2))
    else:
        print(format_listing(listing))
    return EXIT_OK
