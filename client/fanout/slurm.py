"""SLURM as the fan-out's orchestrator: the job's nodes, steps on some of them, sbcast.

Only SLURM's own commands run here (``scontrol``, ``srun``, ``sbcast``): the
transfer, the authentication and the process launch are SLURM's, so stager opens
no network listener and needs nothing configured. Each per-node task is a
``stager-client _node`` agent that talks to its node's daemon over the local
socket, and to the coordinator in JSON lines on stdout and stdin (srun hands stdin
to every task of the step; `client.fanout.protocol`). A `Sink` step runs on
exactly the nodes sbcast sends to.

Errors from these commands become `FanoutError` here, with a sentence naming the
node and the step.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from client.errors import FanoutError

STEP_START_TIMEOUT_S = 120.0  # srun waits for resources; a busy job may take a while


@dataclass(frozen=True)
class Job:
    """The job this process runs in: its id, its nodes (sorted) and the node we are on."""

    job_id: str
    nodes: tuple[str, ...]
    this_node: str
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), repr=False)

    @classmethod
    async def detect(cls, env: Mapping[str, str] | None = None) -> Job:
        env = dict(os.environ if env is None else env)
        job_id = env.get("SLURM_JOB_ID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job_id or not nodelist:
            raise FanoutError(
                "--peers slurm needs a SLURM job (SLURM_JOB_ID and SLURM_JOB_NODELIST are "
                "not set); run it in the batch script of an sbatch job"
            )
        names = await _command(["scontrol", "show", "hostnames", nodelist], env, "scontrol")
        nodes = tuple(sorted(names.split()))
        this_node = env.get("SLURMD_NODENAME") or nodes[0]
        return cls(job_id, nodes, this_node, env)

    @classmethod
    def here(cls, env: Mapping[str, str] | None = None) -> Job:
        """Inside a job step: this node and the job, without asking SLURM for the nodes."""
        env = dict(os.environ if env is None else env)
        node = env.get("SLURMD_NODENAME", "")
        return cls(env.get("SLURM_JOB_ID", ""), (node,), node, env)


async def _command(
    argv: Sequence[str], env: Mapping[str, str], what: str, fix: str = "check the job's allocation"
) -> str:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
        )
    except OSError as exc:
        raise FanoutError(
            f"{argv[0]} could not be run ({exc.strerror}); --peers slurm needs SLURM's "
            "client commands (srun, sbcast, scontrol) on PATH"
        ) from exc
    out, err = await process.communicate()
    if process.returncode != 0:
        raise FanoutError(
            f"{what} failed (`{shlex.join(argv)}` exited {process.returncode}: "
            f"{_last_line(err)}); {fix}"
        )
    return out.decode()


def _last_line(data: bytes) -> str:
    lines = [line for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no message"


def agent_argv(*args: str) -> list[str]:
    """The per-node task: this interpreter running stager-client's hidden ``_node``."""
    return [sys.executable, "-m", "client", "_node", *args]


# A step whose only job is to be there: sbcast reaches the nodes of a step, and this
# one runs on exactly the nodes that lack the data. It says its id, then waits.
SINK = (
    'printf \'{"node": "%s", "event": "ready", "step": "%s.%s"}\\n\' '
    '"$SLURMD_NODENAME" "$SLURM_JOB_ID" "$SLURM_STEP_ID"; exec sleep 86400'
)


def sink_argv() -> list[str]:
    return ["bash", "-c", SINK]


async def cancel_step(job: Job, step_id: str) -> None:
    """End a step (the sink, once sbcast is done with it)."""
    try:
        await _command(["scancel", "--quiet", step_id], job.env, f"scancel {step_id}")
    except FanoutError:
        pass  # already gone


