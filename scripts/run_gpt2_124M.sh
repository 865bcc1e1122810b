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
max_failures=${MAX_FAILURES:-3}
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
if ! [[ "$ngpu" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_gpt2_124M.sh: no GPU to use (NGPU='$ngpu'; nvidia-smi -L lists none?): set NGPU to a count" >&2
    exit 1
fi
if ! [[ "$micro_batch" =~ ^[1-9][0-9]*$ ]]; then
    echo "run_gpt2_124M.sh: B='$micro_batch': expected a positive micro-batch size" >&2
    exit 1
fi
if ! compgen -G "$data/fineweb_edu_10B_gpt2_train_*.bin" >/dev/null || [ ! -f "$data/gpt2_tokenizer.bin" ]; then
    echo "run_gpt2_124M.sh: no GPT-2 shards in $data: run /usr/bin/python3 data/fineweb.py first" >&2
    exit 1
fi
make train_gpt USE_CUDNN="${USE_CUDNN:-1}"

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
    mpirun "${mpirun_root[@]}" -np "$ngpu" ./train_gpt \
        -e d12 -i "$data/fineweb_edu_10B_gpt2_train_*.bin" -j "$data/fineweb_edu_10B_gpt2_val_*.bin" \
        -tf "$data/gpt2_tokenizer.bin" -o "$out_dir" \
        -b "$micro_batch" -t 1024 -d 524288 -x "$steps" \
        -l 0.0006 -u 700 -q 0.0 -k cosine -c 0.1 \
        -v 250 -m 20 -s 20000 -g 144 \
        -r 0 -z 1 -n 1000 -nk 2 -y 1 || true
    # a crash loop (bad flags, out of memory) would otherwise spin forever: count attempts that saved nothing
    if [ "$(latest_done)" = "$before" ] && [ ! -f "$done_file" ]; then
        failures=$((failures + 1))
        if [ "$failures" -ge "$max_failures" ]; then
            echo "run_gpt2_124M.sh: $failures attempts in a row ended without a new checkpoint; see above" >&2
            exit 1
        fi
    else
        failures=0
    fi
    sleep 1
done
echo "run_gpt2_124M.sh: finished: $done_file"
echo "plot: /usr/bin/python3 scripts/plot_log.py -o $out_dir/loss.png $out_dir"
