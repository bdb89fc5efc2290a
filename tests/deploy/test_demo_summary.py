"""`make demo`'s last lines: the training summary, or a line saying why there is none."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

RUN_PY = Path(__file__).resolve().parents[2] / "deploy" / "demo" / "run.py"
HEADER = "epoch,iteration,train_loss,top1,top5,count,img_s_mean,lr"


@pytest.fixture(scope="module")
def epoch_summary():
    # deploy/demo is a script folder, not a package: load run.py by its path.
    spec = importlib.util.spec_from_file_location("demo_run", RUN_PY)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._epoch_summary


def test_the_last_epoch_in_one_line(epoch_summary, tmp_path: Path) -> None:
    csv = tmp_path / "epochs.csv"
    csv.write_text(f"{HEADER}\n0,10,2.5,0.1,0.5,128,90.0,0.05\n0,20,2.25,0.25,0.75,128,99.6,0.05\n")
    assert epoch_summary(csv) == (
        "epoch 0: train loss 2.250, val top-1 25.0% (top-5 75.0%, 128 images), 100 img/s"
    )


def test_no_epochs_csv_says_where_it_looked(epoch_summary, tmp_path: Path) -> None:
    csv = tmp_path / "train" / "epochs.csv"
    assert epoch_summary(csv) == f"no training summary at {csv} (No such file or directory)"


def test_missing_columns_are_named_not_a_key_error(epoch_summary, tmp_path: Path) -> None:
    csv = tmp_path / "epochs.csv"
    csv.write_text("epoch,train_loss,img_s_mean\n0,2.5,90\n")  # e.g. trained with no val split
    assert epoch_summary(csv) == (
        f"no training summary at {csv} (its last row has no top1, top5, count)"
    )


@pytest.mark.parametrize("text", ["", f"{HEADER}\n"])
def test_no_epoch_logged(epoch_summary, tmp_path: Path, text: str) -> None:
    csv = tmp_path / "epochs.csv"
    csv.write_text(text)
    assert epoch_summary(csv) == f"no training summary at {csv} (no epoch was logged)"
