#!/usr/bin/env bash
# dev/test/test_tensor_parallel.sh: command-line tests of tensor parallelism (-tp, -sp; doc/parallelism.md) in the GPT
# trainer on the CPU backend (FP32 build), on distinct batches from a data shard:
#   - -tp 2 with and without sequence parallelism, GPT-2 and llama, gives the losses and gradient norms of -tp 1 on
#     the same batches (each step a new batch), within fp32 rounding (the members' partial sums are added in another
#     order); so does -tp 2 with 2 data-parallel processes (ZeRO-1) against one process with both micro-batches;
#   - with gradient accumulation, validation and sampling: -tp 1's losses, validation losses and sampled tokens;
#   - its model file is the whole model: the header and the parameters of -tp 1's after the same steps;
#   - a -tp 2 run resumed from its checkpoint continues bit-identically; resumed at -tp 1, or on 4 processes (2
#     data-parallel), and a -tp 1 checkpoint resumed at -tp 2, each continues the same losses within fp32 rounding
#     (the optimizer state re-cut for the new layout);
#   - the MoE trainer folds its MoE layers (-etp 1): -tp 2 with the experts shared out over both processes (-ep 2)
#     gives the losses of -tp 1 routing each member's sequence as a micro-step of its own (-d: the same routing
#     groups), its model file is the whole model, and its checkpoint resumed at -tp 1 (2 data-parallel processes)
#     continues those losses; with -etp 2 (each expert's hidden units split) it gives -tp 1's losses on the same
#     batches, and its checkpoint resumed at -tp 1 continues them;
#   - the memory plan (-pm) counts this process's slices, and the activations shrink with -tp and -sp;
#   - every layout that does not fit is refused with one line naming the flag.
# Needs build/train_gpt_fp32, build/train_moe_fp32, build/ref/tp_gpt2_fp32_model.bin, build/ref/tp_llama_fp32_model.bin,
# build/ref/moe_tp_k2_mb2_fp32_model.bin and build/ref/tiny_fp32_model.bin (make test builds them). Runs up to 4
# processes at once. Run from anywhere:
#   dev/test/test_tensor_parallel.sh
set -u
cd "$(dirname "$0")/../.."
TRAIN=build/train_gpt_fp32
MODEL=build/ref/tp_gpt2_fp32_model.bin
LLAMA_MODEL=build/ref/tp_llama_fp32_model.bin
. dev/test/cli_common.sh

$PYTHON train_gpt.py --write-shard "$work/train.bin" --shard-tokens 8192 --V 263 --seed 7 >/dev/null ||
    { echo "cannot write a data shard"; exit 1; }
COMMON=(-i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1)

# --- -tp 2 against -tp 1 on 4 distinct batches: GPT-2 with -sp 1 and -sp 0, llama (2 key/value heads of 4) with -sp 1
"$TRAIN" -e "$MODEL" "${COMMON[@]}" -b 2 -x 4 -n 2 -o "$work/whole" >"$work/whole.log" 2>&1 ||
    fail "-tp 1 run: $(tail -3 "$work/whole.log")"
for sp in 1 0; do
    $MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -b 2 -x 4 -tp 2 -sp $sp -n 2 -o "$work/tp2_sp$sp" \
        >"$work/tp2_sp$sp.log" 2>&1 || fail "-tp 2 -sp $sp run: $(tail -3 "$work/tp2_sp$sp.log")"
    if close_losses "$work/whole.log" "$work/tp2_sp$sp.log" 4; then pass; else
        fail "-tp 2 -sp $sp differs from -tp 1 on the same batches"; fi
done
"$TRAIN" -e "$LLAMA_MODEL" "${COMMON[@]}" -b 2 -x 3 >"$work/llama.log" 2>&1 || fail "llama -tp 1 run: $(tail -3 "$work/llama.log")"
$MPIRUN -np 2 "$TRAIN" -e "$LLAMA_MODEL" "${COMMON[@]}" -b 2 -x 3 -tp 2 -r 2 >"$work/llama_tp2.log" 2>&1 ||
    fail "llama -tp 2 run: $(tail -3 "$work/llama_tp2.log")"
