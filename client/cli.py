"""``stager-client``: stage datasets, wait for them, inspect and cancel them.

Thin: parse flags, call `AsyncStagerClient`, print, and map exceptions to the
named exit codes below (documented in docs/client.md). stdout carries only what
scripts capture (paths, or JSON with --json); messages and progress go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from client import declare
from client._client import DEFAULT_AWAIT_REQUEST_S, AsyncStagerClient, stage_body
from client._progress import (
    BarDisplay,
    Display,
    LogDisplay,
    NullDisplay,
    describe_origin,
    summary,
)
from client.errors import (
    BadConfiguration,
    DaemonError,
    DaemonUnavailable,
    DatasetNotFound,
    FanoutError,
    RequestRejected,
    StagerError,
    StagingFailed,
    WaitTimeout,
)
from client.hints import in_user_terms
from stager.wire.cli_common import (
    SuggestingParser,
    __version__,
    add_completion,
    format_listing,
    print_completion,
)
from stager.wire.schemas import DatasetPublic, DatasetsPublic, ErrorInfo, ErrorResponse

EXIT_OK = 0  # every dataset asked for is ready (or the command did what it said)
EXIT_FAILED = 1  # a dataset failed, was cancelled or evicted; the daemon's sentence is printed
EXIT_USAGE = 2  # bad flags or arguments (argparse's own code), unusable --url / token
EXIT_REJECTED = 3  # the daemon refused the request: invalid spec, unknown recipe or name, 409
EXIT_TIMEOUT = 4  # --timeout passed while a dataset was still staging
EXIT_UNAVAILABLE = 5  # no daemon answered (after retries, for wait and stage)
EXIT_DAEMON_ERROR = 6  # the daemon answered 5xx or something that is not the stager API
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGINT, as shells report it

# Most specific first: the first class an exception is an instance of picks its code.
EXIT_CODES: tuple[tuple[type[StagerError], int], ...] = (
    (StagingFailed, EXIT_FAILED),
    (FanoutError, EXIT_FAILED),
    (WaitTimeout, EXIT_TIMEOUT),
    (DaemonUnavailable, EXIT_UNAVAILABLE),
    (RequestRejected, EXIT_REJECTED),
    (DaemonError, EXIT_DAEMON_ERROR),
    (BadConfiguration, EXIT_USAGE),
)

BAR_POLL_S = 0.5  # how often a terminal bar refreshes its numbers from the daemon
# Log mode long-polls with timeout=--interval: 0 would turn each poll into a busy loop.
MIN_INTERVAL_S = 0.1

EPILOG = """\
exit codes:
  0 ready   1 staging failed/cancelled   2 bad usage   3 rejected by the daemon
  4 timeout   5 daemon unreachable   6 daemon error   130 interrupted

examples:
  stager-client stage inat --recipe inat2021 --source /network/datasets/inat --wait
  stager-client stage imgs --step '{"op": "extract", "src": "/data/imgs.tar"}' \
      --link $SLURM_TMPDIR/imgs
  stager-client wait inat imgs --timeout 3600
  stager-client ls --json
  stager-client recipes                  # the recipes, their params and source files

