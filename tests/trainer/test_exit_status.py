"""How a run ended reaches the caller under torchrun: OUTPUT/exit-status.json and its reader.

torchrun exits 1 when a signal stopped it, although every rank saved and exited 75.
Real ``torchrun --nproc-per-node 2`` runs (gloo, CPU, FakeData, tinynet) get SIGTERM
as SLURM sends it, or crash (torchrun stops the other rank), and a 2-rank run completes
(forked from this process: nothing of torchrun's is in it), and ``stager-train
exit-status`` must give back 75, 0 and a broken code. The reader's rule is walked over
every record it can meet.
"""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.conftest import (
    REPO,
    ForkedTrainer,
    finish,
    run_forked_trainer,
    signal_tree,
    start_trainer,
    tiny_args,
    trainer_env,
    wait_for_lines,
)
from trainer import checkpoint, cli
from trainer.exit_status import FILE, STATES, Record, Recorder, outcome, write

LAUNCHER_EXITS = (None, 0, 1, 2, 75, 137)


def _reader_args(out: Path, run_id: str | None, launcher_exit: int | None) -> list[str]:
    args = ["exit-status", "--output-dir", str(out)]
    if run_id is not None:
        args += ["--run-id", run_id]
    if launcher_exit is not None:
        args += ["--launcher-exit", str(launcher_exit)]
    return args


def run_reader(out: Path, run_id: str | None, launcher_exit: int | None = None):
    """``stager-train exit-status`` as a job script runs it (a process of its own)."""
    cmd = [sys.executable, "-m", "trainer", *_reader_args(out, run_id, launcher_exit)]
    return subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True)


def read_status(capsys, out: Path, run_id: str | None, launcher_exit: int | None = None):
    """The same command in this process (no second torch import): (exit code, stderr)."""
    capsys.readouterr()
    try:
        code = cli.main(_reader_args(out, run_id, launcher_exit))
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    return code, capsys.readouterr().err


def _recorded(out: Path) -> dict:
    return json.loads((out / FILE).read_text())


@pytest.mark.parametrize(
    ("status", "same_run", "checkpoint_there", "launcher_exit"),
    list(itertools.product(STATES, (True, False), (True, False), LAUNCHER_EXITS)),
)
def test_only_this_runs_saved_preemption_reads_75_and_only_its_completion_reads_0(
    tmp_path, status, same_run, checkpoint_there, launcher_exit
):
    ckpt = tmp_path / "checkpoints" / "checkpoint-a0001-s0000000000008.pt"
    if checkpoint_there:
        ckpt.parent.mkdir()
        ckpt.write_bytes(b"x")
    record = Record(
        run_id="this" if same_run else "earlier", status=status, epoch=0, iteration=1,
        samples=8, checkpoint="checkpoints/checkpoint-a0001-s0000000000008.pt",
    )  # fmt: skip
    code, sentence = outcome(record, "this", tmp_path, launcher_exit)
    mine = same_run
    assert (code == 75) == (mine and status == "preempted" and checkpoint_there), sentence
    assert (code == 0) == (mine and status == "completed" and launcher_exit in (None, 0))
    if code not in (0, 75) and launcher_exit not in (None, 0, 75):
        assert code == launcher_exit  # a broken run keeps the launcher's own code
    assert "\n" not in sentence and ("this" in sentence)


def test_no_record_reads_broken_and_a_bad_record_names_the_file(tmp_path, capsys):
    assert outcome(None, "r", tmp_path)[0] == 1
    assert outcome(None, "r", tmp_path, launcher_exit=75)[0] == 1
    (tmp_path / FILE).write_text("{not json")
    code, err = read_status(capsys, tmp_path, "r")
    assert code == 1 and str(tmp_path / FILE) in err
    (tmp_path / FILE).write_text('{"status": "done"}')
    code, err = read_status(capsys, tmp_path, "r")
    assert code == 1 and "is not a stager-train exit status" in err
    code, err = read_status(capsys, tmp_path, None)  # no run id: no guess at whose record
    assert code == 2 and "--run-id is required" in err


def test_only_rank_0_writes_and_a_loader_workers_error_is_one_sentence(tmp_path):
    for out, rank0 in ((tmp_path / "rank0", True), (tmp_path / "rank1", False)):
        rec = Recorder(out, "r", enabled=rank0, launcher="torchrun", world_size=2)
        rec.start()
        assert (out / FILE).exists() == rank0
    rec = Recorder(tmp_path / "rank0", "r", enabled=True, launcher="torchrun", world_size=2)
    worker = ValueError(
        "Caught ValueError in DataLoader worker process 0.\nOriginal Traceback (most recent "
        'call last):\n  File "x.py", line 1\nValueError: cannot decode /d/a.jpg; pass '
        "--bad-images skip"
    )
    rec.failed(worker)
    assert (
        _recorded(tmp_path / "rank0")["error"] == "cannot decode /d/a.jpg; pass --bad-images skip"
    )
    rec.failed(KeyboardInterrupt())
    assert _recorded(tmp_path / "rank0")["error"] == "KeyboardInterrupt"


