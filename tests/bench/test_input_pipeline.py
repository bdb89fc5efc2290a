"""bench/input_pipeline.py and bench/read_roots.py run (at a smoke size): a benchmark
that rots reports nothing."""

from __future__ import annotations

import json

from bench import input_pipeline, read_roots
from bench.jpegs import make_jpegs


def test_input_pipeline_bench_runs_every_pipeline_and_stage(tmp_path, capsys):
    assert input_pipeline.main(["--quick", "--root", str(tmp_path / "jpegs"),
                                "--num-files", "32", "--images", "32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for name in (*input_pipeline.PIPELINES, "decode", "augment", "seed", "collate"):
        assert name in out
    assert "predicted from stages" in out and "measured end to end" in out


def test_read_roots_reads_each_root_with_the_trainers_pipeline(tmp_path, capsys):
    """bench/read_roots.py (bench_squash_user's train section): one rate per run per
    root, as JSON, each root read by the trainer's own pipeline."""
    a = make_jpegs(tmp_path / "a", 32)
    b = make_jpegs(tmp_path / "b", 32)
    argv = [str(a), str(b), "--repeats", "2", "--images", "16", "--batch-size", "8",
            "--workers", "1"]  # fmt: skip
    assert read_roots.main(argv) == 0
    said = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert said["workers"] == 1
    assert set(said["rates"]) == {str(a), str(b)}
    assert all(len(runs) == 2 and min(runs) > 0 for runs in said["rates"].values())
