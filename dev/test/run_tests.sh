#!/usr/bin/env bash
# dev/test/run_tests.sh: runs every test of the suite (`make test` builds them first, then calls this)
# and adds up their summary lines. Each test prints "name: N passed, N failed" last; a test that exits
# non-zero without a failed check, or prints no summary, counts as one failure. Ends with
# "total: N passed, N failed" and a non-zero exit status if anything failed.
set -u
cd "$(dirname "$0")/../.."
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
total_passed=0
total_failed=0

run_test() {
    local label=$1
    shift
    local out rc summary
    out=$(timeout 900 "$@" 2>&1)
    rc=$?
    summary=$(grep -E '^[A-Za-z0-9_]+: [0-9]+ passed, [0-9]+ failed$' <<<"$out" | tail -n 1)
    if [ -z "$summary" ]; then
        echo "$out"
        echo "$label: no summary line (exit status $rc)"
        total_failed=$((total_failed + 1))
        return
    fi
    local p f
    p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$summary")
    f=$(sed -E 's/.*, ([0-9]+) failed/\1/' <<<"$summary")
    if [ "$f" -gt 0 ] || [ "$rc" -ne 0 ]; then
        echo "$out"
        [ "$f" -eq 0 ] && f=1 && echo "$label: exit status $rc"
    fi
    echo "[$label] $summary"
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + f))
}

# A lab binary prints no summary line: it passes when it exits 0 (validation failures exit non-zero).
run_lab() {
    local label=$1
    shift
    local out rc
    out=$(timeout 900 "$@" 2>&1)
    rc=$?
    if [ "$rc" -eq 0 ]; then
        total_passed=$((total_passed + 1))
        echo "[lab $label] validated"
    else
        echo "$out" | tail -n 20
        echo "[lab $label] FAILED (exit status $rc)"
        total_failed=$((total_failed + 1))
    fi
}

run_test runtime build/test_runtime
run_test runtime-sanitize build/test_runtime_sanitize
run_test runtime-ucontext build/test_runtime_ucontext
run_test faults build/test_faults
run_test sanitize build/test_sanitize
run_test cucc dev/test/test_cucc.sh
run_test cublas build/test_cublas
run_test fast-math-exact build/test_fast_math
run_test fast-math build/test_fast_math_fm
run_test edge-blocks build/test_edge_blocks
run_test edge-blocks-sanitize build/test_edge_blocks_sanitize
run_test nccl-2-ranks $MPIRUN -np 2 build/test_nccl
run_test nccl-3-ranks $MPIRUN -np 3 build/test_nccl
run_test host-utils build/test_host_utils
run_test multi-gpu dev/test/test_multi_gpu.sh build/test_host_utils
run_test reference /usr/bin/python3 dev/test/test_reference.py
run_test reference-moe /usr/bin/python3 dev/test/test_reference_moe.py
run_test data /usr/bin/python3 dev/test/test_data.py
run_test plot /usr/bin/python3 dev/test/test_plot.py

