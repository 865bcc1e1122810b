#!/usr/bin/env bash
# dev/test/test_train_gpt.sh: command-line tests of the GPT trainer on the CPU backend (FP32 build):
#   - 2 and 3 MPI ranks with ZeRO-1 (and 2 with ZeRO-0) give the losses of 1 rank with the ranks' micro-batches
#     together (-a 1: the same tokens);
#   - ZeRO-2 gives ZeRO-1's files (one micro-step) or losses (two), and resumes a ZeRO-1 checkpoint;
#   - flash attention gives the losses of the cuBLAS-and-softmax path (-fa 0), bit-identically run after run;
#   - a run resumed from a checkpoint continues bit-identically, and leftovers of an interrupted
#     checkpoint (temporary files, a state without its DONE marker) are ignored;
#   - a model from a descriptor trains (the loss falls);
#   - -arch llama: a descriptor trains, its checkpoint resumes bit-identically, ZeRO-1 on 2 ranks and -oo 1 agree
#     with 1 rank (the untied lm_head is reduced and offloaded), recompute levels give the same bits, the model file
#     is train_gpt.py's, bad architecture flags are refused;
#   - every bad input gets one line naming the file or flag, and a non-zero exit;
#   - reliability: token ids against V, numeric flags, the sampling seed, divergence (-ns), symlinked temporaries,
#     header sizes before allocation, checkpoint checksums and fallback on -y 1, main.log after a resume, stdout into
#     a pipe, the output directory's lock, and the collective watchdog (-wt) with a stopped rank;
#   - pre-emption: SIGTERM on 1 process, on 2 (ZeRO-3, -oo 1, the signal to one rank) and again and again during the
#     checkpoint writes a checkpoint at the signal and exits 143, and the run resumes bit-identically; a fresh run into
#     a used -o is refused; pruning removes what a crash left; a non-finite parameter in a model file is refused at
#     load, and a run that saved nothing exits non-zero; an -o of 1,000 characters works, one of 5,000 is refused
#     before training; -e naming a directory says so.
# Needs build/train_gpt_fp32, build/ref/tiny_fp32_model.bin and build/ref/llama_gqa_fp32_model.bin (make test builds
# them). Run from anywhere:
#   dev/test/test_train_gpt.sh
set -u
cd "$(dirname "$0")/../.."
TRAIN=build/train_gpt_fp32
MODEL=build/ref/tiny_fp32_model.bin
LLAMA_MODEL=build/ref/llama_gqa_fp32_model.bin
. dev/test/cli_common.sh

# the step lines' "loss X | norm Y" parts, one per line
losses() { grep -E '^step [0-9]+/[0-9]+ \| loss' "$1" | sed -E 's/^step ([0-9]+)\/[0-9]+ \| (loss [^|]*\| norm [^|]*)\|.*/\1 \2/'; }

$PYTHON train_gpt.py --write-shard "$work/train.bin" --shard-tokens 8192 --V 263 --seed 7 >/dev/null ||
    { echo "cannot write a data shard"; exit 1; }
COMMON=(-e "$MODEL" -i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1)

# --- ZeRO-1 on 2 ranks vs 1 rank with twice the micro-batch
"$TRAIN" "${COMMON[@]}" -b 4 -a 1 -x 4 >"$work/single.log" 2>&1 || fail "single-rank run: $(tail -3 "$work/single.log")"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -z 1 >"$work/zero1.log" 2>&1 ||
    fail "2-rank ZeRO-1 run: $(tail -3 "$work/zero1.log")"
if close_losses "$work/single.log" "$work/zero1.log" 4; then pass; else
    fail "ZeRO-1 on 2 ranks differs from 1 rank with twice the batch"; fi
# ZeRO-1 on 3 ranks (shards end inside tensors: each piece is reduced to its owner) vs 1 rank with B=6
"$TRAIN" "${COMMON[@]}" -b 6 -a 1 -x 3 >"$work/single6.log" 2>&1 || fail "single-rank B=6 run: $(tail -3 "$work/single6.log")"
$MPIRUN -np 3 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 3 -z 1 >"$work/zero1_3.log" 2>&1 ||
    fail "3-rank ZeRO-1 run: $(tail -3 "$work/zero1_3.log")"
if close_losses "$work/single6.log" "$work/zero1_3.log" 3; then pass; else
    fail "ZeRO-1 on 3 ranks differs from 1 rank with three times the batch"; fi
# ZeRO-0 (all-reduce) on 2 ranks too
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -z 0 >"$work/zero0.log" 2>&1 ||
    fail "2-rank ZeRO-0 run: $(tail -3 "$work/zero0.log")"
if [ "$(losses "$work/zero0.log" | cut -d' ' -f1-3)" = "$(losses "$work/zero1.log" | cut -d' ' -f1-3)" ]; then pass; else
    fail "ZeRO-0 and ZeRO-1 losses differ"; fi

# --- attention paths: flash attention (the default) against cuBLAS GEMMs and softmax (-fa 0), the same fp32 terms
# in another order; flash attention run twice, on 1 and on 2 OpenMP threads, is bit-identical (no atomics, and the
# backend's results do not depend on its thread count)
OMP_NUM_THREADS=1 "$TRAIN" "${COMMON[@]}" -b 4 -x 4 -fa 1 -n 4 -o "$work/flash" >"$work/flash.log" 2>&1 ||
    fail "-fa 1 run: $(tail -3 "$work/flash.log")"
OMP_NUM_THREADS=2 "$TRAIN" "${COMMON[@]}" -b 4 -x 4 -fa 1 -n 4 -o "$work/flash2" >"$work/flash2.log" 2>&1 ||
    fail "second -fa 1 run: $(tail -3 "$work/flash2.log")"
"$TRAIN" "${COMMON[@]}" -b 4 -x 4 -fa 0 >"$work/matmul.log" 2>&1 || fail "-fa 0 run: $(tail -3 "$work/matmul.log")"
if close_losses "$work/flash.log" "$work/matmul.log" 4; then pass; else
    fail "flash attention's losses differ from the cuBLAS-and-softmax path's"; fi
if [ -n "$(losses "$work/flash.log")" ] && [ "$(losses "$work/flash.log")" = "$(losses "$work/flash2.log")" ] &&
    cmp -s "$work/flash/model_00000004.bin" "$work/flash2/model_00000004.bin"; then pass; else
    fail "two flash-attention runs (1 and 2 threads) differ"; fi

# --- checkpoint, resume, interrupted checkpoint
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/full" >"$work/full.log" 2>&1 || fail "checkpointing run: $(tail -3 "$work/full.log")"
mkdir -p "$work/resumed"
cp "$work/full/model_00000003.bin" "$work/full/state_00000003_00000.bin" "$work/full/DONE_00000003" "$work/resumed/"
# leftovers of a checkpoint at step 5 that was interrupted: no DONE marker, a temporary file
cp "$work/full/state_00000003_00000.bin" "$work/resumed/state_00000005_00000.bin"
head -c 1000 "$work/full/model_00000003.bin" >"$work/resumed/model_00000005.bin.tmp"
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/resumed" -y 1 >"$work/resumed.log" 2>&1 ||
    fail "resumed run: $(tail -3 "$work/resumed.log")"
