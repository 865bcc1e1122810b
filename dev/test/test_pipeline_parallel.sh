#!/usr/bin/env bash
# dev/test/test_pipeline_parallel.sh: command-line tests of pipeline parallelism (-pp, -ppl, -pps, -ppt;
# doc/parallelism.md "Pipeline parallelism") in the GPT trainer on the CPU backend, on distinct micro-batches from a
# data shard (-d: 4 micro-batches of 2 sequences per step, each step new ones):
#   - -pp 2 and -pp 4 (1F1B) give the losses, gradient norms and validation losses of
#     -pp 1 within fp32 rounding (the tied wte's two parts are summed in another order), and their model files are -pp
#     1's parameters within 1e-5;
#   - GPipe, 1F1B, ZB-H1 (its weight gradients deferred to W passes) and interleaved 1F1B (2 and 4 chunks per stage,
#     the latter at ZeRO-2) accumulate the micro-batches in the same order: bit-identical losses and model files; ZB at
#     ZeRO-2 and ZeRO-3 gives 1F1B's ZeRO-2 steps bit for bit;
#   - data parallelism inside each stage (-pp 2 on 4 processes, ZeRO-1 and ZeRO-2) gives -pp 1's on 2 processes, and
#     ZeRO-3 gives ZeRO-2's bit for bit; 3D, -pp 2 -tp 2 with 2 data-parallel processes (8 processes), gives one
#     process's losses;
#   - BF16 -pp 2 gives -pp 1's losses within bf16 rounding, in the sanitized build;
#   - the checking build (cpu/cucc --check: every stage's sends and receives meet in matching groups, races, stream
#     order) runs 4 stages in each schedule, with as many micro-batches as stages and with fewer;
#   - a -pp 2 run resumed from its checkpoint continues bit-identically; resumed at -pp 1 or -pp 4, and a -pp 1
#     checkpoint at -pp 2 at another cut, each continues its run's losses within fp32 rounding;
#   - the trace (-ppt) holds every process's passes, and scripts/plot_pipeline.py draws it;
#   - the memory plan (-pm) gives each stage's parameters, optimizer state and micro-batches in flight (ZeRO-3: shards);
#   - every layout that does not fit is refused with one line naming the flag.
# The MoE trainer's stages (train_moe -pp) against its -pp 1 runs, in the same ways (see its section below).
# Needs build/train_gpt_fp32, build/sanitize/train_gpt_bf16, build/check/train_gpt_fp32, build/train_moe_fp32,
# build/check/train_moe_fp32, build/ref/deep_fp32_model.bin, build/ref/deep_bf16_model.bin,
# build/ref/tp_gpt2_fp32_model.bin, build/ref/stages_fp32_model.bin, build/ref/moe_ds_fp32_model.bin,
# build/ref/moe_deep_k1_fp32_model.bin and build/ref/moe_tp_k2_mb2_fp32_model.bin (make test builds them). Runs up
# to 8 processes at once (the 3D layouts).
# Run from anywhere:
#   dev/test/test_pipeline_parallel.sh
set -u
cd "$(dirname "$0")/../.."
TRAIN=build/train_gpt_fp32
MODEL=build/ref/deep_fp32_model.bin  # 5 layers: 2 and 4 stages, balanced and not
. dev/test/cli_common.sh

$PYTHON train_gpt.py --write-shard "$work/train.bin" --shard-tokens 8192 --V 263 --seed 7 >/dev/null ||
    { echo "cannot write a data shard"; exit 1; }
COMMON=(-i "$work/train.bin" -j "$work/train.bin" -t 16 -b 2 -d 128 -v 2 -m 2 -s 0 -l 1e-3 -c 0.1)

# same_parameters A B TOLERANCE: the model files' parameters agree within TOLERANCE (0: bit for bit)
same_parameters() {
    $PYTHON - "$1" "$2" "$3" <<'PY'
import sys, numpy as np
a, b = (np.fromfile(p, dtype=np.uint8)[1024:] for p in sys.argv[1:3])
if len(a) != len(b): sys.exit(1)
tol = float(sys.argv[3])
if tol == 0: sys.exit(0 if np.array_equal(a, b) else 1)
x, y = a.view(np.float32), b.view(np.float32)
sys.exit(0 if np.max(np.abs(x - y)) <= tol else 1)
PY
}
val_losses() { grep -E '^val loss' "$1"; }

