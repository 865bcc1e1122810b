#!/usr/bin/env bash
# dev/test/test_generate.sh: generate (generate.cu, doc/inference.md) on the CPU backend, FP32 build, against the
# PyTorch reference and against itself:
#   - greedy generation's logits at every generated position against the reference's full forward pass over the
#     prompt and the generated tokens (dev/test/generate_reference.py), for GPT-2, llama with grouped-query attention
#     and a llama MoE of DeepSeek-V3's layout (a dense layer first, expert groups, a shared expert, the balancing
#     bias), with blocks of 4 positions so that prompts and samples end inside blocks;
#   - the paged cache against a contiguous one (-bs 0): identical tokens and logits;
#   - continuous batching of 20 prompts of different lengths in a cache too small for all, which forces pre-emption,
#     against each prompt alone (-b 1, room for it): identical tokens;
#   - 4 samples sharing a prompt (-sn 4): the summary's block counts are the ones the sharing and copy on write give,
#     and the same seed gives the same samples; -topk 1 samples the greedy tokens; a text prompt through a tokenizer
#     of bytes (its BPE has no merges) generates as its end-of-text token and bytes given as ids (test_hf.sh holds
#     the BPE encoder to the tokenizers package's);
#   - -vp's perplexity on a data shard against the reference's mean loss over the same sequences (the llama MoE);
#   - the trainer's sample (its engine is generate's) on a small llama trained here: each token the one its draw from
#     the trainer's generator picks from the reference's probabilities;
#   - quantised weights on that llama: -wq int8 and nf4 greedy logits against the reference's forward of
#     the dequantised weights (-wm), and their perplexity within stated bounds of the unquantised one;
#   - bad input (a prompt longer than maxT allows, a token id outside the vocabulary, an empty prompt file, a cache
#     too small for one sequence, text prompts without a tokenizer file, text that is not UTF-8, an unknown flag) gets
#     its one line.
# Needs build/generate_fp32, build/train_gpt_fp32 and the reference models
# build/ref/{tiny,llama_gqa,moe_ds_v3}_fp32_model.bin. Run from anywhere:
#   dev/test/test_generate.sh
set -u
cd "$(dirname "$0")/../.."
GEN=${GEN:-build/generate_fp32}  # GEN=build/check/generate_fp32: the same under the checking build
. dev/test/cli_common.sh

# prompts of token ids (every model's V is 263), of lengths 1 to 20 (maxT 32)
$PYTHON - "$work" <<'PY'
import random, sys
rng = random.Random(7)
lengths = [1, 5, 11, 3, 17, 8, 2, 13, 6, 20, 9, 4, 15, 7, 12, 10, 19, 14, 16, 18]
with open(sys.argv[1] + "/twenty.txt", "w") as f:
    for n in lengths:
        f.write(" ".join(str(rng.randrange(263)) for _ in range(n)) + "\n")
with open(sys.argv[1] + "/three.txt", "w") as f:
    for n in (5, 11, 1):
        f.write(" ".join(str(rng.randrange(263)) for _ in range(n)) + "\n")
PY

# --- logits against the reference: greedy, 12 tokens after each of 3 prompts, in blocks of 4
for model in tiny llama_gqa moe_ds_v3; do
    file=build/ref/${model}_fp32_model.bin
    if $GEN -e "$file" -i "$work/three.txt" -ids 1 -temp 0 -g 12 -bs 4 -lo "$work/$model.logits" \
        >"$work/$model.out" 2>"$work/$model.err"; then
        if $PYTHON dev/test/generate_reference.py "$file" "$work/three.txt" "$work/$model.out" "$work/$model.logits" \
            >"$work/$model.check" 2>&1; then pass; else fail "$model: logits against the reference"; fi
        sed "s/^/  $model: /" "$work/$model.check"
    else
        fail "$model: generate: $(tail -2 "$work/$model.err")"
    fi
done

