#!/usr/bin/env bash
# scripts/run_moe_8x124M.sh: a Switch Transformer on the GPT-2 124M backbone, trained like
# scripts/run_gpt2_124M.sh (same data, tokens, schedule and flags) so that the two loss curves compare:
# every other FFN layer (layers 2, 4, ..., 12: -me 2) is replaced by 8 experts of GPT-2's MLP size (-ne 8,
# -eh 3072) with top-1 routing (-tk 1), capacity factor 1.25 in training and 2.0 in evaluation (Switch
# §2.2), load-balancing loss 0.01 (Switch §2.2) and router z-loss 0.001 (ST-MoE §3). About 320 M parameters,
# about the FLOPs per token of the dense model. Resumable: it loops with -y 1 until the last step's DONE
# marker exists. The log adds "s:STEP aux:.. z:.. drop:.. load_min:.. load_max:.. load_cv:.." lines, which
# scripts/plot_log.py draws.
#
#   /usr/bin/python3 data/fineweb.py        # once: ~28 GB download, then tokenization into data/fineweb_edu_10B/
#   scripts/run_moe_8x124M.sh               # then, beside the dense run:
#   /usr/bin/python3 scripts/plot_log.py -o moe_vs_dense.png build/log_gpt2_124M build/log_moe_8x124M
#
# Environment: NGPU (default: the GPUs nvidia-smi lists), B micro-batch per GPU (32: the experts' activations
# need room; the trainer prints its memory plan), EP expert-parallel degree (1: every GPU holds all 8
# experts; 8 on 8 GPUs puts one expert on each), OUT (build/log_moe_8x124M), DATA (data/fineweb_edu_10B),
# USE_CUDNN (1), MAX_FAILURES (3: attempts in a row that end without a new checkpoint before giving up).
set -euo pipefail
cd "$(dirname "$0")/.."
steps=18865
out_dir=${OUT:-build/log_moe_8x124M}
data=${DATA:-data/fineweb_edu_10B}
micro_batch=${B:-32}
expert_parallel=${EP:-1}
. scripts/run_common.sh
check_gpus_and_batch "$micro_batch"
# the experts are split evenly over EP GPUs, and the GPUs into groups of EP
if ! [[ "$expert_parallel" =~ ^[1-9][0-9]*$ ]] || [ $((ngpu % expert_parallel)) -ne 0 ] \
        || [ $((8 % expert_parallel)) -ne 0 ]; then
    fail "EP='$expert_parallel': expected a divisor of both the 8 experts and NGPU=$ngpu"
fi
check_data "$data"
make train_moe USE_CUDNN="${USE_CUDNN:-1}"
train_until_done "$steps" "$out_dir" "$data" "$micro_batch" ./train_moe \
    -ne 8 -tk 1 -me 2 -eh 3072 -cf 1.25 -cfe 2.0 -ra 0.01 -rz 0.001 -ep "$expert_parallel"
