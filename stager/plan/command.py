"""``stager plan``: the planner's command. This slice has ``--dry-run`` only: one
interval against the real squeue (or ``--squeue-output FILE``), printed with its
reasons; the service loop comes with the node services' prefetch endpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from stager.plan.squeue import RecordedSqueue, Squeue, SqueueError
from stager.settings import Settings, cli_flags, describe_error

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="the pre-staging planner: which queued jobs' data would go to which nodes",
        description="Read every pending job once (one squeue call), and for those that "
        "declare data (#STAGER lines, copied by deploy/slurm/job_submit.lua) and that Slurm "
        "plans to start within the horizon, name the datasets that would be staged on "
        "their planned nodes as their user; and why each other job is skipped. "
        "docs/prestaging.md",
    )
    for _, options, keywords in cli_flags("plan"):
        parser.add_argument(*options, **keywords)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run one interval and print what it would do and why (nothing is staged)",
    )
    parser.add_argument(
        "--squeue-output",
        metavar="FILE",
        type=Path,
        help="read this file as squeue's output instead of running squeue (tests; the "
        f"format: squeue {' '.join(Squeue().argv[1:])})",
    )


def run(args: argparse.Namespace) -> int:
    # Here, not at the top: they load stager-client's parser, which `stager serve` needs not.
    from stager.plan import report
    from stager.plan.planner import Planner

    if not args.dry_run:
        print(
            "stager plan: only --dry-run is built so far (docs/prestaging.md, 'What comes "
            "next'); give --dry-run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    given = {"plan_horizon_s": args.plan_horizon_s} if args.plan_horizon_s else {}
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        print(f"stager: {describe_error(exc, given)}", file=sys.stderr)
        return EXIT_USAGE
    if args.squeue_output:
        try:
            source: Squeue = RecordedSqueue(args.squeue_output.read_text())
        except OSError as exc:
            print(f"stager plan: --squeue-output {args.squeue_output}: {exc}", file=sys.stderr)
            return EXIT_USAGE
    else:
        source = Squeue()
    try:
        interval = Planner(source, settings.plan_horizon_s).interval()
    except SqueueError as exc:
        print(f"stager plan: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in report.lines(interval):
        print(line)
    return EXIT_OK
