#!/usr/bin/env bash
# cpu/bench_oversubscription.sh: what sharing the cores costs the CPU backend (a benchmark: it prints numbers and
# asserts none). `make bench` runs it after build/bench; alone: cpu/bench_oversubscription.sh [REPS] (3).
# The run is GPT d2 (C=768, 2 layers, a 263-token vocabulary) at B=4, T=32 in FP32 (build/train_gpt_fp32 on
# build/prod/train.bin); a cell is the median over REPS runs of each run's median step time (steps 6..STEPS), so
# that a machine shared with other work moves it less, and a row's runs alternate between before and after.
#   before: a thread per core and libgomp's and Open MPI's spinning waits (OMP_NUM_THREADS=cores, CUCC_SPIN_US=-1)
#   after:  the backend's defaults (doc/backend.md, "Threads and waits")
# Rows: one process alone; two processes started at once (neither knows of the other); 4 ranks of mpirun -np 4 on
# this machine (each rank's step, which includes the gradient all-reduce).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${1:-3}
[[ $REPS =~ ^[1-9][0-9]*$ ]] || { echo "usage: $0 [REPS]: REPS, the runs per cell, a positive number"; exit 2; }
TRAIN=build/train_gpt_fp32
DATA=build/prod/train.bin
for f in $TRAIN $DATA; do
    [ -e $f ] || { echo "$0: $f is missing (make $f)"; exit 2; }
done
CORES=$(nproc)
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# run_log FILE STEPS ENV... -- [LAUNCHER...]: one training run, its output in FILE
run_log() {
    local file=$1 steps=$2
    shift 2
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    env "${envs[@]}" "$@" $TRAIN -e d2 -ev 263 -i $DATA -j "" -b 4 -t 32 -x "$steps" -v 0 -s 0 >"$file" 2>&1
}

# the median step time (ms) of a log, steps 6.. (the first ones allocate and warm up)
median_step() {
    grep -E '^step [0-9]+/' "$1" | awk 'NR > 5' | sed -E 's/.*\| ([0-9.]+) ms \|.*/\1/' | sort -n |
        awk '{ v[NR] = $1 } END { if (NR == 0) print "?"; else print v[int((NR + 1) / 2)] }'
}

median_of() { printf '%s\n' "$@" | sort -n | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }

BEFORE=(OMP_NUM_THREADS=$CORES CUCC_SPIN_US=-1)
AFTER=(CUCC_BENCH=1)  # a no-op variable: the defaults

# one_run ROW SETTINGS...: the step times of one run of ROW (alone, pair, np4) with those settings
one_run() {
    local row=$1
    shift
    case $row in
        alone)
            run_log "$tmp/a" 45 "$@" --
            median_step "$tmp/a" ;;
        pair)
            run_log "$tmp/a" 45 "$@" -- &
            run_log "$tmp/b" 45 "$@" --
            wait
            median_step "$tmp/a"
            median_step "$tmp/b" ;;
        np4)
            local mpienv=() e
            for e in "$@"; do mpienv+=(-x "$e"); done
            run_log "$tmp/a" 25 -- $MPIRUN -np 4 "${mpienv[@]}"
            median_step "$tmp/a" ;;
    esac
}

echo "GPT d2, B=4 T=32, FP32, step time (median of $REPS runs; $CORES cores)"
printf '| %-34s | %-38s | %-22s |\n' "run" "before: a thread per core, spinning" "after: the defaults"
printf '|%s|%s|%s|\n' "$(printf -- '-%.0s' {1..36})" "$(printf -- '-%.0s' {1..40})" "$(printf -- '-%.0s' {1..24})"
for row in alone pair np4; do
    case $row in
        alone) label="one process alone" ;;
        pair) label="two processes at once (each)" ;;
        np4) label="4 ranks, mpirun -np 4" ;;
    esac
    # before and after alternate, run by run, so that a machine whose speed drifts moves both alike
    befores=()
    afters=()
    for ((i = 0; i < REPS; i++)); do
        mapfile -t -O ${#befores[@]} befores < <(one_run $row "${BEFORE[@]}")
        mapfile -t -O ${#afters[@]} afters < <(one_run $row "${AFTER[@]}")
    done
    before=$(median_of "${befores[@]}")
    after=$(median_of "${afters[@]}")
    printf '| %-34s | %35s ms | %19s ms |\n' "$label" "$before" "$after"
done
