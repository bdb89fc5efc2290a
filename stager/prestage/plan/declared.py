"""A job's declaration as the planner reads it: job_submit.lua's AdminComment value,
decoded, each line parsed by stager-client's own stage parser (client/declare.py)
into the request body the job itself will send, so a prefetch is the job's cache hit.

The planner (controller side) imports the client, not the daemon: it is a client of
the node services. Parsing is memoized by the comment's text: a job's AdminComment
does not change, and the same declaration recurs across jobs and intervals.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import urllib.parse
from dataclasses import dataclass

from client import cli, declare

log = logging.getLogger(__name__)

MARK = "stager1:"  # deploy/slurm/job_submit.lua writes this, then the lines joined by ";"
MEMO_MAX = 50_000  # distinct comments kept parsed (the least recently used go past it)


@dataclass(frozen=True, order=True)
class Wanted:
    """One dataset a job declares: its name and the body the planner sends."""

    name: str
    body: str  # canonical JSON of the POST body (hashable, comparable across intervals)

    def request(self) -> dict:
        return json.loads(self.body)


def encode(words: list[str]) -> str:
    """What job_submit.lua writes for these lines (tests, and its specification): the
    script's bytes, with "%", ";", "|", control bytes and every byte past ASCII as %XX,
    so the value is one ASCII line of squeue's output whatever the script holds."""
    escaped = (
        re.sub(rb"[%;|\x00-\x1f\x7f-\xff]", lambda m: b"%%%02X" % m.group()[0], w.encode())
        for w in words
    )
    return MARK + ";".join(item.decode("ascii") for item in escaped)


def lines(admin_comment: str) -> list[str] | None:
    """The declaration lines, or None when the comment is not job_submit.lua's."""
    if not admin_comment.startswith(MARK):
        return None
    encoded = admin_comment[len(MARK) :]
    # Back to the script's bytes, read as the job's own client reads its script (UTF-8).
    return [
        urllib.parse.unquote_to_bytes(item).decode("utf-8", "surrogateescape")
        for item in encoded.split(";")
    ]


class Declarations:
    """admin_comment -> the datasets it declares (or the sentence saying why not)."""

    def __init__(self) -> None:
        self.parser = cli.stage_parser()
        self.read = functools.lru_cache(maxsize=MEMO_MAX)(self.parse)  # the planner's

    def parse(self, admin_comment: str) -> tuple[tuple[Wanted, ...], str | None]:
        """(datasets, None), or ((), why none can be pre-staged); not memoized (the node
        service checks users' words with it)."""
        words = lines(admin_comment)
        if words is None:
            return (), "its AdminComment is not a #STAGER declaration"
        script = "\n".join(f"{declare.MARK} {line}" for line in words)
        try:
            parsed = declare.parse_script(script, self.parser, where="#STAGER line")
            bodies = [declare.planned_request(item, cli.request_from) for item in parsed]
        except (declare.BadDeclaration, cli.UsageError) as exc:
            return (), f"bad declaration: {exc}"
        except Exception as exc:  # noqa: BLE001
            # A user writes these lines: whatever one job's make the parser do, it must
            # cost that job its pre-staging, never every job's interval. Logged whole,
            # since it is a bug of the parser's to mend.
            log.exception("the #STAGER lines %r could not be read", words)
            return (), f"its declaration could not be read ({type(exc).__name__})"
        wanted = tuple(
            Wanted(item.name, json.dumps(body, sort_keys=True, separators=(",", ":")))
            for item, body in zip(parsed, bodies, strict=True)
        )
        return wanted, None
