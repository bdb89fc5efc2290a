#!/bin/bash
# Extract a .tar of N files of 512 B (1,000 folders): stager (bench.extract_once, 2
# workers, a whole process) against GNU `tar -xf`, alternating, 3 rounds, each output
# deleted outside the timing. Prints each run and the summed peak memory of stager's
# processes.   bench/extract_vs_tar.sh [N (default 1000000)] [work dir (default /dev/shm/stager-ext)]
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-1000000}
work=${2:-/dev/shm/stager-ext}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
echo "start $(date -u +%H:%M) $(uptime)"
"$python" -c "from bench.datagen import make_small_tar; from pathlib import Path; make_small_tar(Path('$work/n.tar'), $n)"
cat "$work/n.tar" > /dev/null  # in the page cache for both
for round in 1 2 3; do
    for who in stager tar; do
        rm -rf "$work/out"
        mkdir -p "$work/out"
        t0=$(date +%s.%N)
        if [ "$who" = stager ]; then
            "$python" -m bench.extract_once "$work/n.tar" "$work/out" --workers 2 --rss-log "$work/rss.log" >/dev/null
        else
            tar -xf "$work/n.tar" -C "$work/out"
        fi
        t1=$(date +%s.%N)
        echo "round $round $who $(echo "$t1 - $t0" | bc) s, files $(find "$work/out" -type f | wc -l)"
    done
done
echo "stager peak memory, summed: $(tr '\n' ' ' < "$work/rss.log")"
echo "end $(date -u +%H:%M) $(uptime)"
