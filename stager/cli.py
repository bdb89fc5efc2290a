"""``stager``: run and stop the node's staging daemon.

Thin: parse flags into ``Settings`` and call ``stager.server``. Exit codes:
0 success, 1 the daemon could not start or stop, 2 bad usage or settings.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from stager import __version__
from stager.settings import Settings

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

EPILOG = """\
examples:
  stager serve --detach                  # background daemon on the default Unix socket
  stager serve --host 127.0.0.1 --port 8765 --cache-dir /local/scratch/stager
  stager stop
  stager serve --multi-user              # as root: the node service for every user

Every flag can also be set as STAGER_<FLAG> in the environment (e.g.
STAGER_CACHE_DIR=/local/scratch/stager); flags win over the environment.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
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
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_location_flags(serve)
    serve.add_argument("--host", help="serve TCP on this address instead of the Unix socket")
    serve.add_argument("--port", type=int, help="TCP port (default 8765)")
    serve.add_argument("--token", help="bearer token for TCP (default: generated, stored 0600)")
    serve.add_argument("--token-file", type=Path, help="where the TCP token is read or stored")
    serve.add_argument(
        "--no-token",
        action="store_true",
        default=None,
        help="serve TCP without a token (loopback addresses only)",
    )
    serve.add_argument(
        "--cache-dir", type=Path, help="node-local cache root (default /tmp/stager-$UID/cache)"
    )
    serve.add_argument("--max-workers", type=int, help="datasets staged at once (default 2)")
    serve.add_argument(
        "--op-workers",
        type=int,
        help="worker processes one operation may use for per-file work: copy, link, extract, "
        "seal (default 8, capped at the CPU cores; a copy from a network filesystem runs "
        "up to 8 at once whatever the cores, its time being round trips)",
    )
    serve.add_argument(
        "--allowed-root",
        dest="allowed_roots",
        type=Path,
        action="append",
        help="only stage sources under this folder (repeatable)",
    )
    serve.add_argument(
        "--capacity-bytes",
        type=int,
        help="cache size limit; least recently used datasets are evicted beyond it "
        "(default 0: only the disk's free space limits)",
    )
    serve.add_argument(
        "--min-free-bytes", type=int, help="free space to keep on the cache disk (default 1 GiB)"
    )
    serve.add_argument(
        "--user-quota",
        dest="user_quota_bytes",
        type=int,
        help="node service: bytes of data only its user may read that one user may hold; "
        "data every user may read is shared and counts against nobody (default 0: no limit)",
    )
    serve.add_argument(
        "--stall-timeout",
        dest="stall_timeout_s",
        type=float,
        help="fail a staging whose progress has not moved for this many seconds, e.g. on a "
        "hung network filesystem (default 900; 0: never)",
    )
    serve.add_argument(
        "--cancel-grace",
        dest="cancel_grace_s",
        type=float,
        help="seconds a cancelled staging may take to stop before its process is ended (default 3)",
    )
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument(
        "--detach",
        action="store_true",
        help="start in the background, wait until it answers, then return",
    )

    stop = commands.add_parser("stop", help="stop the daemon started for this runtime folder")
    _add_location_flags(stop)

    gc = commands.add_parser(
        "gc",
        help="drop leases of ended jobs and evict superseded datasets from the cache",
        description="Ask the running daemon to drop expired leases and leases of jobs SLURM "
        "no longer knows, then evict ready datasets that no name refers to any more (older "
        "copies of changed sources). With --all, evict every unleased ready dataset.",
    )
    _add_location_flags(gc)
    gc.add_argument(
        "--all",
        action="store_true",
        default=None,
        help="also evict named datasets that no job holds a lease on",
    )
    recipes = commands.add_parser(
        "recipes",
        help="list the dataset recipes, their parameters and expected source files",
        description="List the recipes this node's daemon knows: the shipped ones and those in "
        "STAGER_RECIPE_DIRS / --recipe-dir. Reads the files directly (no daemon needed), so it "
        "also checks a recipe file you are writing.",
    )
    recipes.add_argument(
        "--recipe-dir",
        dest="recipe_dirs",
        type=Path,
        action="append",
        help="also read recipe files (*.toml) from this folder (repeatable)",
    )
    recipes.add_argument("--json", action="store_true", help="print JSON, as GET /v1/recipes")
    return parser


def _add_location_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--multi-user",
        action="store_true",
        default=None,
        help="the node service for every user (as root, from systemd or the SLURM prolog): "
        "one Unix socket anyone may connect to (default /run/stager/stager.sock), each "
        "caller known by the kernel, sources read with the caller's rights, data everyone "
        "may read shared, the rest private (docs/multiuser.md); cache default "
        "/var/cache/stager",
    )
    parser.add_argument(
        "--runtime-dir",
        type=Path,
        help="folder of socket, pid, log, token (default ${XDG_RUNTIME_DIR:-/tmp}/stager-$UID)",
    )
    parser.add_argument(
        "--socket", type=Path, help="Unix socket path (default <runtime-dir>/stager.sock)"
    )


def settings_from(args: argparse.Namespace) -> Settings:
    """Flags given on the command line override ``STAGER_*`` variables."""
    skip = {"command", "detach", "all", "json"}
    given = {k: v for k, v in vars(args).items() if k not in skip and v is not None}
    return Settings(**given)


def main(argv: list[str] | None = None) -> int:
    from stager import server  # uvicorn and the app load only for commands that need them

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "settings"
        print(f"stager: {field}: {first['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "recipes":
        return _recipes(settings, as_json=args.json)
    try:
        if args.command == "serve" and args.detach:
            server.detach(settings, [a for a in argv[1:] if a != "--detach"])
        elif args.command == "serve":
            server.serve(settings)
        elif args.command == "gc":
            print(server.gc(settings, evict_all=bool(args.all)))
        elif args.command == "stop":
            if server.stop(settings):
                print("stager stopped")
            else:
                print(f"no stager daemon running for {settings.runtime_dir}")
    except server.ServeError as exc:
        print(f"stager: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _recipes(settings: Settings, as_json: bool) -> int:
    from stager import recipes

    try:
        listing = recipes.available(settings)
    except recipes.RecipeFileError as exc:
        print(f"stager: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if as_json:
        import json

        print(json.dumps({"data": listing, "count": len(listing)}, indent=2))
    else:
        print(recipes.format_listing(listing))
    return EXIT_OK
