#!/usr/bin/env bash
# scripts/run_gpt2_124M.sh: GPT-2 124M from scratch on FineWeb-Edu 10B, llm.c's recipe on our flags: 18,865
# steps of 524,288 tokens (one pass over ~9.9 B tokens; 6 · 124e6 · 9.9e9 ≈ 7.4e18 FLOPs), AdamW lr 6e-4 with
# 700 warmup steps and cosine decay to 0, weight decay 0.1, bf16, ZeRO-1, no recompute. On 8 A100/H100 80 GB
# a step takes ~0.3 s: about 1.5-2 hours. Fewer GPUs give the same run (the trainer accumulates gradients to
# reach -d), only slower. Resumable: it loops, resuming with -y 1 from the latest checkpoint, until the last
# step's DONE marker exists, so rerunning it after a crash or a reboot picks up where it stopped.
#
#   /usr/bin/python3 data/fineweb.py        # once: ~28 GB download, then tokenization into data/fineweb_edu_10B/
#   scripts/run_gpt2_124M.sh                # then: /usr/bin/python3 scripts/plot_log.py -o loss.png build/log_gpt2_124M
#
# Environment: NGPU (default: the GPUs nvidia-smi lists), B micro-batch per GPU (64: fits 80 GB at T=1024
# with -r 0; lower it on smaller GPUs), OUT (build/log_gpt2_124M), DATA (data/fineweb_edu_10B), USE_CUDNN (1),
# MAX_FAILURES (3: attempts in a row that end without a new checkpoint before giving up).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=18865
out_dir=${OUT:-build/log_gpt2_124M}
data=${DATA:-data/fineweb_edu_10B}
micro_batch=${B:-64}
. scripts/run_common.sh
check_gpus_and_batch "$micro_batch"
check_data "$data"
make train_gpt USE_CUDNN="${USE_CUDNN:-1}"
train_until_done "$steps" "$out_dir" "$data" "$micro_batch" ./train_gpt
