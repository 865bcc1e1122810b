#!/usr/bin/env bash
# dev/test/test_production_runs.sh RUN: one training step of a trainer at a production shape on the CPU backend, in
# edge mode (CUCC_EDGE_BLOCKS=1: only the first and last block of every grid run, device memory is lazily backed;
# doc/backend.md, "Edge mode") and built with --sanitize, so that UBSan's signed-overflow and ASan's bounds checks
# see the index arithmetic of real sizes (offsets past 2^31, grids of millions of blocks). RUN is one of
#   gpt-124m         GPT-2 124M (d12) at B=64, T=1024, as llm.c trains it
#   gpt-1.5b         GPT-2 1.5B (d48) at B=16, T=1024
#   moe-8x-ep2       the 8-expert Switch MoE on the 124M backbone at B=64, T=1024, on 2 ranks with -ep 2
#   moe-64x8-dropless  64 experts, top-8, dropless, on the 124M backbone at B=16, T=1024, with fine-grained
#                    experts (-eh 768: a quarter of GPT-2's MLP, as fine-grained MoE models use)
# It passes when the run exits 0 (a sanitizer finding aborts it, as does an edge-mode range check) and prints its
# step line with a finite loss; the values themselves mean nothing in edge mode. make test builds the sanitized
# BF16 trainers (build/sanitize/) and the data shard (build/prod/train.bin).
set -u
cd "$(dirname "$0")/../.."
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
GPT=build/sanitize/train_gpt_bf16
MOE=build/sanitize/train_moe_bf16
DATA=build/prod/train.bin
COMMON=(-i "$DATA" -j "" -t 1024 -x 1 -v 0 -s 0 -tf none)
run=${1:-}
case $run in
    gpt-124m) cmd=("$GPT" "${COMMON[@]}" -e d12 -b 64) ;;
    gpt-1.5b) cmd=("$GPT" "${COMMON[@]}" -e d48 -b 16) ;;
    # Open MPI's own allocations (strdup'ed names) stay allocated at exit: LeakSanitizer would fail the run on them
    moe-8x-ep2) cmd=(env ASAN_OPTIONS=detect_leaks=0 $MPIRUN -np 2 "$MOE" "${COMMON[@]}" -e d12 -ne 8 -me 2 -ep 2 -b 64) ;;
    moe-64x8-dropless) cmd=("$MOE" "${COMMON[@]}" -e d12 -ne 64 -tk 8 -me 2 -eh 768 -cf 0 -b 16) ;;
    *) echo "usage: $0 gpt-124m|gpt-1.5b|moe-8x-ep2|moe-64x8-dropless" >&2; exit 2 ;;
esac
log=$(mktemp)
trap 'rm -f "$log"' EXIT
CUCC_EDGE_BLOCKS=1 "${cmd[@]}" >"$log" 2>&1
status=$?
step=$(grep -E '^step 1/1 \| loss ' "$log")
loss=$(echo "$step" | sed -E 's/^step 1\/1 \| loss ([^ ]*).*/\1/')
if [ $status -eq 0 ] && [ -n "$step" ] && [ "$loss" != nan ] && [ "$loss" != inf ] && [ "$loss" != -nan ]; then
    echo "OK   $run: $step"
    echo "production_runs: 1 passed, 0 failed"
else
    echo "FAIL $run: exit status $status; the log ends:"
    tail -15 "$log"
    echo "production_runs: 0 passed, 1 failed"
    exit 1
fi
