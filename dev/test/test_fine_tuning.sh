#!/usr/bin/env bash
# dev/test/test_fine_tuning.sh: fine-tuning from the command line (train_gpt -ft METHOD, llmc/model_adapter.h)
# on the CPU backend, on the instruction shards data/instructions.py makes of the shipped sample (bytes, the prompts'
# targets masked), with the references' models and adapters (build/ref/lora_gpt2_fp32: every layer's target, r 8,
# alpha 12; build/ref/adapter_gpt2_fp32: bottleneck adapters of width 8; build/ref/prompt_gpt2_fp32: 5 virtual
# tokens, here before 27 real ones; build/ref/prefix_gpt2_fp32 and lladapter_gpt2_fp32: 5 shared keys per layer):
#   - step 1's loss and gradient norm from each adapter (-fi, -a 1) against PyTorch's (train_gpt.py --train
#     --adapter-from-file, whose first batch is the same rows): FP32, rel 1e-5 (the printed 6 decimals, fp32 sums);
#   - the start-up table's trainable count against L r (C_in + C_out) summed over the targets;
#   - an adapter checkpoint (-n) holds the adapter alone: 1024 + 4 n (1 + 2) bytes for its n values with m and v;
#     6 steps straight and 3 + 3 resumed (-y 1) give the same step lines bit for bit, and so does a resume of that
#     checkpoint on 2 processes under ZeRO-1 with the same global batch within fp32 summation order (rel 1e-5); the
#     bottleneck adapter's checkpoint resumes bit for bit too;
#   - -fm: the merged model's validation loss before any step is the adapted run's last one (printed digits);
#   - -pp 2 (1F1B, the bottleneck adapter under ZB too, LoRA with 2 data-parallel processes per stage): every method's
#     steps and adapter checkpoint bit for bit -pp 1's, on 4 distinct micro-batches per step; the checking build;
#   - samples with prompt tuning and a prefix (the engine's forward-pass path);
#   - refusals: a rank of 0 or not a multiple of 8, an unknown or repeated target, an unknown method, a fine-tuning
#     flag without -ft, LoRA's flags with the bottleneck adapter, an adapter of another method or base model
#     (checksum), a descriptor as the base, -fm of an adapter on a tied classifier, virtual tokens that do not fit
#     the model's maxT, -fl without llama_adapter or past the model's layers, the prefix off flash attention (-fa 0),
#     -tp 2, the experts targets of a model without experts, and in the MoE trainer the balancing bias (-rb), fc targets
#     of a model without a dense MLP and the experts targets named twice;
#   - the MoE trainer (train_moe -ft) the same way: step 1 from its references' LoRA, bottleneck and prompt adapters
#     against train_moe.py --train's, and an adapter checkpoint on 2 processes resumed into another expert-parallel
#     degree and ZeRO stage bit for bit.
# Needs build/train_gpt_fp32, build/check/train_gpt_fp32, build/train_moe_fp32, the references above and
# build/ref/moe_lora_fp32, moe_adapter_fp32, moe_prompt_fp32 and moe_prefix_fp32 (their model and adapter files). Runs
# up to 4 processes at once (-pp 2 with 2 data-parallel processes). Run from anywhere: dev/test/test_fine_tuning.sh
set -u
cd "$(dirname "$0")/../.."
. dev/test/cli_common.sh
MODEL=build/ref/lora_gpt2_fp32_model.bin
ADAPTER=build/ref/lora_gpt2_fp32_adapter.bin

$PYTHON data/instructions.py data/instructions_sample.jsonl --out-dir "$work/data" --tokenizer bytes >/dev/null ||
    { echo "cannot write the instruction shards"; exit 1; }
DATA=(-i "$work/data/train.bin" -j "$work/data/val.bin" -t 32 -v 100 -m 2 -s 0 -l 1e-3)
LORA=(-e "$MODEL" -ft lora -fr 8 -fs 12 -fw qkv,proj,fc,fc_proj)

# step lines -> "loss norm" per step
steps() { grep -E '^step [0-9]+/' "$1" | sed -E 's/.*\| loss ([0-9.]+).*\| norm ([0-9.]+).*/\1 \2/'; }

