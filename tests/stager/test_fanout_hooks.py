"""The engine reaches the daemon's fan-out only through its owner's named hooks
(stager/fanout/room.py, docs/architecture.md): nothing of the fan-out's books is read
or changed from the engine's modules (the staging loop, its jobs, requests and names),
and no other fan-out module is imported by them."""

from __future__ import annotations

import ast
from pathlib import Path

import stager

ENGINE = [
    Path(stager.__file__).parent / "engine" / f"{name}.py"
    for name in ("scheduler", "job", "requests", "names")
]
HOOKS = {
    "clear_deliveries",  # the start: deliveries an earlier run left, deleted by their owners
    "holding",  # whether it holds any transfer: admission asks the next two only then
    "arrival",  # an adoption: what it stages, and from where
    "held",  # admission: promised bytes, keys being packed
    "exporting",  # eviction: keys being packed
    "admitted",  # the adoption decided: its delivery claimed or released
    "staging_starts",  # where an adopting staging may read
    "staging_ends",  # the delivery it read, to be removed
    "export",  # the next part of a dataset to send
    "source_files",  # a probe: what could be broadcast as it is
    "expire",  # the sweep: transfers past their time
}


def fanout_uses(tree: ast.AST) -> set[str]:
    """Every ``fanout.NAME`` and ``<anything>.fanout.NAME`` in ``tree``."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and (
            (isinstance(node.value, ast.Attribute) and node.value.attr == "fanout")
            or (isinstance(node.value, ast.Name) and node.value.id == "fanout")
        )
    }


def engine_fanout_uses() -> set[str]:
    return set().union(*(fanout_uses(ast.parse(path.read_text())) for path in ENGINE))


def test_the_engine_calls_the_fanout_room_through_its_hooks_only() -> None:
    used = engine_fanout_uses()
    assert used, "the engine no longer reaches the fan-out as .fanout: update this test"
    assert used <= HOOKS, f"the engine reaches past the fan-out's hooks: {sorted(used - HOOKS)}"
    imported = {
        node.module
        for path in ENGINE
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and "fanout" in node.module
    }
    assert imported == {"stager.fanout.room"}


def test_the_check_sees_a_reach_past_the_hooks() -> None:
    assert fanout_uses(ast.parse("self.fanout.deliveries.pop(label)")) == {"deliveries"}
    assert fanout_uses(ast.parse("fanout.plans.clear()")) == {"plans"}