want=$(losses "$work/full.log" | tail -n 3)
got=$(losses "$work/resumed.log")
if [ -n "$want" ] && [ "$want" = "$got" ] && grep -q "resumed from step 3" "$work/resumed.log"; then pass; else
    fail "resume is not bit-identical: want [$want] got [$got]"; fi
if cmp -s "$work/full/model_00000006.bin" "$work/resumed/model_00000006.bin"; then pass; else
    fail "the resumed run's final model differs"; fi
# --- ZeRO-Offload (-oo 1): the host's AdamW (llmc/adamw_host.h) computes the kernel's bits, so the model and the
# optimizer state after 6 steps are the same files; the state's format does not depend on offload, so the run
# checkpointed at step 3 without it resumes with it and ends identical
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 6 -o "$work/offload" -oo 1 >"$work/offload.log" 2>&1 ||
    fail "-oo 1 run: $(tail -3 "$work/offload.log")"
if cmp -s "$work/full/model_00000006.bin" "$work/offload/model_00000006.bin" &&
    cmp -s "$work/full/state_00000006_00000.bin" "$work/offload/state_00000006_00000.bin"; then pass; else
    fail "-oo 1 gives another model or optimizer state than -oo 0"; fi
mkdir -p "$work/offload_resumed"
cp "$work/full/model_00000003.bin" "$work/full/state_00000003_00000.bin" "$work/full/DONE_00000003" "$work/offload_resumed/"
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/offload_resumed" -y 1 -oo 1 >"$work/offload_resumed.log" 2>&1 ||
    fail "-oo 1 resuming a -oo 0 checkpoint: $(tail -3 "$work/offload_resumed.log")"
if [ "$(losses "$work/offload_resumed.log")" = "$want" ] &&
    cmp -s "$work/full/model_00000006.bin" "$work/offload_resumed/model_00000006.bin"; then pass; else
    fail "-oo 1 resuming a -oo 0 checkpoint does not continue bit-identically"; fi
# ZeRO-1 on 2 ranks: each rank offloads its shard
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -z 1 -oo 1 >"$work/zero1_offload.log" 2>&1 ||
    fail "2-rank ZeRO-1 -oo 1 run: $(tail -3 "$work/zero1_offload.log")"
if [ -n "$(losses "$work/zero1.log")" ] && [ "$(losses "$work/zero1.log")" = "$(losses "$work/zero1_offload.log")" ]; then
    pass; else fail "ZeRO-1 with -oo 1 differs from ZeRO-1"; fi
expect_error "bad -oo" "-oo 3: expected 0, 1 or 2" "$TRAIN" "${COMMON[@]}" -oo 3
expect_error "bad -gc" "-gc -1: expected a finite norm >= 0 (0: no clipping)" "$TRAIN" "${COMMON[@]}" -gc -1

# --- ZeRO-2 (-z 2): gradients reduced into each process's fp32 shard on every micro-step, layer by layer from two
# reusable buckets. With one micro-step every piece is averaged as ZeRO-1 averages it and the shard holds the exact
# reduced value: the same files. With accumulation the micro-steps' gradients are averaged over processes, then summed
# in fp32, where ZeRO-1 sums them in floatX, then averages: the same terms in another order (close_losses' fp32
# tolerances). A ZeRO-1 checkpoint resumes under ZeRO-2 (the state's shards are the same).
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 2 -o "$work/zero2" >"$work/zero2.log" 2>&1 ||
    fail "2-rank ZeRO-2 run: $(tail -3 "$work/zero2.log")"
if [ -n "$(losses "$work/zero1.log")" ] && [ "$(losses "$work/zero1.log")" = "$(losses "$work/zero2.log")" ]; then
    pass; else fail "ZeRO-2 differs from ZeRO-1 on 2 ranks"; fi
grep -q "memory: gradients .* bytes, fp32 ZeRO-2 shard)" "$work/zero2.log" &&
    grep -q "memory: communication .* bytes, 3 ZeRO-2 buckets)" "$work/zero2.log" && pass ||
    fail "the ZeRO-2 start-up table lacks its gradient and bucket rows"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 1 -o "$work/zero1_ckpt" >"$work/zero1_ckpt.log" 2>&1 ||
    fail "2-rank ZeRO-1 checkpointing run: $(tail -3 "$work/zero1_ckpt.log")"