BOTTLENECK_MODEL=build/ref/adapter_gpt2_fp32_model.bin
BOTTLENECK_ADAPTER=build/ref/adapter_gpt2_fp32_adapter.bin
BOTTLENECK=(-e "$BOTTLENECK_MODEL" -ft adapter -fr 8)
PROMPT_MODEL=build/ref/prompt_gpt2_fp32_model.bin
PROMPT_ADAPTER=build/ref/prompt_gpt2_fp32_adapter.bin
PROMPT=(-e "$PROMPT_MODEL" -ft prompt -fr 5)
PREFIX=(-e build/ref/prefix_gpt2_fp32_model.bin -ft prefix -fr 5)
LLADAPTER=(-e build/ref/lladapter_gpt2_fp32_model.bin -ft llama_adapter -fr 5)

# --- step 1 from each reference's adapter against PyTorch, and the start-up table's trainable count
# first_step NAME MODEL ADAPTER T TRAINER-FLAGS...: TRAINER's first step at -t T against its reference's --train
# (SCRIPT, with SCRIPT_FLAGS)
TRAINER=build/train_gpt_fp32
SCRIPT=train_gpt.py
SCRIPT_FLAGS=()
first_step() {
    local name=$1 model=$2 adapter=$3 T=$4
    shift 4
    "$TRAINER" "$@" -fi "$adapter" "${DATA[@]}" -t "$T" -b 2 -a 1 -x 1 >"$work/$name.log" 2>&1 ||
        fail "$name -a 1: $(tail -2 "$work/$name.log")"
    $PYTHON "$SCRIPT" --train --model-from-file "$model" --adapter-from-file "$adapter" \
        --input-bin "$work/data/train.bin" --B 2 --T "$T" --steps 1 --lr 1e-3 "${SCRIPT_FLAGS[@]}" \
        >"$work/$name.torch.log" 2>&1 || fail "$name $SCRIPT --train: $(tail -2 "$work/$name.torch.log")"
    if $PYTHON - "$name" "$work/$name.log" "$work/$name.torch.log" <<'PY'; then pass; else fail "$name step 1 against PyTorch"; fi
import re, sys
got, want = (re.search(r"step 1/\d+ \| loss ([0-9.]+).*\| norm ([0-9.]+)", open(p).read()) for p in sys.argv[2:])
got, want = tuple(map(float, got.groups())), tuple(map(float, want.groups()))
err = max(abs(g - w) / w for g, w in zip(got, want))
print(f"  {sys.argv[1]} step 1: loss {got[0]:.6f} norm {got[1]:.6f}, PyTorch {want[0]:.6f} {want[1]:.6f}: max rel err "
      f"{err:.1e} (tol 1e-5)")
sys.exit(0 if err < 1e-5 else 1)
PY
}
first_step lora "$MODEL" "$ADAPTER" 32 "${LORA[@]}"
first_step adapter "$BOTTLENECK_MODEL" "$BOTTLENECK_ADAPTER" 32 "${BOTTLENECK[@]}"
first_step prompt "$PROMPT_MODEL" "$PROMPT_ADAPTER" 27 "${PROMPT[@]}"
first_step prefix build/ref/prefix_gpt2_fp32_model.bin build/ref/prefix_gpt2_fp32_adapter.bin 32 "${PREFIX[@]}"
first_step llama_adapter build/ref/lladapter_gpt2_fp32_model.bin build/ref/lladapter_gpt2_fp32_adapter.bin 32 \
    "${LLADAPTER[@]}"
mv "$work/lora.log" "$work/one.log"
# the MoE trainer from its references' adapters, the routers and experts frozen (-cf 0.5: as the references route):
# LoRA with fc and fc_proj on the dense layer and a pair on every expert, the bottleneck adapter after both FFN kinds,
# a prompt's virtual tokens routed with the real ones
TRAINER=build/train_moe_fp32
SCRIPT=train_moe.py
SCRIPT_FLAGS=(--cf 0.5)
MOE_LORA=(-e build/ref/moe_lora_fp32_model.bin -ft lora -fr 8 -fs 12 -fw qkv,proj,fc,fc_proj,lm_head,experts -cf 0.5)
MOE_ADAPTER=(-e build/ref/moe_adapter_fp32_model.bin -ft adapter -fr 8 -cf 0.5)
first_step moe_lora build/ref/moe_lora_fp32_model.bin build/ref/moe_lora_fp32_adapter.bin 32 "${MOE_LORA[@]}"
first_step moe_adapter build/ref/moe_adapter_fp32_model.bin build/ref/moe_adapter_fp32_adapter.bin 32 \
    "${MOE_ADAPTER[@]}"
