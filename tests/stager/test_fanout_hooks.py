"""The engine reaches the daemon's fan-out only through its owner's named hooks
(stager/fanout/room.py, docs/architecture.md): nothing of the fan-out's books is read
or changed from the engine, and no other fan-out module is imported by it."""

from __future__ import annotations

import ast
from pathlib import Path

import stager

ENGINE = Path(stager.__file__).parent / "engine" / "scheduler.py"
HOOKS = {
    "clear_deliveries",  # the start: deliveries an earlier run left, deleted by their owners
    "arrival",  # a request: what it stages, and from where
    "held",  # admission: promised bytes, keys being packed
    "exporting",  # eviction: keys being packed
    "admitted",  # the request decided: its delivery claimed or released
    "staging_starts",  # where an adopting staging may read
    "staging_ends",  # the delivery it read, to be removed
    "export",  # the next part of a dataset to send
    "source_files",  # a probe: what could be broadcast as it is
    "expire",  # the sweep: transfers past their time
}


def fanout_uses(tree: ast.AST) -> set[str]:
    """Every ``self.fanout.NAME`` in the engine."""
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "fanout"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }


def test_the_engine_calls_the_fanout_room_through_its_hooks_only() -> None:
    tree = ast.parse(ENGINE.read_text())
    used = fanout_uses(tree)
    assert used, "the engine no longer reaches the fan-out as self.fanout: update this test"
    assert used <= HOOKS, f"the engine reaches past the fan-out's hooks: {sorted(used - HOOKS)}"
    imported = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and "fanout" in node.module
    }
    assert imported == {"stager.fanout.room"}


def test_the_check_sees_a_reach_past_the_hooks() -> None:
    assert fanout_uses(ast.parse("self.fanout.deliveries.pop(label)")) == {"deliveries"}