# --- paged against contiguous: the same tokens and the same logits, bit for bit
$GEN -e build/ref/llama_gqa_fp32_model.bin -i "$work/three.txt" -ids 1 -temp 0 -g 12 -bs 0 \
    -lo "$work/contiguous.logits" >"$work/contiguous.out" 2>"$work/contiguous.err" ||
    fail "contiguous cache: $(tail -2 "$work/contiguous.err")"
if cmp -s "$work/llama_gqa.out" "$work/contiguous.out" && cmp -s "$work/llama_gqa.logits" "$work/contiguous.logits"
then pass; else fail "the paged cache and the contiguous one differ"; fi

# --- continuous batching: 20 prompts, up to 8 running, 24 blocks of 4 (3072 bytes each in both models; a sequence
# needs up to 8), against each prompt alone
for model in tiny moe_ds_v3; do
    $GEN -e build/ref/${model}_fp32_model.bin -i "$work/twenty.txt" -ids 1 -temp 0 -g 10 -bs 4 -b 8 -km 0.0704 \
        >"$work/${model}_batched.out" 2>"$work/${model}_batched.err" ||
        fail "$model: continuous batching: $(tail -2 "$work/${model}_batched.err")"
    $GEN -e build/ref/${model}_fp32_model.bin -i "$work/twenty.txt" -ids 1 -temp 0 -g 10 -bs 4 -b 1 \
        >"$work/${model}_alone.out" 2>"$work/${model}_alone.err" ||
        fail "$model: one prompt at a time: $(tail -2 "$work/${model}_alone.err")"
    preemptions=$(grep -oE '[0-9]+ pre-emptions' "$work/${model}_batched.err" | cut -d' ' -f1)
    if cmp -s "$work/${model}_batched.out" "$work/${model}_alone.out" && [ "${preemptions:-0}" -gt 0 ] &&
        [ "$(wc -l <"$work/${model}_batched.out")" -eq 20 ]; then pass; else
        fail "$model: batched with pre-emption (${preemptions:-no} pre-emptions) differs from each prompt alone"; fi
    echo "  $model batched: $(tail -1 "$work/${model}_batched.err")"
done

# --- 4 samples of one prompt of 10 positions, blocks of 4, 6 tokens each (positions 10..14 fed): the prompt's 3
# blocks shared, its partial last block copied by 3 of the samples as they write position 10 (the 4th writes the
# original), and one more block each for positions 12..14: at most 3 + 3 + 4 = 10 blocks used, 10 taken
echo "1 2 3 4 5 6 7 8 9 10" >"$work/one.txt"
SAMPLE=(-e build/ref/tiny_fp32_model.bin -i "$work/one.txt" -ids 1 -g 6 -bs 4 -sn 4 -temp 1 -sd 5)
$GEN "${SAMPLE[@]}" >"$work/samples.out" 2>"$work/samples.err" || fail "-sn 4: $(tail -2 "$work/samples.err")"
$GEN "${SAMPLE[@]}" >"$work/samples_again.out" 2>/dev/null
if grep -q "at most 10 used, 10 taken" "$work/samples.err" && cmp -s "$work/samples.out" "$work/samples_again.out" &&
    [ "$(sort -u -t: -k2 "$work/samples.out" | wc -l)" -gt 1 ]; then pass; else
    fail "-sn 4: $(tail -1 "$work/samples.err"); samples: $(tr '\n' '|' <"$work/samples.out")"; fi
echo "  -sn 4: $(tail -1 "$work/samples.err")"
$GEN -e build/ref/tiny_fp32_model.bin -i "$work/three.txt" -ids 1 -g 12 -bs 4 -topk 1 -temp 0.7 \
    >"$work/topk1.out" 2>/dev/null
if cmp -s "$work/topk1.out" "$work/tiny.out"; then pass; else fail "-topk 1 does not give the greedy tokens"; fi