first_step moe_prompt build/ref/moe_prompt_fp32_model.bin build/ref/moe_prompt_fp32_adapter.bin 27 \
    -e build/ref/moe_prompt_fp32_model.bin -ft prompt -fr 5 -cf 0.5
TRAINER=build/train_gpt_fp32
# an MoE adapter checkpoint: 2 steps on 2 processes under -ep 2 and ZeRO-1, resumed into -ep 1 and ZeRO-2 there, give
# the straight run's steps 3-4 bit for bit (no expert state file: the experts are frozen)
RUN=("${MOE_ADAPTER[@]}" "${DATA[@]}" -b 2 -x 4)
$MPIRUN -np 2 build/train_moe_fp32 "${RUN[@]}" -ep 2 -z 1 -o "$work/m_straight" >"$work/m_straight.log" 2>&1 ||
    fail "MoE adapter, 4 steps: $(tail -2 "$work/m_straight.log")"
$MPIRUN -np 2 build/train_moe_fp32 "${RUN[@]}" -ep 2 -z 1 -o "$work/m_resumed" -n 2 -x 2 >/dev/null 2>&1 ||
    fail "MoE adapter, 2 steps"
$MPIRUN -np 2 build/train_moe_fp32 "${RUN[@]}" -ep 1 -z 2 -o "$work/m_resumed" -y 1 >"$work/m_second.log" 2>&1 ||
    fail "MoE adapter resume: $(tail -2 "$work/m_second.log")"
if diff <(grep -E '^step [34]/' "$work/m_straight.log" | cut -d'|' -f1-6) \
        <(grep -E '^step [34]/' "$work/m_second.log" | cut -d'|' -f1-6) >/dev/null &&
   [ "$(grep -cE '^step [34]/' "$work/m_second.log")" = 2 ] && [ -e "$work/m_resumed/adapter_00000002.bin" ] &&
   [ -z "$(ls "$work/m_resumed" | grep expert_state)" ]; then pass
else fail "the MoE adapter's resumed steps 3-4 differ from the straight run's, or its checkpoint is not the adapter's"; fi
# the tiny shape: L 2, C 48, fc 4C; qkv (C -> 3C), proj (C -> C), fc (C -> 4C), fc_proj (4C -> C)
want=$((2 * 8 * ((48 + 144) + (48 + 48) + (48 + 192) + (192 + 48))))
if grep -q "lora r=8 on qkv,proj,fc,fc_proj: $want trainable parameters" "$work/one.log"; then pass
else fail "the start-up table's trainable count: $(grep fine-tuning "$work/one.log"), expected $want"; fi

# --- adapter checkpoints: the adapter alone; a resume bit for bit; a resume on 2 processes
RUN=("${LORA[@]}" "${DATA[@]}" -b 4 -d 256 -x 6)
build/train_gpt_fp32 "${RUN[@]}" -o "$work/straight" >"$work/straight.log" 2>&1 || fail "6 steps: $(tail -2 "$work/straight.log")"
build/train_gpt_fp32 "${RUN[@]}" -o "$work/resumed" -n 3 -x 3 >"$work/first.log" 2>&1 || fail "3 steps: $(tail -2 "$work/first.log")"
cp -r "$work/resumed" "$work/resumed_np2"
n=$want
size=$(stat -c %s "$work/resumed/adapter_00000003.bin" 2>/dev/null || echo missing)
if [ "$size" = $((1024 + 4 * n * 3)) ] && [ ! -e "$work/resumed/model_00000003.bin" ]; then pass
else fail "adapter checkpoint: $size bytes, expected $((1024 + 4 * n * 3)), and no model file"; fi
build/train_gpt_fp32 "${RUN[@]}" -o "$work/resumed" -y 1 >"$work/second.log" 2>&1 || fail "resume: $(tail -2 "$work/second.log")"
if diff <(grep -E '^step [456]/' "$work/straight.log" | cut -d'|' -f1-3) \
        <(grep -E '^step [456]/' "$work/second.log" | cut -d'|' -f1-3) >/dev/null &&
   [ "$(grep -cE '^step [456]/' "$work/second.log")" = 3 ]; then pass
