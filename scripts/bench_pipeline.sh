#!/usr/bin/env bash
# scripts/bench_pipeline.sh: each pipeline schedule's measured idle fraction beside its formula (doc/parallelism.md,
# "Pipeline parallelism"). A benchmark, not a test: it prints numbers and checks nothing.
#   scripts/bench_pipeline.sh [TRAIN] [STAGES] [MICRO_BATCHES]
# TRAIN: the trainer (default build/train_gpt_fp32, the CPU backend: its processes share this machine's cores, so a
# stage's passes stretch when another stage runs beside it; a GPU build on as many GPUs gives the schedules' own
# bubbles). STAGES p (default 4) processes run a fresh GPT-2 descriptor of 2p layers (C 128p, V 263) with m
# MICRO_BATCHES (default 8) of 2 x 64 tokens, 4 steps per schedule; the table gives the last step's idle time over
# busy time of the idlest and the busiest stage, their mean, and the schedule's formula ((p - 1) / m, interleaved's with
# 2 chunks per stage (p - 1) / 2m, ZB's (p - 1) / 3m), and each schedule's trace
# is left in build/bench_pipeline/ (scripts/plot_pipeline.py draws it).
set -euo pipefail
cd "$(dirname "$0")/.."
TRAIN=${1:-build/train_gpt_fp32}
p=${2:-4}
m=${3:-8}
out=build/bench_pipeline
mkdir -p "$out"
make -s "$TRAIN"
/usr/bin/python3 train_gpt.py --write-shard "$out/train.bin" --shard-tokens 65536 --V 263 --seed 7 >/dev/null
printf "%-11s %6s %6s %10s %10s %10s %10s\n" schedule p m "least idle" "most idle" "mean" formula
for schedule in gpipe 1f1b interleaved zb; do
    chunks=$([ $schedule = interleaved ] && echo "-ppv 2" || true)
    mpirun --allow-run-as-root --oversubscribe -np "$p" "$TRAIN" -e "d$((2 * p))" -ev 263 -et 64 -i "$out/train.bin" \
        -j "" -b 2 -t 64 -d $((128 * m)) -x 4 -v 0 -s 0 -pp "$p" -pps "$schedule" $chunks -ppt "$out/$schedule.txt" \
        >"$out/$schedule.log" 2>&1 || { echo "$schedule: $(tail -2 "$out/$schedule.log")"; exit 1; }
    /usr/bin/python3 - "$schedule" "$p" "$m" "$out/$schedule.log" "$out/$schedule.txt" <<'PY'
import re, sys
schedule, p, m, log, trace = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
last = re.findall(r"\| idle ([\d.]+)-([\d.]+) \(\S+ ([\d.]+)\)", open(log).read())[-1]
rows = [l.split() for l in open(trace).read().splitlines()[1:]]
step = max(int(r[0]) for r in rows)
fractions = []
for rank in sorted({int(r[1]) for r in rows}):
    mine = [(float(r[6]), float(r[7])) for r in rows if int(r[0]) == step and int(r[1]) == rank]
    busy = sum(e - b for b, e in mine)
    fractions.append((max(e for _, e in mine) - busy) / busy)
print("%-11s %6d %6d %10s %10s %10.3f %10s" % (schedule, p, m, last[0], last[1], sum(fractions) / len(fractions),
                                             last[2]))
PY
done
