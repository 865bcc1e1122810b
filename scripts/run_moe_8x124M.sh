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
max_failures=${MAX_FAILURES:-3}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if ! [[ "$ngpu" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_moe_8x124M.sh: no GPU to use (NGPU='$ngpu'; nvidia-smi -L lists none?): set NGPU to a count" >&2
    exit 1
fi
if ! [[ "$micro_batch" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_moe_8x124M.sh: B='$micro_batch': expected a positive micro-batch size" >&2
    exit 1
fi
# the experts are split evenly over EP GPUs, and the GPUs into groups of EP
if ! [[ "$expert_parallel" =~ ^[1-9][0-9]*$ ]] || [ $((ngpu % expert_parallel)) -ne 0 ] \
        || [ $((8 % expert_parallel)) -ne 0 ]; then
    echo "run_moe_8x124M.sh: EP='$expert_parallel': expected a divisor of both the 8 experts and NGPU=$ngpu" >&2
    exit 1
fi
if ! compgen -G "$data/fineweb_edu_10B_gpt2_train_*.bin" >/dev/null || [ ! -f "$data/gpt2_tokenizer.bin" ]; then
    echo "run_moe_8x124M.sh: no GPT-2 shards in $data: run /usr/bin/python3 data/fineweb.py first" >&2
    exit 1
fi
make train_moe USE_CUDNN="${USE_CUDNN:-1}"

# Open MPI refuses to run as root (containers on GPU machines often are) unless told it is meant
mpirun_root=()
[ "$(id -u)" -eq 0 ] && mpirun_root=(--allow-run-as-root)
# the newest DONE marker, or nothing (ls fails when there is none yet: not an error under pipefail)
latest_done() { { ls "$out_dir"/DONE_* 2>/dev/null || true; } | sort | tail -n 1; }
done_file=$out_dir/DONE_$(printf '%08d' "$steps")
failures=0
while [ ! -f "$done_file" ]; do
    before=$(latest_done)
    # -y 1 also starts a fresh run when $out_dir holds no checkpoint yet
    mpirun "${mpirun_root[@]}" -np "$ngpu" ./train_moe \
        -e d12 -i "$data/fineweb_edu_10B_gpt2_train_*.bin" -j "$data/fineweb_edu_10B_gpt2_val_*.bin" \
        -tf "$data/gpt2_tokenizer.bin" -o "$out_dir" \
        -b "$micro_batch" -t 1024 -d 524288 -x "$steps" \
        -l 0.0006 -u 700 -q 0.0 -k cosine -c 0.1 \
        -v 250 -m 20 -s 20000 -g 144 \
        -ne 8 -tk 1 -me 2 -eh 3072 -cf 1.25 -cfe 2.0 -ra 0.01 -rz 0.001 -ep "$expert_parallel" \
        -r 0 -z 1 -n 1000 -nk 2 -y 1 || true
    # a crash loop (bad flags, out of memory) would otherwise spin forever: count attempts that saved nothing
    if [ "$(latest_done)" = "$before" ] && [ ! -f "$done_file" ]; then
        failures=$((failures + 1))
        if [ "$failures" -ge "$max_failures" ]; then
            echo "run_moe_8x124M.sh: $failures attempts in a row ended without a new checkpoint; see above" >&2
            exit 1
        fi
    else
        failures=0
    fi
    sleep 1
done
echo "run_moe_8x124M.sh: finished: $done_file"
echo "plot: /usr/bin/python3 scripts/plot_log.py -o $out_dir/loss.png $out_dir"