if close_losses "$work/llama.log" "$work/llama_tp2.log" 3; then pass; else fail "llama -tp 2 differs from -tp 1"; fi

# --- -tp 2 with 2 micro-steps per step (-d), validation and sampling (each member takes part in every pass, and the
# sample reads the logits put together from the members' vocabulary rows): -tp 1's losses, validation losses and
# sampled tokens (no tokenizer: the samples print token ids)
EXTRA=(-e "$MODEL" -i "$work/train.bin" -j "$work/train.bin" -t 16 -b 2 -d 64 -x 4 -v 2 -m 2 -s 2 -g 8 -l 1e-3 -c 0.1
       -tf "$work/none")
"$TRAIN" "${EXTRA[@]}" >"$work/sampled.log" 2>&1 || fail "-tp 1 sampling run: $(tail -3 "$work/sampled.log")"
$MPIRUN -np 2 "$TRAIN" "${EXTRA[@]}" -tp 2 >"$work/sampled_tp2.log" 2>&1 ||
    fail "-tp 2 sampling run: $(tail -3 "$work/sampled_tp2.log")"
if close_losses "$work/sampled.log" "$work/sampled_tp2.log" 4; then pass; else
    fail "-tp 2 with accumulation differs from -tp 1"; fi
samples() { grep -E '^(<[0-9]+>)+$' "$1"; }
if [ -n "$(samples "$work/sampled.log")" ] && [ "$(samples "$work/sampled.log")" = "$(samples "$work/sampled_tp2.log")" ]
then pass; else fail "-tp 2's samples differ from -tp 1's"; fi
$PYTHON - "$work/sampled.log" "$work/sampled_tp2.log" <<'PY' && pass || fail "-tp 2's validation losses differ from -tp 1's"
import re, sys
a, b = ([float(v) for v in re.findall(r"^val loss ([-\d.e+]+)", open(p).read(), re.M)] for p in sys.argv[1:])
print("  validation losses: %s and %s" % (a, b))
sys.exit(0 if len(a) == 3 and len(a) == len(b) and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)) else 1)
PY

# --- -tp 2 on 4 processes (2 data-parallel, ZeRO-1) against 1 process with both micro-batches (-a 1: the same tokens)
"$TRAIN" -e "$MODEL" "${COMMON[@]}" -b 4 -a 1 -x 3 >"$work/single4.log" 2>&1 || fail "B=4 run: $(tail -3 "$work/single4.log")"
$MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -b 2 -a 1 -x 3 -tp 2 -z 1 >"$work/tp2_dp2.log" 2>&1 ||
    fail "-tp 2 -z 1 on 4 processes: $(tail -3 "$work/tp2_dp2.log")"
if close_losses "$work/single4.log" "$work/tp2_dp2.log" 3; then pass; else
    fail "-tp 2 with 2 data-parallel processes differs from 1 process with their batches"; fi

# --- the model file is the whole model, put together from the members' slices: -tp 1's header, and a -tp 1 run
# started from it has the first loss and gradient norm of one started from -tp 1's file after the same 2 steps (the
# parameters themselves may differ by more than fp32 rounding where AdamW normalises a near-zero gradient)
if cmp -s <(head -c 1024 "$work/whole/model_00000002.bin") <(head -c 1024 "$work/tp2_sp1/model_00000002.bin"); then
    pass; else fail "the -tp 2 model file's header differs from -tp 1's"; fi
"$TRAIN" -e "$work/whole/model_00000002.bin" "${COMMON[@]}" -b 2 -x 1 >"$work/from_whole.log" 2>&1 ||
    fail "-tp 1 run from -tp 1's model file: $(tail -3 "$work/from_whole.log")"
