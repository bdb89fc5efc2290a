"""Preemption with loader workers running, and exact resume, also onto another world size.

One uninterrupted 2-rank run with the modern recipe's random parts on (mixup,
cutmix, TrivialAugment, random erasing, EMA, warmup + cosine) is the
reference. Runs cut by a signal (SIGUSR1 to torchrun alone; SIGTERM to every
process of an srun-style step, loader workers included, as SLURM sends it)
then resumed must match it: bit-identical weights and inputs when resumed
on the same layout, the same LR as a function of samples seen when resumed
on another world size. The signals go through the real launchers (torchrun, an
srun-style step); the runs that no signal reaches from outside (the reference, the
resumes, a cut by --debug-signal-at-iter) are forked from this process
(`ForkedTrainer`): what they compute does not depend on how they were started.
"""

from __future__ import annotations

import csv
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import (
    ForkedTrainer,
    descendants,
    finish,
    finish_forked,
    run_forked_trainer,
    signal_tree,
    start_srun_trainer,
    start_trainer,
    tiny_args,
    trainer_env,
    wait_for_lines,
)
from trainer import checkpoint
from trainer.optim import Schedule

pytestmark = pytest.mark.slow

N, EPOCHS, LR = 96, 2, 0.1
SCHEDULE = Schedule("cosine", total=EPOCHS, warmup=0.5, warmup_decay=0.01)
# A torchvision model with BatchNorm (running statistics to carry across the cut, in
# the EMA too) and no dropout to draw: what exactness is about. resnet18's 11M
# parameters cost an all-reduce of 45 MB per step and 135 MB checkpoints for nothing.
RECIPE = [
    "--arch", "shufflenet_v2_x0_5", "--fake-size", str(N), "--fake-image-size", "32",
    "--crop-size", "32", "--val-resize-size", "32", "--epochs", str(EPOCHS), "--workers", "1",
    "--lr", str(LR),
    "--lr-warmup-epochs", "0.5", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0",
    "--auto-augment", "ta_wide", "--random-erase", "0.5", "--label-smoothing", "0.1",
    "--model-ema", "--model-ema-steps", "2", "--no-eval", "--print-freq", "1",
]  # fmt: skip
# torchrun dies of SIGUSR1 unless told to handle it (and then passes it on to the ranks).
TORCHRUN_USR1 = ("--signals-to-handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")


def _args(out: Path, *extra: str) -> list[str]:
    return tiny_args(out, *RECIPE, "--record-samples", str(out / "rec"), *extra)


def _final(out: Path) -> dict:
    return checkpoint.load(checkpoint.latest(out / "checkpoints"))


def _inputs(out: Path, rank: int) -> dict[int, list[str]]:
    """Samples seen -> digests of the micro-batches that started there."""
    found: dict[int, list[str]] = {}
    for line in (out / "rec" / f"inputs-rank{rank}.txt").read_text().splitlines():
        samples, digest = line.split()
        found.setdefault(int(samples), []).append(digest)
    return found


def _steps(out: Path) -> list[dict[str, str]]:
    with open(out / "train_steps.csv") as f:
        return list(csv.DictReader(f))


def _fake_scontrol(tmp_path: Path) -> dict[str, str]:
    """PATH with an scontrol that records how the trainer asked for a requeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "scontrol.log"
    script = f'#!/bin/sh\nif [ "$1" = requeue ]; then echo "$@" >> {log}; exit 0; fi\nexit 1\n'
    (bin_dir / "scontrol").write_text(script)  # other subcommands fail: the trainer copes
    (bin_dir / "scontrol").chmod(0o755)
    return {"PATH": f"{bin_dir}:{trainer_env()['PATH']}"}


@pytest.fixture(scope="module", autouse=True)
def reference_run(tmp_path_factory) -> Iterator[tuple[Path, ForkedTrainer]]:
    """The uninterrupted run, started with the module: the tests that do not compare
    with it (first in this file) run meanwhile; its result does not depend on timing."""
    out = tmp_path_factory.mktemp("reference")
    log = tmp_path_factory.mktemp("reference-log") / "trainer.log"
    run = ForkedTrainer(_args(out), nproc=2, stdout=log)  # a file: nothing reads it meanwhile
    try:
        yield out, run
    finally:
        run.wait()


@pytest.fixture
def reference(reference_run) -> Path:
    out, run = reference_run
    done = run.wait()
    assert done.returncode == 0, done.stdout[-3000:]
    return out


def assert_same_weights(a: Path, b: Path) -> None:
    x, y = _final(a), _final(b)
    assert x["position"] == y["position"]
    for part in ("model", "model_ema"):
        assert x[part].keys() == y[part].keys()
        for key, value in x[part].items():
            assert torch.equal(value, y[part][key]), (part, key)


def assert_lr_follows_samples(*outs: Path) -> None:
    """Every logged LR is the schedule's value at that point, counted in samples."""
    rows = [row for out in outs for row in _steps(out)]
    assert rows
    for row in rows:
        progress = int(row["epoch"]) + int(row["samples_in_epoch"]) / N
        assert float(row["lr"]) == pytest.approx(LR * SCHEDULE.factor(progress), rel=1e-9), row