mkdir -p "$work/zero2_resumed"
cp "$work/zero1_ckpt"/*_00000002* "$work/zero2_resumed/"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 2 -o "$work/zero2_resumed" -y 1 \
    >"$work/zero2_resumed.log" 2>&1 || fail "ZeRO-2 resuming a ZeRO-1 checkpoint: $(tail -3 "$work/zero2_resumed.log")"
if [ "$(losses "$work/zero2_resumed.log")" = "$(losses "$work/zero1.log" | tail -n 2)" ] &&
    cmp -s "$work/zero2/model_00000004.bin" "$work/zero2_resumed/model_00000004.bin" &&
    cmp -s "$work/zero2/state_00000004_00001.bin" "$work/zero2_resumed/state_00000004_00001.bin"; then pass; else
    fail "ZeRO-2 resuming a ZeRO-1 checkpoint does not continue bit-identically"; fi
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -d 128 -x 3 -z 1 >"$work/accum_zero1.log" 2>&1 ||
    fail "2-rank ZeRO-1 accumulation run: $(tail -3 "$work/accum_zero1.log")"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -d 128 -x 3 -z 2 -oo 1 >"$work/accum_zero2.log" 2>&1 ||
    fail "2-rank ZeRO-2 -oo 1 accumulation run: $(tail -3 "$work/accum_zero2.log")"
if close_losses "$work/accum_zero1.log" "$work/accum_zero2.log" 3; then pass; else
    fail "ZeRO-2 with two micro-steps differs from ZeRO-1"; fi

# --- ZeRO-3 (-z 3): ZeRO-2 with each process holding only its shard of the parameters, gathered layer by layer into
# two reusable buffers (the embeddings and the final norm into a third). The gathered values are copies, so the files
# are ZeRO-2's (the model file is gathered for writing); a ZeRO-1 checkpoint resumes under ZeRO-3 and a ZeRO-3 one
# under ZeRO-1 with offload, bit-identically; with accumulation, ZeRO-2's fp32 sums (close_losses).
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 3 -o "$work/zero3" >"$work/zero3.log" 2>&1 ||
    fail "2-rank ZeRO-3 run: $(tail -3 "$work/zero3.log")"
if [ -n "$(losses "$work/zero1.log")" ] && [ "$(losses "$work/zero1.log")" = "$(losses "$work/zero3.log")" ] &&
    cmp -s "$work/zero2/model_00000004.bin" "$work/zero3/model_00000004.bin" &&
    cmp -s "$work/zero2/state_00000004_00000.bin" "$work/zero3/state_00000004_00000.bin"; then
    pass; else fail "ZeRO-3 differs from ZeRO-1/2 on 2 ranks"; fi
grep -q "memory: parameters .* bytes)" "$work/zero3.log" &&
    grep -q "memory: communication .* bytes, 3 ZeRO-3 buckets and 3 gather buffers)" "$work/zero3.log" && pass ||
    fail "the ZeRO-3 start-up table lacks its communication row"
mkdir -p "$work/zero3_resumed" "$work/zero1_from3"
cp "$work/zero1_ckpt"/*_00000002* "$work/zero3_resumed/"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 3 -o "$work/zero3_resumed" -y 1 \
    >"$work/zero3_resumed.log" 2>&1 || fail "ZeRO-3 resuming a ZeRO-1 checkpoint: $(tail -3 "$work/zero3_resumed.log")"
cp "$work/zero3"/*_00000002* "$work/zero1_from3/"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 2 -z 1 -oo 1 -o "$work/zero1_from3" -y 1 \
    >"$work/zero1_from3.log" 2>&1 || fail "ZeRO-1 -oo 1 resuming a ZeRO-3 checkpoint: $(tail -3 "$work/zero1_from3.log")"
if [ "$(losses "$work/zero3_resumed.log")" = "$(losses "$work/zero1.log" | tail -n 2)" ] &&
    [ "$(losses "$work/zero1_from3.log")" = "$(losses "$work/zero1.log" | tail -n 2)" ] &&
    cmp -s "$work/zero1_ckpt/model_00000004.bin" "$work/zero3_resumed/model_00000004.bin" &&
    cmp -s "$work/zero1_ckpt/model_00000004.bin" "$work/zero1_from3/model_00000004.bin" &&
    cmp -s "$work/zero1_ckpt/state_00000004_00001.bin" "$work/zero3_resumed/state_00000004_00001.bin"; then pass; else
    fail "resuming across ZeRO-1 and ZeRO-3 does not continue bit-identically"; fi
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -d 128 -x 3 -z 3 -r 2 >"$work/accum_zero3.log" 2>&1 ||
    fail "2-rank ZeRO-3 -r 2 accumulation run: $(tail -3 "$work/accum_zero3.log")"
if [ -n "$(losses "$work/accum_zero3.log")" ] &&
    [ "$(losses "$work/accum_zero2.log")" = "$(losses "$work/accum_zero3.log")" ]; then pass; else
    fail "ZeRO-3 with two micro-steps differs from ZeRO-2 -oo 1"; fi
# --- -oo 2: the host AdamW runs on each piece of the gradient shard as soon as it reaches the host, during the backward
# pass, as if the step would not clip; a step that clips undoes it and updates again, one that is skipped undoes it.
# Without clipping (-gc 0) every early update is kept, and the files are -oo 0's; with clipping at 0.1 none is, and
# they are -oo 0's too; a diverging run skips its steps as without it (below, beside the divergence checks).
for run in "1 0" "3 0" "2 0.1"; do
    set -- $run
    for oo in 0 2; do
        $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -a 1 -x 4 -n 4 -z $1 -gc $2 -oo $oo -o "$work/early-z$1-oo$oo" \
            >"$work/early-z$1-oo$oo.log" 2>&1 || fail "-z $1 -gc $2 -oo $oo run: $(tail -3 "$work/early-z$1-oo$oo.log")"
    done
    kept=$([ "$2" = 0 ] && echo 4 || echo 0)
    if grep -q "^-oo 2: the early update was kept in $kept of 4 steps" "$work/early-z$1-oo2.log" &&
        cmp -s "$work/early-z$1-oo0/model_00000004.bin" "$work/early-z$1-oo2/model_00000004.bin" &&
        cmp -s "$work/early-z$1-oo0/state_00000004_00001.bin" "$work/early-z$1-oo2/state_00000004_00001.bin"; then
        pass; else fail "-z $1 -gc $2 -oo 2 differs from -oo 0: $(grep '^-oo 2' "$work/early-z$1-oo2.log")"; fi
done

# validation and sampling gather too, on every process: the sample is -z 1's
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -x 2 -z 3 -j "$work/train.bin" -v 2 -m 2 -s 2 -g 6 >"$work/zero3_sample.log" \
    2>&1 || fail "2-rank ZeRO-3 run with validation and sampling: $(tail -3 "$work/zero3_sample.log")"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -x 2 -z 1 -j "$work/train.bin" -v 2 -m 2 -s 2 -g 6 >"$work/zero1_sample.log" \
    2>&1 || fail "2-rank ZeRO-1 run with validation and sampling: $(tail -3 "$work/zero1_sample.log")"
if grep -q "^val loss" "$work/zero3_sample.log" && grep -q "^generating" "$work/zero3_sample.log" &&
    [ "$(grep -A2 -E '^(val loss|generating)' "$work/zero3_sample.log")" = \
      "$(grep -A2 -E '^(val loss|generating)' "$work/zero1_sample.log")" ]; then pass; else
    fail "ZeRO-3's validation or sample differs from ZeRO-1's"; fi
expect_error "bad -z" "-z 4: expected 0, 1, 2 or 3" "$TRAIN" "${COMMON[@]}" -z 4

# --- resume at another ZeRO stage and process count: a 2-process ZeRO-1 checkpoint (B=2) goes on as 1 process at
# ZeRO-0 (B=4) and as 4 processes at ZeRO-2 (B=1). The global batch is the same (processes x B), so the data loader
# takes the same rows; the optimizer shards are put together and cut anew. The losses are the 2-process run's
# within close_losses' fp32 reordering tolerance (gradients reduced over other process counts).
NODATA=(-e "$MODEL" -i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1)
$MPIRUN -np 2 "$TRAIN" "${NODATA[@]}" -b 2 -x 4 -n 2 -z 1 -o "$work/np2" >"$work/np2.log" 2>&1 ||
    fail "2-process checkpointing run: $(tail -3 "$work/np2.log")"
tail -n 2 <(grep -E '^step [0-9]+/' "$work/np2.log") >"$work/np2_last.log"
for layout in "1 4 0" "4 1 3"; do
    set -- $layout
    mkdir -p "$work/np$1"
    cp "$work/np2"/*_00000002* "$work/np$1/"
    $MPIRUN -np "$1" "$TRAIN" "${NODATA[@]}" -b "$2" -x 4 -n 2 -z "$3" -o "$work/np$1" -y 1 >"$work/np$1.log" 2>&1 ||
        fail "resuming a 2-process checkpoint on $1 processes at ZeRO-$3: $(tail -3 "$work/np$1.log")"
    if grep -q "resumed from step 2" "$work/np$1.log" && close_losses "$work/np2_last.log" "$work/np$1.log" 2; then
        pass; else
        fail "a 2-process ZeRO-1 checkpoint resumed on $1 processes at ZeRO-$3 does not continue the run"; fi
done
mkdir -p "$work/np3"
cp "$work/np2"/*_00000002* "$work/np3/"
expect_error "another global batch" \
    "data loader state: saved with B 2, T 16 on 2 processes; expected a global batch of B x processes = 6 rows" \
    $MPIRUN -np 3 "$TRAIN" "${NODATA[@]}" -b 2 -x 4 -o "$work/np3" -y 1

# --- the memory plan (-pm GIB: printed without allocating anything) against the formulas of doc/zero.md, written
# here from GPT-2's shapes: n = 12 L C^2 + 13 L C + Vp C + maxT C + 2 C parameters, padded to a multiple of 8 P;
# fp32 values (this build); parameters all, or ZeRO-3's shard; gradients a full buffer, or ZeRO-2/3's fp32 shard and
# its buckets (two layers and the embeddings with the final LayerNorm; ZeRO-3 as many gather buffers); m and v (and
# master weights with -oo 1; and their backups with -oo 2) of the shard. Activations: the
# leading terms of model_allocate_activations on the flash path, within 1% (the per-row statistics and the backward's
# scratch that they leave out are 16 MB, 0.6%, at this shape).
plan_check() {  # NP ZERO OFFLOAD RECOMPUTE
    $MPIRUN -np "$1" "$TRAIN" -pm 80 -e d12 -b 4 -t 1024 -fa 1 -z "$2" -oo "$3" -r "$4" >"$work/plan.log" 2>&1 ||
        { fail "-pm run -np $1 -z $2 -oo $3 -r $4: $(tail -2 "$work/plan.log")"; return; }
    /usr/bin/python3 - "$work/plan.log" "$@" <<'PY'
import re, sys
log, P, z, oo, r = sys.argv[1], *map(int, sys.argv[2:])
rows = {m.group(1).strip(): int(m.group(2)) for m in re.finditer(r"^\| memory: ([a-z ]+?)\s*\|[^(]*\((\d+) bytes", open(log).read(), re.M)}
L, C, V, maxT, B, T = 12, 768, 50257, 1024, 4, 1024
Vp = (V + 127) // 128 * 128
layer = 12 * C * C + 13 * C
rest = Vp * C + maxT * C + 2 * C
n = L * layer + rest
padded = -(-n // (8 * P)) * 8 * P
shard = padded // P if z >= 1 else padded
want = {"parameters": 4 * padded // P if z == 3 else 4 * padded,
        "gradients": 4 * padded // P if z >= 2 else 4 * padded,
        "communication": 4 * (2 * layer + rest) * (2 if z == 3 else 1) if z >= 2 else 0,
        "optimizer": 4 * shard * (3 if oo else 2) + (4 * shard * 3 if oo == 2 else 0)}
BTC = B * T * C
act = 4 * (BTC * (10 * L + 2 * (1 if r >= 2 else L) + 4 * (1 if r >= 1 else L) + 9) + B * T * Vp)
ok = all(rows.get(k) == v for k, v in want.items())
ok = ok and abs(rows.get("activations", 0) - act) <= 0.01 * act
device = sum(rows.get(k, 0) for k in ("parameters", "gradients", "communication", "activations"))
device += 0 if oo else rows.get("optimizer", 0)
ok = ok and rows.get("device total") == device
print("  plan -np %d -z %d -oo %d -r %d: %s; want %s, activations ~%d" % (P, z, oo, r, rows, want, act))
sys.exit(0 if ok else 1)
PY
    if [ $? = 0 ]; then pass; else fail "the memory plan for -np $1 -z $2 -oo $3 -r $4 differs from the formulas"; fi
}
plan_check 1 0 0 1
plan_check 2 1 2 0
plan_check 3 2 0 2
plan_check 4 2 1 1
plan_check 2 3 1 2
expect_error "-pm with a file" "-pm 24: needs a descriptor (-e dN), not a model file" "$TRAIN" "${COMMON[@]}" -pm 24

# --- checkpoint integrity: the DONE marker lists every file's size and checksum, checked on -y 1
grep -q "^file state_00000006_00000.bin 616080 " "$work/full/DONE_00000006" && pass || fail "DONE lacks the state's checksum"
# a corrupt latest checkpoint is named and the previous complete one is used
mkdir -p "$work/corrupt"
cp "$work/full"/*_0000000[36]* "$work/corrupt/"
printf 'X' | dd of="$work/corrupt/state_00000006_00000.bin" bs=1 seek=5000 conv=notrunc 2>/dev/null
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/corrupt" -y 1 >"$work/corrupt.log" 2>&1 || fail "resume past a corrupt checkpoint: $(tail -3 "$work/corrupt.log")"
if grep -q "^-y 1: checkpoint step 6 fails verification: $work/corrupt/state_00000006_00000.bin: 616080 bytes, checksum" "$work/corrupt.log" &&
    grep -q "resumed from step 3" "$work/corrupt.log" && [ "$(losses "$work/corrupt.log")" = "$want" ]; then pass; else
    fail "a corrupt latest checkpoint: $(grep -v '^[|+]' "$work/corrupt.log" | head -4)"; fi
# none passes: non-zero exit (the step-6 checkpoint was rewritten by that run: corrupt both again)
printf 'X' | dd of="$work/corrupt/model_00000003.bin" bs=1 seek=3000 conv=notrunc 2>/dev/null
printf 'X' | dd of="$work/corrupt/model_00000006.bin" bs=1 seek=3000 conv=notrunc 2>/dev/null
expect_error "no checkpoint passes verification" "-y 1: no complete checkpoint in $work/corrupt passes verification" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/corrupt" -y 1
# an older checkpoint (an empty DONE marker) loads, with a note; its state must still be of its step
mkdir -p "$work/legacy"
cp "$work/full"/*_00000003* "$work/legacy/"
: >"$work/legacy/DONE_00000003"
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/legacy" -y 1 >"$work/legacy.log" 2>&1 || fail "legacy resume: $(tail -3 "$work/legacy.log")"
if grep -q "DONE_00000003 has no checksums (an older checkpoint): loaded unverified" "$work/legacy.log" &&
    [ "$(losses "$work/legacy.log")" = "$want" ]; then pass; else fail "an older checkpoint does not load as before"; fi
rm "$work/legacy"/*_00000006*
cp "$work/full/state_00000006_00000.bin" "$work/legacy/state_00000003_00000.bin"
expect_error "a state of another step" "state_00000003_00000.bin: a state of step 6 for 1 processes" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -o "$work/legacy" -y 1
# -nk 1 keeps only the last checkpoint
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 2 -nk 1 -o "$work/keep" >"$work/keep.log" 2>&1
if [ -e "$work/keep/DONE_00000006" ] && [ ! -e "$work/keep/DONE_00000004" ] && [ ! -e "$work/keep/model_00000002.bin" ]; then pass; else
    fail "-nk 1 did not keep exactly the last checkpoint: $(ls "$work/keep" | tr '\n' ' ')"; fi

# --- a descriptor model trains
"$TRAIN" -e d2 -ev 263 -et 32 -i "$work/train.bin" -j "" -b 4 -t 16 -v 0 -s 0 -l 3e-3 -a 1 -x 30 >"$work/desc.log" 2>&1 ||
    fail "descriptor run: $(tail -3 "$work/desc.log")"
if $PYTHON - "$work/desc.log" <<'PY'
import re, sys
l = [float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([-\d.e+]+)", open(sys.argv[1]).read(), re.M)]
print("  descriptor d2 losses: first %.4f last %.4f" % (l[0], l[-1]) if l else "  no losses")
sys.exit(0 if len(l) == 30 and l[-1] < 0.8 * l[0] else 1)
PY
then pass; else fail "a d2 model overfitting one batch did not learn"; fi

# --- -arch llama (doc/kernels.md): a descriptor with 2 query heads sharing 1 key/value head overfits one batch
"$TRAIN" -e d2 -arch llama -kv 1 -ev 263 -et 32 -i "$work/train.bin" -j "" -b 4 -t 16 -v 0 -s 0 -l 3e-3 -a 1 -x 30 \
    >"$work/llama_desc.log" 2>&1 || fail "llama descriptor run: $(tail -3 "$work/llama_desc.log")"
if grep -q "| model  *| llama L=2 NH=2 NKV=1 C=128 H=384 V=263 Vp=384 maxT=32 " "$work/llama_desc.log" &&
    $PYTHON - "$work/llama_desc.log" <<'PY'
import re, sys
l = [float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([-\d.e+]+)", open(sys.argv[1]).read(), re.M)]
print("  llama descriptor d2 losses: first %.4f last %.4f" % (l[0], l[-1]) if l else "  no losses")
sys.exit(0 if len(l) == 30 and l[-1] < 0.8 * l[0] else 1)
PY
then pass; else fail "a llama d2 model overfitting one batch did not learn (or its start-up table is wrong)"; fi
# its checkpoint resumes bit-identically (a tied output embedding: the encoder's and the classifier's gradients add)
LLAMA_DESC=(-e d2 -arch llama -kv 1 -tie 1 -ev 263 -et 32 -i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1 -b 2)
"$TRAIN" "${LLAMA_DESC[@]}" -x 6 -n 3 -o "$work/llama_full" >"$work/llama_full.log" 2>&1 ||
    fail "llama checkpointing run: $(tail -3 "$work/llama_full.log")"
mkdir -p "$work/llama_resumed"
cp "$work/llama_full"/*_00000003* "$work/llama_resumed/"
"$TRAIN" "${LLAMA_DESC[@]}" -x 6 -n 3 -o "$work/llama_resumed" -y 1 >"$work/llama_resumed.log" 2>&1 ||
    fail "llama resumed run: $(tail -3 "$work/llama_resumed.log")"
want=$(losses "$work/llama_full.log" | tail -n 3)
if [ -n "$want" ] && [ "$want" = "$(losses "$work/llama_resumed.log")" ] &&
    cmp -s "$work/llama_full/model_00000006.bin" "$work/llama_resumed/model_00000006.bin"; then pass; else
    fail "a llama run resumed from its checkpoint is not bit-identical"; fi
# the reference's llama file (2 of 4 heads for keys and values, its own lm_head): ZeRO-1 on 2 ranks against 1 rank
# with twice the micro-batch, and -oo 1 against -oo 0 file for file
LLAMA_FILE=(-e "$LLAMA_MODEL" -i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1)
"$TRAIN" "${LLAMA_FILE[@]}" -b 4 -a 1 -x 3 >"$work/llama_single.log" 2>&1 || fail "llama single-rank run: $(tail -3 "$work/llama_single.log")"
$MPIRUN -np 2 "$TRAIN" "${LLAMA_FILE[@]}" -b 2 -a 1 -x 3 -z 1 >"$work/llama_zero1.log" 2>&1 ||
    fail "llama 2-rank ZeRO-1 run: $(tail -3 "$work/llama_zero1.log")"
if close_losses "$work/llama_single.log" "$work/llama_zero1.log" 3; then pass; else
    fail "llama: ZeRO-1 on 2 ranks differs from 1 rank with twice the batch"; fi
"$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 3 -n 3 -o "$work/llama_oo0" >"$work/llama_oo0.log" 2>&1 || fail "llama -oo 0 run"
"$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 3 -n 3 -o "$work/llama_oo1" -oo 1 >"$work/llama_oo1.log" 2>&1 || fail "llama -oo 1 run"
if cmp -s "$work/llama_oo0/model_00000003.bin" "$work/llama_oo1/model_00000003.bin" &&
    cmp -s "$work/llama_oo0/state_00000003_00000.bin" "$work/llama_oo1/state_00000003_00000.bin"; then pass; else
    fail "llama: -oo 1 gives another model or optimizer state than -oo 0"; fi
# the recompute levels give the same bits (-r 1 recomputes the SwiGLU output, -r 2 the RMSNorm outputs too)
"$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 3 -r 0 >"$work/llama_r0.log" 2>&1 || fail "llama -r 0 run"
"$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 3 -r 2 >"$work/llama_r2.log" 2>&1 || fail "llama -r 2 run"
if [ -n "$(step_fields "$work/llama_r0.log")" ] && [ "$(step_fields "$work/llama_r0.log")" = "$(step_fields "$work/llama_oo0.log")" ] &&
    [ "$(step_fields "$work/llama_r2.log")" = "$(step_fields "$work/llama_oo0.log")" ]; then pass; else
    fail "llama: -r 0, 1 and 2 give different losses or norms"; fi
# the checkpoint's model file is the reference's format: its header words 16..21 as train_gpt.py writes them
if $PYTHON - "$LLAMA_MODEL" "$work/llama_oo0/model_00000003.bin" <<'PY'
import struct, sys
a, b = (struct.unpack("256i", open(p, "rb").read(1024)) for p in sys.argv[1:])
sys.exit(0 if a == b and a[16] == 1 else 1)
PY
then pass; else fail "a llama checkpoint's model header differs from train_gpt.py's"; fi
# bad architecture flags: one line naming the flag
expect_error "-kv not dividing NH" "d2: -kv 3: the key/value heads must divide the 2 heads" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -arch llama -kv 3
expect_error "llama with -fa 0" "-fa 0: -arch llama runs on flash attention only" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -arch llama -fa 0
expect_error "-kv with gpt2" "-kv applies to -arch llama only" "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -kv 2
expect_error "unknown -arch" "-arch gpt3: expected gpt2 or llama" "$TRAIN" "${COMMON[@]}" -arch gpt3
expect_error "odd SwiGLU size" "d2: -fh 100: H = 100: the swiglu kernels need" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -arch llama -fh 100
expect_error "-tie 2" "-tie 2: expected 0 or 1" "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -arch llama -tie 2
expect_error "-arch against a file" "-arch gpt2: $LLAMA_MODEL is a llama model" \
    "$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 1 -arch gpt2
expect_error "-kv against a file" "-kv 4: the model file $LLAMA_MODEL has 2" \
    "$TRAIN" "${LLAMA_FILE[@]}" -b 2 -x 1 -arch llama -kv 4

# --- bad inputs: one line naming the problem, non-zero exit (expect_error: dev/test/cli_common.sh)
printf 'not a model' >"$work/garbage.bin"
head -c 5000 "$MODEL" >"$work/truncated.bin"
head -c 3000 "$work/train.bin" >"$work/truncated_shard.bin"
expect_error "missing model" "no such model file" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/nope.bin"
expect_error "wrong magic" "garbage.bin" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/garbage.bin"
expect_error "truncated model" "truncated.bin is truncated" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/truncated.bin"
expect_error "unknown flag" "unknown flag -zz" "$TRAIN" "${COMMON[@]}" -zz 1
expect_error "non-integer value" "flag -b: expected an integer, got 'two'" "$TRAIN" "${COMMON[@]}" -b two
expect_error "T over maxT" "-t 64: longer than the model's maximum sequence length 32" "$TRAIN" "${COMMON[@]}" -b 2 -t 64
expect_error "bad scheduler" "unknown learning rate scheduler 'cosin'" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -k cosin
expect_error "recompute 3" "-r 3: expected 0, 1 or 2" "$TRAIN" "${COMMON[@]}" -r 3
expect_error "missing data" "no files match" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -i "$work/none_*.bin"
expect_error "truncated shard" "truncated_shard.bin" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -i "$work/truncated_shard.bin"
expect_error "batch not a multiple" "-d 100: must be a multiple of B*T*(data-parallel processes) = 32" "$TRAIN" "${COMMON[@]}" -b 2 -d 100
expect_error "resume without -o" "-y 1 needs -o" "$TRAIN" "${COMMON[@]}" -y 1
expect_error "bad descriptor" "-e d0x: bad descriptor" "$TRAIN" "${COMMON[@]}" -e d0x
# an unknown family in header word 16, a stray word 19 in a gpt2 file, and a llama header (word 16 = 1) with NKV = 0,
# on the tiny model's payload
/usr/bin/python3 - "$MODEL" "$work/family2.bin" "$work/word19.bin" "$work/llama_nkv0.bin" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
for path, word, value in ((sys.argv[2], 16, 2), (sys.argv[3], 19, 192), (sys.argv[4], 16, 1)):
    h = list(struct.unpack("256i", data[:1024]))
    h[word] = value
    open(path, "wb").write(struct.pack("256i", *h) + data[1024:])
PY
expect_error "unknown family" "family2.bin: model family 2 in header word 16 (1 = llama" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/family2.bin"
expect_error "stray family word" "word19.bin: header word 19 = 192, but a GPT-2-family file has 0" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/word19.bin"
expect_error "llama file with NKV 0" "llama_nkv0.bin: header word 17 (NKV) 0: the key/value heads must divide the 3 heads" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/llama_nkv0.bin"
# a header that claims C=96 with 5 heads: the sizes are refused before any parameter is read
$PYTHON - "$MODEL" "$work/heads.bin" <<'PY'
import struct, sys
h = list(struct.unpack("256i", open(sys.argv[1], "rb").read(1024)))
h[5], h[6] = 5, 96
open(sys.argv[2], "wb").write(struct.pack("256i", *h))
PY
expect_error "heads do not divide C" "channels (96) must be a multiple of the number of heads (5)" \
    "$TRAIN" "${COMMON[@]}" -b 2 -e "$work/heads.bin"

# --- token ids are checked against the model's vocabulary on every batch, train and val
# shard WIDTH NTOK VALUE [POSITION]: NTOK tokens of width 2 (uint16) or 4 (uint32), all 5 but VALUE at POSITION (or
# all VALUE without one)
shard() {
    $PYTHON - "$@" <<'PY'
import struct, sys
path, width, n, value = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
pos = int(sys.argv[5]) if len(sys.argv) > 5 else -1
toks = [value if pos < 0 or i == pos else 5 for i in range(n)]
h = [0] * 256
h[:3] = [20240520, 1 if width == 2 else 2, n]
open(path, "wb").write(struct.pack("256i", *h) + struct.pack("<%d%s" % (n, "H" if width == 2 else "I"), *toks))
PY
}
shard "$work/ffff.bin" 2 4096 65535
shard "$work/eqV.bin" 2 4096 263 100
shard "$work/eqV32.bin" 4 4096 263 4000
expect_error "tokens of 65535 on V=256" "ffff.bin: token 65535 at position 0 is out of range for the model's vocabulary (expected 0 to 255, V = 256)" \
    "$TRAIN" -e d2 -ev 256 -et 32 -i "$work/ffff.bin" -j "" -b 2 -t 16 -v 0 -s 0 -x 2 -a 1
expect_error "a val token equal to V" "eqV.bin: token 263 at position 100 is out of range" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 2 -j "$work/eqV.bin" -v 1 -m 4
expect_error "a uint32 train token equal to V, late in the shard" "eqV32.bin: token 263 at position 4000 is out of range" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 200 -a 0 -i "$work/eqV32.bin"

# --- numeric flags: values no run can use get one line naming the flag
expect_error "-d 0" "-d 0: expected a positive number of tokens per step" "$TRAIN" "${COMMON[@]}" -d 0
expect_error "-d negative" "-d -32: expected a positive number of tokens per step" "$TRAIN" "${COMMON[@]}" -d -32
expect_error "-x 0" "-x 0: expected a positive number of steps, or -1 for one epoch" "$TRAIN" "${COMMON[@]}" -x 0
expect_error "-x -2" "-x -2: expected a positive number of steps, or -1" "$TRAIN" "${COMMON[@]}" -x -2
for f in -n -v -m -g -s; do
    expect_error "$f negative" "$f -1: expected 0 or a positive number" "$TRAIN" "${COMMON[@]}" $f -1
done
# -g beyond what -t allows is clamped, with a line saying so
"$TRAIN" "${COMMON[@]}" -b 2 -x 1 -s 1 -g 100 -tf "$work/none.bin" >"$work/clamp.log" 2>&1 || fail "-g 100 run: $(tail -3 "$work/clamp.log")"
if grep -q "^-g 100: more than the sequence length -t 16 allows; samples will have 15 tokens" "$work/clamp.log"; then pass; else
    fail "-g over -t is not reported"; fi

# --- sampling: without a tokenizer the seed is a token of the model; a tokenizer larger than the model is not used
if grep -q "^note: no tokenizer: samples start from token 0 and print token ids" "$work/clamp.log" &&
    grep -A2 '^generating' "$work/clamp.log" | sed -n 3p | grep -qE '^(<[0-9]+>){15}$'; then pass; else
    fail "sampling without a tokenizer: $(grep -A2 '^generating' "$work/clamp.log" | tr '\n' ' ')"; fi
$PYTHON train_gpt.py --write-tokenizer "$work/bytes_tok.bin" --V 257 >/dev/null || fail "cannot write a tokenizer"
"$TRAIN" -e d2 -ev 256 -et 32 -i "$work/train.bin" -j "" -b 2 -t 16 -v 0 -s 1 -g 8 -x 1 -tf "$work/bytes_tok.bin" \
    >"$work/bigtok.log" 2>&1 || true
if grep -q "note: tokenizer $work/bytes_tok.bin has 257 tokens, more than the model's V = 256: not used" "$work/bigtok.log" &&
    grep -q "^note: no tokenizer: samples start from token 0" "$work/bigtok.log"; then pass; else
    fail "a tokenizer larger than the model: $(head -c 300 "$work/bigtok.log")"; fi

# --- divergence: a learning rate of 1e30 makes step 2 on NaN; -ns 3 such steps in a row stop the run (non-zero exit),
# no checkpoint is written from them, and -nk 1 keeps the step-1 checkpoint, the last one before the trouble
expect_error "divergence" "step 4: training diverged: the loss or the gradient norm was not finite for 3 steps in a row (-ns 3); the last checkpoint is step 1" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 10 -l 1e30 -n 1 -nk 1 -o "$work/diverge"
if [ "$(ls "$work/diverge" | grep -c '^DONE_')" = 1 ] && [ -e "$work/diverge/DONE_00000001" ] &&
    [ -e "$work/diverge/model_00000001.bin" ]; then pass; else
    fail "a diverging run's checkpoints: $(ls "$work/diverge" | tr '\n' ' ')"; fi
"$TRAIN" "${COMMON[@]}" -b 2 -x 10 -l 1e30 -ns 2 >"$work/diverge2.log" 2>&1
if grep -q "^step 2: loss -\?nan, gradient norm -\?nan: not finite, update skipped (1 of -ns 2 in a row)" "$work/diverge2.log" &&
    grep -q "^step 3: training diverged" "$work/diverge2.log" && ! grep -q "loss scale" "$work/diverge2.log"; then pass; else
    fail "-ns 2: $(grep -v '^[|+]' "$work/diverge2.log" | tail -4)"; fi
# -oo 2's early updates undone on the skipped steps
"$TRAIN" "${COMMON[@]}" -b 2 -x 10 -l 1e30 -ns 2 -oo 2 >"$work/diverge_early.log" 2>&1
if [ "$(grep -E '^step [0-9]+:' "$work/diverge_early.log")" = "$(grep -E '^step [0-9]+:' "$work/diverge2.log")" ] &&
    grep -q "^step 3: training diverged" "$work/diverge_early.log"; then pass; else
    fail "-oo 2 diverging: $(grep -v '^[|+]' "$work/diverge_early.log" | tail -3)"; fi
expect_error "-ns 0" "-ns 0: expected at least 1 step" "$TRAIN" "${COMMON[@]}" -ns 0

# --- checkpoint writes do not follow symlinks: a link planted at a temporary name is replaced, its target untouched
mkdir -p "$work/links"
printf 'precious' >"$work/precious.txt"
ln -s "$work/precious.txt" "$work/links/model_00000001.bin.tmp"
ln -s "$work/precious.txt" "$work/links/state_00000001_00000.bin.tmp"
"$TRAIN" "${COMMON[@]}" -b 2 -x 1 -n 1 -o "$work/links" >"$work/links.log" 2>&1 || fail "run with planted links: $(tail -3 "$work/links.log")"
if [ "$(cat "$work/precious.txt")" = precious ] && [ -e "$work/links/DONE_00000001" ] && [ ! -L "$work/links/model_00000001.bin" ] &&
    cmp -s "$work/links/model_00000001.bin" "$work/full/model_00000003.bin" -n 1024; then pass; else
    fail "a checkpoint write followed a symlink: precious.txt is now $(head -c 40 "$work/precious.txt" | od -c | head -1)"; fi

# --- a header's sizes are checked against the file's length before anything is allocated for them; a model that
# is all there but does not fit gets a line naming the file and the bytes it needs (a sparse file of 170 GB)
$PYTHON - "$MODEL" "$work/layers.bin" "$work/huge.bin" <<'PY'
import struct, sys
h = list(struct.unpack("256i", open(sys.argv[1], "rb").read(1024)))
h[4] = 30000
open(sys.argv[2], "wb").write(struct.pack("256i", *h) + b"\0" * 100000)
h[2:8] = [64, 263, 6000, 12, 768, 384]
f = open(sys.argv[3], "wb")
f.write(struct.pack("256i", *h))
n = 384 * 768 + 64 * 768 + 6000 * (2 * 768 + 3 * 768 * 768 + 3 * 768 + 768 * 768 + 768 + 2 * 768 + 8 * 768 * 768 + 5 * 768) + 2 * 768
f.truncate(1024 + 4 * n)
PY
expect_error "30000 layers on a small file" "layers.bin is truncated: its header describes" \
    timeout 20 "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/layers.bin"
expect_error "a model larger than memory" "huge.bin: out of device memory: the parameters and gradients of its" \
    timeout 20 "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/huge.bin"
rm -f "$work/huge.bin"
expect_error "activations larger than memory" "out of device memory: the activations (B=1000000 T=16, recompute 1:" \
    timeout 20 "$TRAIN" "${COMMON[@]}" -b 1000000 -x 1 -a 1

# --- main.log after a resume: the steps the resumed run redoes (and the validation it redoes) appear once
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -v 3 -m 1 -j "$work/train.bin" -o "$work/logfull" >"$work/logfull.log" 2>&1 ||
    fail "logging run: $(tail -3 "$work/logfull.log")"
mkdir -p "$work/logresumed"
cp "$work/logfull"/*_00000003* "$work/logfull/main.log" "$work/logresumed/"
"$TRAIN" "${COMMON[@]}" -b 2 -x 6 -n 3 -v 3 -m 1 -j "$work/train.bin" -o "$work/logresumed" -y 1 >"$work/logresumed.log" 2>&1 ||
    fail "resumed logging run: $(tail -3 "$work/logresumed.log")"
if $PYTHON - "$work/logfull/main.log" "$work/logresumed/main.log" <<'PY'
import re, sys
def keys(path):
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^s:(\d+) (\w+):", open(path).read(), re.M)]
a, b = keys(sys.argv[1]), keys(sys.argv[2])
print("  main.log steps: full %s\n  resumed %s" % (a, b))
sys.exit(0 if a == b and len(a) == 9 and "resumed from step 3" in open(sys.argv[2]).read() else 1)
PY
then pass; else fail "main.log after a resume repeats or lacks steps"; fi

# --- stdout is line-buffered: into a pipe, the memory plan is out before step 1 even if the process is killed there
# wait_stopped PID: until the process stands still (SIGSTOP), at most 60 s
wait_stopped() {
    for _ in $(seq 600); do
        [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" = T ] && return 0
        kill -0 "$1" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}
mkfifo "$work/pipe"
cat "$work/pipe" >"$work/piped.log" &
cat_pid=$!
TRAIN_TEST_STOP_AT_STEP=1 "$TRAIN" "${COMMON[@]}" -b 2 -x 5 >"$work/pipe" 2>/dev/null &
train_pid=$!
wait_stopped $train_pid || fail "the trainer did not stop before step 1"
kill -9 $train_pid
wait $train_pid 2>/dev/null
wait $cat_pid
if grep -q "memory: parameters" "$work/piped.log"; then pass; else fail "the memory plan was lost in the pipe's buffer"; fi

# --- the output directory is locked: a second run into it while one runs is refused, naming the holder's pid
TRAIN_TEST_STOP_AT_STEP=1 "$TRAIN" "${COMMON[@]}" -b 2 -x 5 -o "$work/locked" >/dev/null 2>&1 &
holder=$!
wait_stopped $holder || fail "the first run did not stop before step 1"
expect_error "a second run into a locked directory" "-o $work/locked: in use by another run (pid $holder holds $work/locked/train.lock)" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -o "$work/locked"
kill -9 $holder
wait $holder 2>/dev/null
if "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -o "$work/locked" -y 1 >"$work/relock.log" 2>&1; then pass; else
    fail "the lock outlived its holder: $(tail -2 "$work/relock.log")"; fi

# --- the collective watchdog: rank 1 stops (SIGSTOP) before step 2; with -wt 3 rank 0 ends the job, naming the
# operation it waited in and the step, instead of waiting forever
start=$(date +%s)
TRAIN_TEST_STOP_AT_STEP=2 TRAIN_TEST_STOP_RANK=1 timeout 120 $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -b 2 -x 5 -wt 3 \
    >"$work/watchdog.log" 2>&1
rc=$?
elapsed=$(( $(date +%s) - start ))
if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ $elapsed -lt 60 ] &&
    grep -q "^watchdog: process 0, step 2: the forward and backward passes with the gradient reduction did not complete within 3 s (-wt)" "$work/watchdog.log"; then
    pass; else fail "the watchdog did not end a job with a stopped process (exit $rc after ${elapsed}s): $(grep -v '^[|+]' "$work/watchdog.log" | tail -3)"; fi
expect_error "-wt negative" "-wt -1: expected seconds, or 0 for no watchdog" "$TRAIN" "${COMMON[@]}" -wt -1

# --- pre-emption (llmc/preemption.h): a process stopped before step 4 gets SIGTERM and goes on; it finishes step 4,
# every process agrees at the boundary, and the job writes a checkpoint of step 4 and exits 143; resumed, it prints
# the uninterrupted run's steps 5 and 6 bit for bit. On 1 process; on 2 at ZeRO-3 with -oo 1, the signal to rank 1
# only (rank 0 learns it at the boundary); and with SIGTERM sent again and again while the checkpoint is written
PRE=("${COMMON[@]}" -b 2 -x 6 -n 2)
preempted sigterm 1 once "$TRAIN" "${PRE[@]}"
preempted sigterm_np2 2 once "$TRAIN" "${PRE[@]}" -z 3 -oo 1
preempted sigterm_again 1 again "$TRAIN" "${PRE[@]}"

# --- one run per output directory: a fresh run into one that holds another run's files is refused, naming them
expect_error "a fresh run into a used -o" "-o $work/sigterm: holds another run" "$TRAIN" "${PRE[@]}" -o "$work/sigterm"

# --- pruning removes what a crash left: files of a checkpoint with no DONE marker (one being written or deleted) and
# temporaries go at the next checkpoint, beside the -nk 1 newest complete one
mkdir -p "$work/pruned"
cp "$work/sigterm/"*_00000004* "$work/pruned/"
touch "$work/pruned/model_00000005.bin" "$work/pruned/state_00000005_00000.bin" "$work/pruned/state_00000003_00001.bin" \
    "$work/pruned/model_00000004.bin.tmp" "$work/pruned/notes.txt"
"$TRAIN" "${PRE[@]}" -nk 1 -o "$work/pruned" -y 1 >"$work/pruned.log" 2>&1 || fail "pruned run: $(tail -3 "$work/pruned.log")"
left=$(cd "$work/pruned" && ls | tr '\n' ' ')
if [ "$left" = "DONE_00000006 main.log model_00000006.bin notes.txt state_00000006_00000.bin train.lock " ]; then pass; else
    fail "pruning left: $left"; fi

# --- no silent empty runs: a non-finite parameter in the model file (a wpe row past -t, which no batch reaches) is
# refused at load, named with its index; a run whose every due checkpoint was skipped (the loss not finite from a
# learning rate of 1e30) exits non-zero, saying so
$PYTHON - "$MODEL" "$work/nan_model.bin" <<'PY'
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
header = struct.unpack_from("<256i", data)
maxT, V, C, Vp = header[2], header[3], header[6], header[7]
at = 1024 + 4 * (Vp * C + (maxT - 1) * C + 5)  # wpe[maxT - 1][5]
struct.pack_into("<f", data, at, float("nan"))
open(sys.argv[2], "wb").write(data)
print("  wpe element %d of %s set to NaN" % ((maxT - 1) * C + 5, sys.argv[2]))
PY
expect_error "a non-finite parameter" "parameter wpe, element 1493 (value nan; the file's parameter" \
    "$TRAIN" "${COMMON[@]}" -e "$work/nan_model.bin" -b 2 -x 1
expect_error "a run that saved nothing" "no checkpoint was written" "$TRAIN" "${COMMON[@]}" -b 2 -x 3 -n 10 -l 1e30 \
    -o "$work/empty"

# --- names of any length: an -o of 1,000 characters (components of 199) works; one of 5,000, which the file system
# refuses, is refused before training with the path whole
long="$work"
while [ ${#long} -lt 1000 ]; do long="$long/$(printf 'd%.0s' $(seq 199))"; done
long=${long:0:1000}
mkdir -p "$(dirname "$long")"
if "$TRAIN" "${COMMON[@]}" -b 2 -x 2 -n 1 -o "$long" >"$work/long.log" 2>&1 && [ -e "$long/DONE_00000002" ] &&
    [ -e "$long/state_00000002_00000.bin" ]; then pass; else fail "an -o of 1000 characters: $(tail -2 "$work/long.log")"; fi
longer="$long"
while [ ${#longer} -lt 5000 ]; do longer="$longer/$(printf 'e%.0s' $(seq 199))"; done
expect_error "an -o of 5000 characters" "$longer" "$TRAIN" "${COMMON[@]}" -b 2 -x 2 -o "$longer"
if ! grep -q "^step 1/" <("$TRAIN" "${COMMON[@]}" -b 2 -x 2 -o "$longer" 2>&1); then pass; else
    fail "an -o of 5000 characters trained"; fi

# --- -e naming a directory says so
expect_error "-e naming a directory" "$work: is a directory" "$TRAIN" "${COMMON[@]}" -e "$work" -b 2 -x 1

echo "test_train_gpt: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
