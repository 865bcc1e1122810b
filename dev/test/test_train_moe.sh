#!/usr/bin/env bash
# dev/test/test_train_moe.sh: command-line tests of the MoE trainer on the CPU backend (FP32 build):
#   - E=1, top-1, no capacity limit reproduces the dense trainer's losses from the same weights;
#   - ZeRO-1 equals ZeRO-0 on 2 MPI ranks, with and without expert parallelism;
#   - ZeRO-2 gives ZeRO-1's checkpoint files on 2 ranks (-ep 1 and 2), resumes a ZeRO-1 checkpoint to them, and
#     accumulates two micro-steps (with -oo 1) within fp32 reordering of ZeRO-1;
#   - expert parallelism: -ep 2 on 2 ranks trains as -ep 1 on 2 ranks (validation and sampling included);
#   - a run resumed from a checkpoint continues bit-identically;
#   - a checkpoint of -ep 2 resumes with -ep 1 and one of -ep 1 with -ep 2: identical weights, the same training;
#   - an MoE model from a descriptor trains (the loss falls) and logs aux, z, drop and the expert loads;
#   - with router jitter and noisy top-k gating, a resumed run continues bit-identically (the noise follows the step);
#   - sigmoid scores with a routed scale, a dense layer first and expert groups from a descriptor: the checkpoint's
#     model file records them (header words 24, 27, 28, 30 … 32) and a run resumed from it continues bit-identically;
#   - shared experts from a descriptor (-se, -seh) on 2 ranks with -ep 2: the checkpoint's model file records them
#     (header words 24, 25, 26; its size holds their tensors) and a run resumed from it continues bit-identically;
#   - aux-loss-free balancing (-rb) from a descriptor on 2 ranks with -ep 2: the checkpoint's model file records the
#     biases (header word 29, fp32 after the parameters), the validation lines print them, a run resumed from it
#     continues bit-identically, and -rb 0 keeps a model file's biases; its log's per-layer telemetry (the steps'
#     choices over every process, the loads, the dead experts, the biases);
#   - experts that get no token are reported dead after 100 steps, not before;
#   - the descriptors mix8 and ds64: their parameter counts (an independent formula) and routing, a flag overriding;
#   - -arch llama with SwiGLU routed and shared experts from a descriptor on 2 ranks with -ep 2: the model file records
#     the family (words 16..21) and holds SwiGLU tensors without biases, a resumed run continues bit-identically; a
#     llama MoE reference file trains;
#   - bad inputs (-kv not dividing NH, -kv or -arch against the model file, a family word neither gpt2 nor llama,
#     top-k above E, a file of the wrong kind, tokens the model lacks, -ne/-tk/-me/-eh/-md/-rs/-rsf/-se/-seh against
#     the model file or checkpoint, bad -rs, -rsf, -se, -seh, -rb, -rsl and -rg, -eg without -egk, -rb with softmax
#     scores, -dl negative, without expert groups (-ep 1), above them, with fewer than k experts in its groups or with
#     noisy gating, the MoE header words 24..32 a reader refuses (the model's expert groups with softmax, dense layers
#     leaving no MoE layer), biases the file lacks or that are not finite) get their one line; a
#     corrupt expert state is named on -y 1;
#   - the llama MoE's sample before training on 2 ranks: the same tokens with -ep 1, -ep 2, -tp 2 and -tp 2 -etp 2;
#   - pre-emption: SIGTERM to one of 2 ranks with -ep 2 writes a checkpoint, and the run resumes bit-identically.
# Needs build/train_moe_fp32, build/train_gpt_fp32, build/ref/tiny_fp32_model.bin,
# build/ref/moe_k1_cf0.5_fp32_model.bin and build/ref/moe_llama_shared_fp32_model.bin (make test builds them).
# Run from anywhere: dev/test/test_train_moe.sh
set -u
cd "$(dirname "$0")/../.."
TRAIN=build/train_moe_fp32
DENSE=build/train_gpt_fp32
DENSE_MODEL=build/ref/tiny_fp32_model.bin
MOE_MODEL=build/ref/moe_k1_cf0.5_fp32_model.bin
LLAMA_MOE_MODEL=build/ref/moe_llama_shared_fp32_model.bin
. dev/test/cli_common.sh