def assert_each_sample_once_per_epoch(rec: Path, global_batch: int) -> None:
    lines = [line.split() for f in rec.glob("samples-rank*.txt") for line in open(f)]
    seen = Counter((int(e), int(i)) for e, i in lines)
    for epoch in range(EPOCHS):
        ids = [i for (e, i), n in seen.items() if e == epoch for _ in range(n)]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: a sample twice"
        assert N - len(ids) < global_batch, f"epoch {epoch}: {N - len(ids)} samples missing"


def test_sigterm_to_every_process_of_an_srun_step_then_resume(tmp_path):
    # What SLURM does at the time limit or on scancel: SIGTERM to every process
    # of the step, loader workers included.
    cut = tmp_path / "cut"
    procs = start_srun_trainer(_args(cut), **_fake_scontrol(tmp_path))
    wait_for_lines(cut / "rec" / "inputs-rank0.txt", 3, procs[0])
    for proc in procs:
        assert len(signal_tree(proc.pid, signal.SIGTERM)) >= 2  # a rank and its worker
    done = finish(procs)
    assert [d.returncode for d in done] == [75, 75], done[0].stderr[-3000:]
    assert "preempted at iteration" in done[0].stderr
    assert "Traceback" not in done[0].stderr + done[1].stderr
    requeued = (tmp_path / "scontrol.log").read_text().splitlines()
    assert len(requeued) == 1 and requeued[0].startswith("requeue ")  # rank 0 alone, once
    assert len(checkpoint.entries(cut / "checkpoints")) >= 1

    resumed = run_forked_trainer([*_args(cut), "--resume"], nproc=1)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_lr_follows_samples(cut)
    assert_each_sample_once_per_epoch(cut / "rec", global_batch=8)


def test_one_rank_cut_resumed_on_two_ranks(tmp_path):
    out = tmp_path / "run"
    first = run_forked_trainer([*_args(out), "--debug-signal-at-iter", "5"], nproc=1)
    assert first.returncode == 75, first.stderr[-3000:]
    assert _final(out)["position"]["samples"] == 20
    resumed = run_forked_trainer([*_args(out), "--resume"], nproc=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # Epoch 0 goes on after sample 20 in steps of 8: 9 more steps, and a tail of 4
    # that fills no step on two ranks is left out.
    assert "epoch 0 continues after its first 20 samples" in resumed.stderr
    assert_lr_follows_samples(out)
    assert_each_sample_once_per_epoch(out / "rec", global_batch=8)


def test_ranks_draw_different_augmentations(reference):
    rank0, rank1 = _inputs(reference, 0), _inputs(reference, 1)
    assert rank0.keys() == rank1.keys() and len(rank0) == EPOCHS * N // 8
    assert all(rank0[s] != rank1[s] for s in rank0)  # every micro-batch differs across ranks
    assert_lr_follows_samples(reference)
    final = _final(reference)
    assert any(
        not torch.equal(value, final["model_ema"][f"module.{key}"])
        for key, value in final["model"].items()
    )


def test_usr1_to_torchrun_with_workers_then_resume_is_exact(reference, tmp_path):
    cut = tmp_path / "cut"
    launcher = start_trainer(
        _args(cut), nproc=2, torchrun=TORCHRUN_USR1,
        env=trainer_env(SLURM_JOB_ID="4242", **_fake_scontrol(tmp_path)),
    )  # fmt: skip
    wait_for_lines(cut / "rec" / "inputs-rank0.txt", 3, launcher)
    tree = descendants(launcher.pid)  # both ranks and their loader workers
    assert len(tree) >= 4
    launcher.send_signal(signal.SIGUSR1)  # torchrun only, as a user's `kill -USR1` would
    (done,) = finish([launcher])
    assert "preempted at iteration" in done.stderr, done.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text().split() == ["requeue", "4242"]
    # What ends with the ranks (a resource tracker sees their pipes close) may take a
    # moment more to be reaped; nothing may outlive that.
    deadline = time.monotonic() + 10
    while (left := [pid for pid in tree if Path(f"/proc/{pid}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    assert not left, "processes left behind"
    saved = _final(cut)["position"]
    assert 0 < saved["samples"] < EPOCHS * N
    one = tmp_path / "onto-one-rank"
    shutil.copytree(cut, one)

    # Resumed on the same layout, and the same checkpoint onto one rank, side by side
    # (what either computes does not depend on timing).
    runs = [ForkedTrainer([*_args(cut), "--resume"], nproc=2),
            ForkedTrainer([*_args(one), "--resume"], nproc=1)]  # fmt: skip
    resumed, done = finish_forked(runs)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"sample {saved['samples']}" in resumed.stderr
    assert_same_weights(reference, cut)
    for rank in (0, 1):  # every augmentation and mixing draw, before and after the cut
        assert _inputs(cut, rank) == _inputs(reference, rank)

    # On one rank the schedule goes on in samples.
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 2, batch 4, accumulation 1; now 1, 4, 1" in done.stderr
    assert_lr_follows_samples(one)
    assert_each_sample_once_per_epoch(one / "rec", global_batch=8)
