"""Who am I in the job, and the collectives the trainer needs.

The launcher is detected from the environment in exactly one place
(`World.detect`); nothing else in the trainer reads rank variables.

- torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
- plain `srun python -m trainer ...` sets step-level SLURM_PROCID, SLURM_LOCALID,
  SLURM_STEP_NUM_TASKS and SLURM_STEP_NODELIST; the rendezvous address is the
  first host of the step and the port is derived from the job id so that every
  task computes the same one without talking to the others.
- anything else is a single process.

Job-level SLURM variables (SLURM_NTASKS, SLURM_PROCID=0 in the batch script)
are deliberately *not* enough to mean "distributed": an sbatch script that runs
`python -m trainer` without srun is one process, and must not wait for peers.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SRUN_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST")
# Ports below 10000 are often taken by services; 20000 wide keeps two jobs on
# one node from colliding unless their ids are 20000 apart.
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000


class DistributedEnvError(RuntimeError):
    """The launch environment is half set: some rank variables exist, others do not."""


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "single"  # "torchrun" | "srun" | "single"
    local_world_size: int = 1
    slurm_job_id: str | None = None
    cpus_per_task: int | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main(self) -> bool:
        return self.local_rank == 0

    @classmethod
    def detect(cls, env: Mapping[str, str] | None = None) -> World:
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID")
        cpus = _int_or_none(env.get("SLURM_CPUS_PER_TASK"))
        common = {"slurm_job_id": job_id, "cpus_per_task": cpus}
        if any(k in env for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
            missing = [k for k in TORCHRUN_VARS if not env.get(k)]
            if missing:
                raise DistributedEnvError(
                    f"torchrun-style launch is half set: {', '.join(missing)} missing; "
                    "launch with torchrun, or unset RANK/LOCAL_RANK/WORLD_SIZE"
                )
            return cls(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                master_addr=env["MASTER_ADDR"],
                master_port=int(env["MASTER_PORT"]),
                launcher="torchrun",
                local_world_size=int(env.get("LOCAL_WORLD_SIZE") or 1),
                **common,
            )
        if "SLURM_STEP_NUM_TASKS" in env:
            missing = [k for k in SRUN_VARS if not env.get(k)]
            if job_id is None and env.get("MASTER_PORT") is None:
                missing.append("SLURM_JOB_ID (or MASTER_PORT)")
            if missing:
                raise DistributedEnvError(
                    f"srun launch is half set: {', '.join(missing)} missing; "
                    "run the trainer as an srun step (srun python -m trainer ...)"
                )
            port = env.get("MASTER_PORT")
            return cls(
                rank=int(env["SLURM_PROCID"]),
                local_rank=int(env["SLURM_LOCALID"]),
                world_size=int(env["SLURM_STEP_NUM_TASKS"]),
                master_addr=env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"]),
                master_port=int(port) if port else slurm_port(job_id or "0"),
                launcher="srun",
                local_world_size=_tasks_on_first_node(env.get("SLURM_STEP_TASKS_PER_NODE")),
                **common,
            )
        return cls(**common)


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _tasks_on_first_node(value: str | None) -> int:
    # "4(x2),3" -> 4: only used to split the node's CPUs among loader workers.
    m = re.match(r"(\d+)", value or "")
    return int(m.group(1)) if m else 1


def slurm_port(job_id: str) -> int:
    # Array jobs look like "1234_7"; keep the digits so each task gets a port.
    digits = int(re.sub(r"\D", "", job_id) or 0)
    return SLURM_PORT_BASE + digits % SLURM_PORT_SPAN


def first_host(nodelist: str) -> str:
    """First host of a SLURM hostlist: "gpu[03-05,09],cpu1" -> "gpu03"."""
    return hostnames(nodelist)[0]


def hostnames(nodelist: str) -> list[str]:
    """A SLURM hostlist expanded, as ``scontrol show hostnames`` prints it.

    SLURM's own expansion where SLURM is installed (the authority on its
    syntax); `expand_hostlist` where it is not, or where scontrol cannot run
    (no configuration reachable: it would retry for a minute, hence the timeout).
    """
    scontrol = shutil.which("scontrol")
    if scontrol is not None:
        try:
            done = subprocess.run(
                [scontrol, "show", "hostnames", nodelist],
                capture_output=True, text=True, timeout=10, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0 and done.stdout.split():
            return done.stdout.split()
    return expand_hostlist(nodelist)


def expand_hostlist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist without SLURM.

    The forms SLURM documents: comma-separated names and bracket groups,
    ranges and lists inside brackets ("tux[1,3,5-7]"), zero padding kept from
    the range's start ("node[08-12]"), and several bracket groups in one name
    ("rack[0-1]_blade[0-63]", every combination, the last group fastest).
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist.strip()):
        parts = re.split(r"(\[[^\[\]]*\])", item)
        if any(c in p for p in parts if not p.startswith("[") for c in "[]"):
            raise DistributedEnvError(
                f"cannot parse SLURM node list {nodelist!r}: unbalanced brackets"
            )
        choices = [_bracket(p[1:-1], nodelist) if p.startswith("[") else [p] for p in parts]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    if not hosts or any(not h for h in hosts):
        raise DistributedEnvError(f"cannot parse SLURM node list {nodelist!r}")
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, current = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += ch
    items.append(current)
    return [item for item in items if item]


def _bracket(body: str, nodelist: str) -> list[str]:
    out: list[str] = []
    for piece in body.split(","):
        lo, dash, hi = piece.partition("-")
        if not dash:
            out.append(lo)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise DistributedEnvError(
                f"cannot parse SLURM node list {nodelist!r}: bad range {piece!r}"
            )
        out.extend(f"{i:0{len(lo)}d}" for i in range(int(lo), int(hi) + 1))
    return out


def init(world: World, device: torch.device) -> None:
    """Join the process group (no-op for one process); NCCL on GPU, gloo on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(world.local_rank % max(torch.cuda.device_count(), 1))
    if not world.distributed:
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{world.master_addr}:{world.master_port}",
        rank=world.rank,
        world_size=world.world_size,
        # Long enough for rank 0 to write a large checkpoint while the others
        # wait at a barrier. Waits that can be longer (--stager-wait) use their
        # own group with their own timeout: a day here would also delay NCCL's
        # watchdog from noticing a genuinely hung collective.
        timeout=datetime.timedelta(minutes=30),
        device_id=device if device.type == "cuda" else None,
    )


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if active():
        dist.barrier()


def new_gloo_group(timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A CPU group over all ranks (a collective: every rank must call it, in the same order)."""
    return dist.new_group(backend="gloo", timeout=timeout)


def destroy_group(group: dist.ProcessGroup | None) -> None:
    """Free a group from `new_gloo_group` (None, the default group, is left alone)."""
    if group is not None:
        dist.destroy_process_group(group)


def cpu_group() -> dist.ProcessGroup | None:
    """A group for small CPU-tensor collectives: the default one if it is gloo.

    Under NCCL a flag would have to go to the GPU and back, and reading it with
    `.item()` waits for every kernel queued so far; gloo reduces it on the CPU.
    A collective: call it on every rank.
    """
    if dist.get_backend() == "gloo":
        return None
    return new_gloo_group()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place (identity on one process) and return it."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


def broadcast_buffers(model: torch.nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s buffers (BatchNorm running stats) to every rank.

    DDP broadcasts buffers at the start of each forward, so after the last
    training forward every rank holds running stats updated by its own batch
    only. Evaluating those would give each rank a different model, none of
    them the one rank 0 saves.
    """
    if not active():
        return
    for buf in model.buffers():
        dist.broadcast(buf, src=src)


def broadcast_object(obj: object, src: int = 0) -> object:
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
