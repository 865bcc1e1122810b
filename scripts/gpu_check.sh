#!/usr/bin/env bash
# scripts/gpu_check.sh: the one command a lent NVIDIA GPU runs. It builds everything for that GPU, checks the
# GPT and MoE trainers against PyTorch (test_gpt: FP32 and BF16, recompute 0/1/2; test_moe: top-1 with drops,
# top-2, dropless top-1 (the grouped GEMMs), noisy top-2 gating; test_gpt and test_moe once more in BF16 on cuDNN's
# attention, the USE_CUDNN=1 build, with its default deterministic backward), trains GPT-2 124M for 30 steps on
# synthetic data (bf16, B=8 T=1024, recompute 0 and 1, flash attention; and recompute 1 with -fa 0, the cuBLAS-
# and-softmax attention) and the Switch-MoE model on the same backbone beside it
# (8 experts, top-1, every other layer), GPT-2 124M at B=64 with flash attention, at recompute 1 with -z 2, -z 3 and
# with -oo 1 and 2 (their targets), runs every kernel-lab file at
# full size (the flash-attention labs first, and once more built with cuDNN for its variant 5), and prints one
# summary table: test results, tokens/s, MFU, peak memory, each lab variant's best time against its floor, and flash
# attention's forward+backward against cuDNN's and the cuBLAS path's at B=8..64, T=1024, HS=64 (targets:
# >= 90% of cuDNN's speed, >= 4x the cuBLAS path).
#   scripts/gpu_check.sh LOGDIR                the whole check, one log per stage in LOGDIR (under 8 minutes
#                                              on an H100-class GPU)
#   scripts/gpu_check.sh --parse-only LOGDIR   only the summary table, from the logs of an earlier run
# Without an NVIDIA GPU (nvidia-smi missing or failing, or a CUDA probe finding no device) it says so in one
# line and exits with status 2 before building anything. Binaries and data go to build/gpucheck/ (the USE_CUDNN=1
# builds to build/gpucheck/cudnn/), the lab binaries to dev/cuda/ (where make -C dev/cuda puts them). A time
# budget (GPU_CHECK_BUDGET_S, default 450 s) bounds the run, labs last: whatever would start past it is skipped,
# and its row in the table says so.
# Exit status: 0 when every test and lab validation passed and every training run finished, 1 otherwise.
set -u
usage() {
    echo "usage: $0 LOGDIR | --parse-only LOGDIR" >&2
    exit 2
}
if [ $# -eq 1 ] && [ "$1" != --parse-only ]; then PARSE_ONLY=0
elif [ $# -eq 2 ] && [ "$1" = --parse-only ] && [ -d "$2" ]; then PARSE_ONLY=1
else usage; fi
LOGDIR=$(realpath -m "${!#}")  # absolute: the script works from the repository root
cd "$(dirname "$0")/.." || exit 1

BIN=build/gpucheck
PYTHON=/usr/bin/python3
STEPS=30
SHARD_TOKENS=2097152  # 2^21: 32 batches of 64 x 1024, so 30 steps stay inside one epoch of the shard
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}

# ----------------------------------------------------------------------------------------------------------
# The summary table, from the logs alone (so that --parse-only gives the same table as the run). Every stage
# log ends with the line run_stage appends: "gpu_check: exit status N", "gpu_check: timed out after N s" or
# "gpu_check: skipped: why".

stage_status() {
    local last
    last=$(grep -E '^gpu_check: ' "$1" | tail -n 1)
    case "$last" in
    "gpu_check: exit status 0") echo ok ;;
    "gpu_check: exit status "*) echo "exit status ${last#gpu_check: exit status }" ;;
    "gpu_check: "*) echo "${last#gpu_check: }" ;;
    *) echo "no status line" ;;
    esac
}

# one row per stage log of the given kind: its status (builds, reference states, data)
summarize_statuses() {
    local log
    for log in "$@"; do
        [ -e "$log" ] && printf '  %-34s %s\n' "$(basename "$log" .log)" "$(stage_status "$log")"
    done
}