# --- a text prompt through a tokenizer of bytes is its end-of-text token and its bytes: the same logits as those ids
(cd data && $PYTHON -c 'import sys; from data_common import ByteTokenizer, write_tokenizer_file
write_tokenizer_file(sys.argv[1], ByteTokenizer())' "$work/bytes_tokenizer.bin") || fail "a byte-level tokenizer"
printf 'ROMEO:\n' >"$work/text.txt"
echo "256 82 79 77 69 79 58" >"$work/text_ids.txt"
$GEN -e build/ref/tiny_fp32_model.bin -i "$work/text.txt" -tf "$work/bytes_tokenizer.bin" -temp 0 -g 8 \
    -lo "$work/text.logits" >/dev/null 2>&1 || fail "a text prompt"
$GEN -e build/ref/tiny_fp32_model.bin -i "$work/text_ids.txt" -ids 1 -temp 0 -g 8 -lo "$work/text_ids.logits" \
    >/dev/null 2>&1
if cmp -s "$work/text.logits" "$work/text_ids.logits"; then pass; else fail "a text prompt is not its bytes' ids"; fi

# --- -vp: the perplexity of the llama MoE on a data shard, against the reference's mean loss over the same sequences
$PYTHON train_gpt.py --write-shard "$work/shard.bin" --shard-tokens 2048 --V 263 --seed 7 >/dev/null
$GEN -e build/ref/moe_ds_v3_fp32_model.bin -vp "$work/shard.bin" >"$work/vp.out" 2>"$work/vp.err" ||
    fail "-vp: $(tail -2 "$work/vp.err")"
if $PYTHON dev/test/generate_reference.py perplexity build/ref/moe_ds_v3_fp32_model.bin "$work/shard.bin" \
    "$work/vp.out" >"$work/vp.check" 2>&1; then pass; else fail "-vp against the reference"; fi
sed "s/^/  /" "$work/vp.check"

# --- quantised weights (-wq): a small llama (d2: C 128, H 512) trained here for 60 steps on a Markov chain's tokens
# (each token followed by one of 4 fixed ones, so that there is something to learn: perplexity 263 to about 8)
$PYTHON - "$work" <<'PY'
import sys
import numpy as np
sys.path.insert(0, ".")
import train_gpt
follow = np.random.default_rng(1).integers(0, 263, size=(263, 4))
for name, n, seed in (("chain_train", 16384, 7), ("chain_val", 4096, 8)):
    rng, tokens = np.random.default_rng(seed), np.zeros(n, dtype="<u2")
    for i in range(1, n):
        tokens[i] = follow[tokens[i - 1], rng.integers(0, 4)]
    train_gpt.write_file(f"{sys.argv[1]}/{name}.bin", train_gpt.header(train_gpt.SHARD_MAGIC, 1, n), tokens)
PY
build/train_gpt_fp32 -e d2 -arch llama -kv 1 -ev 263 -et 64 -i "$work/chain_train.bin" -j "" -b 4 -t 64 -x 60 -n 60 \
    -v 0 -s 60 -g 8 -tf none -l 3e-3 -o "$work/chain" >"$work/chain.log" 2>&1 || fail "training the quantisation's model"
CHAIN=$work/chain/model_00000060.bin
# the trainer's samples go through the same engine: its last one (after step 0's 8 draws; no tokenizer, so from token
# 0) against the reference's probabilities and the trainer's generator
if $PYTHON dev/test/generate_reference.py trainer-sample "$CHAIN" "$work/chain.log" 0 8 >"$work/trainer_sample.check" \
    2>&1; then pass; else fail "the trainer's sample against the reference"; fi
sed "s/^/  /" "$work/trainer_sample.check"
# each format's decode (its quantised kernels) against the reference on its -wm model, the weights as it dequantises
# them: FP32 tolerance, as above
for quant in int8 nf4; do
    $GEN -e "$CHAIN" -i "$work/three.txt" -ids 1 -temp 0 -g 12 -bs 4 -wq $quant -wm "$work/$quant.bin" \
        -lo "$work/$quant.logits" >"$work/$quant.out" 2>"$work/$quant.err" ||
        fail "-wq $quant: $(tail -2 "$work/$quant.err")"
    if $PYTHON dev/test/generate_reference.py "$work/$quant.bin" "$work/three.txt" "$work/$quant.out" \
        "$work/$quant.logits" >"$work/$quant.check" 2>&1; then pass; else
        fail "-wq $quant: logits against the reference"; fi
    sed "s/^/  -wq $quant: /" "$work/$quant.check"
done
# perplexity on held-out tokens: int8 within 0.5% of the unquantised model's, nf4 within 5% (QLoRA measures NF4 within
# about 1% on large models; a broken scale or code table moves it by far more), and neither the same
for quant in none int8 nf4; do
    $GEN -e "$CHAIN" -vp "$work/chain_val.bin" -wq $quant 2>/dev/null | grep -oE '^perplexity [0-9.]+' | cut -d' ' -f2 \
        >"$work/ppl_$quant.txt"
done
if $PYTHON - "$work" <<'PY'; then pass; else fail "-wq perplexity bounds"; fi
import sys
ppl = {q: float(open(f"{sys.argv[1]}/ppl_{q}.txt").read()) for q in ("none", "int8", "nf4")}
print(f"  -vp perplexity: none {ppl['none']:.4f}, int8 {ppl['int8']:.4f}, nf4 {ppl['nf4']:.4f}")
ok = ppl["none"] < 20 and all(ppl[q] != ppl["none"] for q in ("int8", "nf4"))
ok = ok and abs(ppl["int8"] / ppl["none"] - 1) < 0.005 and abs(ppl["nf4"] / ppl["none"] - 1) < 0.05
sys.exit(0 if ok else 1)
PY

# --- bad input
TINY=build/ref/tiny_fp32_model.bin
$PYTHON -c 'print(" ".join(["1"] * 32))' >"$work/long.txt"
expect_error "a prompt longer than maxT allows" \
    "line 1: a prompt of 32 tokens; the model's maxT 32 leaves room for at most 31" \
    $GEN -e $TINY -i "$work/long.txt" -ids 1
echo "5 263 7" >"$work/outside.txt"
expect_error "a token id outside the vocabulary" "line 1: '263' is not a token id of the model (0..262)" \
    $GEN -e $TINY -i "$work/outside.txt" -ids 1
: >"$work/empty.txt"
expect_error "an empty prompt file" "no prompts (an empty file)" $GEN -e $TINY -i "$work/empty.txt" -ids 1
expect_error "a cache too small for one sequence" "cannot hold one sequence of 17 positions" \
    $GEN -e $TINY -i "$work/three.txt" -ids 1 -g 6 -bs 4 -km 0.001
expect_error "text without a tokenizer file" "none.bin not found: text needs it to be encoded" \
    $GEN -e $TINY -i "$work/three.txt" -tf "$work/none.bin"
printf 'ROMEO\nab\377c\n' >"$work/not_utf8.txt"
expect_error "text that is not UTF-8" "line 2 is not UTF-8 text (byte 2)" \
    $GEN -e $TINY -i "$work/not_utf8.txt" -tf "$work/bytes_tokenizer.bin"
expect_error "an unknown quantisation" "-wq int4: expected none, int8 or nf4" \
    $GEN -e $TINY -i "$work/three.txt" -ids 1 -wq int4
expect_error "-wm without -wq" "-wm $work/x.bin: needs -wq int8 or nf4" $GEN -e $TINY -i "$work/three.txt" -ids 1 \
    -wm "$work/x.bin"
expect_error "an unknown flag" "unknown flag -wx" $GEN -e $TINY -i "$work/three.txt" -ids 1 -wx 1

echo "test_generate: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
