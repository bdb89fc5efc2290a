"""A job's declaration as the planner reads it: job_submit.lua's AdminComment value,
decoded, each line parsed by stager-client's own stage parser (client/declare.py)
into the request body the job itself will send, so a prefetch is the job's cache hit.

The planner (controller side) imports the client, not the daemon: it is a client of
the node services. Parsing is memoized by the comment's text: a job's AdminComment
does not change, and the same declaration recurs across jobs and intervals.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from client import cli, declare

MARK = "stager1:"  # deploy/slurm/job_submit.lua writes this, then the lines joined by ";"
_ESCAPED = re.compile(r"%([0-9A-Fa-f]{2})")
MEMO_MAX = 50_000  # distinct comments kept parsed; dropped wholesale past it


@dataclass(frozen=True, order=True)
class Wanted:
    """One dataset a job declares: its name and the body the planner sends."""

    name: str
    body: str  # canonical JSON of the POST body (hashable, comparable across intervals)

    def request(self) -> dict:
        return json.loads(self.body)


def encode(words: list[str]) -> str:
    """What job_submit.lua writes for these lines (tests, and its specification)."""
    escaped = (re.sub(r"[%;|\x00-\x1f\x7f]", lambda m: f"%{ord(m.group()):02X}", w) for w in words)
    return MARK + ";".join(escaped)


def lines(admin_comment: str) -> list[str] | None:
    """The declaration lines, or None when the comment is not job_submit.lua's."""
    if not admin_comment.startswith(MARK):
        return None
    encoded = admin_comment[len(MARK) :]
    return [_ESCAPED.sub(lambda m: chr(int(m.group(1), 16)), item) for item in encoded.split(";")]


class Declarations:
    """admin_comment -> the datasets it declares (or the sentence saying why not)."""

    def __init__(self) -> None:
        self.parser = cli.stage_parser()
        self.memo: dict[str, tuple[tuple[Wanted, ...], str | None]] = {}

    def read(self, admin_comment: str) -> tuple[tuple[Wanted, ...], str | None]:
        """(datasets, None), or ((), why none can be pre-staged)."""
        found = self.memo.get(admin_comment)
        if found is None:
            if len(self.memo) >= MEMO_MAX:
                self.memo.clear()
            found = self.memo[admin_comment] = self._parse(admin_comment)
        return found

    def _parse(self, admin_comment: str) -> tuple[tuple[Wanted, ...], str | None]:
        words = lines(admin_comment)
        if words is None:
            return (), "its AdminComment is not a #STAGER declaration"
        script = "\n".join(f"{declare.MARK} {line}" for line in words)
        try:
            parsed = declare.parse_script(script, self.parser, where="#STAGER line")
            bodies = [declare.planned_request(item, cli.request_from) for item in parsed]
        except (declare.BadDeclaration, cli.UsageError) as exc:
            return (), f"bad declaration: {exc}"
        wanted = tuple(
            Wanted(item.name, json.dumps(body, sort_keys=True, separators=(",", ":")))
            for item, body in zip(parsed, bodies, strict=True)
        )
        return wanted, None
