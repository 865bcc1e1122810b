#!/usr/bin/env bash
# dev/test/behaviour_snapshot.sh OUT: what a change that should not change behaviour must leave alone, written to
# OUT (a file): the step losses and the checkpoint files' SHA-256 of short training runs on the CPU backend, for
#   GPT-2 in FP32 and BF16 (and with the matmul-and-softmax attention and -r 2); llama with grouped-query attention
#   (in BF16 with -r 2); the MoE in FP32 and BF16, on 2 processes with -ep 2,
#   with ZeRO-3, and with ZeRO-Offload's early update (-oo 2); a llama MoE with a dense layer and a shared expert.
# Run it before and after a refactoring and compare: the two files must be identical.
#   dev/test/behaviour_snapshot.sh /tmp/before.txt; (change); dev/test/behaviour_snapshot.sh /tmp/after.txt
#   diff /tmp/before.txt /tmp/after.txt
# It builds (through make) the four trainers it runs; the runs take under a minute on 2 cores.
set -u
cd "$(dirname "$0")/../.."
[ $# -eq 1 ] || { echo "usage: $0 OUT" >&2; exit 2; }
out=$1
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1} OMPI_MCA_hwloc_base_binding_policy=none
make -s --no-print-directory build/train_gpt_fp32 build/train_gpt_bf16 build/train_moe_fp32 build/train_moe_bf16 ||
    { echo "$0: cannot build the trainers" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
/usr/bin/python3 train_gpt.py --write-shard "$work/train.bin" --shard-tokens 16384 --V 263 --seed 7 >/dev/null ||
    { echo "$0: cannot write a data shard" >&2; exit 1; }
# a model from a descriptor (drawn from -es's seed), 4 steps on distinct batches, a checkpoint after the last
COMMON=(-i "$work/train.bin" -j "" -ev 263 -et 64 -t 32 -b 2 -x 4 -n 4 -v 0 -s 0 -l 1e-3)

: >"$out"
# snapshot NAME COMMAND...: the run's step lines without their timings, then the checkpoint files' hashes
snapshot() {
    local name=$1
    shift
    local dir=$work/$name
    if ! OMP_NUM_THREADS=1 "$@" -o "$dir" >"$work/$name.log" 2>&1; then
        echo "$0: $name failed:" >&2
        tail -5 "$work/$name.log" >&2
        exit 1
    fi
    {
        echo "== $name"
        grep -E '^step [0-9]+/[0-9]+ \| loss' "$work/$name.log" | sed -E 's/ \| lr [^|]*\|.*//'
        (cd "$dir" && sha256sum model_*.bin state_*.bin expert_state_*.bin 2>/dev/null)
    } >>"$out"
}

snapshot gpt-fp32 build/train_gpt_fp32 "${COMMON[@]}" -e d2
snapshot gpt-bf16 build/train_gpt_bf16 "${COMMON[@]}" -e d2
snapshot gpt-fp32-matmul-attention-r2 build/train_gpt_fp32 "${COMMON[@]}" -e d2 -fa 0 -r 2
snapshot llama-gqa-fp32 build/train_gpt_fp32 "${COMMON[@]}" -e d2 -arch llama -kv 1
snapshot llama-gqa-bf16-r2 build/train_gpt_bf16 "${COMMON[@]}" -e d2 -arch llama -kv 1 -r 2
snapshot moe-fp32 build/train_moe_fp32 "${COMMON[@]}" -e d2 -ne 4 -tk 2 -me 1
snapshot moe-bf16 build/train_moe_bf16 "${COMMON[@]}" -e d2 -ne 4 -tk 2 -me 1
snapshot moe-fp32-ep2 $MPIRUN -np 2 build/train_moe_fp32 "${COMMON[@]}" -e d2 -ne 4 -tk 2 -me 1 -ep 2
snapshot moe-fp32-z3 $MPIRUN -np 2 build/train_moe_fp32 "${COMMON[@]}" -e d2 -ne 4 -tk 2 -me 1 -z 3
snapshot moe-llama-shared-fp32-r1 build/train_moe_fp32 "${COMMON[@]}" -e d2 -arch llama -kv 1 -ne 4 -tk 2 -me 2 -se 1 -seh 32 -r 1
snapshot moe-fp32-oo2 build/train_moe_fp32 "${COMMON[@]}" -e d2 -ne 4 -tk 2 -me 1 -oo 2
echo "behaviour_snapshot: $(grep -c '^== ' "$out") runs written to $out"
