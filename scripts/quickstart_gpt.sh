#!/usr/bin/env bash
# scripts/quickstart_gpt.sh: the GPT trainer in one command, on the CPU backend. Installs what is missing,
# builds the FP32 trainer, turns the GNU licence texts every Debian machine ships into byte-level data
# (data/bytes.py), and trains a 4-layer GPT (C=256) for 300 steps on 2 cores (about two minutes here),
# sampling text before and after. Log and checkpoints go to build/quickstart_gpt/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
make -s build/train_gpt_fp32
texts=(/usr/share/common-licenses/GPL-3 /usr/share/common-licenses/LGPL-3 /usr/share/common-licenses/GPL-2 /usr/share/common-licenses/Apache-2.0)
python3 data/bytes.py --out-dir build/quickstart_gpt/data "${texts[@]}"
build/train_gpt_fp32 -e d4 -ev 257 -et 128 -sd 1 \
    -i build/quickstart_gpt/data/train.bin -j build/quickstart_gpt/data/val.bin -tf build/quickstart_gpt/data/tokenizer.bin \
    -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 100 -m 8 -s 300 -g 200 -o build/quickstart_gpt -n 300 -nk 1