else fail "the resumed steps 4-6 differ from the straight run's"; fi
$MPIRUN -np 2 build/train_gpt_fp32 "${LORA[@]}" "${DATA[@]}" -b 2 -d 256 -x 6 -z 1 -o "$work/resumed_np2" -y 1 \
    >"$work/np2.log" 2>&1 || fail "resume on 2 processes: $(tail -2 "$work/np2.log")"
steps "$work/straight.log" | tail -3 >"$work/straight.steps"
steps "$work/np2.log" >"$work/np2.steps"
if $PYTHON - "$work/straight.steps" "$work/np2.steps" <<'PY'; then pass; else fail "the 2-process resume"; fi
import sys
want, got = ([tuple(map(float, line.split())) for line in open(p)] for p in sys.argv[1:])
err = max(abs(g - w) / w for a, b in zip(got, want) for g, w in zip(a, b)) if len(got) == len(want) == 3 else 1
print(f"  steps 4-6 resumed on 2 processes (-z 1) against 1: max rel err {err:.1e} (tol 1e-5)")
sys.exit(0 if err < 1e-5 else 1)
PY

# the bottleneck adapter's checkpoint: 2 + 2 steps resumed bit-identical to 4
RUN=("${BOTTLENECK[@]}" "${DATA[@]}" -b 4 -x 4)
build/train_gpt_fp32 "${RUN[@]}" -o "$work/b_straight" >"$work/b_straight.log" 2>&1 ||
    fail "adapter, 4 steps: $(tail -2 "$work/b_straight.log")"
build/train_gpt_fp32 "${RUN[@]}" -o "$work/b_resumed" -n 2 -x 2 >/dev/null 2>&1 || fail "adapter, 2 steps"
build/train_gpt_fp32 "${RUN[@]}" -o "$work/b_resumed" -y 1 >"$work/b_second.log" 2>&1 || fail "adapter resume"
if diff <(grep -E '^step [34]/' "$work/b_straight.log" | cut -d'|' -f1-3) \
        <(grep -E '^step [34]/' "$work/b_second.log" | cut -d'|' -f1-3) >/dev/null &&
   [ "$(grep -cE '^step [34]/' "$work/b_second.log")" = 2 ]; then pass
else fail "the bottleneck adapter's resumed steps 3-4 differ from the straight run's"; fi

# --- -fm: the merged model is the adapted one
build/train_gpt_fp32 "${LORA[@]}" -fi "$ADAPTER" "${DATA[@]}" -b 4 -x 2 -v 2 -fm "$work/merged.bin" >"$work/merge.log" 2>&1 ||
    fail "-fm: $(tail -2 "$work/merge.log")"
build/train_gpt_fp32 -e "$work/merged.bin" "${DATA[@]}" -b 4 -x 1 -l 0 >"$work/merged.log" 2>&1 ||
    fail "the merged model: $(tail -2 "$work/merged.log")"
adapted=$(grep "val loss" "$work/merge.log" | tail -1)
merged=$(grep "val loss" "$work/merged.log" | head -1)
if [ -n "$adapted" ] && [ "$adapted" = "$merged" ]; then pass
else fail "-fm: the adapted run's last '$adapted', the merged model's first '$merged'"; fi

