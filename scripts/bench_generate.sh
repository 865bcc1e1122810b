#!/usr/bin/env bash
# scripts/bench_generate.sh: generate's throughput against the batch size, and its KV memory waste against a
# contiguous maxT cache (doc/inference.md). A benchmark, not a test: it prints numbers and checks nothing.
#   scripts/bench_generate.sh [MODEL.bin] [GENERATE]
# MODEL.bin: any model file (default: a fresh llama descriptor d4 with maxT 512, V 263, written by the FP32 CPU
# trainer in a single step); GENERATE: the program (default build/generate_fp32, the CPU backend: its times are CPU
# times, a GPU's ./generate gives GPU ones). For each batch size 1, 2, 4, ..., 64: that many prompts of 32 random token
# ids (one per sequence), 64 greedy tokens each, all running together, blocks of 16; a table of prefill and decode
# tokens per second, the decode step's time, and the mean KV waste paged and as a contiguous cache.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
GEN=${2:-build/generate_fp32}
make -s "$GEN"
model=${1:-}
if [ -z "$model" ]; then
    make -s build/train_gpt_fp32
    /usr/bin/python3 train_gpt.py --write-shard "$work/train.bin" --shard-tokens 4096 --V 263 --seed 7 >/dev/null
    build/train_gpt_fp32 -e d4 -arch llama -kv 2 -ev 263 -et 512 -i "$work/train.bin" -j "" -b 1 -t 64 -x 1 -n 1 -v 0 -s 0 \
        -o "$work/run" >/dev/null
    model="$work/run/model_00000001.bin"
fi
printf "%6s %16s %16s %14s %12s %14s\n" batch "prefill tok/s" "decode tok/s" "step (ms)" "KV waste" "contiguous"
for batch in 1 2 4 8 16 32 64; do
    /usr/bin/python3 -c "import random, sys; r = random.Random(1)
for _ in range(int(sys.argv[1])): print(' '.join(str(r.randrange(263)) for _ in range(32)))" "$batch" >"$work/prompts.txt"
    "$GEN" -e "$model" -i "$work/prompts.txt" -ids 1 -temp 0 -g 64 -b "$batch" -bs 16 >/dev/null 2>"$work/summary.txt"
    /usr/bin/python3 - "$batch" "$work/summary.txt" <<'PY'
import re, sys
batch, text = int(sys.argv[1]), open(sys.argv[2]).read()
prefill = float(re.search(r"prefill \d+ tokens, ([\d.]+) tokens/s", text).group(1))
decode_tokens, steps, decode = re.search(r"decode (\d+) tokens in (\d+) steps, ([\d.]+) tokens/s", text).groups()
waste, contiguous = re.search(r"KV waste ([\d.]+)% paged, ([\d.]+)% as a contiguous", text).groups()
step_ms = 1000.0 * int(decode_tokens) / float(decode) / int(steps)
print(f"{batch:6d} {prefill:16.1f} {float(decode):16.1f} {step_ms:14.2f} {waste:>11}% {contiguous:>13}%")
PY
done
