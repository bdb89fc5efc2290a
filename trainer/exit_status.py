"""How a training run ended, recorded in its output folder for the launcher's caller.

Under ``torchrun`` the ranks' exit codes do not reach the caller: on SIGTERM
torchrun passes the signal to the ranks, waits for them (each saves and exits
75) and then exits 1 itself ("got signal 15"), the same code as a crash. So
rank 0 also records the outcome in ``OUTPUT/exit-status.json``, and
``stager-train exit-status`` turns it back into an exit code after the
launcher returns: 75 preempted (checkpoint saved), 0 completed, anything else
broken.

The record belongs to one run, named by ``--run-id`` (default
``$STAGER_TRAIN_RUN_ID``), so that a record left by an earlier run is never
taken for this one's: a run that dies before rank 0 writes anything (bad
flags, a failed rendezvous) leaves the earlier run's record in place, and the
reader, given this run's id, sees that it is not this run's.

Record lifecycle (rank 0, each write atomic: temporary file, fsync, rename):

    running    written when the run starts, before the process group forms
    completed  the run returned 0 (exit_code 0)
    preempted  the ranks stopped at a checkpoint, which is saved (exit_code 75)
    failed     an exception ended rank 0 (exit_code 1, ``error`` says why)

A record still ``running`` after the launcher returned means that rank 0 was
killed or hung (torchrun kills the ranks 30 s after passing a signal on).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from trainer.preempt import EXIT_PREEMPTED

FILE = "exit-status.json"
RUN_ID_ENV = "STAGER_TRAIN_RUN_ID"
EXIT_OK = 0
EXIT_ERROR = 1
STATES = ("running", "completed", "preempted", "failed")


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class Record:
    """The file's content (JSON keys are these field names)."""

    run_id: str
    status: str  # one of STATES
    exit_code: int | None = None
    started: str = field(default_factory=_now)
    ended: str | None = None
    host: str = field(default_factory=socket.gethostname)
    launcher: str = "single"
    world_size: int = 1
    epoch: int | None = None
    iteration: int | None = None
    samples: int | None = None
    checkpoint: str | None = None  # relative to the output folder
    error: str | None = None

    @classmethod
    def from_json(cls, data: dict, path: Path) -> Record:
        names = set(cls.__dataclass_fields__)
        if not isinstance(data, dict) or data.get("status") not in STATES or "run_id" not in data:
            raise ValueError(
                f"{path} is not a stager-train exit status; remove it and rerun the training"
            )
        return cls(**{k: v for k, v in data.items() if k in names})


def write(out: Path, record: Record) -> None:
    """Replace ``out/exit-status.json`` atomically: a reader sees the old record or the new."""
    out.mkdir(parents=True, exist_ok=True)
    final = out / FILE
    tmp = out / f".{FILE}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(asdict(record), f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a node crash
    finally:
        os.close(fd)


def read(out: Path) -> Record | None:
    path = out / FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{path} is not valid JSON ({exc}); remove it and rerun the training"
        ) from exc
    return Record.from_json(data, path)


def error_sentence(exc: BaseException) -> str:
    """The error's own sentence, also when a loader worker raised it.

    The DataLoader re-raises a worker's exception as the same type whose text
    is "Caught X in DataLoader worker process N. Original Traceback: ...";
    its last line holds the original message.
    """
    text = str(exc)
    if "Original Traceback" in text:
        last = text.rstrip().splitlines()[-1]
        text = last.split(": ", 1)[1] if ": " in last else last
    return text


class Recorder:
    """Rank 0's writer; on the other ranks every call does nothing."""

    def __init__(
        self, out: Path, run_id: str | None, *, enabled: bool, launcher: str, world_size: int
    ) -> None:
        self.out = Path(out)
        self.enabled = enabled
        self.record = Record(
            run_id=run_id or uuid.uuid4().hex[:12], status="running",
            launcher=launcher, world_size=world_size,
        )  # fmt: skip

    def start(self) -> None:
        if self.enabled:
            write(self.out, self.record)

    def saved(self, checkpoint: Path, epoch: int, iteration: int, samples: int) -> None:
        """Note the latest checkpoint and position (kept in memory; written at the end)."""
        r = self.record
        r.checkpoint = os.path.relpath(checkpoint, self.out)
        r.epoch, r.iteration, r.samples = epoch, iteration, samples

    def finish(self, code: int) -> None:
        status = {EXIT_OK: "completed", EXIT_PREEMPTED: "preempted"}.get(code, "failed")
        self._end(status, code)

    def failed(self, exc: BaseException) -> None:
        self._end("failed", EXIT_ERROR, error=error_sentence(exc) or type(exc).__name__)

    def _end(self, status: str, code: int, error: str | None = None) -> None:
        r = self.record
        r.status, r.exit_code, r.ended, r.error = status, code, _now(), error
        if self.enabled:
            write(self.out, r)