"$TRAIN" -e "$work/tp2_sp1/model_00000002.bin" "${COMMON[@]}" -b 2 -x 1 >"$work/from_tp2.log" 2>&1 ||
    fail "-tp 1 run from -tp 2's model file: $(tail -3 "$work/from_tp2.log")"
if close_losses "$work/from_whole.log" "$work/from_tp2.log" 1; then pass; else
    fail "the -tp 2 model file is not -tp 1's model"; fi

# resume_into NAME SOURCE-DIR PROCESSES TRAINER MODEL FLAGS...: SOURCE-DIR's step-2 checkpoint resumed into
# $work/NAME (log $work/NAME.log) for steps 3 and 4
resume_into() {
    local name=$1 source=$2 np=$3 trainer=$4 model=$5
    shift 5
    mkdir -p "$work/$name"
    cp "$source/"*_00000002* "$work/$name/"
    $MPIRUN -np "$np" "$trainer" -e "$model" "${COMMON[@]}" -x 4 -n 2 -o "$work/$name" -y 1 "$@" >"$work/$name.log" \
        2>&1 || fail "resume $name: $(tail -3 "$work/$name.log")"
}
# steps_3_4 LOG: its steps 3 and 4, which a run resumed from its step-2 checkpoint goes on with
steps_3_4() { grep -E '^step [34]/' "$1" >"${1%.log}_tail.log"; echo "${1%.log}_tail.log"; }

# --- a -tp 2 run resumed from its step-2 checkpoint continues bit-identically
resume_into tp2_resumed "$work/tp2_sp1" 2 "$TRAIN" "$MODEL" -b 2 -tp 2
want=$(step_fields "$work/tp2_sp1.log" | tail -n 2)
if [ -n "$want" ] && [ "$(step_fields "$work/tp2_resumed.log")" = "$want" ] &&
    cmp -s "$work/tp2_sp1/model_00000004.bin" "$work/tp2_resumed/model_00000004.bin"; then pass; else
    fail "the resumed -tp 2 run differs from the uninterrupted one"; fi

# --- resumed into another layout (doc/formats.md: the optimizer state's slices and shards cut anew): the -tp 2 run's
# step-2 checkpoint at -tp 1 on 1 process, and at -tp 2 on 4 processes with half the micro-batch each (the same global
# batch); -tp 1's checkpoint at -tp 2. Each goes on with its source run's steps 3 and 4.
tp2_tail=$(steps_3_4 "$work/tp2_sp1.log")
resume_into tp2_to_tp1 "$work/tp2_sp1" 1 "$TRAIN" "$MODEL" -b 2
if close_losses "$tp2_tail" "$work/tp2_to_tp1.log" 2; then pass; else fail "-tp 2 resumed at -tp 1 differs"; fi
resume_into tp2_to_np4 "$work/tp2_sp1" 4 "$TRAIN" "$MODEL" -b 1 -tp 2 -z 1
if close_losses "$tp2_tail" "$work/tp2_to_np4.log" 2; then pass; else fail "-tp 2 resumed on 4 processes differs"; fi
resume_into tp1_to_tp2 "$work/whole" 2 "$TRAIN" "$MODEL" -b 2 -tp 2
if close_losses "$(steps_3_4 "$work/whole.log")" "$work/tp1_to_tp2.log" 2; then pass; else
    fail "-tp 1 resumed at -tp 2 differs"; fi

# --- the MoE trainer at -tp 2 -ep 2 (each member routes its own sequence, its experts 2 of the 4) against -tp 1 with
# each step's 2 sequences as 2 micro-steps of one (the same routing groups); its model file is the whole model, and
# its step-2 checkpoint resumed at -tp 1 on 2 data-parallel processes of one sequence each (the same routing groups
# again; the experts' state in the file's global layout) continues its losses
MOE=build/train_moe_fp32
MOE_MODEL=build/ref/moe_tp_k2_mb2_fp32_model.bin
"$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 1 -d 32 -x 4 -n 2 -o "$work/moe_whole" >"$work/moe_whole.log" 2>&1 ||
    fail "MoE -tp 1 run: $(tail -3 "$work/moe_whole.log")"
$MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 4 -tp 2 -ep 2 -n 2 -o "$work/moe_tp2" \
    >"$work/moe_tp2.log" 2>&1 || fail "MoE -tp 2 -ep 2 run: $(tail -3 "$work/moe_tp2.log")"
if close_losses "$work/moe_whole.log" "$work/moe_tp2.log" 4; then pass; else
    fail "MoE -tp 2 -ep 2 differs from -tp 1 with the members' sequences as micro-steps"; fi
for run in moe_whole moe_tp2; do
    "$MOE" -e "$work/$run/model_00000002.bin" "${COMMON[@]}" -b 1 -d 32 -x 1 >"$work/from_$run.log" 2>&1 ||
        fail "MoE -tp 1 run from $run's model file: $(tail -3 "$work/from_$run.log")"
done
if close_losses "$work/from_moe_whole.log" "$work/from_moe_tp2.log" 1; then pass; else
    fail "the MoE -tp 2 -ep 2 model file is not -tp 1's model"; fi
resume_into moe_tp2_to_dp2 "$work/moe_tp2" 2 "$MOE" "$MOE_MODEL" -b 1 -ep 2
if close_losses "$(steps_3_4 "$work/moe_tp2.log")" "$work/moe_tp2_to_dp2.log" 2; then pass; else
    fail "MoE -tp 2 resumed at -tp 1 (2 data-parallel processes of one sequence) differs"; fi

# --- folded with the global-batch loss (-rg 1): the step's counts so far summed over every routing group, here both
# members' of the same micro-step, as 2 data-parallel processes of one sequence each sum theirs: the same losses
$MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 1 -x 3 -rg 1 >"$work/moe_rg_dp2.log" 2>&1 ||
    fail "MoE -rg 1 on 2 data-parallel processes: $(tail -3 "$work/moe_rg_dp2.log")"
$MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 3 -rg 1 -tp 2 >"$work/moe_rg_tp2.log" 2>&1 ||
    fail "MoE -rg 1 -tp 2: $(tail -3 "$work/moe_rg_tp2.log")"
if close_losses "$work/moe_rg_dp2.log" "$work/moe_rg_tp2.log" 3; then pass; else
    fail "MoE -rg 1 -tp 2 differs from 2 data-parallel processes"; fi

# --- -etp 2: each expert's hidden units split over the members, every member routing the whole batch: -tp 1's losses
# on the same 2 sequences per step, and its step-2 checkpoint (the experts' slices put together in the state file)
# resumed at -tp 1 continues them
"$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 4 >"$work/moe_b2.log" 2>&1 ||
    fail "MoE -b 2 run: $(tail -3 "$work/moe_b2.log")"
$MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 4 -tp 2 -etp 2 -n 2 -o "$work/moe_etp2" \
    >"$work/moe_etp2.log" 2>&1 || fail "MoE -tp 2 -etp 2 run: $(tail -3 "$work/moe_etp2.log")"
if close_losses "$work/moe_b2.log" "$work/moe_etp2.log" 4; then pass; else
    fail "MoE -tp 2 -etp 2 differs from -tp 1"; fi
resume_into moe_etp2_to_tp1 "$work/moe_etp2" 1 "$MOE" "$MOE_MODEL" -b 2
if close_losses "$(steps_3_4 "$work/moe_etp2.log")" "$work/moe_etp2_to_tp1.log" 2; then pass; else
    fail "MoE -tp 2 -etp 2 resumed at -tp 1 differs"; fi