# the kernel lab: every variant validated at small sizes, bf16 and fp32
for lab in build/lab/*_bf16 build/lab/*_fp32; do
    run_lab "$(basename "$lab")" "$lab" -s
done

# the GPT trainer against PyTorch: FP32 and BF16, every recompute level, with and without master weights
for r in 0 1 2; do
    run_test "gpt-fp32-r$r" build/test_gpt_fp32 build/ref/tiny_fp32 -r $r
    for w in 0 1; do
        run_test "gpt-bf16-r$r-w$w" build/test_gpt_bf16 build/ref/tiny_bf16 -r $r -w $w
    done
done
run_test gpt-fp16-r1 build/test_gpt_fp16 build/ref/tiny_bf16 -r 1
run_test gpt-fp32-gelu-unfused build/test_gpt_fp32 build/ref/tiny_fp32 -ge 0
run_test gpt-bf16-gelu-fused-backward build/test_gpt_bf16 build/ref/tiny_bf16 -ge 2
run_test train-gpt-cli dev/test/test_train_gpt.sh

# the MoE trainer against PyTorch: dropping (cf 0.5) and dropless (packed, grouped GEMMs) top-1, top-2 every other
# layer; FP32 at every recompute level; BF16 likewise (its dropless reference uses seed 2, whose routing has no
# choice within bf16 rounding of a tie: see the Makefile); router jitter and noisy top-k gating in FP32 and BF16
for r in 0 1 2; do
    run_test "moe-fp32-k1-cf0.5-r$r" build/test_moe_fp32 build/ref/moe_k1_cf0.5_fp32 -cf 0.5 -r $r
done
run_test moe-fp32-k1-dropless build/test_moe_fp32 build/ref/moe_k1_dropless_fp32 -cf 0
run_test moe-fp32-k1-dropless-r0 build/test_moe_fp32 build/ref/moe_k1_dropless_fp32 -cf 0 -r 0 -ge 0
run_test moe-fp32-k2-me2 build/test_moe_fp32 build/ref/moe_k2_me2_cf0.5_fp32 -cf 0.5 -r 2
for w in 0 1; do
    run_test "moe-bf16-k1-cf0.5-w$w" build/test_moe_bf16 build/ref/moe_k1_cf0.5_bf16 -cf 0.5 -w $w
done
run_test moe-bf16-k1-dropless build/test_moe_bf16 build/ref/moe_k1_dropless_seed2_bf16 -cf 0
run_test moe-bf16-k2-me2 build/test_moe_bf16 build/ref/moe_k2_me2_cf0.5_bf16 -cf 0.5
run_test moe-fp32-k1-jitter build/test_moe_fp32 build/ref/moe_k1_jitter_fp32 -cf 0.5 -rj 0.1
run_test moe-fp32-k2-noisy build/test_moe_fp32 build/ref/moe_k2_noisy_fp32 -cf 0.5 -r 0
run_test moe-fp32-k1-noisy-jitter-dropless build/test_moe_fp32 build/ref/moe_k1_noisy_jitter_fp32 -cf 0 -rj 0.05 -r 2
run_test moe-bf16-k1-jitter build/test_moe_bf16 build/ref/moe_k1_jitter_bf16 -cf 0.5 -rj 0.1
run_test moe-bf16-k2-noisy build/test_moe_bf16 build/ref/moe_k2_noisy_bf16 -cf 0.5
# expert parallelism against PyTorch (every process on the reference batch) and against -ep 1 (distinct batches):
# 2 ranks in one expert group; 4 ranks in two groups (replicas, ZeRO-1); 4 ranks, one expert each, dropless
run_test moe-fp32-ep2-np2 $MPIRUN -np 2 build/test_moe_fp32 build/ref/moe_k1_cf0.5_fp32 -cf 0.5 -ep 2
run_test moe-bf16-ep2-np2 $MPIRUN -np 2 build/test_moe_bf16 build/ref/moe_k1_cf0.5_bf16 -cf 0.5 -ep 2
run_test moe-fp32-ep2-np4-zero1 $MPIRUN -np 4 build/test_moe_fp32 build/ref/moe_k2_me2_cf0.5_fp32 -cf 0.5 -ep 2 -z 1
run_test moe-fp32-ep4-np4-dropless $MPIRUN -np 4 build/test_moe_fp32 build/ref/moe_k1_dropless_fp32 -cf 0 -ep 4
run_test train-moe-cli dev/test/test_train_moe.sh

# The checking build (cpu/cucc --check, README "Checking mode"): the backend's probes (each deliberate GPU bug is
# reported, its correct twin is not), every lab validation, and the trainers' tests with every check on. The
# PyTorch comparisons run checked at one configuration per code path (recompute, GELU fusion, dropping, dropless,
# top-2, router noise, expert parallelism with ZeRO-0 and ZeRO-1); the plain runs above cover the other flags.
run_test check-probes cpu/test/check/run_probes.sh
for lab in build/lab_check/*_bf16 build/lab_check/*_fp32; do
    run_lab "check-$(basename "$lab")" "$lab" -s
done
run_test check-gpt-fp32-r0 build/check/test_gpt_fp32 build/ref/tiny_fp32 -r 0
run_test check-gpt-fp32-gelu-unfused build/check/test_gpt_fp32 build/ref/tiny_fp32 -ge 0
run_test check-gpt-bf16-r2-w0 build/check/test_gpt_bf16 build/ref/tiny_bf16 -r 2 -w 0
run_test check-gpt-bf16-gelu-fused-backward build/check/test_gpt_bf16 build/ref/tiny_bf16 -ge 2
run_test check-moe-fp32-k1-cf0.5-r0 build/check/test_moe_fp32 build/ref/moe_k1_cf0.5_fp32 -cf 0.5 -r 0
run_test check-moe-fp32-k1-dropless build/check/test_moe_fp32 build/ref/moe_k1_dropless_fp32 -cf 0
run_test check-moe-fp32-k2-me2 build/check/test_moe_fp32 build/ref/moe_k2_me2_cf0.5_fp32 -cf 0.5 -r 2
run_test check-moe-fp32-k1-noisy-jitter-dropless build/check/test_moe_fp32 build/ref/moe_k1_noisy_jitter_fp32 -cf 0 \
    -rj 0.05 -r 2
run_test check-moe-bf16-k1-cf0.5-w1 build/check/test_moe_bf16 build/ref/moe_k1_cf0.5_bf16 -cf 0.5 -w 1
run_test check-moe-bf16-k2-noisy build/check/test_moe_bf16 build/ref/moe_k2_noisy_bf16 -cf 0.5
run_test check-moe-fp32-ep2-np2 $MPIRUN -np 2 build/check/test_moe_fp32 build/ref/moe_k1_cf0.5_fp32 -cf 0.5 -ep 2
run_test check-moe-bf16-ep2-np2 $MPIRUN -np 2 build/check/test_moe_bf16 build/ref/moe_k1_cf0.5_bf16 -cf 0.5 -ep 2
run_test check-moe-fp32-ep2-np4-zero1 $MPIRUN -np 4 build/check/test_moe_fp32 build/ref/moe_k2_me2_cf0.5_fp32 -cf 0.5 \
    -ep 2 -z 1
run_test check-moe-fp32-ep4-np4-dropless $MPIRUN -np 4 build/check/test_moe_fp32 build/ref/moe_k1_dropless_fp32 -cf 0 \
    -ep 4

echo "total: $total_passed passed, $total_failed failed"
[ "$total_failed" -eq 0 ]
