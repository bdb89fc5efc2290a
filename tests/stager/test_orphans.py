"""What a starting daemon finds that no entry owns is moved aside at once (so a new
staging of the same key starts in a fresh folder) and deleted afterwards."""

from __future__ import annotations

from pathlib import Path

from stager import preflight
from stager.dataset import Entry
from stager.engine import Engine
from stager.metrics import Metrics
from stager.schemas import State
from stager.settings import Settings
from tests.trees import write_tree


def entry(key: str, state: State) -> Entry:
    return Entry(key=key, spec={}, steps=[], verify="size", state=state)


def test_orphans_leave_their_keys_names_before_deletion(tmp_path: Path) -> None:
    settings = Settings(cache_dir=tmp_path / "cache", runtime_dir=tmp_path / "run")
    preflight.ensure_dirs(settings)
    engine = Engine(settings, Metrics())
    engine._entries = {  # what the state store loaded
        "a" * 24: entry("a" * 24, State.EVICTED),  # partial data a failed cleanup left
        "b" * 24: entry("b" * 24, State.STAGING),  # interrupted: resumed, kept
        "c" * 24: entry("c" * 24, State.READY),  # published: kept
        "d" * 24: entry("d" * 24, State.EVICTED),  # eviction recorded, tree not yet moved
    }
    partial, data = settings.partial_dir, settings.data_dir
    for folder in (
        partial / ("a" * 24),
        partial / ("b" * 24),
        data / ("c" * 24),
        data / ("d" * 24),
    ):
        write_tree(folder, n_files=3)
    (partial / f"{'a' * 24}.steps-done").write_text("1")
    write_tree(partial / f"discarded-{'e' * 24}-0123abcd", n_files=3)

    orphans = engine._orphans()

    assert sorted(p.parent for p in orphans) == [partial] * 4
    assert all(p.name.startswith("discarded-") and p.exists() for p in orphans)
    assert sorted(p.name for p in partial.iterdir() if not p.name.startswith("discarded-")) == [
        "b" * 24
    ]
    assert [p.name for p in data.iterdir()] == ["c" * 24]
