"""bench/input_pipeline.py runs (at a smoke size): a benchmark that rots reports nothing."""

from __future__ import annotations

from bench import input_pipeline


def test_input_pipeline_bench_runs_every_pipeline_and_stage(tmp_path, capsys):
    assert input_pipeline.main(["--quick", "--root", str(tmp_path / "jpegs"),
                                "--num-files", "32", "--images", "32"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    for name in (*input_pipeline.PIPELINES, "decode", "augment", "seed", "collate"):
        assert name in out
    assert "predicted from stages" in out and "measured end to end" in out