def outcome(
    record: Record | None, run_id: str, out: Path, launcher_exit: int | None = None
) -> tuple[int, str]:
    """The exit code the caller should see for run ``run_id``, and one sentence why."""
    path = out / FILE
    # When the record cannot vouch for the run: the launcher's own failure code if it
    # has one, else 1; never 75, which would have the run resumed as if it had saved.
    broken = launcher_exit if launcher_exit not in (None, EXIT_OK, EXIT_PREEMPTED) else EXIT_ERROR
    if record is None:
        return broken, (
            f"{path} does not exist: run {run_id} ended before its rank 0 started training "
            "(see the run's log)"
        )
    if record.run_id != run_id:
        return broken, (
            f"{path} records run {record.run_id}, not run {run_id}: run {run_id} ended before "
            "its rank 0 started training (see the run's log)"
        )
    if record.status == "running":
        return broken, (
            f"run {run_id} recorded no end in {path}: its rank 0 was killed or hung "
            "(see the run's log)"
        )
    if record.status == "failed":
        return broken, f"run {run_id} failed: {record.error}"
    if record.status == "preempted":
        where = f"epoch {record.epoch}, iteration {record.iteration}, sample {record.samples}"
        saved = out / record.checkpoint if record.checkpoint else None
        if saved is None or not saved.is_file():
            return broken, (
                f"run {run_id} was preempted at {where} but its checkpoint {saved} is missing; "
                "a --resume would not continue from there"
            )
        return EXIT_PREEMPTED, (
            f"run {run_id} was preempted at {where}; checkpoint {saved} saved: rerun with --resume"
        )
    if launcher_exit not in (None, EXIT_OK):
        return broken, (
            f"run {run_id}'s rank 0 completed, but the launcher exited {launcher_exit}: "
            "another rank failed (see the run's log)"
        )
    return EXIT_OK, f"run {run_id} completed"


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="stager-train exit-status",
        description="Exit with the code a training run recorded in OUTPUT/exit-status.json: "
        "75 preempted (checkpoint saved; rerun with --resume), 0 completed, 1 (or the "
        "launcher's code) broken. Run it after torchrun returns: torchrun exits 1 when a "
        "signal stopped it, also when every rank saved and exited 75.",
        epilog="example:\n"
        "  export STAGER_TRAIN_RUN_ID=$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}\n"
        "  torchrun --nproc-per-node 4 -m trainer ... --output-dir OUT && rc=0 || rc=$?\n"
        '  stager-train exit-status --output-dir OUT --launcher-exit "$rc" && rc=0 || rc=$?',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--output-dir", required=True, help="the run's --output-dir")
    p.add_argument(
        "--run-id",
        default=os.environ.get(RUN_ID_ENV),
        help=f"the run's --run-id (default ${RUN_ID_ENV}); a record of another run is not "
        "this run's outcome",
    )
    p.add_argument(
        "--launcher-exit",
        type=int,
        default=None,
        metavar="RC",
        help="the launcher's exit code: returned when the record cannot vouch for the run, "
        "and when rank 0 completed but the launcher failed (another rank did)",
    )
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = get_parser()
    args = parser.parse_args(argv)
    if not args.run_id:
        parser.error(
            f"--run-id is required (or ${RUN_ID_ENV}): the id the run was given, so that an "
            "earlier run's record is not taken for this one's"
        )
    return args


def main(args: argparse.Namespace) -> int:
    out = Path(args.output_dir)
    code, sentence = outcome(read(out), args.run_id, out, args.launcher_exit)
    print(f"stager-train exit-status: {sentence} (exit {code})", file=sys.stderr)
    return code