# run_and_resume NAME STEPS EVERY COMMAND...: the training COMMAND with -x STEPS and a checkpoint every EVERY steps into
# $work/NAME (log $work/NAME.log), then again from its first checkpoint into $work/NAME_resumed (-y 1)
run_and_resume() {
    local name=$1 steps=$2 every=$3
    shift 3
    "$@" -x "$steps" -n "$every" -o "$work/$name" >"$work/$name.log" 2>&1 || fail "$name run: $(tail -3 "$work/$name.log")"
    mkdir -p "$work/${name}_resumed"
    cp "$work/$name"/*_"$(printf %08d "$every")"* "$work/${name}_resumed/"
    "$@" -x "$steps" -n "$every" -o "$work/${name}_resumed" -y 1 >"$work/${name}_resumed.log" 2>&1 ||
        fail "$name resumed run: $(tail -3 "$work/${name}_resumed.log")"
}

$PYTHON train_gpt.py --write-shard "$work/train.bin" --shard-tokens 8192 --V 263 --seed 7 >/dev/null ||
    { echo "cannot write a data shard"; exit 1; }
COMMON=(-i "$work/train.bin" -j "" -t 16 -v 0 -s 0 -l 1e-3 -c 0.1)

# --- E=1, k=1, dropless: the dense model's losses. The MoE file holds the dense weights with the one
# expert's fc/fcproj equal to each layer's MLP (its gate is softmax over one logit: exactly 1).
$PYTHON - "$DENSE_MODEL" "$work/e1.bin" <<'PY'
import struct, sys
import numpy as np
raw = open(sys.argv[1], "rb").read()
h = list(struct.unpack("256i", raw[:1024]))
maxT, V, L, NH, C, Vp = h[2:8]
w = np.frombuffer(raw[1024:], dtype=np.float32)
sizes = [Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C, L * C, L * C,
         L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
parts, o = [], 0
for n in sizes:
    parts.append(w[o:o + n]); o += n
router = np.full(L * 1 * C, 0.01, dtype=np.float32)
payload = parts[:10] + [router] + parts[10:14] + parts[14:16]  # no dense layers; experts = the MLPs
m = [0] * 256
m[:12] = [20261129, 1, maxT, V, L, NH, C, Vp, 1, 1, 1, 4 * C]
open(sys.argv[2], "wb").write(struct.pack("256i", *m) + b"".join(p.tobytes() for p in payload))
PY
"$DENSE" "${COMMON[@]}" -e "$DENSE_MODEL" -b 4 -a 1 -x 4 >"$work/dense.log" 2>&1 || fail "dense run: $(tail -3 "$work/dense.log")"
"$TRAIN" "${COMMON[@]}" -e "$work/e1.bin" -b 4 -a 1 -x 4 -cf 0 -ra 0 -rz 0 >"$work/e1.log" 2>&1 ||
    fail "E=1 run: $(tail -3 "$work/e1.log")"
if close_losses "$work/dense.log" "$work/e1.log" 4; then pass; else fail "E=1, k=1, dropless differs from the dense model"; fi

# --- ZeRO-1 equals ZeRO-0 on 2 ranks (each rank routes its own micro-batch), with one and two expert groups
for ep in 1 2; do
    for z in 0 1; do
        $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -a 1 -x 3 -cf 0.5 -z $z -ep $ep >"$work/zero$z-ep$ep.log" 2>&1 ||
            fail "2-rank ZeRO-$z -ep $ep run: $(tail -3 "$work/zero$z-ep$ep.log")"
    done
    if [ -n "$(step_fields "$work/zero0-ep$ep.log")" ] &&
        [ "$(step_fields "$work/zero0-ep$ep.log")" = "$(step_fields "$work/zero1-ep$ep.log")" ]; then
        pass
    else
        fail "ZeRO-0 and ZeRO-1 differ with -ep $ep: [$(step_fields "$work/zero0-ep$ep.log")] [$(step_fields "$work/zero1-ep$ep.log")]"
    fi
done

# --- -ep 2 on 2 ranks against -ep 1 on 2 ranks, dropless (the exchanged counts), with validation and sampling
# (every rank of an expert group takes part in each forward pass)
for ep in 1 2; do
    $MPIRUN -np 2 "$TRAIN" -i "$work/train.bin" -j "$work/train.bin" -v 2 -m 2 -s 2 -g 8 -t 16 -l 1e-3 -c 0.1 \
        -e "$MOE_MODEL" -b 2 -x 4 -cf 0 -cfe 0.5 -ep $ep >"$work/spread-ep$ep.log" 2>&1 ||
        fail "2-rank -ep $ep run: $(tail -3 "$work/spread-ep$ep.log")"
done
if close_losses "$work/spread-ep1.log" "$work/spread-ep2.log" 4 &&
    [ "$(grep -c '^val loss' "$work/spread-ep2.log")" = 3 ] && [ "$(grep -c '^generating' "$work/spread-ep2.log")" = 3 ] &&
    [ "$(grep '^val loss' "$work/spread-ep1.log")" = "$(grep '^val loss' "$work/spread-ep2.log")" ]; then
    pass
else
    fail "-ep 2 does not train as -ep 1 on 2 ranks"
fi

# --- a sample under every layout: the llama MoE's (shared experts; 4 heads) sample before training on 2 ranks with
# -ep 1, -ep 2, -tp 2 (experts folded, sequence-parallel: the decode step's token padded to a row per member) and
# -tp 2 -etp 2 -sp 0: the same tokens (the engine's decode step is each layout's forward pass on a token)
for layout in "-ep 1" "-ep 2" "-tp 2" "-tp 2 -etp 2 -sp 0"; do
    name=$(echo "$layout" | tr -d ' -')
    $MPIRUN -np 2 "$TRAIN" -i "$work/train.bin" -j "" -v 0 -s 1 -g 8 -t 16 -l 1e-3 -e "$LLAMA_MOE_MODEL" -b 2 -x 1 \
        -cf 0 -cfe 0.5 -tf none $layout >"$work/sample-$name.log" 2>&1 || fail "$layout sampling run: $(tail -3 "$work/sample-$name.log")"
    grep -A2 -m1 '^generating' "$work/sample-$name.log" | sed -n 3p >"$work/sample-$name.txt"
done
if grep -qE '^(<[0-9]+>){8}$' "$work/sample-ep1.txt" && cmp -s "$work/sample-ep1.txt" "$work/sample-ep2.txt" &&
    cmp -s "$work/sample-ep1.txt" "$work/sample-tp2.txt" && cmp -s "$work/sample-ep1.txt" "$work/sample-tp2etp2sp0.txt"
then pass; else fail "the samples differ between layouts: $(cat "$work"/sample-*.txt | tr '\n' ' ')"; fi

# --- resume across a change of the expert-parallel degree: -ep A writes checkpoints at steps 3 and 6; its step-3
# checkpoint resumed with -ep B continues as the -ep A run did (losses within fp32 summation order), and resumed with
# lr 0 it writes back the very weights it read (the file layout does not depend on the degree)
for change in "2 1" "1 2"; do
    set -- $change
    from=$1 to=$2
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -cf 0.5 -z 1 -ep $from -o "$work/ep$from" \
        >"$work/ep$from.log" 2>&1 || fail "-ep $from checkpointing run: $(tail -3 "$work/ep$from.log")"
    for lr in 1e-3 0; do
        dir="$work/ep$from-to$to-lr$lr"
        mkdir -p "$dir"
        cp "$work/ep$from"/*_00000003* "$dir/"
        x=$([ "$lr" = 0 ] && echo 4 || echo 6)
        $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -l $lr -e "$MOE_MODEL" -b 2 -x $x -n 1 -cf 0.5 -z 1 -ep $to -o "$dir" -y 1 \
            >"$dir.log" 2>&1 || fail "resume of -ep $from with -ep $to: $(tail -3 "$dir.log")"
    done
    grep -E '^step [4-6]/' "$work/ep$from.log" >"$work/ep$from-tail.log"
    if close_losses "$work/ep$from-tail.log" "$work/ep$from-to$to-lr1e-3.log" 3 &&
        cmp -s "$work/ep$from/model_00000003.bin" "$work/ep$from-to$to-lr0/model_00000004.bin"; then
        pass
    else
        fail "a checkpoint of -ep $from does not resume as it should with -ep $to"
    fi
done

# whether two 2-process runs' step-6 checkpoints (model, both states, the expert state) are the same files
same_step6_files() {
    local f
    for f in model_00000006.bin state_00000006_00000.bin state_00000006_00001.bin expert_state_00000006.bin; do
        cmp -s "$1/$f" "$2/$f" || return 1
    done
}

# --- ZeRO-Offload (-oo 1) with -ep 2 -z 1: both parameter sets' shards on the host, the experts' gathered for
# their state file; the same model and optimizer state files as the -ep 2 run above after 6 steps
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 6 -cf 0.5 -z 1 -ep 2 -oo 1 -o "$work/offload" \
    >"$work/offload.log" 2>&1 || fail "-ep 2 -z 1 -oo 1 run: $(tail -3 "$work/offload.log")"
if same_step6_files "$work/ep2" "$work/offload"; then pass; else
    fail "-oo 1 with -ep 2 -z 1 gives other checkpoint files than -oo 0"; fi

# --- ZeRO-2 (-z 2): the routers' gradients go into the model's layer buckets, the experts' into two buckets of the
# expert set, each reduced into its process's fp32 shard on every micro-step. With one micro-step that is ZeRO-1's
# reduction: the -z 1 runs above (-ep 1 and -ep 2) give the same files, and a ZeRO-1 checkpoint resumes under
# ZeRO-2 to them. With two micro-steps the same terms are summed in another order (close_losses' fp32 tolerances).
# ZeRO-3 (-z 3) shards the parameters too: the routers are gathered with their layer, the experts over the processes
# that hold the same experts (with -ep 1 the two processes; with -ep 2 each process alone). Gathered values are
# copies: -z 1's files again, a -z 3 checkpoint resumed under -z 1 gives them too, and with two micro-steps -z 3
# gives -z 2 -oo 1's losses.
for z in 2 3; do
    for ep in 1 2; do
        $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -cf 0.5 -z $z -ep $ep \
            -o "$work/zero$z-ep$ep" >"$work/zero$z-ep$ep.log" 2>&1 ||
            fail "-ep $ep -z $z run: $(tail -3 "$work/zero$z-ep$ep.log")"
        if same_step6_files "$work/ep$ep" "$work/zero$z-ep$ep"; then pass; else
            fail "-z $z with -ep $ep gives other checkpoint files than -z 1"; fi
    done
done
mkdir -p "$work/zero2_resumed"
cp "$work/ep2"/*_00000003* "$work/zero2_resumed/"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -cf 0.5 -z 2 -ep 2 -o "$work/zero2_resumed" -y 1 \
    >"$work/zero2_resumed.log" 2>&1 || fail "-z 2 resuming a -z 1 checkpoint: $(tail -3 "$work/zero2_resumed.log")"
if same_step6_files "$work/ep2" "$work/zero2_resumed"; then pass; else
    fail "-z 2 resuming a -z 1 checkpoint does not continue bit-identically"; fi
for z in 1 2; do
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -d 128 -x 3 -cf 0.5 -z $z -oo $((z - 1)) -ep 2 \
        >"$work/accum-zero$z.log" 2>&1 || fail "-ep 2 -z $z accumulation run: $(tail -3 "$work/accum-zero$z.log")"
done
if close_losses "$work/accum-zero1.log" "$work/accum-zero2.log" 3; then pass; else
    fail "-z 2 -oo 1 with two micro-steps differs from -z 1"; fi

# ZeRO-3: its start-up table, a -z 3 checkpoint resumed under -z 1, accumulation
grep -q "memory: communication .* bytes, 5 ZeRO-3 buckets and 5 gather buffers)" "$work/zero3-ep2.log" && pass ||
    fail "the ZeRO-3 start-up table lacks its communication row"
mkdir -p "$work/zero1_from3"
cp "$work/zero3-ep1"/*_00000003* "$work/zero1_from3/"
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -cf 0.5 -z 1 -ep 1 -o "$work/zero1_from3" -y 1 \
    >"$work/zero1_from3.log" 2>&1 || fail "-z 1 resuming a -z 3 checkpoint: $(tail -3 "$work/zero1_from3.log")"
if same_step6_files "$work/ep1" "$work/zero1_from3"; then pass; else
    fail "-z 1 resuming a -z 3 checkpoint does not continue bit-identically"; fi
$MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -d 128 -x 3 -cf 0.5 -z 3 -ep 2 >"$work/accum-zero3.log" \
    2>&1 || fail "-ep 2 -z 3 accumulation run: $(tail -3 "$work/accum-zero3.log")"
want=$(step_fields "$work/accum-zero2.log")
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/accum-zero3.log")" ]; then pass; else
    fail "-z 3 with two micro-steps differs from -z 2 -oo 1"; fi

# --- checkpoint and bit-identical resume
"$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -o "$work/full" >"$work/full.log" 2>&1 ||
    fail "checkpointing run: $(tail -3 "$work/full.log")"
mkdir -p "$work/resumed"
cp "$work/full"/*_00000003* "$work/resumed/"
"$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -o "$work/resumed" -y 1 >"$work/resumed.log" 2>&1 ||
    fail "resumed run: $(tail -3 "$work/resumed.log")"
want=$(step_fields "$work/full.log" | tail -n 3)
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/resumed.log")" ] &&
    cmp -s "$work/full/model_00000006.bin" "$work/resumed/model_00000006.bin"; then pass; else
    fail "MoE resume is not bit-identical"; fi

# a corrupt expert state in the latest checkpoint is named, and the run resumes from the one before
mkdir -p "$work/corrupt"
cp "$work/full"/*_0000000[36]* "$work/corrupt/"
printf 'X' | dd of="$work/corrupt/expert_state_00000006.bin" bs=1 seek=2000 conv=notrunc 2>/dev/null
"$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -n 3 -o "$work/corrupt" -y 1 >"$work/corrupt.log" 2>&1 ||
    fail "resume past a corrupt expert state: $(tail -3 "$work/corrupt.log")"
if grep -q "^-y 1: checkpoint step 6 fails verification: $work/corrupt/expert_state_00000006.bin" "$work/corrupt.log" &&
    [ "$want" = "$(step_fields "$work/corrupt.log")" ]; then pass; else
    fail "a corrupt expert state: $(grep -v '^[|+]' "$work/corrupt.log" | head -3)"; fi

# --- a descriptor MoE model trains, with its telemetry in the step line and the log
"$TRAIN" -e d2 -ev 263 -et 32 -ne 4 -tk 2 -me 1 -i "$work/train.bin" -j "$work/train.bin" -v 30 -m 2 -s 0 -b 4 -t 16 \
    -l 3e-3 -a 1 -x 30 -o "$work/desc" >"$work/desc.log" 2>&1 || fail "descriptor run: $(tail -3 "$work/desc.log")"
if $PYTHON - "$work/desc.log" "$work/desc/main.log" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
l = [float(x) for x in re.findall(r"^step \d+/\d+ \| loss ([-\d.e+]+) \| aux [-\d.e+]+ \| z [-\d.e+]+ \| drop [\d.]+", text, re.M)]
log = open(sys.argv[2]).read()
ok = len(l) == 30 and l[-1] < 0.8 * l[0] and "val moe layer 1: aux" in text and re.search(r"^s:30 aux:\S+ z:\S+ drop:\S+ load_min:\S+ load_max:\S+ load_cv:\S+$", log, re.M)
print("  MoE d2 (4 experts, top-2) losses: first %.4f last %.4f" % (l[0], l[-1]) if l else "  no MoE step lines")
sys.exit(0 if ok else 1)
PY
then pass; else fail "a d2 MoE model did not learn, or its telemetry is missing"; fi

# --- router noise: a noisy-gating model with jitter, from a descriptor; a checkpoint of it resumes bit-identically
NOISE=(-e d2 -ev 263 -et 32 -ne 4 -tk 1 -me 1 -rn 1 -rj 0.1 -cf 0.5 -i "$work/train.bin" -j "" -v 0 -s 0 -b 2 -t 16 -l 3e-3)
run_and_resume noise 6 3 "$TRAIN" "${NOISE[@]}"
want=$(step_fields "$work/noise.log" | tail -n 3)
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/noise_resumed.log")" ] &&
    cmp -s "$work/noise/model_00000006.bin" "$work/noise_resumed/model_00000006.bin"; then pass; else
    fail "a noisy-gating run with jitter does not resume bit-identically"; fi

# --- sigmoid scores with the routed scale 2.5 (doc/moe.md, "Routing options" 3 and 5) in DeepSeek-V3's layout (ibid.
# 11 and 12: a dense layer first, each token's experts in 2 of 4 groups): the checkpoint's model file has header
# words 24 = 2, 27 = 1 (sigmoid), 28 = 2.5's fp32 bits, 30 = 1, 31 = 4, 32 = 2, and resuming from it (the flags
# agreeing with the file) continues bit-identically
SIGMOID=(-e d2 -ev 263 -et 32 -ne 8 -tk 2 -me 1 -rs sigmoid -rsf 2.5 -md 1 -eg 4 -egk 2 -cf 0 -i "$work/train.bin" -j ""
         -v 0 -s 0 -b 2 -t 16 -l 3e-3)
run_and_resume sigmoid 6 3 "$TRAIN" "${SIGMOID[@]}"
want=$(step_fields "$work/sigmoid.log" | tail -n 3)
words=$($PYTHON -c 'import struct, sys; h = struct.unpack("256i", open(sys.argv[1], "rb").read(1024)); print(*h[24:33])' \
    "$work/sigmoid/model_00000006.bin")
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/sigmoid_resumed.log")" ] &&
    cmp -s "$work/sigmoid/model_00000006.bin" "$work/sigmoid_resumed/model_00000006.bin" &&
    [ "$words" = "2 0 0 1 1075838976 0 1 4 2" ]; then pass; else
    fail "a sigmoid run does not resume bit-identically, or its model file's words 24..32 are [$words]"; fi

# --- shared experts (doc/moe.md, "Routing options" 2): two of hidden size 64 beside 4 experts shared out over 2
# ranks, every other layer, from a descriptor; the checkpoint's model file has header words 24 = 1, 25 = 2, 26 = 64
# (28: the routed scale 1's fp32 bits, as every revision-1 file writes) and its size counts the shared tensors
# (Lm (S H_s C + S H_s + S C H_s + S C) values more than without them); resuming from it continues bit-identically
SHARED=(-e d2 -ev 263 -et 32 -ne 4 -tk 1 -me 2 -se 2 -seh 64 -ep 2 -i "$work/train.bin" -j "" -v 0 -s 0 -b 2 -t 16
        -l 3e-3)
run_and_resume shared 6 3 $MPIRUN -np 2 "$TRAIN" "${SHARED[@]}"
"$TRAIN" -e d2 -ev 263 -et 32 -ne 4 -tk 1 -me 2 -i "$work/train.bin" -j "" -v 0 -s 0 -b 2 -t 16 -x 1 -n 1 -o "$work/unshared" \
    >"$work/unshared.log" 2>&1 || fail "run without shared experts: $(tail -3 "$work/unshared.log")"
want=$(step_fields "$work/shared.log" | tail -n 3)
words=$($PYTHON -c 'import struct, sys; h = struct.unpack("256i", open(sys.argv[1], "rb").read(1024)); print(*h[24:30])' \
    "$work/shared/model_00000006.bin")
C=$($PYTHON -c 'import struct, sys; print(struct.unpack("256i", open(sys.argv[1], "rb").read(1024))[6])' \
    "$work/shared/model_00000006.bin")
L=$($PYTHON -c 'import struct, sys; print(struct.unpack("256i", open(sys.argv[1], "rb").read(1024))[4])' \
    "$work/shared/model_00000006.bin")
extra=$(( (L / 2) * (2 * 64 * C * 2 + 2 * 64 + 2 * C) * 4 ))  # fp32 values of the shared tensors
size_with=$(stat -c %s "$work/shared/model_00000006.bin")
size_without=$(stat -c %s "$work/unshared/model_00000001.bin")
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/shared_resumed.log")" ] &&
    cmp -s "$work/shared/model_00000006.bin" "$work/shared_resumed/model_00000006.bin" &&
    [ "$words" = "1 2 64 0 1065353216 0" ] && [ "$((size_with - size_without))" = "$extra" ]; then pass; else
    fail "a shared-expert run does not resume bit-identically, or its model file's words 24..29 are [$words], or it"\
" has $((size_with - size_without)) bytes more than without shared experts (want $extra)"; fi

# --- aux-loss-free balancing (doc/moe.md, "Routing options" 4 and 6): sigmoid top-2 of 4 experts shared out over 2
# ranks, from a descriptor (the biases start at 0), -rb 0.01; 4 steps with checkpoints every 2. The checkpoint's
# model file has header word 29 = 1 and Lm * E fp32 biases after the parameters (its size that much above the same
# run's without -rb), the biases moved (each is a sum of +-0.01 steps), the validation lines print them, and the run
# resumed from step 2 continues bit-identically (its step-4 model file, biases included, is the same). A run from
# that model file with -rb 0 keeps the biases as they are.
BIAS=(-e d2 -ev 263 -et 32 -ne 4 -tk 2 -me 1 -rs sigmoid -cf 0 -ep 2 -i "$work/train.bin" -j "$work/train.bin" -v 2
      -m 1 -s 0 -b 2 -t 16 -l 3e-3)
run_and_resume bias 4 2 $MPIRUN -np 2 "$TRAIN" "${BIAS[@]}" -rb 0.01
$MPIRUN -np 2 "$TRAIN" "${BIAS[@]}" -x 1 -n 1 -o "$work/unbiased" >"$work/unbiased.log" 2>&1 ||
    fail "run without -rb: $(tail -3 "$work/unbiased.log")"
"$TRAIN" -e "$work/bias/model_00000004.bin" -i "$work/train.bin" -j "" -v 0 -s 0 -b 2 -t 16 -l 3e-3 -cf 0 -rb 0 -x 1 \
    -n 1 -o "$work/bias_fixed" >"$work/bias_fixed.log" 2>&1 ||
    fail "-rb 0 from a biased model: $(tail -3 "$work/bias_fixed.log")"
want=$(step_fields "$work/bias.log" | tail -n 2)
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/bias_resumed.log")" ] &&
    cmp -s "$work/bias/model_00000004.bin" "$work/bias_resumed/model_00000004.bin" &&
    $PYTHON - "$work/bias/model_00000004.bin" "$work/unbiased/model_00000001.bin" "$work/bias_fixed/model_00000001.bin" \
        "$work/bias.log" <<'PY'
import struct, sys
import numpy as np
biased, unbiased, fixed = (open(p, "rb").read() for p in sys.argv[1:4])
h = struct.unpack("256i", biased[:1024])
Lm, E = h[4] // h[10], h[8]
tail = np.frombuffer(biased[-4 * Lm * E:], dtype="<f4")
steps = np.round(tail / np.float32(0.01))
ok = (list(h[24:30]) == [1, 0, 0, 1, 1065353216, 1] and len(biased) - len(unbiased) == 4 * Lm * E
      and np.any(tail != 0) and np.all(np.abs(tail - steps * np.float32(0.01)) < 1e-6) and np.all(np.abs(steps) <= 4)
      and fixed[-4 * Lm * E:] == biased[-4 * Lm * E:])
text = open(sys.argv[4]).read()
ok = ok and all(f"val moe layer {m}: aux" in text for m in range(Lm)) and all(
    " bias " in line for line in text.splitlines() if line.startswith("val moe layer"))
print("  balancing biases after 4 steps:", *tail)
sys.exit(0 if ok else 1)
PY
then pass; else
    fail "a balancing-bias run does not resume bit-identically, or its model file (words 24..29, the biases after the"\
" parameters, kept by -rb 0) or its validation lines are not as they should be"; fi
# The same run's routed-load telemetry (doc/moe.md, "Telemetry"): at the validations of steps 2 and 4 each layer's
# log line counts the choices of the 2 steps before it over both processes (steps 2 x processes 2 x B 2 x T 16 x
# top-k 2 = 256: a process's own counts would give 128, a count per micro-step or per pass other numbers), the
# experts' loads over the mean add up to E, no expert is dead (fewer than 100 steps), and the biases logged are the
# model file's (step 4).
if $PYTHON - "$work/bias/main.log" "$work/bias/model_00000004.bin" <<'PY'
import struct, sys
import numpy as np
lines = [dict(f.split(":", 1) for f in line.split()) for line in open(sys.argv[1]) if " layer:" in line]
blob = open(sys.argv[2], "rb").read()
h = struct.unpack("256i", blob[:1024])
Lm, E = h[4] // h[10], h[8]
final = np.frombuffer(blob[-4 * Lm * E:], dtype="<f4").reshape(Lm, E)
ok = sorted((int(l["s"]), int(l["layer"])) for l in lines) == [(s, m) for s in (0, 2, 4) for m in range(Lm)]
for l in lines:
    if l["s"] == "0":
        ok = ok and "layer_loads" not in l and l["layer_dead"] == "0"
        continue
    loads = [float(x) for x in l["layer_loads"].split(",")]
    ok = ok and l["layer_steps"] == "2" and l["layer_choices"] == "256" and len(loads) == E
    ok = ok and abs(sum(loads) - E) < 0.002 * E and l["layer_dead"] == "0"
    if l["s"] == "4":
        bias = np.array([float(x) for x in l["layer_bias"].split(",")], dtype=np.float32)
        ok = ok and np.allclose(bias, final[int(l["layer"])], rtol=1e-5, atol=1e-9)
sys.exit(0 if ok else 1)
PY
then pass; else fail "the balancing-bias run's telemetry lines (choices, loads, dead experts, biases) are not as they should be"; fi
# Dead experts (doc/moe.md, "Telemetry"): a copy of the top-1-of-4 reference model whose MoE layers route every token
# to expert 3 (ln_2's weight 0 and its bias a unit vector u, so that every token's router input is u; router rows
# -10u, -10u, -10u, 10u), trained at learning rate 0 so that it stays so. Experts 0..2 have no token from the first
# step on: at the validation of step 99 they have been quiet 99 steps (not dead), at step 100 they are dead (3 a
# layer), and the loads since the last validation are 0, 0, 0, 4 times the mean.
$PYTHON - "$MOE_MODEL" "$work/starved.bin" <<'PY' || fail "cannot write the starved-expert model"
import sys
import torch
sys.path.insert(0, ".")
import train_moe
model = train_moe.read_model_file(sys.argv[1])
assert model.config.E == 4 and model.config.topk == 1
g = torch.Generator().manual_seed(11)
with torch.no_grad():
    for block in model.moe_blocks():
        u = torch.randn(model.config.C, generator=g)
        u /= u.norm()
        block.ln_2.weight.zero_()
        block.ln_2.bias.copy_(u)
        block.moe.router.weight.copy_(torch.outer(torch.tensor([-10.0, -10.0, -10.0, 10.0]), u))
train_moe.write_model_file(sys.argv[2], model, train_moe.MOE_VERSION_FP32)
PY
"$TRAIN" -i "$work/train.bin" -j "$work/train.bin" -t 16 -b 2 -s 0 -l 0 -e "$work/starved.bin" -cf 0.5 -x 100 -v 99 \
    -m 1 -o "$work/starved" >"$work/starved.log" 2>&1 || fail "starved-expert run: $(tail -3 "$work/starved.log")"
if $PYTHON - "$work/starved/main.log" <<'PY'
import sys
lines = [dict(f.split(":", 1) for f in line.split()) for line in open(sys.argv[1]) if " layer:" in line]
dead = sorted((int(l["s"]), int(l["layer"]), int(l["layer_dead"])) for l in lines)
loads = [[float(x) for x in l["layer_loads"].split(",")] for l in lines if l["s"] != "0"]
print("  (step, layer, dead experts):", *dead)
ok = dead == [(s, m, 3 if s == 100 else 0) for s in (0, 99, 100) for m in range(2)]
sys.exit(0 if ok and len(loads) == 4 and all(l == [0.0, 0.0, 0.0, 4.0] for l in loads) else 1)
PY
then pass; else fail "the starved experts are not reported dead after 100 steps (and only then): see $work/starved/main.log"; fi
# --- the named descriptors (doc/moe.md, "Descriptors"): -e mix8 and -e ds64 at V = 50257, maxT = 1024 plan (-pm,
# nothing allocated) the parameter counts of their shapes, here from an independent formula (padded vocabulary, untied
# lm_head, per layer RMSNorm weights, GQA attention, router, SwiGLU experts and shared experts; the final RMSNorm),
# and the start-up table shows their routing (ds64: sigmoid scores with the routed scale 2.5, 2 shared experts of
# 128, -rsl 0.0001, -rb 0.001); a flag on the command line overrides the descriptor's (-ne 32).
descriptor_params() {  # L C NH NKV E H S Hs
    $PYTHON -c 'import sys; L, C, NH, NKV, E, H, S, Hs = map(int, sys.argv[1:]); Vp = 50304; HS = C // NH
print(2 * Vp * C + L * (2 * C + (NH + 2 * NKV) * HS * C + C * C + E * C + E * 3 * H * C + S * 3 * Hs * C) + C)' "$@"
}
"$TRAIN" -e mix8 -ev 50257 -et 1024 -pm 80 >"$work/mix8.log" 2>&1
"$TRAIN" -e ds64 -ev 50257 -et 1024 -pm 80 >"$work/ds64.log" 2>&1
"$TRAIN" -e ds64 -ev 50257 -et 1024 -pm 80 -ne 32 >"$work/ds64_32.log" 2>&1
if grep -q "| parameters  *| $(descriptor_params 8 512 8 2 8 1792 0 0) " "$work/mix8.log" &&
    grep -q "| model  *| llama L=8 NH=8 NKV=2 C=512 " "$work/mix8.log" &&
    grep -q "| router scores  *| softmax, gates times 1 " "$work/mix8.log" &&
    grep -q "| parameters  *| $(descriptor_params 8 512 8 8 64 128 2 128) " "$work/ds64.log" &&
    grep -q "| router scores  *| sigmoid, gates times 2.5 " "$work/ds64.log" &&
    grep -q "| shared experts  *| 2 per MoE layer, hidden size 128 " "$work/ds64.log" &&
    grep -q "| sequence-wise loss  *| alpha 0.0001 " "$work/ds64.log" &&
    grep -q "| balancing bias  *| moves by 0.001 per step " "$work/ds64.log" &&
    grep -q "| experts  *| 32 per MoE layer" "$work/ds64_32.log"; then pass; else
    fail "the descriptors mix8 and ds64 do not plan their shapes and routing: $(grep -E 'parameters|model|router' \
"$work/mix8.log" "$work/ds64.log" | head -6)"; fi
# --- -arch llama (doc/moe.md, "Routing options and the llama MoE"): SwiGLU experts, 2 of 4 per token dropless, and a
# SwiGLU shared expert on 2 ranks with -ep 2 and a resume from the step-3 checkpoint. The model file's header records
# the family (words 16..21: 1, NKV 1, theta 10000's and eps 1e-5's fp32 bits, H 384, untied) and the MoE shape, its size
# counts the SwiGLU tensors without biases (L (E (2H C + C H) + S (2H_s C + C H_s)) expert values: no efcb, efcprojb or
# shared biases); the resumed run continues bit-identically. A llama MoE reference file (train_moe.py) trains.
LLAMA=(-e d2 -arch llama -kv 1 -ev 263 -et 32 -ne 4 -tk 2 -me 1 -eh 64 -cf 0 -se 1 -seh 32 -rs sigmoid -ep 2
       -i "$work/train.bin" -j "" -v 0 -s 0 -b 2 -t 16 -l 3e-3)
run_and_resume llama 6 3 $MPIRUN -np 2 "$TRAIN" "${LLAMA[@]}"
want=$(step_fields "$work/llama.log" | tail -n 3)
words=$($PYTHON -c 'import struct, sys; h = struct.unpack("256i", open(sys.argv[1], "rb").read(1024)); print(*h[8:13], *h[16:22], *h[24:27])' \
    "$work/llama/model_00000006.bin")
size=$(stat -c %s "$work/llama/model_00000006.bin")
# V=263 Vp=384 maxT=32 L=2 C=128 NH=2 NKV=1 (HS 64), dense H 384 unused (every layer MoE): wte, lm_head, per layer
# ln1w, qkvw (NH + 2 NKV) HS C, attprojw, ln2w, routerw E C, experts, the shared expert; lnfw
llama_values=$(( 2 * 384 * 128 + 2 * (128 + 4 * 64 * 128 + 128 * 128 + 128 + 4 * 128 +
                 4 * (2 * 64 * 128 + 128 * 64) + (2 * 32 * 128 + 128 * 32)) + 128 ))
if [ -n "$want" ] && [ "$want" = "$(step_fields "$work/llama_resumed.log")" ] &&
    cmp -s "$work/llama/model_00000006.bin" "$work/llama_resumed/model_00000006.bin" &&
    [ "$words" = "4 2 1 64 0 1 1 1176256512 384 925353388 0 1 1 32" ] &&
    [ "$size" = "$(( 1024 + 4 * llama_values ))" ]; then pass; else
    fail "a llama MoE run does not resume bit-identically, or its model file's words 8..12 16..21 24..26 are [$words],"\
" or it has $size bytes (want $(( 1024 + 4 * llama_values )))"; fi
if "$TRAIN" "${COMMON[@]}" -e "$LLAMA_MOE_MODEL" -b 2 -x 2 -cf 0.5 -arch llama -kv 2 >"$work/llama_file.log" 2>&1 &&
    grep -q "| model  *| llama L=2 NH=4 NKV=2 C=64 " "$work/llama_file.log"; then pass; else
    fail "the llama MoE reference file does not train: $(tail -2 "$work/llama_file.log")"; fi

# --- bad inputs
expect_error "-kv not dividing NH" "-kv 3: the key/value heads must divide the 2 heads" "$TRAIN" "${COMMON[@]}" \
    -e d2 -arch llama -kv 3 -ev 263 -et 32 -x 1
expect_error "-kv against the llama file" "-kv 1: the model file $LLAMA_MOE_MODEL has 2" "$TRAIN" "${COMMON[@]}" \
    -e "$LLAMA_MOE_MODEL" -b 2 -x 1 -arch llama -kv 1
expect_error "-arch llama against a gpt2 file" "-arch llama: $MOE_MODEL is a gpt2 model" "$TRAIN" "${COMMON[@]}" -b 2 \
    -x 1 -e "$MOE_MODEL" -arch llama
expect_error "top-k above E" "-tk 9: top-k must be between 1 and the number of experts (8)" "$TRAIN" "${COMMON[@]}" -e d2 -tk 9
expect_error "dense file to the MoE trainer" "not a MoE model file" "$TRAIN" "${COMMON[@]}" -b 2 -e "$DENSE_MODEL"
expect_error "MoE file to the dense trainer" "not a GPT-2 model file" "$DENSE" "${COMMON[@]}" -b 2 -e "$MOE_MODEL"
expect_error "MoE flag to the dense trainer" "unknown flag -ne" "$DENSE" "${COMMON[@]}" -ne 8
expect_error "expert parallelism over one process" "-ep 2: the expert-parallel degree must divide the number of processes (1)" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ep 2
expect_error "expert-parallel degree 0" "-ep 0: the expert-parallel degree must be at least 1" "$TRAIN" "${COMMON[@]}" -ep 0
expect_error "experts not divisible by the degree" "-ep 2: the 3 experts per MoE layer must divide evenly over the expert-parallel degree" \
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -ne 3 -ep 2
mkdir -p "$work/no_expert_state"
cp "$work/full/model_00000003.bin" "$work/full/state_00000003_00000.bin" "$work/full/DONE_00000003" "$work/no_expert_state/"
expect_error "missing expert state" "expert_state_00000003.bin" "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 6 -o "$work/no_expert_state" -y 1
expect_error "noisy top-k from a file without a noise router" "-rn 1: $MOE_MODEL has no noise router" \
    "$TRAIN" "${COMMON[@]}" -b 2 -e "$MOE_MODEL" -rn 1
expect_error "noisy top-k with every expert chosen" "-rn 1: noisy top-k gating needs -tk (4) below -ne (4)" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ne 4 -tk 4 -rn 1
expect_error "noisy top-k 2" "-rn 2: expected 0 or 1" "$TRAIN" "${COMMON[@]}" -rn 2
expect_error "jitter out of range" "-rj 1.5: the jitter must be in [0, 1)" "$TRAIN" "${COMMON[@]}" -rj 1.5
expect_error "zero experts" "-ne 0: expected at least 1 expert" "$TRAIN" "${COMMON[@]}" -ne 0
expect_error "unknown score" "-rs tanh: expected softmax or sigmoid" "$TRAIN" "${COMMON[@]}" -e d2 -rs tanh
expect_error "routed scale 0" "-rsf 0: the routed scale must be finite and positive" "$TRAIN" "${COMMON[@]}" -e d2 -rsf 0
expect_error "noisy top-k with sigmoid scores" "-rn 1 -rs sigmoid: noisy top-k gating is defined on softmax scores only" \
    "$TRAIN" "${COMMON[@]}" -e d2 -rn 1 -rs sigmoid
expect_error "-seh without -se" "-seh 64: the shared experts' hidden size needs -se N > 0" "$TRAIN" "${COMMON[@]}" -e d2 -seh 64
expect_error "-se with -seh 0" "-seh 0: the shared experts' hidden size must be positive" "$TRAIN" "${COMMON[@]}" -e d2 -se 1 -seh 0
expect_error "negative -rb" "-rb -0.1: the balancing bias step must be finite and >= 0" \
    "$TRAIN" "${COMMON[@]}" -e d2 -rb -0.1
expect_error "-rb nan" "flag -rb: expected a number, got 'nan'" "$TRAIN" "${COMMON[@]}" -e d2 -rb nan
expect_error "negative -rsl" "-rsl -0.01: the sequence-wise loss coefficient must be finite and >= 0" \
    "$TRAIN" "${COMMON[@]}" -e d2 -rsl -0.01
expect_error "-rg 2" "-rg 2: expected 0 or 1" "$TRAIN" "${COMMON[@]}" -e d2 -rg 2
expect_error "-rb with softmax scores" "-rb 0.001: aux-loss-free balancing needs sigmoid scores" \
    "$TRAIN" "${COMMON[@]}" -e d2 -rb 0.001
expect_error "-rb on a softmax model file" \
    "-rb 0.001: aux-loss-free balancing needs sigmoid scores (-rs sigmoid; $MOE_MODEL has softmax)" \
    "$TRAIN" "${COMMON[@]}" -b 2 -e "$MOE_MODEL" -rb 0.001
expect_error "negative -se" "-se -1: expected 0 or more shared experts" "$TRAIN" "${COMMON[@]}" -e d2 -se -1
expect_error "negative -dl" "-dl -1: the device limit must be >= 0 (0: off)" "$TRAIN" "${COMMON[@]}" -e d2 -dl -1
expect_error "-dl without expert groups" "-dl 1 -ep 1 (d2): device-limited routing needs expert groups" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -ne 4 -tk 1 -dl 1
expect_error "-dl above the groups" "-dl 3 -ep 2 (d2): device-limited routing is more than the expert groups" \
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -ne 4 -tk 2 -ep 2 -dl 3
expect_error "-dl groups with fewer than k experts" \
    "-dl 1 -ep 2 (d2): device-limited routing groups of 2 experts hold fewer than the top-k 3" \
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -ne 4 -tk 3 -ep 2 -dl 1
expect_error "-dl with noisy gating" "-dl 1 -ep 2 (d2): device-limited routing is not defined with noisy top-k gating" \
    $MPIRUN -np 2 "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -ne 4 -tk 2 -rn 1 -ep 2 -dl 1
expect_error "shared hidden size not a multiple of 8" "d2: shared expert hidden size 12: their GEMMs need a positive multiple of 8" \
    "$TRAIN" "${COMMON[@]}" -e d2 -ev 263 -et 32 -se 1 -seh 12
expect_error "-se against the file" "-se 1 -seh 0: the model file $MOE_MODEL has 0 shared experts of hidden size 0 (header words 25" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -se 1
expect_error "-se against a checkpoint" "the model file $work/shared/model_00000006.bin has 2 shared experts of hidden size 64" \
    $MPIRUN -np 2 "$TRAIN" "${SHARED[@]}" -x 7 -o "$work/shared" -y 1 -se 1

# a shard of tokens the model has no row for (uint16 65535 on V=256) is refused before any step, naming shard,
# position, token and V
$PYTHON - "$work/ffff.bin" <<'PY'
import struct, sys
n = 4096
open(sys.argv[1], "wb").write(struct.pack("256i", *([20240520, 1, n] + [0] * 253)) + struct.pack("<%dH" % n, *([65535] * n)))
PY
expect_error "tokens of 65535 on V=256" "ffff.bin: token 65535 at position 0 is out of range for the model's vocabulary (expected 0 to 255, V = 256)" \
    "$TRAIN" -e d2 -ev 256 -et 32 -ne 4 -i "$work/ffff.bin" -j "" -b 2 -t 16 -v 0 -s 0 -x 2 -a 1

# explicit -ne, -tk, -me, -eh that contradict the model file are refused (the file's own values are accepted)
expect_error "-ne against the file" "-ne 8: the model file $MOE_MODEL has 4 experts per MoE layer" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -ne 8
expect_error "-tk against the file" "-tk 2: the model file $MOE_MODEL has 1 experts per token" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -tk 2
expect_error "-me against the file" "-me 2: the model file $MOE_MODEL has 1 layers per MoE layer" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -me 2
expect_error "-eh against the file" "-eh 64: the model file $MOE_MODEL has 96 as the experts' hidden size" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -eh 64
expect_error "-ne against a checkpoint" "-ne 2: the model file $work/full/model_00000006.bin has 4 experts" \
    "$TRAIN" "${COMMON[@]}" -e "$MOE_MODEL" -b 2 -x 7 -o "$work/full" -y 1 -ne 2
if "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -ne 4 -tk 1 -me 1 -eh 96 >"$work/same_shape.log" 2>&1; then pass; else
    fail "the file's own -ne -tk -me -eh were refused: $(tail -2 "$work/same_shape.log")"; fi
# a family word that is neither gpt2 (0) nor llama (1) is refused naming the word
$PYTHON - "$MOE_MODEL" "$work/moe_family2.bin" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
h = list(struct.unpack("256i", data[:1024]))
h[16] = 2
open(sys.argv[2], "wb").write(struct.pack("256i", *h) + data[1024:])
PY
expect_error "unknown family" "moe_family2.bin: model family 2 in header word 16 (1 = llama; doc/formats.md): this trainer reads only gpt2 (0) and llama (1) files" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/moe_family2.bin"
# the MoE header words of the routing options (doc/formats.md): what this trainer does not build yet, and what any
# reader refuses, named by word. make_header FILE WORD=VALUE...: the MoE test model with those header words
make_header() {
    $PYTHON - "$MOE_MODEL" "$@" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
h = list(struct.unpack("256i", data[:1024]))
for change in sys.argv[3:]:
    word, value = change.split("=")
    h[int(word)] = int(value)
open(sys.argv[2], "wb").write(struct.pack("256i", *h) + data[1024:])
PY
}
# header_refused NAME WHAT EXPECTED WORD=VALUE...: the test model with those words, as $work/NAME.bin, is refused
# with a line holding EXPECTED
header_refused() {
    local name=$1 what=$2 expected=$3
    shift 3
    make_header "$work/$name.bin" "$@"
    expect_error "$what" "$expected" "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/$name.bin"
}
header_refused moe_shared "shared experts the file lacks" \
    "moe_shared.bin is truncated: its header describes 127040 parameters" 24=1 25=1 26=64
header_refused moe_shared_no_hidden "shared experts without a hidden size" \
    "header words 25 and 26 (shared experts 1, their hidden size 0) must be both positive or both 0" 24=1 25=1
header_refused moe_bias "balancing biases the file lacks" \
    "moe_bias.bin is truncated: its header describes" 24=1 27=1 29=1
$PYTHON -c 'import sys; d = open(sys.argv[1], "rb").read(); open(sys.argv[2], "wb").write(d[:-4] + b"\x00\x00\xc0\x7f")' \
    "$work/bias/model_00000004.bin" "$work/moe_bias_nan.bin"
expect_error "a balancing bias that is not finite" \
    "moe_bias_nan.bin: balancing bias 7 (MoE layer 1, expert 3) is not finite" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$work/moe_bias_nan.bin"
header_refused moe_bias_softmax "balancing biases with softmax" \
    "header word 29 = 1: balancing biases need sigmoid scores (word 27 = 1)" 24=1 29=1
header_refused moe_rev0 "word 27 without revision 1" \
    "header word 27 = 1: words 25 to 32 must be 0 when word 24 is 0" 27=1
header_refused moe_rev1_groups "expert groups without revision 2" \
    "header word 31 = 2: words 30 to 32 must be 0 when word 24 is 1" 24=1 27=1 31=2 32=1
header_refused moe_groups_softmax "expert groups with softmax" \
    "moe_groups_softmax.bin: 2 expert groups, 1 kept (-eg, -egk; header words 31, 32): they need sigmoid scores" \
    24=2 31=2 32=1
header_refused moe_all_dense "no MoE layer after the dense ones" \
    "moe_all_dense.bin: 2 dense layers first: expected 0..1" 24=2 30=2
expect_error "-md against the file" "-md 1: the model file $MOE_MODEL has 0 dense layers first" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -md 1
expect_error "-eg without -egk" "-eg 2 -egk 0: the expert groups and the groups kept go together, both positive" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -eg 2
header_refused moe_rsf "negative routed scale in the file" \
    "header word 28 = -1082130432: the routed scale (fp32 bits) must be finite" 24=1 28=-1082130432
expect_error "-rs against the file" "-rs sigmoid: the model file $MOE_MODEL has softmax scores (header word 27" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -rs sigmoid
expect_error "-rsf against the file" "-rsf 2: the model file $MOE_MODEL has the routed scale 1 (header word 28" \
    "$TRAIN" "${COMMON[@]}" -b 2 -x 1 -e "$MOE_MODEL" -rsf 2

# --- pre-emption with experts: on 2 ranks with -ep 2 at ZeRO-1, SIGTERM to rank 1 before step 4; the job writes a
# checkpoint of step 4 (the experts' state with it), exits 143, and resumed prints the uninterrupted steps 5 and 6
preempted moe_sigterm 2 once "$TRAIN" -e "$MOE_MODEL" "${COMMON[@]}" -b 2 -x 6 -n 2 -ep 2 -z 1

echo "test_train_moe: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
