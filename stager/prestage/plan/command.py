"""``stager plan``: the planner's command. Without flags, the service
(stager.prestage.plan.service): an interval every ``plan_interval_s`` until SIGTERM,
each change an order to its node; ``--once`` one such interval; ``--dry-run`` one
interval printed with its reasons, nothing sent. Against the real squeue, or
``--squeue-output FILE`` (read at each interval)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from stager.core.settings import Settings, cli_flags, describe_error
from stager.prestage.plan.squeue import RecordedSqueue, Squeue, SqueueError

if TYPE_CHECKING:
    from stager.prestage.plan.planner import Planner

log = logging.getLogger("stager.prestage.plan")

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def add_parser(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "plan",
        help="the pre-staging planner: queued jobs' data staged on their planned nodes",
        description="Every interval, read every pending job once (one squeue call), and "
        "for those that declare data (#STAGER lines, copied by deploy/slurm/job_submit.lua) "
        "and that Slurm plans to start within the horizon, have the node services of their "
        "planned nodes stage it as their user (re-targeted when the plan moves, cancelled "
        "when the job goes). Runs as root or SlurmUser, until SIGTERM. --dry-run prints "
        "what one interval would do and why each other job is skipped. docs/prestaging.md",
    )
    for _, options, keywords in cli_flags("plan"):
        parser.add_argument(*options, **keywords)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run one interval and print what it would do and why (nothing is staged)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="run one interval for real, sending its orders, then exit (1 if any order "
        "was not carried out)",
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
    from stager.prestage.plan import report
    from stager.prestage.plan.planner import Planner

    given = {
        name: getattr(args, name)
        for name, _, _ in cli_flags("plan")
        if getattr(args, name) is not None
    }
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        print(f"stager: {describe_error(exc, given)}", file=sys.stderr)
        return EXIT_USAGE
    if args.squeue_output and not args.squeue_output.is_file():
        print(f"stager plan: --squeue-output {args.squeue_output}: no such file", file=sys.stderr)
        return EXIT_USAGE
    source = RecordedSqueue(args.squeue_output) if args.squeue_output else Squeue()
    planner = Planner(source, settings.plan_horizon_s, targets_max=settings.plan_job_targets_max)
    if not args.dry_run:
        return serve(planner, settings, once=args.once)
    try:
        interval = planner.interval()
    except SqueueError as exc:
        print(f"stager plan: {exc}", file=sys.stderr)
        return EXIT_FAILED
    for line in report.lines(interval):
        print(line)
    return EXIT_OK


def serve(planner: Planner, settings: Settings, once: bool) -> int:
    """The service: intervals until SIGTERM (or one, ``once``), as root or SlurmUser."""
    from stager.prestage.plan.service import Sender, Service
    from stager.prestage.prefetch.authority import signed_by_slurm

    if os.geteuid() not in signed_by_slurm(settings):
        print(
            f"stager plan: runs as root or SlurmUser ({settings.slurm_user}, "
            f"STAGER_SLURM_USER), not uid {os.geteuid()}: node services would refuse its "
            "credentials; start it from deploy/systemd/stager-plan.service, or give --dry-run",
            file=sys.stderr,
        )
        return EXIT_USAGE
    logging.basicConfig(level=logging.INFO, format="stager plan: %(message)s", stream=sys.stderr)
    # httpx logs each request at INFO: one line per order would bury the planner's own
    # lines (what it ordered and why) at thousands of jobs.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    mapped = f", addresses {','.join(settings.plan_node_addresses)}"
    log.info(
        "planning every %g s, horizon %g s, orders to each node's port %d%s",
        settings.plan_interval_s,
        settings.plan_horizon_s,
        settings.plan_node_port,
        mapped if settings.plan_node_addresses else "",
    )

    async def main() -> int:
        service = Service(planner, Sender(settings), settings.plan_state_path)
        return await service.run(settings.plan_interval_s, once)

    return asyncio.run(main())