# one row per test log: pass with its count of checks, or what went wrong
summarize_tests() {
    local log status counts
    for log in "$1"/test_*.log; do
        [ -e "$log" ] || continue
        status=$(stage_status "$log")
        counts=$(grep -E '^test_[a-z]+: [0-9]+ passed, [0-9]+ failed$' "$log" | tail -n 1 | sed 's/^[^:]*: //')
        if [ "$status" = ok ]; then status="pass ($counts)"; else status="FAIL: $status${counts:+ ($counts)}"; fi
        printf '  %-34s %s\n' "$(basename "$log" .log)" "$status"
    done
}

# A training log's row: tokens/s and MFU are medians over the last 10 step lines; memory is the trainer's plan
# (the sum of its memory rows) and the peak of nvidia-smi's samples during the run (NAME.mem, when there are
# samples). With "tokens" as second argument: only the median tokens/s and the batch.
trainer_row() {
    local log=$1 mem=()
    [ -e "${log%.log}.mem" ] && mem=("${log%.log}.mem")
    awk -v name="$(basename "$log" .log)" -v status="$(stage_status "$log")" -v only_tokens="${2:-}" '
        function median(values, count,    sorted, i, j, v, first) {
            if (count == 0) return -1
            first = count > 10 ? count - 9 : 1
            for (i = first; i <= count; i++) {
                v = values[i]
                for (j = i - first; j > 0 && sorted[j] > v; j--) sorted[j + 1] = sorted[j]
                sorted[j + 1] = v
            }
            count = count - first + 1
            return count % 2 ? sorted[(count + 1) / 2] : (sorted[count / 2] + sorted[count / 2 + 1]) / 2
        }
        FILENAME ~ /\.mem$/ { if ($1 ~ /^[0-9]+$/ && $1 + 0 > peak) peak = $1 + 0; next }
        /^\| model / { match($0, /L=[0-9]+ NH=[0-9]+ C=[0-9]+/); model = substr($0, RSTART, RLENGTH) }
        /^\| precision / { precision = $4 }
        /^\| batch / { match($0, /B=[0-9]+ T=[0-9]+/); batch = substr($0, RSTART, RLENGTH) }
        /^\| memory: device total / { match($0, /[0-9.]+ MiB/); plan = substr($0, RSTART, RLENGTH - 4) }
        /^step [0-9]+\/[0-9]+ \|/ {
            steps++
            if (match($0, /[0-9.]+ tok\/s/)) tokens[++num_tokens] = substr($0, RSTART, RLENGTH - 6) + 0
            if (match($0, /[0-9.]+% MFU/)) mfu[++num_mfu] = substr($0, RSTART, RLENGTH - 5) + 0
        }
        END {
            t = median(tokens, num_tokens)
            m = median(mfu, num_mfu)
            if (only_tokens != "") { printf "%.0f (%s)\n", t, batch; exit }
            printf "  %-16s %-24s %-13s %5d %11s %6s %10s %10s  %s\n", name,
                   model == "" ? "-" : model " " precision, batch == "" ? "-" : batch, steps,
                   t < 0 ? "-" : sprintf("%.0f", t), m < 0 ? "-" : sprintf("%.1f%%", m),
                   plan == 0 ? "-" : sprintf("%.2f GiB", plan / 1024),
                   peak == 0 ? "-" : sprintf("%.2f GiB", peak / 1024), status
        }' "$log" "${mem[@]}"
}

