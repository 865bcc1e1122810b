#!/usr/bin/env bash
# scripts/quickstart.sh: the project in one command, on the CPU backend. Installs what is missing, prepares
# TinyShakespeare with the byte-level tokenizer (offline, data/tinyshakespeare.py falls back to the King James
# Bible of Debian's bible-kjv, under its own name), builds the trainer (for the GPU when one is present, else the
# CPU backend's FP32 build), trains a small Switch-MoE GPT
# (4 layers, C=256, 4 experts, top-1, MoE every other layer) for 300 steps on 2 cores (a few minutes here),
# sampling text before and after and validating with the expert loads, and plots the loss curve.
#   scripts/quickstart.sh          the MoE model
#   scripts/quickstart.sh gpt      the dense GPT of the same size
# Log, checkpoint and loss.png go to build/quickstart_moe/ (or build/quickstart_gpt/).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-moe}
case "$model" in
    moe) moe_flags=(-ne 4 -tk 1 -me 2 -cf 1.25 -cfe 2.0) ;;
    gpt) moe_flags=() ;;
    *) echo "quickstart.sh: unknown model '$model' (expected moe or gpt)" >&2; exit 1 ;;
esac
# the GPU build where a GPU answers, else the CPU backend's
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    trainer=./train_$model
else
    trainer=build/train_${model}_fp32
fi
scripts/install_deps.sh
/usr/bin/python3 data/tinyshakespeare.py --tokenizer bytes
data=data/tinyshakespeare/tinyshakespeare_bytes
tokenizer=data/tinyshakespeare/bytes_tokenizer.bin
if [ ! -e "${data}_train.bin" ]; then
    data=data/fallback_kjv/fallback_kjv_bytes
    tokenizer=data/fallback_kjv/bytes_tokenizer.bin
fi
make -s "$trainer"
out=build/quickstart_$model
rm -rf "$out"
"$trainer" -e d4 -ev 257 -et 128 -sd 1 "${moe_flags[@]}" -i "${data}_train.bin" -j "${data}_val.bin" -tf "$tokenizer" \
    -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 100 -m 8 -s 300 -g 200 -o "$out" -n 300 -nk 1
/usr/bin/python3 scripts/plot_log.py -o "$out/loss.png" "$out"
echo "quickstart: loss curve in $out/loss.png"