def test_an_earlier_runs_preemption_is_not_this_runs(tmp_path, capsys):
    # The earlier run saved and was preempted; this one dies before rank 0 writes a
    # thing (a bad flag): its reader must not have it resumed as preempted.
    ckpt = tmp_path / "checkpoints" / "checkpoint-a0001-s0000000000008.pt"
    ckpt.parent.mkdir()
    ckpt.write_bytes(b"x")
    write(tmp_path, Record(run_id="earlier", status="preempted", exit_code=75,
                           checkpoint=str(ckpt.relative_to(tmp_path))))  # fmt: skip
    assert read_status(capsys, tmp_path, "earlier")[0] == 75
    bad = run_forked_trainer(
        tiny_args(tmp_path, "--no-such-flag"), env=trainer_env(STAGER_TRAIN_RUN_ID="now")
    )
    assert bad.returncode == 2, bad.stderr
    code, err = read_status(capsys, tmp_path, "now", launcher_exit=bad.returncode)
    assert code == 2 and "records run earlier, not run now" in err


@pytest.mark.slow
def test_torchrun_preempted_completed_and_crashed_runs_read_75_0_and_broken(tmp_path, capsys):
    done_ok, crash = tmp_path / "done", tmp_path / "crash"
    # SIGTERM to torchrun alone (it passes it on, then waits for the ranks), and to
    # torchrun and its ranks at once, as SLURM signals every process of a step.
    cuts = {"torchrun": tmp_path / "cut-torchrun", "tree": tmp_path / "cut-tree"}
    # An earlier run's record in each folder: every run must replace it with its own.
    for out in (*cuts.values(), done_ok, crash):
        write(out, Record(run_id="earlier", status="preempted", exit_code=75))
    launchers = {
        how: start_trainer(
            tiny_args(out, "--epochs", "50", "--no-eval", "--record-samples", str(out / "rec")),
            nproc=2,
            env=trainer_env(STAGER_TRAIN_RUN_ID=f"cut-{how}"),
        )
        for how, out in cuts.items()
    }
    for how, out in cuts.items():
        wait_for_lines(out / "rec" / "inputs-rank0.txt", 3, launchers[how])
        assert _recorded(out)["status"] == "running"
    launchers["torchrun"].send_signal(signal.SIGTERM)
    assert len(signal_tree(launchers["tree"].pid, signal.SIGTERM)) >= 3
    stopped = dict(zip(cuts, finish(list(launchers.values()), timeout=90), strict=True))
    for how, out in cuts.items():
        done = stopped[how]
        assert "preempted at iteration" in done.stderr, done.stderr[-3000:]
        # torchrun's own code: why the record exists (docs/trainer.md says 1).
        assert done.returncode == 1, (how, done.stderr[-3000:])
        record = _recorded(out)
        assert record["run_id"] == f"cut-{how}" and record["launcher"] == "torchrun"
        assert record["status"] == "preempted" and record["exit_code"] == 75
        assert record["world_size"] == 2 and 0 < record["samples"] < 50 * 48
        saved = out / record["checkpoint"]
        assert saved == checkpoint.latest(out / "checkpoints")
        assert checkpoint.load(saved)["position"]["samples"] == record["samples"]
    read = run_reader(cuts["torchrun"], "cut-torchrun", launcher_exit=1)
    assert read.returncode == 75, read.stderr
    assert "checkpoints/checkpoint-" in read.stderr and "--resume" in read.stderr
    assert read_status(capsys, cuts["tree"], "cut-tree", launcher_exit=1)[0] == 75

    # A completed run and a crashing one (no optimizer step fits: ValueError on every rank).
    completing = ForkedTrainer(tiny_args(done_ok, "--epochs", "1", "--no-eval"), nproc=2,
                               env=trainer_env(STAGER_TRAIN_RUN_ID="done-1"))  # fmt: skip
    crashing = start_trainer(tiny_args(crash, "--epochs", "1", "--batch-size", "100",
                                       "--run-id", "crash-1"), nproc=2)  # fmt: skip
    try:
        ok = completing.wait(timeout=90)
    finally:
        (bad,) = finish([crashing], timeout=90)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert _recorded(done_ok)["status"] == "completed"
    assert read_status(capsys, done_ok, "done-1", launcher_exit=0)[0] == 0
    assert bad.returncode not in (0, 75), bad.stderr[-3000:]
    record = _recorded(crash)
    assert record["run_id"] == "crash-1" and record["status"] == "failed"
    assert "lower --batch-size" in record["error"]
    for launcher_exit in (bad.returncode, None):
        code, err = read_status(capsys, crash, "crash-1", launcher_exit=launcher_exit)
        assert code not in (0, 75) and "lower --batch-size" in err, err