# --- the memory plan (-pm) of a GPT-2 d12 at -tp 2, on one process (the plan takes the layout's sizes only): the
# parameters are this process's slices (the split tensors halved, the others whole: doc/parallelism.md's table,
# counted here on its own), and the activations shrink
# from -tp 1 to -tp 2 -sp 0 (the heads' and hidden units' slices) to -tp 2 -sp 1 (the stream's tokens too)
plan() {  # NAME PROCESSES FLAGS...
    local name=$1 np=$2
    shift 2
    $MPIRUN -np "$np" "$TRAIN" -pm 80 -e d12 -b 4 -t 1024 -fa 1 "$@" >"$work/plan_$name.log" 2>&1 ||
        fail "-pm $name: $(tail -2 "$work/plan_$name.log")"
}
plan whole 1
plan tp2_sp0 1 -tp 2 -sp 0
plan tp2_sp1 1 -tp 2
$PYTHON - "$work/plan_whole.log" "$work/plan_tp2_sp0.log" "$work/plan_tp2_sp1.log" <<'PY' && pass || fail "the -tp 2 memory plan differs from the slices' sizes"
import re, sys
def rows(path):
    text = open(path).read()
    return {m.group(1).strip(): int(m.group(2)) for m in re.finditer(r"^\| memory: ([a-z ]+?)\s*\|[^(]*\((\d+) bytes", text, re.M)}, text
(whole, _), (sp0, _), (sp1, text) = (rows(p) for p in sys.argv[1:])
L, C, V, maxT, N = 12, 768, 50257, 1024, 2
Vp = (V + 127) // 128 * 128
split = Vp * C + L * (3 * C * C + 3 * C + C * C + 4 * C * C + 4 * C + 4 * C * C)  # wte, qkv, attproj, fc, fcproj
whole_tensors = maxT * C + L * 6 * C + 2 * C  # wpe, ln1, attprojb, ln2, fcprojb, lnf
n = split // N + whole_tensors
want = 4 * (-(-n // 8) * 8)
print("  parameters at -tp 2: %d bytes, want %d; activations %d > %d > %d" %
      (sp1.get("parameters", 0), want, whole.get("activations", 0), sp0.get("activations", 0), sp1.get("activations", 0)))
ok = sp1.get("parameters") == want and sp0.get("parameters") == want
ok = ok and whole["activations"] > sp0["activations"] > sp1["activations"] > 0
ok = ok and "Korthikanti" in text and "sent per process" in text
sys.exit(0 if ok else 1)
PY

# --- layouts that do not fit: one line naming the flag
TINY=build/ref/tiny_fp32_model.bin
expect_error "-tp not dividing the processes" "-pp 1 -tp 3: their product must divide the number of processes (2)" \
    $MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -b 2 -x 1 -tp 3
expect_error "-tp not dividing the heads" "3 heads, which 2 processes cannot share equally" \
    $MPIRUN -np 2 "$TRAIN" -e "$TINY" "${COMMON[@]}" -b 2 -x 1 -tp 2
expect_error "-sp with -tp 1" "-sp 1: sequence parallelism cuts the tokens" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -sp 1
expect_error "-sp 1 with T not a multiple" "the sequence length -t 15 must be a multiple of 2" \
    $MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -t 15 -b 2 -x 1 -tp 2
expect_error "-sp out of range" "-sp 2: expected 0 or 1" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -tp 2 -sp 2
expect_error "-tp 0" "-tp 0: expected 1 or more" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -tp 0
expect_error "-etp other than 1 or -tp" "-etp 3: expected 1 (the experts whole) or -tp's 2" \
    $MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 1 -tp 2 -etp 3
expect_error "-tp 2 -etp 1 with B*T not dividing" "-tp 2 -etp 1: each member routes an equal part" \
    $MPIRUN -np 2 "$MOE" -e "$MOE_MODEL" "${COMMON[@]}" -t 15 -b 1 -x 1 -tp 2 -sp 0

echo "tensor_parallel: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
