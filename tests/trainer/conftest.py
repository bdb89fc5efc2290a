"""Helpers for trainer tests: tiny on-disk datasets and real multi-process launches."""

from __future__ import annotations

import atexit
import functools
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import descendants

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# iNat 2021 folder names: "<id:05d>_<kingdom>_<phylum>_<class>_<order>_<family>_<genus>_<species>".
INAT_TAXA = [
    ("Animalia", "Chordata", "Aves", "Passeriformes", "Corvidae", "Corvus", "corax"),
    ("Animalia", "Chordata", "Aves", "Passeriformes", "Paridae", "Parus", "major"),
    ("Animalia", "Arthropoda", "Insecta", "Coleoptera", "Cleridae", "Trichodes", "apiarius"),
    ("Plantae", "Tracheophyta", "Magnoliopsida", "Rosales", "Rosaceae", "Rosa", "canina"),
]
COLORS = [(220, 40, 40), (40, 200, 40), (40, 40, 220), (220, 220, 40)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_jpeg(path: Path, color: tuple[int, int, int], seed: int, size=(40, 30)) -> None:
    """A class-coloured image with noise: learnable through any crop, unlike FakeData's noise."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    arr = np.clip(rng.normal(color, 40, size=(size[1], size[0], 3)), 0, 255).astype("uint8")
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(arr).save(path, quality=90)


def make_inat2021(root: Path, version: str = "2021_train", per_class: int = 8, seed: int = 0):
    for c, taxa in enumerate(INAT_TAXA):
        folder = root / version / "_".join((f"{c:05d}", *taxa))
        for i in range(per_class):
            write_jpeg(folder / f"{c}-{i:04d}.jpg", COLORS[c], seed * 10_000 + c * 100 + i)
    return root


def make_imagefolder(root: Path, split: str, per_class: int = 5, seed: int = 0) -> Path:
    for c in range(3):
        for i in range(per_class):
            path = root / split / f"class{c}" / f"img{i:03d}.jpg"
            write_jpeg(path, COLORS[c], seed + c * 100 + i)
    return root


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    for key in list(env):  # a stray launcher variable would make the child half-distributed
        if key.startswith(("SLURM_", "TORCHELASTIC_")) or key in (
            "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        ):  # fmt: skip
            env.pop(key)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@functools.cache
def torchrun_logs() -> Path:
    """Where this test process's torchruns keep their logs, removed at its exit: without
    ``--log-dir`` each torchrun makes a /tmp/torchelastic_* that nothing removes."""
    folder = Path(tempfile.mkdtemp(prefix="torchrun-logs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def trainer_command(args: list[str], nproc: int = 1, torchrun: tuple[str, ...] = ()) -> list[str]:
    """``python -m trainer ARGS`` or ``torchrun --nproc-per-node N [TORCHRUN] -m trainer ARGS``."""
    if nproc == 1:
        return [sys.executable, "-m", "trainer", *args]
    return [
        str(BIN / "torchrun"), "--nproc-per-node", str(nproc),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "--log-dir", str(torchrun_logs()), *torchrun,
        "-m", "trainer", *args,
    ]  # fmt: skip


def start_trainer(
    args: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
    torchrun: tuple[str, ...] = (),
) -> subprocess.Popen:
    """``run_trainer``'s launch, left running (for runs that go on side by side)."""
    return subprocess.Popen(
        trainer_command(args, nproc, torchrun), cwd=cwd, env=env or trainer_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def run_trainer(
    args: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 240,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        trainer_command(args, nproc), cwd=cwd, env=env or trainer_env(), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and everything below it, as SLURM signals a job step."""
    targets = [pid, *descendants(pid)]
    for target in targets:
        try:
            os.kill(target, sig)
        except ProcessLookupError:
            pass
    return targets


def wait_for_lines(path: Path, count: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``path`` has ``count`` lines (training is under way); fails if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        if proc.poll() is not None:
            raise AssertionError(
                f"the trainer ended (exit {proc.returncode}) before {path} "
                f"had {count} lines:\n{proc.stderr.read() if proc.stderr else ''}"
            )
        time.sleep(0.01)
    raise AssertionError(f"{path} did not reach {count} lines in {timeout}s")


def free_slurm_job_id() -> str:
    """A job id whose derived rendezvous port (`slurm_port`) is free right now."""
    from trainer.distributed import SLURM_PORT_SPAN, slurm_port

    for job in random.sample(range(1, SLURM_PORT_SPAN), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", slurm_port(str(job))))
            except OSError:
                continue
            return str(job)
    raise RuntimeError("no free port in the SLURM port range")


def start_srun_trainer(
    args: list[str], ntasks: int = 2, **extra_env: str
) -> list[subprocess.Popen]:
    """What ``srun --ntasks N python -m trainer ARGS`` starts: N processes, step variables only."""
    job = free_slurm_job_id()
    procs = []
    for rank in range(ntasks):
        env = trainer_env(
            SLURM_JOB_ID=job, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            SLURM_STEP_NUM_TASKS=str(ntasks), SLURM_STEP_NODELIST="localhost",
            SLURM_STEP_TASKS_PER_NODE=str(ntasks), **extra_env,
        )  # fmt: skip
        cmd = [sys.executable, "-m", "trainer", *args]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def run_srun_trainer(
    args: list[str], ntasks: int = 2, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    return finish(start_srun_trainer(args, ntasks), timeout)


def fork_ranks(fn: Callable[..., None], args: tuple, nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, as ``torch.multiprocessing.spawn``
    runs it (an error in one is raised here), but forked from this test process: a
    spawned one starts a new interpreter that imports torch, torchvision, the trainer
    and the test's module again before its first line (3-5 s of CPU each), where a
    fork starts with them imported. The ranks are processes of their own either way,
    each with its own gloo group member. Whatever stops the wait (pytest-timeout's
    alarm, ^C), no rank outlives it: a hung rank, non-daemonic, would otherwise run on
    and hold the test process's exit (multiprocessing joins it there)."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="fork")
    try:
        while not ranks.join():
            pass
    finally:
        for rank in ranks.processes:
            if rank.is_alive():
                rank.kill()
            rank.join()


class ForkedTrainer:
    """``python -m trainer ARGS`` (or N ranks of it, with torchrun's rank variables),
    for runs whose claim is the trainer's, not a launcher's: each rank is forked by
    the loaders' forkserver (`trainer.data.loader_context`, one per test process),
    which has torch and torchvision imported; a new interpreter imports them again
    (3-5 s of CPU each), and torchrun is one more. Not forked from the test process:
    what its torch did (autograd's threads) can leave a fork unable to train. Every
    rank writes to the same two files, as torchrun's ranks write to its stdout and
    stderr; its own loader workers come from a forkserver of its own, stopped at its
    end. Not for tests of signal delivery by a launcher: those keep torchrun or srun."""

    live: set[ForkedTrainer] = set()  # the forkserver stops when the last of them ends

    def __init__(
        self, args: list[str], nproc: int = 1, env: dict[str, str] | None = None,
        cwd: Path = REPO, stdout: Path | None = None,
    ) -> None:  # fmt: skip
        from trainer import data

        ForkedTrainer.live.add(self)
        self.args = [sys.executable, "-m", "trainer", *args]
        self._dir = Path(tempfile.mkdtemp(prefix="forked-trainer-"))
        self._out = stdout or self._dir / "stdout"
        self._err = self._out if stdout else self._dir / "stderr"
        port = free_port()
        self.ranks = []
        for rank in range(nproc):
            rank_env = dict(env or trainer_env())
            if nproc > 1:
                rank_env.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                    LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                )  # fmt: skip
            # Forked from the loaders' forkserver (torch and torchvision imported), not from
            # this process: its torch may hold what a fork cannot use (autograd's threads).
            process = data.loader_context().Process(
                target=_trainer_rank, args=(args, rank_env, cwd, self._out, self._err)
            )
            process.start()
            self.ranks.append(process)

    def wait(self, timeout: float = 240) -> subprocess.CompletedProcess:
        """The ranks' common exit code (else the first that is not 0), and what they
        wrote; a rank still running at the timeout fails the test, and none outlives
        the wait (a timeout's alarm, ^C)."""
        deadline = time.monotonic() + timeout
        try:
            for rank in self.ranks:
                rank.join(max(0.0, deadline - time.monotonic()))
            if any(rank.exitcode is None for rank in self.ranks):
                raise subprocess.TimeoutExpired(self.args, timeout)
        finally:
            self.stop()
        codes = [rank.exitcode for rank in self.ranks]
        code = next((c for c in codes if c != 0), 0)
        out = self._out.read_text() if self._out.exists() else ""
        err = self._err.read_text() if self._err.exists() else ""
        shutil.rmtree(self._dir, ignore_errors=True)
        return subprocess.CompletedProcess(self.args, code, out, err)

    def stop(self) -> None:
        """Kill the ranks still running (none, after a `wait` that returned); the last
        run to end stops the forkserver (what a test starts, it stops)."""
        from trainer import data

        for rank in self.ranks:
            if rank.is_alive():
                rank.kill()
            rank.join()
        ForkedTrainer.live.discard(self)
        if not ForkedTrainer.live:
            data.stop_loader_server()


def finish_forked(runs: list[ForkedTrainer], timeout: float = 240):
    """Every run's result (`ForkedTrainer.wait`); one that fails stops the others too."""
    try:
        return [run.wait(timeout) for run in runs]
    finally:
        for run in runs:
            run.stop()


def _trainer_rank(args: list[str], env: dict[str, str], cwd: Path, out: Path, err: Path) -> None:
    """One forked rank: what ``python -m trainer ARGS`` does, in the forkserver's image."""
    import signal

    import torch

    from trainer import cli, data, preempt

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("OMP_NUM_THREADS"):  # what a new process takes from it at its start; a
        # fork has what the test process last set (sums in another order, other floats)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    # The forkserver ignores (and started with blocked) the preemption signals, for its
    # loader workers; a rank starts as a new process does, with neither.
    for sig in preempt.SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, preempt.SIGNALS)
    try:
        code = cli.main(list(args))
    finally:
        data._stop_workers()  # what the trainer's exit does (no atexit in a forked child)
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def run_forked_trainer(
    args: list[str], nproc: int = 1, env: dict[str, str] | None = None, timeout: float = 240,
    cwd: Path = REPO,
) -> subprocess.CompletedProcess:  # fmt: skip
    """``run_trainer``, forked (`ForkedTrainer`)."""
    return ForkedTrainer(args, nproc, env, cwd).wait(timeout)


def finish(
    procs: list[subprocess.Popen], timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """Wait for every process; kill them all if one overruns."""
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def tiny_args(out: Path, *extra: str) -> list[str]:
    """Fake data at 16x16 through tinynet on CPU: a full run takes seconds."""
    return [
        "--dataset", "fake", "--fake-size", "48", "--fake-val-size", "21",
        "--fake-image-size", "16", "--crop-size", "16", "--val-resize-size", "16",
        "--num-classes", "4", "--arch", "tinynet", "--device", "cpu", "--workers", "0",
        "--batch-size", "4", "--print-freq", "1000", "--no-tensorboard",
        "--output-dir", str(out), *extra,
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