The daemon is found from --url, else STAGER_URL (unix:///path/to.sock or
http://host:port with STAGER_TOKEN or the daemon's token file), else the default
socket ${XDG_RUNTIME_DIR:-/tmp}/stager-$UID/stager.sock.
"""


class UsageError(Exception):
    """A flag's value cannot be used; reported with exit code 2 like argparse's own."""


# ---- parser -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: a flag given after the subcommand overrides, without resetting one given before.
    common.add_argument(
        "--url",
        default=argparse.SUPPRESS,
        help="daemon URL (default: STAGER_URL, else the default socket)",
    )
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress and no messages; only errors and results",
    )
    parser = SuggestingParser(
        prog="stager-client",
        description="Stage datasets onto this node through the stager daemon, and wait for them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"stager-client {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_stage(commands, common)
    _add_wait(commands, common)
    sub = commands.add_parser("status", parents=[common], help="one dataset's state and progress")
    sub.add_argument("name", metavar="NAME")
    _add_json(sub, "print the status as the API's DatasetPublic JSON")
    sub.set_defaults(run=cmd_status)
    sub = commands.add_parser("ls", parents=[common], help="every dataset the daemon knows")
    _add_json(sub, "print the API's DatasetsPublic JSON")
    sub.set_defaults(run=cmd_ls)
    sub = commands.add_parser(
        "cancel", parents=[common], help="cancel a staging, evict a ready dataset"
    )
    sub.add_argument("name", metavar="NAME")
    _add_json(sub, "print the resulting status as JSON")
    sub.set_defaults(run=cmd_cancel)
    _add_release(commands, common)
    sub = commands.add_parser(
        "whoami", parents=[common], help="who the daemon takes you to be, and its mode"
    )
    _add_json(sub, "print the API's WhoAmI JSON")
    sub.set_defaults(run=cmd_whoami)
    sub = commands.add_parser(
        "recipes",
        parents=[common],
        help="the recipes the daemon knows: their params, the files each split needs, and "
        "the torchvision call that loads it",
    )
    _add_json(sub, "print the API's GET /v1/recipes JSON")
    sub.set_defaults(run=cmd_recipes)
    add_completion(commands, parser)
    return parser


def _add_json(parser: argparse.ArgumentParser, text: str) -> None:
    parser.add_argument("--json", action="store_true", help=text)


def _add_wait_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=_seconds,
        metavar="S",
        help="give up after S seconds (exit 4); default: wait forever",
    )
    parser.add_argument(
        "--retry-for",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="keep retrying an unreachable daemon this long (default 30)",
    )
    parser.add_argument(
        "--interval",
        type=_interval,
        default=30.0,
        metavar="S",
        help="seconds between progress lines when not on a terminal (default 30)",
    )
    parser.add_argument(
        "--progress",
        choices=["auto", "bar", "log", "none"],
        default="auto",
        help="auto: a bar on a terminal, log lines otherwise",
    )


def _add_stage(commands: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    sub = commands.add_parser(
        "stage",
        parents=[common],
        help="stage (or join) a dataset; --wait blocks until it is ready",
        description="Give a recipe with its source, raw --step JSON, or a --request file.",
    )
    sub.add_argument(
        "name",
        metavar="NAME",
        nargs="?",
        help="the dataset's handle, [a-z0-9._-] (may come from --request)",
    )
    sub.add_argument(
        "--recipe", help="named recipe, e.g. inat2021 (`stager-client recipes` lists them)"
    )
    sub.add_argument("--source", help="the recipe's source folder or URL")
    sub.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="K=V",
        help="recipe parameter; V is parsed as JSON when it parses (repeatable)",
    )
    sub.add_argument(
        "--step",
        action="append",
        default=[],
        metavar="JSON",
        help='one step, e.g. \'{"op": "copy", "src": "/data/x"}\' (repeatable, in order)',
    )
    sub.add_argument(
        "--request",
        metavar="FILE",
        help="a JSON request body (POST /v1/datasets); '-' reads stdin; "
        "flags given here override its fields",
    )
    sub.add_argument("--link", metavar="PATH", help="absolute symlink to the staged root")
    sub.add_argument("--verify", choices=["size", "sha256", "none"])
    sub.add_argument("--fingerprint", choices=["cheap", "deep"])
    sub.add_argument(
        "--as-image",
        action="store_true",
        default=None,
        help="stage the dataset as one read-only image mounted at its path: ready sooner and "
        "evicted at once for many small files (docs/image-mode.md)",
    )
    sub.add_argument(
        "--image-fallback",
        action="store_true",
        default=None,
        help="with --as-image: where this daemon cannot mount an image, stage a tree instead "
        "of failing (the answer says so)",
    )
    leasing = sub.add_mutually_exclusive_group()
    leasing.add_argument(
        "--lease",
        metavar="HOLDER",
        help="pin the dataset for HOLDER (default inside a SLURM job: slurm-job-$SLURM_JOB_ID, "
        "dropped by the daemon when the job ends)",
    )
    leasing.add_argument(
        "--no-lease", action="store_true", help="do not pin the dataset, even inside a SLURM job"
    )
    sub.add_argument("--wait", action="store_true", help="block until ready; print its path")
    sub.add_argument(
        "--peers",
        choices=["none", "slurm"],
        default="none",
        help="slurm: stage on every node of this SLURM job, reading the shared storage once "
        "(run once in the batch script; implies --wait; see docs/multinode.md)",
    )
    sub.add_argument(
        "--broadcast",
        choices=["auto", "prepared", "sources"],
        default="auto",
        help="with --peers slurm, what is sent to the other nodes: the prepared tree, or an "
        "image dataset's image file (auto); the prepared tree even for an image dataset "
        "(prepared); or the request's source files (archives) for every node to stage "
        "from (sources) (see docs/multinode.md)",
    )
    sub.add_argument(
        "--from-script",
        nargs="?",
        const="",
        metavar="SCRIPT",
        help="stage every dataset the job script declares on its #STAGER lines (each line "
        "takes this command's NAME and flags, e.g. `#STAGER inat --recipe inat2021 --source "
        "/net/inat`), as each line's own `stage` would, with this command line's --wait, "
        "--peers, --timeout, ...; SCRIPT defaults to this SLURM job's batch script (`scontrol "
        "write batch_script`), what the planner pre-staged from (docs/prestaging.md)",
    )
    _add_wait_flags(sub)
    _add_json(sub, "print the final status as JSON")
    sub.set_defaults(run=cmd_stage)
    return sub


def stage_parser() -> argparse.ArgumentParser:
    """The stage subcommand's parser alone, raising `declare.BadDeclaration` instead of
    exiting: #STAGER lines are read with it (client/declare.py)."""
    holder = declare.DeclarationParser(prog="stager-client", add_help=False)
    commands = holder.add_subparsers(parser_class=declare.DeclarationParser)
    return _add_stage(commands, argparse.ArgumentParser(add_help=False))


def _add_wait(commands: Any, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser(
        "wait",
        parents=[common],
        help="block until every NAME is ready; print their paths",
        description="Tolerates a daemon that is still starting or restarts meanwhile.",
    )
    sub.add_argument("names", metavar="NAME", nargs="+")
    sub.add_argument(
        "--await-request",
        type=_seconds,
        default=DEFAULT_AWAIT_REQUEST_S,
        metavar="S",
        help="a NAME the daemon does not know yet may be requested within S seconds of the "
        "daemon's first answer (its stage request may still be on its way, e.g. from "
        f"another rank or job step; default {DEFAULT_AWAIT_REQUEST_S:g}); then it fails "
        "(exit 3); 0: at once",
    )
    _add_wait_flags(sub)
    _add_json(sub, "print the final statuses as the API's DatasetsPublic JSON")
    sub.set_defaults(run=cmd_wait)


def _add_release(commands: Any, common: argparse.ArgumentParser) -> None:
    sub = commands.add_parser("release", parents=[common], help="drop leases on a dataset")
    sub.add_argument("name", metavar="NAME")
    who = sub.add_mutually_exclusive_group()
    who.add_argument("--holder", help="only this holder's leases (default: all)")
    who.add_argument("--id", dest="lease_id", help="only the lease with this id")
    _add_json(sub, "print the released leases as JSON")
    sub.set_defaults(run=cmd_release)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def _seconds(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _interval(text: str) -> float:
    value = _number(text)
    if value < MIN_INTERVAL_S:  # negatives included: same cause, same fix
        raise argparse.ArgumentTypeError(
            f"{text!r} would poll the daemon in a tight loop; "
            f"give --interval {MIN_INTERVAL_S} or more (default 30)"
        )
    return value


# ---- building a stage request -----------------------------------------------------------


def _default_lease(holder: str | None) -> dict[str, Any] | None:
    """Inside a SLURM job a stage pins its data for the job: the daemon drops the lease
    when SLURM says the job ended, and the epilog releases it at once."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if holder is None and job_id is None:
        return None
    lease: dict[str, Any] = {"holder": holder or f"slurm-job-{job_id}"}
    if job_id:
        lease["slurm_job_id"] = job_id
    return lease


def request_from(args: argparse.Namespace) -> dict[str, Any]:
    """The POST body from --request, then flags; raises `UsageError` on unusable input."""
    body = _read_request_file(args.request) if args.request else {}
    steps = [_parse_step(text) for text in args.step] or body.get("steps")
    params = {**body.get("params", {}), **dict(_parse_param(p) for p in args.param)}
    name = args.name or body.get("name")
    if not name:
        raise UsageError("give the dataset's NAME (or a 'name' in the --request file)")
    lease = None if args.no_lease else (body.get("lease") or _default_lease(args.lease))
    given = stage_body(
        name,
        recipe=args.recipe,
        source=args.source,
        params=params,
        steps=steps,
        link=args.link,
        verify=args.verify,
        fingerprint=args.fingerprint,
        lease=lease,
        image=args.as_image,
        image_fallback=args.image_fallback,
    )
    merged = {**body, **given}
    if getattr(args, "declared", None):  # a #STAGER line's words (client.declare)
        merged["declared"] = args.declared
    if not merged.get("recipe") and not merged.get("steps"):
        raise UsageError("give --recipe with --source, one or more --step, or --request FILE")
    return merged


def _read_request_file(path: str) -> dict[str, Any]:
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise UsageError(f"--request {path}: {exc.strerror}") from exc
    body = _json(text, f"--request {path}")
    if not isinstance(body, dict):
        raise UsageError(f"--request {path} must hold a JSON object (a POST /v1/datasets body)")
    return body


def _json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON ({exc})") from exc
    except RecursionError:  # json's decoder recurses once per nested [ or {
        raise UsageError(f"{what} is nested too deep to be a request; write it flat") from None


def _parse_step(text: str) -> dict[str, Any]:
    step = _json(text, f"--step {text!r}")
    if not isinstance(step, dict):
        raise UsageError(f'--step {text!r} must be a JSON object like {{"op": "copy", ...}}')
    return step


def _parse_param(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise UsageError(f"--param {text!r} must look like KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw  # a bare word like `2021_train` is meant as a string
    except RecursionError:
        raise UsageError(f"--param {key}: its value is nested too deep to be a parameter") from None


# ---- commands ---------------------------------------------------------------------------


def make_display(args: argparse.Namespace) -> Display:
    mode = "none" if args.quiet or args.json else args.progress
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "log"
    if mode == "bar":
        return BarDisplay()
    if mode == "log":
        return LogDisplay(sys.stderr, args.interval)
    return NullDisplay()


def _poll_interval(args: argparse.Namespace, display: Display) -> float | None:
    if isinstance(display, BarDisplay):
        return BAR_POLL_S
    if isinstance(display, LogDisplay):
        return args.interval
    return None  # nobody watches: plain long-polls


async def wait_all(
    client: AsyncStagerClient, names: Sequence[str], args: argparse.Namespace
) -> list[DatasetPublic]:
    """Wait for every name at once; the first failure stops the others (fail fast)."""
    display = make_display(args)
    interval = _poll_interval(args, display)
    tasks = [
        asyncio.create_task(
            client.wait(
                name,
                args.timeout,
                on_status=display.update,
                interval=interval,
                on_not_requested=lambda sentence: _say(args, sentence),
                # `stage --wait` has just made its name known
                await_request=getattr(args, "await_request", DEFAULT_AWAIT_REQUEST_S),
            )
        )
        for name in names
    ]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()
        for task in tasks:
            if task in done and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        display.close()


async def cmd_stage(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    if args.from_script is not None:
        return await stage_declared(client, args)
    if args.peers == "slurm":
        return await stage_on_peers(client, args)
    status = await client.submit(request_from(args))
    if status.notice:
        _say(args, status.notice)  # e.g. a tree staged where an image was asked for
    if args.wait:
        status = (await wait_all(client, [status.name], args))[0]
    if args.json:
        _print_json(status)
    elif status.path and status.state == "ready":
        print(status.path)
    else:
        _say(args, f"{summary(status)}; `stager-client wait {status.name}` blocks until ready")
    return EXIT_OK


async def stage_declared(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    """--from-script: each #STAGER line as its own `stage`; paths (or JSON) in line order."""
    try:
        runs = declare.invocations(args, stage_parser())
    except declare.BadDeclaration as exc:
        raise UsageError(str(exc)) from exc
    if args.peers == "slurm":  # one fan-out per dataset, each reading the storage once
        for run in runs:
            if (code := await stage_on_peers(client, run)) != EXIT_OK:
                return code
        return EXIT_OK
    bodies = []  # every line checked before the first is sent
    for run in runs:
        try:
            bodies.append(request_from(run))
        except UsageError as exc:  # e.g. a --step that is not JSON
            raise UsageError(f"{run.declared_at}: {exc}") from exc
    statuses = [await client.submit(body) for body in bodies]
    if args.wait:
        statuses = await wait_all(client, [status.name for status in statuses], args)
    if args.json:
        _print_json(DatasetsPublic(data=statuses, count=len(statuses)))
        return EXIT_OK
    for status in statuses:
        if status.state == "ready" and status.path:
            print(status.path)
        else:
            _say(args, f"{summary(status)}; `stager-client wait {status.name}` blocks until ready")
    return EXIT_OK


async def stage_on_peers(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    """Every node of the job, through SLURM: one line per node on stderr, this node's
    path on stdout; fails naming the nodes (and steps) left without the data."""
    # Imported here: a plain `stage` or `wait` does not pay for the fan-out's modules.
    from client.fanout.coordinator import Fanout
    from client.fanout.slurm import Job

    job = await Job.detect()
    body = request_from(args)
    fanout = Fanout(job, client, body, args.timeout, _sayer(args), args.broadcast)
    report = await fanout.run()
    if args.json:
        print(json.dumps(report.as_json()))
    else:
        _say(args, report.headline())
        for result in sorted(report.nodes.values(), key=lambda r: r.node):
            _say(args, f"  {result.line()}")
        here = report.nodes.get(job.this_node)
        if here is not None and here.path and not here.error:
            print(here.path)
    if report.failed:
        # The report (with --json) is already the one document on stdout; the reason
        # goes to stderr, as for any failure.
        nodes = "; ".join(f"{r.node}: {r.error}" for r in report.failed)
        error = FanoutError(f"dataset {report.name!r} is not ready on every node ({nodes})")
        print(f"stager-client: {error}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _sayer(args: argparse.Namespace) -> Callable[[str], None]:
    return lambda message: _say(args, f"stager-client: {message}")


async def cmd_wait(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    statuses = await wait_all(client, args.names, args)
    if args.json:
        _print_json(DatasetsPublic(data=statuses, count=len(statuses)))
    else:
        for status in statuses:
            print(status.path)
    return EXIT_OK


async def cmd_status(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    status = await client.status(args.name)
    if args.json:
        _print_json(status)
        return EXIT_OK
    print(summary(status) + describe_origin(status))
    if status.state == "ready":  # what README promises: the call that loads it
        for usage in status.usage:
            print(f"  usage: {usage.code}")
    return EXIT_OK


async def cmd_recipes(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    listing = await client.recipes()
    if args.json:
        print(json.dumps(listing))
    else:
        print(format_listing(listing["data"]))
    return EXIT_OK


async def cmd_whoami(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    who = await client.whoami()
    if args.json:
        _print_json(who)
    else:
        print(f"{who.user} (uid {who.uid}, gid {who.gid}) on the {who.mode} daemon at {client.url}")
    return EXIT_OK


async def cmd_ls(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    statuses = await client.list()
    if args.json:
        _print_json(DatasetsPublic(data=statuses, count=len(statuses)))
        return EXIT_OK
    if not statuses:
        _say(args, "no datasets; stage one with `stager-client stage NAME ...`")
    for status in statuses:
        print(summary(status) + describe_origin(status))
    return EXIT_OK


async def cmd_cancel(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    status = await client.cancel(args.name)
    if args.json:
        _print_json(status)
    else:
        print(status.outcome or f"{status.name}: {status.state}")
    return EXIT_OK


async def cmd_release(client: AsyncStagerClient, args: argparse.Namespace) -> int:
    leases = await client.release(args.name, holder=args.holder, lease_id=args.lease_id)
    if args.json:
        print(json.dumps([lease.model_dump(mode="json") for lease in leases]))
    else:
        print(f"{args.name}: released {len(leases)} lease(s)")
    return EXIT_OK


def _print_json(model: BaseModel) -> None:
    print(model.model_dump_json(by_alias=True))


def _say(args: argparse.Namespace, message: str) -> None:
    if not args.quiet:
        print(message, file=sys.stderr)


# ---- main -------------------------------------------------------------------------------


def exit_code(exc: StagerError) -> int:
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), EXIT_DAEMON_ERROR)


def describe(exc: StagerError, args: argparse.Namespace | None = None) -> str:
    """The sentence for the terminal, in the terms of stager-client's own commands."""
    if isinstance(exc, StagingFailed):
        return in_user_terms(f"dataset {exc.name!r} {exc.status.state}: {exc}")
    sentence = in_user_terms(str(exc))
    if isinstance(exc, DatasetNotFound) and args is not None and args.command == "wait":
        sentence += (
            " (--await-request S waits longer)"
            if exc.waited
            else "; if its stage request is still on its way, give --await-request S"
        )
    return sentence


def interrupted(args: argparse.Namespace) -> str:
    """What Ctrl-C leaves behind: a staging it waited on goes on in the daemon."""
    names = list(getattr(args, "names", None) or [])
    if args.command == "stage" and args.name:
        names = [args.name]
    if args.command not in ("stage", "wait") or not names:
        return "stager-client: interrupted"
    shown = " ".join(names)
    cancel = " or ".join(f"`stager-client cancel {name}`" for name in names)
    return (
        f"stager-client: interrupted; the daemon goes on staging {shown} (if it was "
        f"requested): `stager-client wait {shown}` waits again, "
        f"{cancel} stops {'it' if len(names) == 1 else 'one'}"
    )


def _report(args: argparse.Namespace, exc: StagerError) -> int:
    sentence = describe(exc, args)
    if getattr(args, "json", False):
        _print_json(ErrorResponse(error=ErrorInfo(type=exc.type, message=sentence)))
    print(f"stager-client: {sentence}", file=sys.stderr)
    return exit_code(exc)


async def _run(args: argparse.Namespace, run: Callable[..., Awaitable[int]]) -> int:
    retry_for = getattr(args, "retry_for", 0.0)
    on_retry = _sayer(args) if retry_for else None  # say at once what a retry waits for
    async with AsyncStagerClient(args.url, retry_for=retry_for, on_retry=on_retry) as client:
        return await run(client, args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_node"]:  # one node's part of --peers slurm, started by srun
        from client.fanout import agent

        return agent.main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "completion":
        return print_completion(args)
    args.url = getattr(args, "url", None)
    args.quiet = getattr(args, "quiet", False)
    try:
        return asyncio.run(_run(args, args.run))
    except UsageError as exc:
        parser.error(str(exc))  # exits 2 with the usage line, as argparse does
    except StagerError as exc:
        return _report(args, exc)
    except KeyboardInterrupt:
        print(interrupted(args), file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK  # unreachable: parser.error exits


if __name__ == "__main__":
    sys.exit(main())
