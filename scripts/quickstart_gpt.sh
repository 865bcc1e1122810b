#!/usr/bin/env bash
# scripts/quickstart_gpt.sh: the GPT trainer in one command, on the CPU backend. Installs what is missing,
# prepares TinyShakespeare with the byte-level tokenizer (offline, data/tinyshakespeare.py falls back to the
# King James Bible of Debian's bible-kjv, under its own name), builds the FP32 trainer, trains a 4-layer GPT
# (C=256) for 300 steps on 2 cores (about three minutes here), sampling text before and after, and plots the
# loss curve. Log, checkpoint and build/quickstart_gpt/loss.png go to build/quickstart_gpt/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
/usr/bin/python3 data/tinyshakespeare.py --tokenizer bytes
data=data/tinyshakespeare/tinyshakespeare_bytes
tokenizer=data/tinyshakespeare/bytes_tokenizer.bin
if [ ! -e "${data}_train.bin" ]; then
    data=data/fallback_kjv/fallback_kjv_bytes
    tokenizer=data/fallback_kjv/bytes_tokenizer.bin
fi
make -s build/train_gpt_fp32
out=build/quickstart_gpt
rm -rf "$out"
build/train_gpt_fp32 -e d4 -ev 257 -et 128 -sd 1 -i "${data}_train.bin" -j "${data}_val.bin" -tf "$tokenizer" \
    -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 100 -m 8 -s 300 -g 200 -o "$out" -n 300 -nk 1
/usr/bin/python3 scripts/plot_log.py -o "$out/loss.png" "$out"
echo "quickstart: loss curve in $out/loss.png"
