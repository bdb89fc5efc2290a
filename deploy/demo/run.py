"""`make demo`: the main job end to end on this machine, no SLURM needed.

1. generate a small fake iNaturalist 2021 release (train.tar.gz, val.tar.gz) in a
   "shared filesystem" folder (once; later runs reuse it),
2. start the daemon (`stager serve --detach`),
3. stage it with the inat2021 recipe, showing progress, and link it into a job folder
   (`stager-client stage ... --wait`),
4. train a small ResNet with 2 gloo processes on the CPU for a number of steps sized
   to this machine's cores (--steps N: N), and show the validation accuracy
   (`torchrun ... stager-train`),
5. stop the daemon and say where everything is.

The cache lives in the work folder, so a second `make demo` is a cache hit.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench.fakedata import make_inat2021  # noqa: E402

BIN = Path(sys.executable).parent
# Training steps per core of this machine (each step: 2 processes x 16 images at 48 px):
# about 10 s of training on a 2-core node, enough for the accuracy to climb well
# above chance (1 in 8), and no longer on a bigger one than it needs.
STEPS_PER_CORE = 10


def training_size() -> tuple[int, int, int]:
    """(processes, steps, threads per process) for this machine."""
    cores = len(os.sched_getaffinity(0))
    processes = 2 if cores >= 2 else 1
    return processes, max(12, STEPS_PER_CORE * cores), max(1, cores // processes)


def steps_count(text: str) -> int:
    """--steps: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps (1 or more)")
    return int(text)


def cpu_model() -> str:
    """The CPU's name: PyTorch picks its kernels by the CPU, so the accuracy's last
    digits differ from one CPU to another (README's spread)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    names = [line.partition(":")[2].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else (platform.machine() or "an unknown CPU")


def banner(step: str) -> None:
    print(f"\n\033[1m== {step}\033[0m" if sys.stdout.isatty() else f"\n== {step}", flush=True)


def run(cmd: list[str], env: dict[str, str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, check=True)


def requests_by_outcome(socket: Path) -> dict[str, int]:
    transport = httpx.HTTPTransport(uds=str(socket))
    with httpx.Client(transport=transport, base_url="http://stager") as client:
        text = client.get("/metrics").text
    counts = {}
    for line in text.splitlines():
        if line.startswith("stager_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = int(float(line.rsplit(" ", 1)[1]))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_work = Path("/tmp") / f"stager-demo-{os.getuid()}"
    parser.add_argument("--work-dir", type=Path, default=default_work)
    parser.add_argument("--fresh", action="store_true", help="forget the cache and start over")
    parser.add_argument(
        "--steps",
        type=steps_count,
        help=f"training steps (default: {STEPS_PER_CORE} per core of this machine, at least "
        "12); fewer for a quicker look at the whole flow, more for a higher accuracy",
    )
    args = parser.parse_args()

    work: Path = args.work_dir
    if args.fresh:
        shutil.rmtree(work, ignore_errors=True)
    shared, job = work / "shared" / "inat", work / "job"
    env = {
        **os.environ,
        "STAGER_RUNTIME_DIR": str(work / "run"),
        "STAGER_CACHE_DIR": str(work / "cache"),
        "STAGER_MIN_FREE_BYTES": str(64 * 2**20),
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    socket = work / "run" / "stager.sock"
    env["STAGER_URL"] = f"unix://{socket}"
    started = time.monotonic()

    banner("1/5 a fake iNaturalist 2021 release on the 'shared filesystem'")
    if (shared / "val.tar.gz").exists():
        print(f"reusing {shared}")
    else:
        make_inat2021(shared, classes=8, per_class={"train": 160, "val": 16}, size=(160, 120))
        print(f"wrote {', '.join(sorted(p.name for p in shared.iterdir()))} to {shared}")

    banner("2/5 start the node's daemon")
    run([str(BIN / "stager"), "serve", "--detach"], env)
    try:
        banner("3/5 stage it with the inat2021 recipe and link it into the job's folder")
        shutil.rmtree(job / "data", ignore_errors=True)
        run(
            [
                str(BIN / "stager-client"),
                "stage",
                "inat",
                "--recipe",
                "inat2021",
                "--source",
                str(shared),
                "--link",
                str(job / "data" / "inat"),
                "--wait",
                "--interval",  # progress lines this often when output is not a terminal
                "0.5",
            ],
            env,
        )
        outcome = requests_by_outcome(socket)

        processes, steps, threads = training_size()
        steps = args.steps or steps
        banner(
            f"4/5 train resnet18 for {steps} steps ({len(os.sched_getaffinity(0))} cores "
            f"here): {processes} processes, gloo, CPU"
        )
        shutil.rmtree(job / "train", ignore_errors=True)
        run(
            [
                str(BIN / "torchrun"),
                "--standalone",
                "--nproc-per-node",
                str(processes),
                "--log-dir",  # its own logs here, not a new /tmp/torchelastic_* each run
                str(job / "torchrun-logs"),
                "-m",
                "trainer",
                "--dataset",
                "inat2021",
                "--data-root",
                str(job / "data" / "inat"),
                "--arch",
                "resnet18",
                "--crop-size",
                "48",
                "--val-resize-size",
                "56",
                "--iterations",
                str(steps),
                "--batch-size",
                "16",
                "--lr",
                "0.05",
                "--workers",
                "1",
                "--device",
                "cpu",
                "--progress",
                "log",
                "--no-tensorboard",
                "--output-dir",
                str(job / "train"),
            ],
            {**env, "OMP_NUM_THREADS": str(threads)},
        )
    finally:
        banner("5/5 stop the daemon")
        run([str(BIN / "stager"), "stop"], env)

    banner("summary")
    link = job / "data" / "inat"
    print(f"shared source : {shared}")
    print(f"staged copy   : {os.path.realpath(link)}")
    print(f"job's link    : {link} -> {os.readlink(link)}")
    print(f"training out  : {job / 'train'}")
    print(f"training      : {_epoch_summary(job / 'train' / 'epochs.csv')}")
    # The same figure on every run of one machine; another CPU rounds differently (README).
    print(f"on            : {len(os.sched_getaffinity(0))} cores of {cpu_model()}")
    if outcome.get("hit"):
        print("cache         : HIT - the dataset was already staged on this node; nothing copied")
    else:
        print("cache         : miss - staged now; run `make demo` again to see a cache hit")
    print(
        f"took {time.monotonic() - started:.0f} s; `make demo` again reuses the cache, "
        f"`python deploy/demo/run.py --fresh` starts over"
    )
    return 0


# The columns the summary line shows; trainer/train.py writes them (top1, top5 and
# count only when there is a val split).
SUMMARY_COLUMNS = ("epoch", "train_loss", "top1", "top5", "count", "img_s_mean")


def _epoch_summary(path: Path) -> str:
    """The last epoch in one line, or why there is none: the newcomer must not be left
    wondering where the accuracy went."""
    try:
        with open(path, newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as exc:
        return f"no training summary at {path} ({exc.strerror})"
    if not rows:
        return f"no training summary at {path} (no epoch was logged)"
    last = rows[-1]
    missing = [c for c in SUMMARY_COLUMNS if not last.get(c)]
    if missing:
        return f"no training summary at {path} (its last row has no {', '.join(missing)})"
    return (  # every column is there now: checked with .get() above
        f"epoch {last['epoch']}: train loss {float(last['train_loss']):.3f}, "
        f"val top-1 {float(last['top1']):.1%} (top-5 {float(last['top5']):.1%}, "
        f"{last['count']} images), {float(last['img_s_mean']):.0f} img/s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