summarize_trainers() {
    local logdir=$1 log dense moe_tokens dense_tokens
    printf '  %-16s %-24s %-13s %5s %11s %6s %10s %10s  %s\n' run model batch steps "tok/s (med)" MFU "plan mem" \
        "peak mem" status
    for log in "$logdir"/train_gpt_r*.log "$logdir"/train_gpt_fa0_r*.log "$logdir"/train_gpt_b64_r*.log \
        "$logdir"/train_gpt_z2_r*.log "$logdir"/train_gpt_z3_r*.log "$logdir"/train_gpt_oo1_r*.log \
        "$logdir"/train_gpt_oo2_r*.log \
        "$logdir"/train_moe_r*.log; do
        [ -e "$log" ] && trainer_row "$log"
    done
    for variant in z2 z3 oo1 oo2; do  # against the same run without it (on one GPU -z 1 is -z 0)
        [ -e "$logdir/train_gpt_${variant}_r1.log" ] && [ -e "$logdir/train_gpt_r1.log" ] || continue
        awk -v name="$variant" -v a="$(trainer_row "$logdir/train_gpt_${variant}_r1.log" tokens)" \
            -v b="$(trainer_row "$logdir/train_gpt_r1.log" tokens)" 'BEGIN {
            ratio = a + 0 > 0 && b + 0 > 0 ? sprintf("%s / %s = %.2f", a, b, a / b) : "-"
            printf "  %s / train_gpt tokens/s at r1: %s\n", name, ratio }'
    done
    ls "$logdir"/train_gpt_r*.log >/dev/null 2>&1 || echo "  train_gpt: no log in $logdir"
    if ls "$logdir"/train_moe_r*.log >/dev/null 2>&1; then
        for log in "$logdir"/train_moe_r*.log; do  # the MoE model beside the dense one, same recompute
            dense=$logdir/train_gpt_${log##*train_moe_}
            [ -e "$dense" ] || continue
            moe_tokens=$(trainer_row "$log" tokens)
            dense_tokens=$(trainer_row "$dense" tokens)
            awk -v r="$(basename "${log##*_}" .log)" -v moe="$moe_tokens" -v dense="$dense_tokens" 'BEGIN {
                ratio = moe + 0 > 0 && dense + 0 > 0 ? sprintf("%s / %s = %.2f", moe, dense, moe / dense) : "-"
                printf "  moe / dense tokens/s at %s: %s\n", r, ratio }'
        done
    else
        echo "  train_moe: no log in $logdir"
    fi
}

# one row per (kernel, variant) of a lab log: the fastest of its timing rows (lab_print_row: variant, block,
# ms, throughput value and unit, % floor), under the kernel name of the lab_print_header line above them;
# then, unless the lab passed, its status and first FAIL line
lab_rows() {
    awk -v status="$(stage_status "$1")" -v lab="$(basename "$1" .log)" '
        { previous = current; current = $0 }
        /^  variant +block +time/ { kernel = previous; sub(/:.*/, "", kernel); next }
        kernel != "" && NF == 6 && $1 ~ /^[0-9]+$/ && $2 ~ /^[0-9]+$/ && $3 ~ /^[0-9.]+$/ {
            key = kernel " " $1
            if (!(key in best)) order[++count] = key
            if (!(key in best) || $3 + 0 < best[key] + 0) {
                best[key] = $3; block[key] = $2; throughput[key] = $4 " " $5; floor[key] = $6
            }
            next
        }
        { kernel = "" }
        /^FAIL/ && first_failure == "" { first_failure = $0 }
        END {
            for (i = 1; i <= count; i++) {
                key = order[i]
                variant = key; sub(/.* /, "", variant)
                name = key; sub(/ [0-9]+$/, "", name)
                printf "  %-34s %7s %6s %10s %14s %8s\n", name, variant, block[key], best[key], throughput[key], floor[key]
            }
            if (status != "ok")
                printf "  %-34s %s%s\n", lab, status, first_failure == "" ? "" : ": " first_failure
        }' "$1"
}

summarize_labs() {
    local log
    printf '  %-34s %7s %6s %10s %14s %8s\n' kernel variant block "best ms" throughput "% floor"
    for log in "$1"/lab_*.log; do
        [ -e "$log" ] && lab_rows "$log"
    done
}