# --- -pp 2 (the balanced cut, 3 and 2 layers) and -pp 4 against -pp 1, 3 steps of 4 micro-batches (checkpoints after
# steps 2 and 3)
"$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -n 2 -o "$work/whole" >"$work/whole.log" 2>&1 ||
    fail "-pp 1 run: $(tail -3 "$work/whole.log")"
for layout in "2" "4"; do
    name=pp${layout// /_}
    name=${name//,/_}
    np=${layout%% *}
    $MPIRUN -np "$np" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -n 2 -o "$work/$name" -pp $layout >"$work/$name.log" 2>&1 ||
        fail "-pp $layout run: $(tail -3 "$work/$name.log")"
    if close_losses "$work/whole.log" "$work/$name.log" 3 >/dev/null &&
        [ "$(val_losses "$work/whole.log")" = "$(val_losses "$work/$name.log")" ] &&
        same_parameters "$work/whole/model_00000003.bin" "$work/$name/model_00000003.bin" 1e-5; then pass; else
        fail "-pp $layout differs from -pp 1"; close_losses "$work/whole.log" "$work/$name.log" 3; fi
done

# --- GPipe and ZB-H1 against 1F1B at 4 stages: the same sums in the same order (ZB's deferred weight gradients too),
# and ZB at 2 stages with -r 2 (its W passes copy the recomputed norms' outputs)
for schedule in gpipe zb; do
    $MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -n 3 -o "$work/$schedule" -pp 4 -pps $schedule \
        >"$work/$schedule.log" 2>&1 || fail "-pps $schedule run: $(tail -3 "$work/$schedule.log")"
    if [ -n "$(step_fields "$work/$schedule.log")" ] &&
        [ "$(step_fields "$work/$schedule.log")" = "$(step_fields "$work/pp4.log")" ] &&
        same_parameters "$work/$schedule/model_00000003.bin" "$work/pp4/model_00000003.bin" 0; then pass; else
        fail "$schedule differs from 1f1b"; fi
done
$MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -v 0 -r 2 -pp 2 -pps zb >"$work/r2_zb.log" 2>&1 ||
    fail "-r 2 -pp 2 -pps zb: $(tail -3 "$work/r2_zb.log")"
# (-r 2 recomputes the norms' outputs bit for bit: the steps of -r 1's 1F1B)
if [ -n "$(step_fields "$work/r2_zb.log")" ] && [ "$(step_fields "$work/r2_zb.log")" = "$(step_fields "$work/pp2.log")" ]
then pass; else fail "zb -r 2 differs from 1f1b"; fi

# --- interleaved 1F1B on an 8-layer model: -pp 2 -ppv 2 (stage 0 holds layers 0-1 and 4-5) against 1F1B at the cut 4,4
# (the same sums in the same order: each layer's gradients over the micro-batches in order), both against -pp 1;
# -pp 2 -ppv 4 (chunks of one layer) too, at ZeRO-2: on one data-parallel process its shards sum each micro-batch's
# gradients in fp32 in the order the gradient buffer does
STAGES=build/ref/stages_fp32_model.bin
"$TRAIN" -e "$STAGES" "${COMMON[@]}" -x 2 -v 0 >"$work/stages.log" 2>&1 || fail "8 layers: $(tail -3 "$work/stages.log")"
$MPIRUN -np 2 "$TRAIN" -e "$STAGES" "${COMMON[@]}" -x 2 -v 0 -n 2 -o "$work/cut44" -pp 2 -ppl 4,4 >"$work/cut44.log" 2>&1 ||
    fail "-pp 2 -ppl 4,4: $(tail -3 "$work/cut44.log")"
for v in 2 4; do
    $MPIRUN -np 2 "$TRAIN" -e "$STAGES" "${COMMON[@]}" -x 2 -v 0 -n 2 -o "$work/inter$v" -pp 2 -pps interleaved -ppv $v \
        -z $((v - 2)) >"$work/inter$v.log" 2>&1 || fail "-pps interleaved -ppv $v: $(tail -3 "$work/inter$v.log")"
    losses() { grep -oE '^step [0-9]+/[0-9]+ \| loss [0-9.]+' "$1"; }
    if [ -n "$(losses "$work/inter$v.log")" ] && [ "$(losses "$work/inter$v.log")" = "$(losses "$work/cut44.log")" ] &&
        same_parameters "$work/inter$v/model_00000002.bin" "$work/cut44/model_00000002.bin" 0 &&
        close_losses "$work/stages.log" "$work/inter$v.log" 2 >/dev/null; then pass; else
        fail "interleaved -ppv $v differs from 1f1b or -pp 1"; fi
done

# --- data parallelism inside each stage (ZeRO-1) against -pp 1 on as many data-parallel processes
$MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -z 1 >"$work/dp2.log" 2>&1 || fail "-pp 1 on 2: $(tail -3 "$work/dp2.log")"
$MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -z 1 -pp 2 >"$work/pp2_dp2.log" 2>&1 ||
    fail "-pp 2 on 4: $(tail -3 "$work/pp2_dp2.log")"
if close_losses "$work/dp2.log" "$work/pp2_dp2.log" 3 >/dev/null; then pass; else
    fail "-pp 2 with 2 data-parallel processes differs from -pp 1 on 2"; fi
# ZeRO-2 (each micro-batch's gradients averaged into the shards; the tied wte's summed whole over the micro-batches,
# then between the stages) within fp32 rounding of ZeRO-1's, and ZeRO-3 (the parameters sharded too) bit for bit ZeRO-2
for z in 2 3; do
    $MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -z $z -pp 2 >"$work/pp2_z$z.log" 2>&1 ||
        fail "-pp 2 -z $z on 4: $(tail -3 "$work/pp2_z$z.log")"
done
if close_losses "$work/dp2.log" "$work/pp2_z2.log" 3 >/dev/null; then pass; else
    fail "-pp 2 -z 2 on 4 differs from -pp 1 -z 1 on 2"; fi
if [ -n "$(step_fields "$work/pp2_z3.log")" ] && [ "$(step_fields "$work/pp2_z3.log")" = "$(step_fields "$work/pp2_z2.log")" ]
then pass; else fail "-pp 2 -z 3 differs from -z 2"; fi
# ZB at ZeRO-2 and ZeRO-3 (each layer's weights take their bucket space in its W pass, the rest in its B pass, each
# reduced once): 1F1B's ZeRO-2 steps bit for bit (every shard adds the micro-batches' gradients in the same order)
for z in 2 3; do
    $MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -z $z -pp 2 -pps zb >"$work/zb_z$z.log" 2>&1 ||
        fail "-pp 2 -pps zb -z $z on 4: $(tail -3 "$work/zb_z$z.log")"
    if [ -n "$(step_fields "$work/zb_z$z.log")" ] && [ "$(step_fields "$work/zb_z$z.log")" = "$(step_fields "$work/pp2_z2.log")" ]
    then pass; else fail "-pp 2 -pps zb -z $z differs from 1f1b -z 2"; fi
done

# --- 3D: 2 stages x 2 tensor-parallel members x 2 data-parallel processes against 1 process (2 layers, 4 heads)
TP_MODEL=build/ref/tp_gpt2_fp32_model.bin
"$TRAIN" -e "$TP_MODEL" "${COMMON[@]}" -x 2 -v 0 >"$work/tp_whole.log" 2>&1 || fail "1 process: $(tail -3 "$work/tp_whole.log")"
$MPIRUN -np 8 "$TRAIN" -e "$TP_MODEL" "${COMMON[@]}" -x 2 -v 0 -pp 2 -tp 2 -z 1 >"$work/3d.log" 2>&1 ||
    fail "-pp 2 -tp 2 on 8: $(tail -3 "$work/3d.log")"
if close_losses "$work/tp_whole.log" "$work/3d.log" 2 >/dev/null; then pass; else fail "3D differs from 1 process"; fi

# --- BF16: -pp 2 against -pp 1 within bf16 rounding (the tied wte's parts summed in another order, rounded), in the
# sanitized build (ASan and UBSan over the pipeline's code too; Open MPI's own allocations outlive the run)
BF16=build/sanitize/train_gpt_bf16
$BF16 -e build/ref/deep_bf16_model.bin "${COMMON[@]}" -x 3 -v 0 >"$work/bf16.log" 2>&1 ||
    fail "bf16 -pp 1: $(tail -3 "$work/bf16.log")"
ASAN_OPTIONS=detect_leaks=0 $MPIRUN -np 2 $BF16 -e build/ref/deep_bf16_model.bin "${COMMON[@]}" -x 3 -v 0 -pp 2 \
    >"$work/bf16_pp2.log" 2>&1 || fail "bf16 -pp 2: $(tail -3 "$work/bf16_pp2.log")"
$PYTHON - "$work/bf16.log" "$work/bf16_pp2.log" <<'PY' && pass || fail "bf16 -pp 2 differs from -pp 1"
import re, sys
a, b = ([float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([-\d.]+)", open(p).read(), re.M)] for p in sys.argv[1:])
sys.exit(0 if len(a) == 3 and len(b) == 3 and all(abs(x - y) <= 1e-2 * abs(x) for x, y in zip(a, b)) else 1)
PY

# --- the checking build: 4 stages in each schedule, 4 micro-batches (1F1B: 2, fewer than the stages; interleaved: 2
# chunks of one layer per stage of the 8-layer model); GPipe at ZeRO-3, interleaved and ZB at ZeRO-2 (their buckets'
# and gathers' stream order, one data-parallel process per stage)
# (micro-batches of 1 sequence of 8 tokens: the checks are of the order of operations, not of the sizes)
for schedule in 1f1b gpipe zb interleaved; do
    for d in $([ $schedule = 1f1b ] && echo 16 || echo 32); do
        model=$([ $schedule = interleaved ] && echo "$STAGES" || echo "$MODEL")
        chunks=$([ $schedule = interleaved ] && echo "-ppv 2" || true)
        zero=$(case $schedule in gpipe) echo 3;; interleaved | zb) echo 2;; *) echo 0;; esac)
        $MPIRUN -np 4 build/check/train_gpt_fp32 -e "$model" "${COMMON[@]}" -b 1 -t 8 -d $d -x 1 -v 0 -pp 4 \
            -pps $schedule $chunks -z $zero \
            >"$work/check.log" 2>&1 && grep -q '^step 1/1' "$work/check.log" && pass ||
            fail "checking build, -pp 4 -pps $schedule -d $d: $(grep -m2 -E 'cucc|rror' "$work/check.log")"
    done
done

# --- a -pp 2 run resumed from its step-2 checkpoint continues bit-identically; another cut is refused
mkdir -p "$work/resumed"
cp "$work/pp2/"*_00000002* "$work/resumed/"
$MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -n 2 -o "$work/resumed" -y 1 -pp 2 >"$work/resumed.log" 2>&1 ||
    fail "resumed -pp 2: $(tail -3 "$work/resumed.log")"
if [ "$(step_fields "$work/resumed.log")" = "$(step_fields "$work/pp2.log" | tail -n 1)" ] &&
    cmp -s "$work/resumed/model_00000003.bin" "$work/pp2/model_00000003.bin"; then pass; else
    fail "the resumed -pp 2 run differs from the uninterrupted one"; fi
# --- resumed into another layout (the optimizer state's stages, slices and shards cut anew, doc/formats.md): -pp 2's
# step-2 checkpoint at -pp 1 and at -pp 4, and -pp 1's at -pp 2 at another cut: each goes on with
# step 3 of the run it came from, within fp32 rounding
resume_into() {  # NAME SOURCE NP FLAGS...: SOURCE's step-2 checkpoint resumed in NAME for step 3
    local name=$1 source=$2 np=$3
    shift 3
    mkdir -p "$work/$name"
    cp "$source/"*_00000002* "$work/$name/"
    $MPIRUN -np "$np" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 3 -n 2 -o "$work/$name" -y 1 "$@" >"$work/$name.log" 2>&1 ||
        fail "resume $name: $(tail -3 "$work/$name.log")"
}
grep -E '^step 3/' "$work/pp2.log" >"$work/pp2_step3.log"
grep -E '^step 3/' "$work/whole.log" >"$work/whole_step3.log"
resume_into pp2_at_pp1 "$work/pp2" 1
resume_into pp2_at_pp4 "$work/pp2" 4 -pp 4
resume_into pp1_at_pp2 "$work/whole" 2 -pp 2 -ppl 1,4
for name in pp2_at_pp1 pp2_at_pp4; do
    if close_losses "$work/pp2_step3.log" "$work/$name.log" 1 >/dev/null; then pass; else
        fail "$name does not continue -pp 2's step 3"; fi
done
if close_losses "$work/whole_step3.log" "$work/pp1_at_pp2.log" 1 >/dev/null; then pass; else
    fail "-pp 1's checkpoint at -pp 2 does not continue its step 3"; fi

# --- the trace (ZB): every process's 3 x 4 passes per step, F, B and W of each micro-batch once; drawn as a PNG
$MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 2 -v 0 -pp 2 -pps zb -ppt "$work/trace.txt" >"$work/trace.log" 2>&1 ||
    fail "-ppt run: $(tail -3 "$work/trace.log")"
$PYTHON - "$work/trace.txt" <<'PY' && pass || fail "the trace does not hold each process's passes"
import sys
rows = [l.split() for l in open(sys.argv[1]).read().splitlines()]
assert rows[0] == "step rank stage pass micro chunk begin_ms end_ms".split()
for step in (1, 2):
    for rank in (0, 1):
        mine = [r for r in rows[1:] if int(r[0]) == step and int(r[1]) == rank]
        assert sorted((r[3], int(r[4])) for r in mine) == sorted((k, i) for k in "FBW" for i in range(4)), mine
        assert all(0 <= float(r[6]) <= float(r[7]) and r[5] == "0" for r in mine) and all(int(r[2]) == rank for r in mine)
PY
if $PYTHON scripts/plot_pipeline.py -o "$work/trace.png" "$work/trace.txt" >/dev/null && [ -s "$work/trace.png" ]; then
    pass; else fail "plot_pipeline.py did not draw the trace"; fi
printf 'step rank stage pass micro chunk begin_ms end_ms\n1 0 0 X 0 0 1 2\n' >"$work/bad_trace.txt"
expect_error "a malformed trace" "expected 'step rank stage F|B|W micro chunk begin_ms end_ms'" \
    $PYTHON scripts/plot_pipeline.py -o "$work/bad.png" "$work/bad_trace.txt"

# --- the memory plan (-pm) of a GPT-2 d12 on 4 processes (-pn: planned from one) at -pp 2 (2 data-parallel per stage):
# each stage's parameters and optimizer state (its tensors, padded for 2 shards, fp32; m and v) against the model's
# shape, and the micro-batches in flight under each schedule (m = 4: -d over B*T*2); at ZeRO-3 (1F1B) each process's
# half of the stage's parameters and optimizer state
for schedule in gpipe 1f1b zb "1f1b -z 3"; do
    "$TRAIN" -e d12 -pm 80 -pp 2 -pn 4 -b 4 -t 1024 -d 32768 -pps $schedule >"$work/plan_${schedule// /}.log" 2>&1 ||
        fail "-pm -pp 2 -pps $schedule: $(tail -2 "$work/plan_${schedule// /}.log")"
done
plans=("$work/plan_gpipe.log" "$work/plan_1f1b.log" "$work/plan_zb.log" "$work/plan_1f1b-z3.log")
$PYTHON - "${plans[@]}" <<'PY' && pass || fail "the -pp memory plan"
import re, sys
C, L, V, maxT, Vp = 768, 12, 50257, 1024, 50304
layer = 12 * C * C + 13 * C
for path, flight, shards in zip(sys.argv[1:], [(4, 4), (2, 1), (3, 2), (2, 1)], [1, 1, 1, 2]):  # zb: by hand
    text = open(path).read()
    cut = [int(x) for x in re.search(r"\| pipeline +\| 2 stages \(-pp\) x 1 chunk of layers (\d+),(\d+)", text).groups()]
    assert sum(cut) == L, cut
    want = [Vp * C + maxT * C + cut[0] * layer, cut[1] * layer + 2 * C + Vp * C]  # the tied wte on both
    for s in (0, 1):
        got = re.search(r"\| stage %d +\| +([\d.]+) MiB parameters, +([\d.]+) MiB optimizer, .*\((\d+) in flight\)" % s,
                        text)
        padded = -(-want[s] // 16) * 16  # 2 shards of multiples of 8
        assert abs(float(got.group(1)) - padded * 4 / shards / 2**20) < 0.06, (path, s, got.group(1), padded * 4 / 2**20)
        assert abs(float(got.group(2)) - padded * 8 / shards / 2**20) < 0.06, (path, s, got.group(2))
        assert int(got.group(3)) == flight[s], (path, s, got.group(3), flight[s])
PY

# --- layouts that do not fit: one line naming the flag
expect_error "-pp not dividing the processes" "-pp 3 -tp 1: their product must divide the number of processes (2)" \
    $MPIRUN -np 2 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 1 -pp 3
# (the cut's refusals are the plan's too: one process plans the layout of -pn processes)
PLAN=(-e d4 -pm 1 -b 1 -t 16)
expect_error "-pp over the layers" "-pp 6: more stages than the model's 4 layers" "$TRAIN" "${PLAN[@]}" -pn 6 -pp 6
expect_error "-ppl not summing to L" "-ppl 2,1: 2 stages of 3 layers in all; -pp 2 over the model's 4 layers" \
    "$TRAIN" "${PLAN[@]}" -pn 2 -pp 2 -ppl 2,1
expect_error "-ppl with a stage of none" "-ppl 4,0: expected the layers of each stage, each 1 or more" \
    "$TRAIN" "${PLAN[@]}" -pn 2 -pp 2 -ppl 4,0
expect_error "an unknown schedule" "-pps zb2: expected gpipe, 1f1b, interleaved or zb" \
    "$TRAIN" -e "$MODEL" "${COMMON[@]}" -pp 2 -pps zb2
expect_error "interleaved chunks that do not divide the layers" "the model's 4 layers do not cut into 6 equal chunks" \
    "$TRAIN" "${PLAN[@]}" -pn 2 -pp 2 -pps interleaved -ppv 3
expect_error "interleaved with micro-batches not a multiple of the stages" "not a multiple of the 4 stages" \
    $MPIRUN -np 4 "$TRAIN" -e "$STAGES" "${COMMON[@]}" -x 1 -pp 4 -pps interleaved -ppv 2 -d 192
expect_error "interleaved with one chunk" "-ppv 1: -pps interleaved runs 2 or more chunks per stage" \
    "$TRAIN" -e "$MODEL" "${COMMON[@]}" -pp 2 -pps interleaved
expect_error "-ppv without interleaved" "-ppv 2: model chunks per stage are -pps interleaved's" \
    "$TRAIN" -e "$MODEL" "${COMMON[@]}" -pp 2 -ppv 2
expect_error "-ppl with interleaved" "-ppl 4,4: -pps interleaved cuts the layers into equal chunks" \
    "$TRAIN" -e "$MODEL" "${COMMON[@]}" -pp 2 -pps interleaved -ppv 2 -ppl 4,4
expect_error "zb with fewer micro-batches than stages" "-pps zb: 2 micro-batches per step (-d 64), fewer than the 4" \
    $MPIRUN -np 4 "$TRAIN" -e "$MODEL" "${COMMON[@]}" -x 1 -pp 4 -pps zb -d 64
expect_error "-ppl without -pp" "-ppl: applies to a pipeline of 2 or more stages" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -ppl 5
expect_error "-pp 0" "-pp 0: expected 1 or more stages" "$TRAIN" -e "$MODEL" "${COMMON[@]}" -pp 0

# --- the MoE trainer: each stage holds its MoE layers' routers and experts (shared out over its -ep group) and
# routes its own layers; every stage's layers are every process's at -pp 1, bit for bit where the sums are the same:
# - pp 2 x ep 2 (4 processes) against -pp 1 -ep 2 on 2, with sigmoid scores, shared experts and aux-loss-free
#   balancing (moe_ds: 2 MoE layers, 16 experts, -rb moving the biases): the step lines (loss, aux, z, drop, norm) and
#   the validation lines (the loss, every MoE layer's report: aux, z, drops, loads, biases) identical; the model files
#   within 1e-6 (the tied wte's two parts summed in another order), the biases after the parameters bit for bit;
# - ZB at ZeRO-2, and interleaved (2 chunks of one MoE layer per stage) at ZeRO-3, on the 4-layer moe_deep: the steps
#   of -pp 1;
# - -pp 2 -tp 2 -ep 2 on 4 processes (each stage's 2 members an expert group: MoE parallel folding), against
#   -tp 2 -ep 2 on 2;
# - -pp 2's checkpoint resumed at -pp 1 and -pp 1's at -pp 2 (the expert state cut by stage): step 3 goes on as the
#   run's it came from within fp32 rounding (the tied wte's parts summed in another order);
# - the checking build: -pp 2 -ep 2 interleaved at ZeRO-2 (every MoE layer's all-to-alls inside the stages' groups,
#   between the sends; the slots' MoE activations; the expert buckets), with a validation pass (its sends done before
#   the loss's sum over the 2 data-parallel processes of each stage);
# - the memory plan of an MoE: each stage's routers and experts (-ep 2: half of them) against the model's shape.
MOE_TRAIN=build/train_moe_fp32
MOE_DS=build/ref/moe_ds_fp32_model.bin
MOE_DEEP=build/ref/moe_deep_k1_fp32_model.bin
$MPIRUN -np 2 $MOE_TRAIN -e "$MOE_DS" "${COMMON[@]}" -x 3 -n 2 -rb 0.001 -ep 2 -o "$work/moe1" >"$work/moe1.log" 2>&1 ||
    fail "train_moe -pp 1: $(tail -3 "$work/moe1.log")"
$MPIRUN -np 4 $MOE_TRAIN -e "$MOE_DS" "${COMMON[@]}" -x 3 -n 2 -rb 0.001 -ep 2 -pp 2 -o "$work/moe2" >"$work/moe2.log" \
    2>&1 || fail "train_moe -pp 2: $(tail -3 "$work/moe2.log")"
moe_lines() { grep -E '^(step [0-9]+/[0-9]+ \| loss|val )' "$1" | sed -E 's/ \| lr .*//'; }
if [ "$(moe_lines "$work/moe1.log" | grep -c 'val moe layer')" = 6 ] &&
    [ "$(moe_lines "$work/moe1.log")" = "$(moe_lines "$work/moe2.log")" ] &&
    same_parameters "$work/moe1/model_00000003.bin" "$work/moe2/model_00000003.bin" 1e-6 &&
    cmp -s <(tail -c 128 "$work/moe1/model_00000003.bin") <(tail -c 128 "$work/moe2/model_00000003.bin"); then pass
else fail "train_moe -pp 2 -ep 2 differs from -pp 1"; diff <(moe_lines "$work/moe1.log") <(moe_lines "$work/moe2.log"); fi
MOE=(-e "$MOE_DEEP" "${COMMON[@]}" -v 0 -x 2)
$MPIRUN -np 2 $MOE_TRAIN "${MOE[@]}" -ep 2 >"$work/moe_deep1.log" 2>&1 || fail "moe_deep -pp 1: $(tail -3 "$work/moe_deep1.log")"
for layout in "-pps zb -z 2" "-pps interleaved -ppv 2 -z 3"; do
    $MPIRUN -np 4 $MOE_TRAIN "${MOE[@]}" -ep 2 -pp 2 $layout >"$work/moe_deep2.log" 2>&1 ||
        fail "moe_deep $layout: $(tail -3 "$work/moe_deep2.log")"
    if [ -n "$(moe_lines "$work/moe_deep2.log")" ] && [ "$(moe_lines "$work/moe_deep1.log")" = "$(moe_lines "$work/moe_deep2.log")" ]
    then pass; else fail "train_moe -pp 2 $layout differs from -pp 1"; fi
done
MOE_TP=build/ref/moe_tp_k2_mb2_fp32_model.bin
$MPIRUN -np 2 $MOE_TRAIN -e "$MOE_TP" "${COMMON[@]}" -v 0 -x 2 -tp 2 -ep 2 >"$work/moe_tp.log" 2>&1 ||
    fail "moe -tp 2: $(tail -3 "$work/moe_tp.log")"
$MPIRUN -np 4 $MOE_TRAIN -e "$MOE_TP" "${COMMON[@]}" -v 0 -x 2 -tp 2 -ep 2 -pp 2 >"$work/moe_pp_tp.log" 2>&1 ||
    fail "moe -pp 2 -tp 2 on 4: $(tail -3 "$work/moe_pp_tp.log")"
if [ -n "$(moe_lines "$work/moe_pp_tp.log")" ] && [ "$(moe_lines "$work/moe_tp.log")" = "$(moe_lines "$work/moe_pp_tp.log")" ]
then pass; else fail "train_moe -pp 2 -tp 2 -ep 2 differs from -tp 2 -ep 2"; fi
for pair in "moe2 1 2 -pp 1" "moe1 2 4 -pp 2"; do
    read -r from to np flags <<<"$pair"
    mkdir -p "$work/${from}_resumed"
    cp "$work/$from/"*_00000002* "$work/${from}_resumed/"
    $MPIRUN -np "$np" $MOE_TRAIN -e "$MOE_DS" "${COMMON[@]}" -x 3 -n 2 -rb 0.001 -ep 2 $flags -o "$work/${from}_resumed" \
        -y 1 >"$work/${from}_resumed.log" 2>&1 || fail "$from resumed at $flags: $(tail -3 "$work/${from}_resumed.log")"
    grep -E '^step 3/' "$work/$from.log" >"$work/${from}_step3.log"
    if close_losses "$work/${from}_step3.log" "$work/${from}_resumed.log" 1 >/dev/null; then pass
    else fail "train_moe's checkpoint of $from resumed at $flags does not continue its run"; fi
done
$MPIRUN -np 4 build/check/train_moe_fp32 "${MOE[@]}" -b 1 -t 8 -d 32 -x 1 -v 1 -m 1 -ep 2 -pp 2 -pps interleaved \
    -ppv 2 -z 2 >"$work/check.log" 2>&1 && grep -q '^step 1/1' "$work/check.log" && pass ||
    fail "checking build, train_moe -pp 2 interleaved: $(grep -m2 -E 'cucc|rror' "$work/check.log")"
build/train_moe_fp32 -e d12 -ne 8 -me 2 -pm 80 -pp 2 -pn 4 -ep 2 -b 4 -t 1024 -d 32768 >"$work/moe_plan.log" 2>&1 ||
    fail "train_moe -pm -pp 2: $(tail -2 "$work/moe_plan.log")"
$PYTHON - "$work/moe_plan.log" <<'PY' && pass || fail "the MoE's -pp memory plan"
import re, sys
C, V, maxT, Vp, E = 768, 50257, 1024, 50304, 8
H = 4 * C
dense, attention, router, expert = 12 * C * C + 13 * C, 4 * C * C + 8 * C, E * C, 2 * C * H + H + C
text = open(sys.argv[1]).read()
cut = [int(x) for x in re.search(r"\| pipeline +\| 2 stages \(-pp\) x 1 chunk of layers (\d+),(\d+)", text).groups()]
first = [0, cut[0], 12]
for s in (0, 1):
    moe = sum(1 for l in range(first[s], first[s + 1]) if (l + 1) % 2 == 0)  # -me 2
    replicated = (first[s + 1] - first[s] - moe) * dense + moe * (attention + router)
    replicated += Vp * C + maxT * C if s == 0 else 2 * C + Vp * C  # wte and wpe; the final norm and the tied wte
    own = moe * E // 2 * expert  # -ep 2: half of each MoE layer's experts, on one process (no replica)
    padded = -(-replicated // 16) * 16 + -(-own // 8) * 8  # 2 shards of the replicated set, 1 of the experts
    got = re.search(r"\| stage %d +\| +([\d.]+) MiB parameters, +([\d.]+) MiB optimizer" % s, text)
    assert abs(float(got.group(1)) - padded * 4 / 2**20) < 0.06, (s, got.group(1), padded * 4 / 2**20)
    assert abs(float(got.group(2)) - padded * 8 / 2**20) < 0.06, (s, got.group(2))
PY
expect_error "train_moe -pp with a stage of no MoE layer" "-pp 2: stage 0 (layers 0..1) holds no MoE layer" \
    $MPIRUN -np 2 $MOE_TRAIN -e d4 -ne 4 -me 4 "${COMMON[@]}" -x 1 -pp 2 -ppl 2,2
expect_error "train_moe -pp with -rg 1" "-rg 1: the global-batch balance loss runs without pipeline stages (-pp 1)" \
    $MPIRUN -np 2 $MOE_TRAIN "${MOE[@]}" -pp 2 -rg 1

echo "pipeline_parallel: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
