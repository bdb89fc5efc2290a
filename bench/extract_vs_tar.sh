#!/bin/bash
# stager's extraction (bench.extract_once, 2 workers, a whole process: interpreter start
# included) against GNU tar on the same archive, alternating, 3 rounds, each output
# deleted outside the timing; prints each run, the median of each side, the pairwise
# ratios and their median, and the summed peak memory of stager's processes.
#
#   bench/extract_vs_tar.sh [N (default 1000000)] [work dir (default /dev/shm/stager-ext)]
#       a .tar of N files of 512 B in 1,000 folders, against `tar -xf`
#   bench/extract_vs_tar.sh --gz [N (default 6000)] [work dir]
#       a .tar.gz (written by GNU tar/gzip) of N random files of 4-100 KB in 100
#       folders (6,000: ~320 MB), against `tar -xzf`
set -euo pipefail
cd "$(dirname "$0")/.."
mode=tar
if [ "${1:-}" = --gz ]; then
    mode=tar.gz
    shift
fi
if [ "$mode" = tar ]; then n=${1:-1000000}; else n=${1:-6000}; fi
work=${2:-/dev/shm/stager-ext}
python=${PYTHON:-.venv/bin/python}
mkdir -p "$work"
trap 'rm -rf "$work"' EXIT
echo "start $(date -u '+%F %H:%M') $(uptime)"
if [ "$mode" = tar ]; then
    archive=$work/n.tar
    tar_flags=-xf
    "$python" -c "from bench.datagen import make_small_tar; from pathlib import Path; make_small_tar(Path('$archive'), $n)"
else
    archive=$work/tree.tar.gz
    tar_flags=-xzf
    if [ ! -f "$archive" ]; then  # reused: a work dir made ready beforehand
        "$python" -c "from bench.datagen import make_archives, make_tree; from pathlib import Path; w = Path('$work'); make_archives(make_tree(w / 'tree', n_files=$n), w)"
        rm -rf "$work/tree" "$work/tree.tar"  # only the .tar.gz is read
    fi
fi
cat "$archive" > /dev/null  # in the page cache for both
echo "archive $(basename "$archive"): $n files, $(du -m "$archive" | cut -f1) MB"
# Seconds of CPU the hypervisor gave to others while a run had work for both vCPUs
# (/proc/stat "steal"): stager's workers need the second core, tar does not, so a
# round with much steal favours tar; printed beside each run to read the spread.
steal() { awk '/^cpu /{print $9}' /proc/stat; }
declare -A took
for round in 1 2 3; do
    for who in stager tar; do
        rm -rf "$work/out"
        mkdir -p "$work/out"
        s0=$(steal)
        t0=$(date +%s.%N)
        if [ "$who" = stager ]; then
            "$python" -m bench.extract_once "$archive" "$work/out" --workers 2 --rss-log "$work/rss.log" >/dev/null
        else
            tar "$tar_flags" "$archive" -C "$work/out"
        fi
        t1=$(date +%s.%N)
        s1=$(steal)
        took[$who$round]=$(echo "$t1 - $t0" | bc)
        echo "round $round $who ${took[$who$round]} s, files $(find "$work/out" -type f | wc -l)," \
            "steal $(echo "scale=2; ($s1 - $s0) / $(getconf CLK_TCK)" | bc) s"
    done
done
rm -rf "$work/out"
median() { printf '%s\n' "$@" | sort -g | sed -n 2p; }
ratios=()
for round in 1 2 3; do
    ratios+=("$(echo "scale=3; ${took[stager$round]} / ${took[tar$round]}" | bc)")
done
echo "median stager $(median "${took[stager1]}" "${took[stager2]}" "${took[stager3]}") s," \
    "tar $tar_flags $(median "${took[tar1]}" "${took[tar2]}" "${took[tar3]}") s;" \
    "pairwise ratios ${ratios[*]}, median $(median "${ratios[@]}")"
echo "stager peak memory, summed: $(tr '\n' ' ' < "$work/rss.log")"
echo "end $(date -u '+%F %H:%M') $(uptime)"
