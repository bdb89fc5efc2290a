"""Staging operations, one module each; ``run_step`` dispatches on ``step.op``."""

from __future__ import annotations

import importlib
from typing import Any

from stager.ops.base import OpContext


def _module(op: str) -> Any:
    # Imported on first use so that importing one op does not import the others' deps.
    return importlib.import_module(f"stager.ops.{op}")


def check_step(step: Any) -> int:
    """Fast pre-flight of one step's inputs; returns the bytes it is expected to write."""
    return _module(step.op).check(step)


def run_step(step: Any, ctx: OpContext) -> None:
    _module(step.op).run(step, ctx)