# --- pipeline stages (-pp 2, a layer each, 1F1B; 2 steps of 4 micro-batches): each method's adapter checkpoint is
# -pp 1's bit for bit. Each stage computes its layers' part of the adapter's gradient (the other stage's part zero,
# which the sum over the stages adds exactly), in -pp 1's order: LoRA with the classifier's pair on the last stage,
# the prompt on the first; the bottleneck adapter's kept inputs in each micro-batch's activation slot (the step lines
# alone would not see them mixed up: only the files do), under ZB too; LoRA with 2 data-parallel processes per stage
# (ZeRO-1) gives -pp 1's on 2
pp_pair() {  # NAME NP PP-FLAGS -- FLAGS...: the run of FLAGS on 1 process (NP 2: 2) against NP processes with PP-FLAGS
    local name=$1 np=$2 pp=() one=()
    shift 2
    while [ "$1" != -- ]; do pp+=("$1"); shift; done
    shift
    [ "$np" = 4 ] && one=($MPIRUN -np 2)
    "${one[@]}" build/train_gpt_fp32 "$@" -x 2 -n 2 -o "$work/${name}_pp1" >"$work/${name}_pp1.log" 2>&1 ||
        fail "$name -pp 1: $(tail -2 "$work/${name}_pp1.log")"
    $MPIRUN -np "$np" build/train_gpt_fp32 "$@" -x 2 -n 2 -o "$work/${name}_pp2" "${pp[@]}" >"$work/${name}_pp2.log" \
        2>&1 || fail "$name ${pp[*]}: $(tail -2 "$work/${name}_pp2.log")"
    if [ -n "$(steps "$work/${name}_pp2.log")" ] && [ "$(steps "$work/${name}_pp1.log")" = "$(steps "$work/${name}_pp2.log")" ] &&
        cmp -s "$work/${name}_pp1/adapter_00000002.bin" "$work/${name}_pp2/adapter_00000002.bin"; then pass
    else fail "$name ${pp[*]}: the steps or the adapter differ from -pp 1's"; fi
}
PP_DATA=("${DATA[@]}" -b 2 -d 256 -v 0)
pp_pair lora 2 -pp 2 -- -e "$MODEL" -ft lora -fr 8 -fs 12 -fw qkv,proj,fc,fc_proj,lm_head "${PP_DATA[@]}"
pp_pair adapter 2 -pp 2 -- "${BOTTLENECK[@]}" "${PP_DATA[@]}"
pp_pair adapter_zb 2 -pp 2 -pps zb -- "${BOTTLENECK[@]}" "${PP_DATA[@]}"
pp_pair prompt 2 -pp 2 -- "${PROMPT[@]}" "${PP_DATA[@]}" -t 27 -d 216
pp_pair prefix 2 -pp 2 -- "${PREFIX[@]}" "${PP_DATA[@]}"
pp_pair llama_adapter 2 -pp 2 -- "${LLADAPTER[@]}" "${PP_DATA[@]}"
pp_pair lora_dp2 4 -pp 2 -- "${LORA[@]}" "${PP_DATA[@]}" -z 1
# the checking build (the sends, the adapter's sum over the stages, stream order): the bottleneck adapter under ZB
# (micro-batches of 1 sequence of 8 tokens: the checks are of the order of operations)
$MPIRUN -np 2 build/check/train_gpt_fp32 "${BOTTLENECK[@]}" "${DATA[@]}" -b 1 -t 8 -d 32 -x 1 -v 0 -pp 2 -pps zb \
    >"$work/check.log" 2>&1 && grep -q '^step 1/1' "$work/check.log" && pass ||
    fail "checking build, -ft adapter -pp 2 -pps zb: $(grep -m2 -E 'cucc|rror' "$work/check.log")"

# --- samples: prompt tuning and a prefix print theirs (the engine's forward-pass path, generate_by_prefill, whose
# logits test_gpt's prompt and prefix rows check against PyTorch): 6 tokens each at steps 0 and 1
for method in prompt prefix; do
    flags=("${PROMPT[@]}")
    [ "$method" = prefix ] && flags=("${PREFIX[@]}")
    build/train_gpt_fp32 "${flags[@]}" "${DATA[@]}" -t 24 -b 2 -x 1 -s 1 -g 6 -tf none >"$work/$method.samples" 2>&1 ||
        fail "-ft $method with samples: $(tail -2 "$work/$method.samples")"
    if [ "$(grep -A2 '^generating:' "$work/$method.samples" | grep -cE '^(<[0-9]+>){6}$')" = 2 ]; then pass
    else
        fail "-ft $method: two samples of 6 tokens expected, got: $(grep -A2 '^generating:' "$work/$method.samples")"
    fi
done

