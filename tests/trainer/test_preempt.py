"""Ranks agree on the preemption step through a CPU vote (real gloo group)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

from tests.trainer.conftest import fork_ranks, free_port
from trainer.preempt import SIGNALS, Preemption


def _vote_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)  # fmt: skip
    try:
        p = Preemption()
        p.install()
        votes = [p.requested()]
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # one rank only
        votes.append(p.requested())
        Path(out, f"rank{rank}.json").write_text(json.dumps(votes))
    finally:
        dist.destroy_process_group()


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    fork_ranks(_vote_worker, (free_port(), str(tmp_path)))
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [False, True]


def test_single_process_needs_no_group():
    saved = {sig: signal.getsignal(sig) for sig in SIGNALS}
    try:
        p = Preemption()
        p.install()
        assert p.group is None and not p.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert p.requested() and p.signum == signal.SIGTERM
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
