"""A site's own op, loaded by a daemon through ``STAGER_OP_MODULES``: the op table
is the only place an op is declared, so this module is all it takes."""

from __future__ import annotations

import os

from stager.core.errors import BadRequest
from stager.ops.base import CheckContext, OpContext, RelativePath, StepParams
from stager.ops.table import Op


class ToyStep(StepParams):
    """Write ``text`` into a file of the dataset."""

    dst: RelativePath
    text: str


def check(step: ToyStep, ctx: CheckContext) -> int:
    if not step.text:
        raise BadRequest("toy step: 'text' is empty; give the file some text")
    return len(step.text.encode())


# A bug in an op, on demand: what the client and the daemon log say of it is tested.
BUG = "raise a bug"


def run(step: ToyStep, ctx: OpContext) -> None:
    if step.text == BUG:
        raise ZeroDivisionError("a bug in an op, with a secret path /home/alice/secret")
    target = ctx.destination(step.dst)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = step.text.encode()
    ctx.progress.add_total(len(data), 1)
    with open(target, "wb") as out:
        out.write(data)
        os.fsync(out.fileno())
    ctx.progress.advance(len(data), 1)


OPS = [Op("toy", ToyStep, check, run, verify=frozenset({"none", "size"}))]
