"""Run one benchmark script against two checkouts of stager, alternating, and keep each output.

A refactor claims "no slower than before"; the only honest check is the same
benchmark, on the same machine, in the same minutes, on both revisions. This
runs ``python SCRIPT ARGS`` with each checkout first on ``PYTHONPATH`` (so the
daemon, client and ops come from that checkout; the script itself too), rounds
times, the order swapped every round so neither revision always runs on the
warmer cache. Outputs go to ``OUT/<label>-<round>.txt``; read the figures from
there (each script prints its own table).

    python -m bench.compare_revisions --base /tmp/old-main --head . --rounds 3 \\
        --out /tmp/cmp-api -- bench/bench_api.py --work-dir /tmp/stager-bench-cmp
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path


def run_once(checkout: Path, script: str, args: list[str], out: Path) -> int:
    """Run the script once; its exit status. A benchmark that misses its own goal exits
    1 with its table printed: that is a figure too, so the rounds go on."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [sys.executable, str(checkout / script), *args]
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True)
    out.write_text(done.stdout + done.stderr)
    return done.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="checkout of the old revision")
    parser.add_argument("--head", type=Path, default=Path("."), help="checkout of the new one")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, required=True, help="folder for the outputs")
    parser.add_argument("script", help="benchmark script, relative to each checkout")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments (after --)")
    options = parser.parse_args()
    options.out.mkdir(parents=True, exist_ok=True)
    checkouts = {"base": options.base.resolve(), "head": options.head.resolve()}
    for round_ in range(options.rounds):
        order = ["base", "head"] if round_ % 2 == 0 else ["head", "base"]
        for label in order:
            out = options.out / f"{label}-{round_}.txt"
            status = run_once(checkouts[label], options.script, options.args, out)
            said = "" if status == 0 else f" (exit {status}: a missed goal, or see the file)"
            print(f"round {round_ + 1}/{options.rounds} {label}: {out}{said}", flush=True)


if __name__ == "__main__":
    main()
