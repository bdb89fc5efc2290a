"""bench/bench_overhead.py --trace finds every point it times: the anchors are lines
of the daemon's code, and a refactor that moves one must move the anchor too."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_trace_point_names_a_line_that_exists() -> None:
    spec = importlib.util.spec_from_file_location(
        "bench_overhead", REPO / "bench" / "bench_overhead.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for relative, anchor, label in module.TRACE_POINTS:
        text = (REPO / relative).read_text()
        assert text.count(anchor) >= 1, (
            f"trace point {label!r}: {anchor.strip()!r} is not in {relative}"
        )
