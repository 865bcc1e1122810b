# scripts/run_common.sh: what scripts/run_gpt2_124M.sh and scripts/run_moe_8x124M.sh share, so that the two
# runs check their input and train the same way: the NGPU, B and data checks, llm.c's GPT-2 124M recipe, and
# the loop that resumes the trainer until the last step's DONE marker exists. Not run on its own: each of them
# sources it (. scripts/run_common.sh) from the repository root, under `set -euo pipefail`.
#
# Environment it reads: NGPU (default: the GPUs nvidia-smi lists), MAX_FAILURES (3: attempts in a row that
# end without a new checkpoint before giving up).

# the messages name the script that was run
script_name=$(basename "$0")
ngpu=${NGPU:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
max_failures=${MAX_FAILURES:-3}

fail() {
    echo "$script_name: $*" >&2
    exit 1
}

# check_gpus_and_batch MICRO_BATCH: one line and exit 1 unless NGPU and B are positive counts
check_gpus_and_batch() {
    if ! [[ "$ngpu" =~ ^[1-9][0-9]*$ ]]; then
        fail "no GPU to use (NGPU='$ngpu'; nvidia-smi -L lists none?): set NGPU to a count"
    fi
    if ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
        fail "B='$1': expected a positive micro-batch size"
    fi
}

# check_data DATA: one line and exit 1 unless DATA holds the FineWeb-Edu GPT-2 shards and tokenizer
check_data() {
    if ! compgen -G "$1/fineweb_edu_10B_gpt2_train_*.bin" >/dev/null || [ ! -f "$1/gpt2_tokenizer.bin" ]; then
        fail "no GPT-2 shards in $1: run /usr/bin/python3 data/fineweb.py first"
    fi
}

# train_until_done STEPS OUT_DIR DATA MICRO_BATCH TRAINER [FLAG...]: runs TRAINER (./train_gpt, ./train_moe)
# under mpirun on NGPU GPUs with llm.c's GPT-2 124M recipe (FLAGs go in before the memory and checkpoint
# flags), over and over with -y 1 (resume from the latest checkpoint) until OUT_DIR/DONE_<STEPS> exists.
train_until_done() {
    local steps=$1 out_dir=$2 data=$3 micro_batch=$4 trainer=$5
    shift 5
    # Open MPI refuses to run as root (containers on GPU machines often are) unless told it is meant
    local mpirun_root=()
    [ "$(id -u)" -eq 0 ] && mpirun_root=(--allow-run-as-root)
    local done_file failures=0 before
    done_file=$out_dir/DONE_$(printf '%08d' "$steps")
    while [ ! -f "$done_file" ]; do
        before=$(latest_done "$out_dir")
        # -y 1 also starts a fresh run when $out_dir holds no checkpoint yet
        mpirun "${mpirun_root[@]}" -np "$ngpu" "$trainer" \
            -e d12 -i "$data/fineweb_edu_10B_gpt2_train_*.bin" -j "$data/fineweb_edu_10B_gpt2_val_*.bin" \
            -tf "$data/gpt2_tokenizer.bin" -o "$out_dir" \
            -b "$micro_batch" -t 1024 -d 524288 -x "$steps" \
            -l 0.0006 -u 700 -q 0.0 -k cosine -c 0.1 \
            -v 250 -m 20 -s 20000 -g 144 \
            "$@" \
            -r 0 -z 1 -n 1000 -nk 2 -y 1 || true
        # a crash loop (bad flags, out of memory) would otherwise spin forever: count attempts that saved nothing
        if [ "$(latest_done "$out_dir")" = "$before" ] && [ ! -f "$done_file" ]; then
            failures=$((failures + 1))
            if [ "$failures" -ge "$max_failures" ]; then
                fail "$failures attempts in a row ended without a new checkpoint; see above"
            fi
        else
            failures=0
        fi
        sleep 1
    done
    echo "$script_name: finished: $done_file"
    echo "plot: /usr/bin/python3 scripts/plot_log.py -o $out_dir/loss.png $out_dir"
}

# latest_done OUT_DIR: the newest DONE marker, or nothing (ls fails when there is none yet: not an error
# under pipefail)
latest_done() { { ls "$1"/DONE_* 2>/dev/null || true; } | sort | tail -n 1; }