# --- refusals
E=("${DATA[@]}" -x 1)
expect_error "rank 0" "-fr 0: the rank must be a positive multiple of 8" build/train_gpt_fp32 "${LORA[@]}" -fr 0 "${E[@]}"
expect_error "rank 12" "-fr 12: the rank must be a positive multiple of 8" build/train_gpt_fp32 "${LORA[@]}" -fr 12 "${E[@]}"
expect_error "unknown target" "unknown target 'bogus'" build/train_gpt_fp32 "${LORA[@]}" -fw qkv,bogus "${E[@]}"
expect_error "repeated target" "repeated target 'qkv'" build/train_gpt_fp32 "${LORA[@]}" -fw qkv,qkv "${E[@]}"
expect_error "unknown method" "-ft prefixes: unknown fine-tuning method" build/train_gpt_fp32 -e "$MODEL" -ft prefixes "${E[@]}"
expect_error "-fr without -ft" "-fr applies to fine-tuning only" build/train_gpt_fp32 -e "$MODEL" -fr 8 "${E[@]}"
expect_error "width 12" "-fr 12: the bottleneck width must be a positive multiple of 8" \
    build/train_gpt_fp32 "${BOTTLENECK[@]}" -fr 12 "${E[@]}"
expect_error "adapter -fs" "-fs applies to -ft lora" build/train_gpt_fp32 "${BOTTLENECK[@]}" -fs 3 "${E[@]}"
expect_error "adapter -fm" "-fm applies to -ft lora" build/train_gpt_fp32 "${BOTTLENECK[@]}" -fm "$work/x.bin" "${E[@]}"
expect_error "another method" "header word 2 (method (-ft: 1 lora, 2 adapter, 3 prompt, 4 prefix, 5 llama_adapter)) is 1, this run's is 2" \
    build/train_gpt_fp32 -e "$MODEL" -ft adapter -fr 8 -fi "$ADAPTER" "${E[@]}"
expect_error "another base" "the adapter was trained on another base model file" \
    build/train_gpt_fp32 -e "$work/merged.bin" -ft lora -fr 8 -fs 12 -fw qkv,proj,fc,fc_proj -fi "$ADAPTER" "${E[@]}"
expect_error "another rank" "header word 3 (rank (-fr)) is 8, this run's is 16" \
    build/train_gpt_fp32 "${LORA[@]}" -fr 16 -fi "$ADAPTER" "${E[@]}"
expect_error "descriptor base" "fine-tunes a model file (-e FILE); d2 is none" \
    build/train_gpt_fp32 -e d2 -ev 263 -et 32 -ft lora "${E[@]}"
expect_error "-fm of a tied lm_head" "ties its output embedding to wte" \
    build/train_gpt_fp32 "${LORA[@]}" -fw qkv,lm_head -fm "$work/tied.bin" "${E[@]}"
expect_error "prompt past maxT" "5 virtual tokens and -t 32 exceed the model's maximum sequence length 32" \
    build/train_gpt_fp32 "${PROMPT[@]}" "${E[@]}"
expect_error "prompt -fw" "-fw applies to -ft lora" build/train_gpt_fp32 "${PROMPT[@]}" -fw qkv "${E[@]}"
expect_error "-fl of lora" "-fl 1: applies to -ft llama_adapter only" build/train_gpt_fp32 "${LORA[@]}" -fl 1 "${E[@]}"
expect_error "-fl past L" "-fl 3: more layers than the model's 2" build/train_gpt_fp32 "${LLADAPTER[@]}" -fl 3 "${E[@]}"
expect_error "prefix -fa 0" "-ft prefix: its shared keys join flash attention (-fa 1)" \
    build/train_gpt_fp32 "${PREFIX[@]}" -fa 0 "${E[@]}"
expect_error "-tp 2" "-ft lora -tp 2: the adapters are not split" build/train_gpt_fp32 "${LORA[@]}" -tp 2 "${E[@]}"
expect_error "MoE -rb" "-rb 0.001: the balancing biases are the model's, frozen under -ft" \
    build/train_moe_fp32 "${MOE_ADAPTER[@]}" -rb 0.001 "${E[@]}"
expect_error "MoE fc of no dense MLP" "has no dense MLP for fc or fc_proj" \
    build/train_moe_fp32 -e build/ref/moe_prefix_fp32_model.bin -ft lora -fw qkv,fc "${E[@]}"
expect_error "experts of a dense model" "has no experts" build/train_gpt_fp32 "${LORA[@]}" -fw qkv,experts "${E[@]}"
expect_error "-fw experts twice" "repeated target 'experts.fc'" \
    build/train_moe_fp32 -e build/ref/moe_prefix_fp32_model.bin -ft lora -fw experts,experts.fc "${E[@]}"

echo "test_fine_tuning: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