# flash attention (variant 4: tensor cores in bf16) against cuDNN (variant 5, the USE_CUDNN lab build) and the
# cuBLAS path (variant 1), forward + backward, each pass's fastest timing row at each B (T=1024, HS=64)
summarize_flash() {
    local logdir=$1 logs=()
    for log in "$logdir"/lab_flash_attention_{forward,backward}{,_cudnn}.log; do [ -e "$log" ] && logs+=("$log"); done
    printf '  %-7s %12s %12s %12s %18s %18s\n' batch "cuBLAS ms" "flash ms" "cuDNN ms" "flash/cuDNN speed" \
        "flash vs cuBLAS"
    if [ ${#logs[@]} -eq 0 ]; then
        echo "  not measured (no flash-attention lab log)"
        return
    fi
    awk '
        FNR == 1 { pass = FILENAME ~ /backward/ ? "bwd" : "fwd" }
        /^flash_attention_(forward|backward): B=[0-9]+ T=1024 / { size = substr($2, 3) + 0; next }
        /^  variant +block +time/ { table = 1; next }
        table && NF == 6 && $1 ~ /^[0-9]+$/ {
            key = size SUBSEP $1 SUBSEP pass
            if (!(key in ms) || $3 + 0 < ms[key] + 0) ms[key] = $3
            seen[size] = 1
            next
        }
        { table = 0 }
        function total(b, variant,    forward, backward) {
            forward = b SUBSEP variant SUBSEP "fwd"
            backward = b SUBSEP variant SUBSEP "bwd"
            if (!(forward in ms) || !(backward in ms)) return -1
            return ms[forward] + ms[backward]
        }
        function shown(x) { return x < 0 ? "not measured" : sprintf("%.3f", x) }
        END {
            for (b = 8; b <= 64; b *= 2) {
                if (!(b in seen)) { printf "  B=%-5d not measured\n", b; continue }
                cublas = total(b, 1); flash = total(b, 4); cudnn = total(b, 5)
                printf "  B=%-5d %12s %12s %12s %18s %18s\n", b, shown(cublas), shown(flash), shown(cudnn),
                       (flash > 0 && cudnn > 0 ? sprintf("%.0f%% (>= 90%%)", 100 * cudnn / flash) : "not measured"),
                       (flash > 0 && cublas > 0 ? sprintf("%.1fx (>= 4x)", cublas / flash) : "not measured")
            }
        }' "${logs[@]}"
}

# Prints the table; returns 0 when every stage log in LOGDIR says ok.
summarize() {
    local logdir=$1 device log stages=0 not_ok=0
    device=$(sed -n 's/^gpu_check: device 0: //p' "$logdir/gpu.log" 2>/dev/null | head -n 1)
    [ -n "$device" ] || device=$(sed -n 's/^| device *| \(.*[^ ]\) *|$/\1/p' "$logdir"/train_gpt_r*.log 2>/dev/null | head -n 1)
    echo "==================================================================================================="
    echo "gpu_check summary: ${device:-unknown device}; logs in $logdir"
    echo "-- builds, reference states, data -----------------------------------------------------------------"
    summarize_statuses "$logdir"/build_*.log "$logdir"/reference_*.log "$logdir/data.log"
    echo "-- test_gpt and test_moe against PyTorch ----------------------------------------------------------"
    summarize_tests "$logdir"
    echo "-- trainers on synthetic data (MoE: -ne 8 -tk 1 -me 2); tok/s and MFU: medians of the last 10 steps -"
    summarize_trainers "$logdir"
    echo "-- kernel lab (dev/cuda): each variant's fastest block size ----------------------------------------"
    summarize_labs "$logdir"
    echo "-- flash attention forward+backward, bf16, T=1024, HS=64 (llmc/flash_attention.cuh on tensor cores) --"
    summarize_flash "$logdir"
    echo "==================================================================================================="
    for log in "$logdir"/*.log; do
        [ -e "$log" ] && [ "$(basename "$log")" != gpu.log ] || continue
        stages=$((stages + 1))
        [ "$(stage_status "$log")" = ok ] || not_ok=$((not_ok + 1))
    done
    ls "$logdir"/train_gpt_r*.log >/dev/null 2>&1 || not_ok=$((not_ok + 1))
    if [ "$not_ok" -eq 0 ]; then echo "gpu_check: all $stages stages passed"
    else echo "gpu_check: $not_ok of $stages stages did not pass (see their rows above and their logs)"; fi
    [ "$not_ok" -eq 0 ]
}

if [ "$PARSE_ONLY" -eq 1 ]; then
    summarize "$LOGDIR"
    exit
fi

# ----------------------------------------------------------------------------------------------------------
# Is there a GPU? Three questions, each answered in one line when the answer is no: nvidia-smi, nvcc, and a
# CUDA probe (nvidia-smi can work in a container whose CUDA runtime sees no device).
no_gpu() {
    echo "gpu_check: no usable NVIDIA GPU: $*" >&2
    exit 2
}
command -v nvidia-smi >/dev/null 2>&1 || no_gpu "nvidia-smi not found"
gpu_query=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>&1) ||
    no_gpu "nvidia-smi failed: $(head -n 1 <<<"$gpu_query")"
compute_cap=$(head -n 1 <<<"$gpu_query" | sed 's/.*, *//')
[[ "$compute_cap" =~ ^[0-9]+\.[0-9]+$ ]] || no_gpu "nvidia-smi reports no compute capability: $(head -n 1 <<<"$gpu_query")"
command -v nvcc >/dev/null 2>&1 || [ ! -x /usr/local/cuda/bin/nvcc ] || PATH=$PATH:/usr/local/cuda/bin
command -v nvcc >/dev/null 2>&1 || no_gpu "nvcc not found (a GPU is there, but nothing can be built for it)"
arch=${compute_cap/./}
GPU_ARCH="-gencode arch=compute_$arch,code=sm_$arch"
read -ra ARCH_FLAGS <<<"$GPU_ARCH"
mkdir -p "$BIN" || exit 1
cat >"$BIN/cuda_probe.cu" <<'EOF'
// written by scripts/gpu_check.sh: does the CUDA runtime see a device?
#include <cuda_runtime.h>
#include <stdio.h>
int main(void) {
    int count = 0;
    cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess || count == 0) {
        printf("no CUDA device (%s)\n", error != cudaSuccess ? cudaGetErrorString(error) : "count 0");
        return 1;
    }
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, 0);
    printf("gpu_check: device 0: %s, sm_%d%d, %.0f GiB\n", p.name, p.major, p.minor, p.totalGlobalMem / 1073741824.0);
    return 0;
}
EOF
probe=$(nvcc "${ARCH_FLAGS[@]}" "$BIN/cuda_probe.cu" -o "$BIN/cuda_probe" 2>&1 && "$BIN/cuda_probe" 2>&1) ||
    no_gpu "CUDA probe: $(tail -n 1 <<<"$probe")"
# the summary reads every log in LOGDIR: another run's would mix in
if ls "$LOGDIR"/*.log >/dev/null 2>&1; then
    echo "gpu_check: $LOGDIR already holds logs of a run: give a new directory" >&2
    exit 1
fi
mkdir -p "$LOGDIR" || exit 1
{
    echo "$gpu_query"
    echo "$probe"
} >"$LOGDIR/gpu.log"
echo "$probe; building for $GPU_ARCH"

# ----------------------------------------------------------------------------------------------------------
# Stages
start=$(date +%s)
deadline=$((start + BUDGET_S))
# Open MPI refuses root without these; the trainers initialise MPI even as a single process
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# run_stage LOG LIMIT_S COMMAND...: the command's output into LOG, at most LIMIT_S seconds and never past the
# deadline, then the status line the summary reads back; one progress line on stdout
run_stage() {
    local log=$1 limit=$2
    shift 2
    local left=$((deadline - $(date +%s)))
    if [ "$left" -lt 5 ]; then
        echo "gpu_check: skipped: time budget of $BUDGET_S s spent" >"$log"
    else
        [ "$limit" -gt "$left" ] && limit=$left
        # line-buffered, so that a command the timeout kills leaves every line it printed
        timeout -k 5 "$limit" stdbuf -oL "$@" >"$log" 2>&1
        local rc=$?
        if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then echo "gpu_check: timed out after $limit s" >>"$log"
        else echo "gpu_check: exit status $rc" >>"$log"; fi
    fi
    printf 'gpu_check [%4d s] %-28s %s\n' $(($(date +%s) - start)) "$(basename "$log" .log)" "$(stage_status "$log")"
    [ "$(stage_status "$log")" = ok ]
}

skip_stage() {
    echo "gpu_check: skipped: $2" >"$1"
    printf 'gpu_check [%4d s] %-28s skipped: %s\n' $(($(date +%s) - start)) "$(basename "$1" .log)" "$2"
}

# the top-level Makefile's own variables, for the reference states
make_var() {
    make --no-print-directory -s -f Makefile -f - "gpucheck-print-$1" <<<'gpucheck-print-%: ; @echo $($*)'
}
read -ra REF_ARGS <<<"$(make_var REF_ARGS)"
read -ra MOE_REF_ARGS <<<"$(make_var MOE_REF_ARGS)"

# build: the trainers and tests through the Makefile's GPU rules (GPU_BUILD/NAME_PREC), and the labs, in parallel
build_binary() {  # NAME_PREC
    run_stage "$LOGDIR/build_$1.log" 300 make --no-print-directory GPU_BUILD="$BIN" GPU_ARCH="$GPU_ARCH" "$BIN/$1"
}
build_binary train_gpt_bf16 &
build_binary test_gpt_bf16 &
build_binary test_gpt_fp32 &
build_binary train_moe_bf16 &
build_binary test_moe_bf16 &
build_binary test_moe_fp32 &
# the tests on cuDNN's attention: bf16 only (cuDNN's flash attention has no fp32), beside the others
build_cudnn_binary() {  # NAME_PREC
    run_stage "$LOGDIR/build_$1_cudnn.log" 300 make --no-print-directory GPU_BUILD="$BIN/cudnn" GPU_ARCH="$GPU_ARCH" \
        USE_CUDNN=1 "$BIN/cudnn/$1"
}
build_cudnn_binary test_gpt_bf16 &
build_cudnn_binary test_moe_bf16 &
# -B: lab binaries left in dev/cuda by a build for another GPU would otherwise count as up to date
run_stage "$LOGDIR/build_labs.log" 300 make -B -k -j "$(nproc)" -C dev/cuda GPU_ARCH="$GPU_ARCH" &
run_stage "$LOGDIR/build_labs_cudnn.log" 300 make -B -k -j 2 -C dev/cuda GPU_ARCH="$GPU_ARCH" \
    flash_attention_forward_cudnn flash_attention_backward_cudnn &
wait

have_torch=0
"$PYTHON" -c 'import torch' >/dev/null 2>&1 && have_torch=1

# test_gpt against the PyTorch reference states the Makefile's REF_ARGS describe
if [ $have_torch -eq 0 ]; then
    for p in fp32 bf16; do
        for r in 0 1 2; do skip_stage "$LOGDIR/test_gpt_${p}_r$r.log" "torch is missing for $PYTHON (no reference state)"; done
    done
    for t in test_gpt_bf16_cudnn test_moe_bf16_cudnn; do
        skip_stage "$LOGDIR/$t.log" "torch is missing for $PYTHON (no reference state)"
    done
else
    mkdir -p "$BIN/ref"
    for p in fp32 bf16; do
        dtype=float32
        [ $p = bf16 ] && dtype=bfloat16
        run_stage "$LOGDIR/reference_$p.log" 120 "$PYTHON" train_gpt.py --write-reference "$BIN/ref/tiny_$p" \
            "${REF_ARGS[@]}" --dtype $dtype
        for r in 0 1 2; do
            if [ ! -x "$BIN/test_gpt_$p" ]; then skip_stage "$LOGDIR/test_gpt_${p}_r$r.log" "not built (build_test_gpt_$p.log)"
            else run_stage "$LOGDIR/test_gpt_${p}_r$r.log" 120 "$BIN/test_gpt_$p" "$BIN/ref/tiny_$p" -r $r; fi
        done
        # the MoE trainer: top-1 with drops, and top-2 every other layer (the Makefile's MoE references)
        run_stage "$LOGDIR/reference_moe_$p.log" 120 "$PYTHON" train_moe.py --write-reference "$BIN/ref/moe_k1_$p" \
            "${MOE_REF_ARGS[@]}" --topk 1 --moe-every 1 --cf 0.5 --dtype $dtype
        run_stage "$LOGDIR/reference_moe2_$p.log" 120 "$PYTHON" train_moe.py --write-reference "$BIN/ref/moe_k2_$p" \
            "${MOE_REF_ARGS[@]}" --topk 2 --moe-every 2 --cf 0.5 --dtype $dtype
        # dropless (the grouped GEMMs; BF16 routes by the reference's choices, as every BF16 test_moe) and noisy
        # top-2 gating with jitter
        run_stage "$LOGDIR/reference_moe_dropless_$p.log" 120 "$PYTHON" train_moe.py --write-reference \
            "$BIN/ref/moe_dropless_$p" "${MOE_REF_ARGS[@]}" --topk 1 --moe-every 1 --cf 0 --dtype $dtype
        run_stage "$LOGDIR/reference_moe_noisy_$p.log" 120 "$PYTHON" train_moe.py --write-reference \
            "$BIN/ref/moe_noisy_$p" "${MOE_REF_ARGS[@]}" --topk 2 --moe-every 1 --cf 0.5 --noisy-topk 1 --dtype $dtype
        if [ ! -x "$BIN/test_moe_$p" ]; then skip_stage "$LOGDIR/test_moe_${p}.log" "not built (build_test_moe_$p.log)"
        else
            run_stage "$LOGDIR/test_moe_${p}_k1.log" 120 "$BIN/test_moe_$p" "$BIN/ref/moe_k1_$p" -cf 0.5
            run_stage "$LOGDIR/test_moe_${p}_k2.log" 120 "$BIN/test_moe_$p" "$BIN/ref/moe_k2_$p" -cf 0.5
            run_stage "$LOGDIR/test_moe_${p}_dropless.log" 120 "$BIN/test_moe_$p" "$BIN/ref/moe_dropless_$p" -cf 0
            run_stage "$LOGDIR/test_moe_${p}_noisy.log" 120 "$BIN/test_moe_$p" "$BIN/ref/moe_noisy_$p" -cf 0.5
        fi
    done
    # cuDNN's attention against the same bf16 references: one recompute level and one MoE configuration, as the
    # attention is the only difference (the first run also builds cuDNN's plans)
    if [ ! -x "$BIN/cudnn/test_gpt_bf16" ]; then
        skip_stage "$LOGDIR/test_gpt_bf16_cudnn.log" "not built (build_test_gpt_bf16_cudnn.log)"
    else run_stage "$LOGDIR/test_gpt_bf16_cudnn.log" 120 "$BIN/cudnn/test_gpt_bf16" "$BIN/ref/tiny_bf16" -r 1; fi
    if [ ! -x "$BIN/cudnn/test_moe_bf16" ]; then
        skip_stage "$LOGDIR/test_moe_bf16_cudnn.log" "not built (build_test_moe_bf16_cudnn.log)"
    else run_stage "$LOGDIR/test_moe_bf16_cudnn.log" 120 "$BIN/cudnn/test_moe_bf16" "$BIN/ref/moe_k1_bf16" -cf 0.5; fi
fi

# synthetic data: uniform random GPT-2 token ids (train_gpt.py --write-shard; without torch, the same llm.c
# shard format written by the standard library: 256 int32 header [magic, version 1, tokens], uint16 tokens)
mkdir -p "$BIN/data"
shard=$BIN/data/train.bin
if [ $have_torch -eq 1 ]; then
    run_stage "$LOGDIR/data.log" 120 "$PYTHON" train_gpt.py --write-shard "$shard" --shard-tokens $SHARD_TOKENS \
        --V 50257 --seed 1
else
    run_stage "$LOGDIR/data.log" 120 python3 -c '
import array, random, sys
path, count = sys.argv[1], int(sys.argv[2])
header = array.array("i", [20240520, 1, count] + [0] * 253)
rng = random.Random(1)
tokens = array.array("H", (rng.randrange(50257) for _ in range(count)))
with open(path, "wb") as f:
    header.tofile(f)
    tokens.tofile(f)
print(f"wrote {path}: {count} tokens in [0, 50257) (standard library writer: no torch)")' "$shard" $SHARD_TOKENS
fi

# train NAME BINARY "RECOMPUTE LEVELS" [flags]: B=8 (TRAIN_BATCHES: the batches to try, first to last) T=1024,
# halving B while the GPU runs out of memory; nvidia-smi samples the memory in use every 200 ms into
# LOGDIR/NAME_rR.mem
train() {
    local name=$1 binary=$2 levels=$3
    shift 3
    local r log batch sampler
    for r in $levels; do
        log=$LOGDIR/${name}_r$r.log
        if [ ! -x "$binary" ]; then
            skip_stage "$log" "not built (build_$(basename "$binary").log)"
            continue
        fi
        for batch in ${TRAIN_BATCHES:-8 4 2 1}; do
            nvidia-smi -i 0 --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"${log%.log}.mem" 2>/dev/null &
            sampler=$!
            run_stage "$log" 180 "$binary" -e d12 -i "$shard" -j "" -b $batch -t 1024 -x $STEPS -v 0 -s 0 -r $r "$@"
            kill "$sampler" 2>/dev/null
            wait "$sampler" 2>/dev/null
            case "$(stage_status "$log")" in skipped:*) rm -f "${log%.log}.mem" ;; esac  # samples of no run
            [ "$batch" -gt 1 ] && grep -qi "out of memory" "$log" || break
            mv "$log" "${log%.log}_b${batch}_out_of_memory.txt"
            echo "gpu_check: $(basename "$log" .log) ran out of memory at -b $batch: again with -b $((batch / 2))"
        done
    done
}
# the trainers' default attention is flash attention (llmc/flash_attention.cuh); train_gpt_fa0: the cuBLAS GEMMs
# and softmax path beside it (-fa 0)
train train_gpt "$BIN/train_gpt_bf16" "0 1"
train train_gpt_fa0 "$BIN/train_gpt_bf16" "1" -fa 0
train train_moe "$BIN/train_moe_bf16" "0 1" -ne 8 -tk 1 -me 2
# GPT-2 124M at the batch of the flash-attention targets
TRAIN_BATCHES="64 32 16" train train_gpt_b64 "$BIN/train_gpt_bf16" "0"
# the 1-GPU targets: ZeRO-2's code path (buckets, fp32 shard), ZeRO-3's (and gather buffers; target: within
# 1.1x of ZeRO-1's step, which on one GPU is train_gpt_r1's) and ZeRO-Offload (AdamW on the host) beside
# train_gpt_r1; the summary prints their tokens/s against it
train train_gpt_z2 "$BIN/train_gpt_bf16" "1" -z 2
train train_gpt_z3 "$BIN/train_gpt_bf16" "1" -z 3
train train_gpt_oo1 "$BIN/train_gpt_bf16" "1" -oo 1
train train_gpt_oo2 "$BIN/train_gpt_bf16" "1" -oo 2  # the host AdamW overlapped with the backward pass

# every lab file at full size, all its variants; flash attention first, and its cuDNN build's variant 5
for lab in flash_attention_forward flash_attention_backward; do
    if [ ! -x "dev/cuda/${lab}_cudnn" ]; then skip_stage "$LOGDIR/lab_${lab}_cudnn.log" "not built (build_labs_cudnn.log)"
    else run_stage "$LOGDIR/lab_${lab}_cudnn.log" 150 "dev/cuda/${lab}_cudnn" 5; fi
done
for source in dev/cuda/flash_attention_*.cu dev/cuda/*.cu; do
    lab=$(basename "$source" .cu)
    [ -e "$LOGDIR/lab_$lab.log" ] && continue  # the flash-attention labs, already run first
    if [ ! -x "dev/cuda/$lab" ]; then skip_stage "$LOGDIR/lab_$lab.log" "not built (build_labs.log)"
    else run_stage "$LOGDIR/lab_$lab.log" 150 "dev/cuda/$lab"; fi
done

echo "gpu_check: finished in $(($(date +%s) - start)) s"
summarize "$LOGDIR" | tee "$LOGDIR/summary.txt"
exit "${PIPESTATUS[0]}"