class Step:
    """A running ``srun`` step with one task per node: JSON lines out, instructions in."""

    def __init__(self, job: Job, nodes: Sequence[str], name: str) -> None:
        self.job = job
        self.nodes = tuple(nodes)
        self.name = name
        self.step_id: str | None = None  # JOB.STEP once a task has said it
        self._process: asyncio.subprocess.Process | None = None
        self._stderr: list[str] = []
        self._stderr_task: asyncio.Task[None] | None = None

    def label(self) -> str:
        where = ",".join(self.nodes)
        return f"step {self.step_id or '?'} ({self.name} on {where})"

    async def start(
        self, argv: Sequence[str], *, stdin: bool = False, kill_on_bad_exit: bool = False
    ) -> Step:
        srun = [
            "srun",
            "--overlap",  # beside the batch step and the job's other steps
            f"--nodes={len(self.nodes)}",
            f"--ntasks={len(self.nodes)}",
            "--ntasks-per-node=1",
            "--cpus-per-task=1",
            f"--nodelist={','.join(self.nodes)}",
            f"--job-name=stager-{self.name}",
            # 1: a task that dies (not one that reports a failure: those exit 0) ends the
            # step, so the driver is not left waiting for it.
            f"--kill-on-bad-exit={int(kill_on_bad_exit)}",
            "--quiet",
        ]
        try:
            self._process = await asyncio.create_subprocess_exec(
                *srun,
                *argv,
                stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(self.job.env),
                limit=64 << 20,  # one JSON line may carry a manifest digest and paths
            )
        except OSError as exc:
            raise FanoutError(
                f"srun could not be run ({exc.strerror}); --peers slurm needs SLURM's client "
                "commands on PATH"
            ) from exc
        self._stderr_task = asyncio.create_task(self._collect_stderr())
        return self

    async def _collect_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        async for line in self._process.stderr:
            self._stderr.append(line.decode(errors="replace").rstrip())

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Each JSON line a task prints, in arrival order; other lines are ignored."""
        assert self._process is not None and self._process.stdout is not None
        async for raw in self._process.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict) and "node" in event:
                if self.step_id is None and event.get("step"):
                    self.step_id = str(event["step"])
                yield event

    async def write(self, message: Mapping[str, Any]) -> None:
        """One JSON line to every task's stdin (srun gives stdin to all tasks)."""
        assert self._process is not None and self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(message).encode() + b"\n")
            await self._process.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise FanoutError(
                f"{self.label()} ended before it got its instructions "
                f"({self.stderr_tail()}); see the job's log"
            ) from exc

    def close_stdin(self) -> None:
        if self._process is not None and self._process.stdin is not None:
            self._process.stdin.close()

    async def wait(self) -> int:
        assert self._process is not None
        code = await self._process.wait()
        if self._stderr_task is not None:
            await self._stderr_task
        return code

    def stderr_tail(self) -> str:
        lines = [line for line in self._stderr if line.strip()]
        return "; ".join(lines[-3:]) if lines else "no message from srun"

    async def kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self.wait()


@dataclass(frozen=True)
class Broadcast:
    """How sbcast sends one file: lz4 or not, and its fan-out."""

    compress: bool
    fanout: int

    def flags(self) -> list[str]:
        return [f"--compress={'lz4' if self.compress else 'none'}", f"--fanout={self.fanout}"]


async def sbcast(
    job: Job, sender: str, to_step: str, source: str, dest: str, how: Broadcast
) -> None:
    """Send ``source`` (a file on ``sender``) to ``dest`` on every node of ``to_step``.

    sbcast has no node list: it reaches the nodes of a step, so the caller starts a
    step on exactly the nodes that lack the data. On another node than ours it runs
    inside a one-task step there, and reads that node's file.
    """
    argv = ["sbcast", f"--jobid={to_step}", "--force", *how.flags(), source, dest]
    if sender != job.this_node:
        argv = [
            "srun",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={sender}",
            "--job-name=stager-sbcast",
            "--quiet",
            *argv,
        ]
    await _command(
        argv,
        job.env,
        f"sbcast of {source} from {sender} to step {to_step}",
        "check that sbcast is permitted on this cluster and the nodes' local disks have room",
    )


class Sink:
    """The step sbcast sends to: on exactly the nodes that lack the data."""

    def __init__(self, step: Step) -> None:
        self.step = step
        self.step_id = ""

    async def started(self) -> Sink:
        async for event in self.step.events():
            if event.get("step"):
                self.step_id = str(event["step"])
                return self
        raise FanoutError(
            f"{self.step.label()} did not start ({self.step.stderr_tail()}); check those "
            "nodes with sinfo"
        )

    async def close(self) -> None:
        if self.step_id:
            await cancel_step(self.step.job, self.step_id)
        await self.step.kill()
