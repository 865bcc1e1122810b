#!/usr/bin/env bash
# dev/test/test_hf.sh: Hugging Face interop (scripts/hf_import.py, scripts/hf_export.py; doc/formats.md) against
# transformers, on the CPU backend (FP32 build), nothing downloaded. For GPT-2, llama (2 key/value heads of 4, own
# lm_head) and Mixtral (that llama with top-2 of 4 SwiGLU experts in every layer), each a small random model that
# transformers builds and saves, and a DeepSeek-V3-style model without MLA (a dense layer, then 2 MoE layers of top-2
# of 8 experts in 2 of 4 groups, the correction bias, a shared expert and a routed scale) drawn in its published
# tensor names (dev/test/hf_reference.py):
#   - imported, the C trainer's logits, loss, every gradient and 10 AdamW steps are transformers' (test_gpt, or
#     test_moe with every routing choice, against a debug state that transformers wrote; for DeepSeek-V3, whose class
#     the pinned transformers lacks, hf_reference.py's own forward from its published modelling code; FP32
#     tolerances of test_gpt.cu);
#   - trained 10 steps by the trainer on a data shard and exported, transformers loads it with its class and its
#     logits, gradients and steps are again the trainer's;
#   - imported, exported and imported again: bit-identical model files; exported with --tokenizer (a Hugging Face
#     directory, or the project's tokenizer file), the tokenizer loads from the export and encodes as the source's;
#   - generate's BPE encoder of text prompts (llmc/bpe_encoder.h) encodes as the tokenizers package's;
#   - a feature the trainers lack (a top-1 Mixtral, Qwen2-MoE's shared-expert gate and DeepSeek's softmax scores
#     among them), a missing tensor, a
#     shape that contradicts the config and an MoE model file with no Hugging Face class are refused with one line.
# The Python tools' commands run in two batches, each one process (dev/test/hf_reference.py batch): loading torch and
# transformers again for each was most of the script's time.
# Needs build/train_gpt_fp32, build/test_gpt_fp32, build/train_moe_fp32, build/test_moe_fp32, build/test_host_utils
# and .venv/hf
# (scripts/install_deps.sh). Run from anywhere:
#   dev/test/test_hf.sh
set -u
cd "$(dirname "$0")/../.."
HF=.venv/hf/bin/python
. dev/test/cli_common.sh
export TRANSFORMERS_VERBOSITY=error HF_HUB_OFFLINE=1

$PYTHON train_gpt.py --write-shard "$work/train.bin" --shard-tokens 4096 --V 263 --seed 7 >/dev/null ||
    { echo "cannot write a data shard"; exit 1; }
# batch NAME: the commands of $work/NAME.commands (`LOG COMMAND ARG...`: hf_reference.py's modes, import, export) in one
# Python process (dev/test/hf_reference.py batch), each one's output in its LOG, whose last line is its status
batch() {
    $HF dev/test/hf_reference.py batch "$work/$1.commands" >"$work/$1.log" 2>&1 || fail "$1: $(tail -2 "$work/$1.log")"
}
# ran LOG WHAT: the batch's command of LOG succeeded
ran() {
    if [ "$(tail -1 "$1" 2>/dev/null)" = "status: 0" ]; then return 0; fi
    fail "$2: $(tail -1 "$1" 2>/dev/null)"
    return 1
}
# against_transformers NAME: test_gpt (test_moe) holds the trainer to transformers' debug state $work/NAME, which the
# batch's command of $work/NAME.state wrote
against_transformers() {
    ran "$work/$1.state" "$1: transformers' reference" || return
    if "$TEST" "$work/$1" >"$work/$1.log" 2>&1; then pass; else
        fail "$1: the trainer differs from transformers: $(grep -E 'FAIL' "$work/$1.log" | head -3)"; fi
    grep -E "^OK   (logits|steps)" "$work/$1.log" | sed "s/^/  $1: /"
}
families() {  # FAMILY: its trainer, test program and training flags (the MoE families are train_moe's, dropless)
    TRAIN=build/train_gpt_fp32 TEST=build/test_gpt_fp32 TRAIN_FLAGS=()
    case $1 in
    mixtral | deepseek_v3) TRAIN=build/train_moe_fp32 TEST=build/test_moe_fp32 TRAIN_FLAGS=(-cf 0) ;;
    esac
}
FAMILIES=(gpt2 llama mixtral deepseek_v3)

# the random models; each imported, its debug state from transformers, exported and imported again
{
    echo "$work/random.out random gpt2 $work/gpt2 llama $work/llama mixtral $work/mixtral deepseek_v3 $work/deepseek_v3"
    for f in "${FAMILIES[@]}"; do
        echo "$work/$f.import import $work/$f $work/$f.bin"
        echo "$work/${f}_imported.state state $work/$f $work/$f.bin $work/${f}_imported"
        echo "$work/$f.export export $work/$f.bin $work/${f}_exported"
        echo "$work/$f.again import $work/${f}_exported $work/${f}_again.bin"
    done
} >"$work/imports.commands"
batch imports
ran "$work/random.out" "random models"
for family in "${FAMILIES[@]}"; do
    families $family
    ran "$work/$family.import" "$family: import" && against_transformers "${family}_imported"
    ran "$work/$family.export" "$family: export" && ran "$work/$family.again" "$family: import of the export" &&
        if cmp -s "$work/$family.bin" "$work/${family}_again.bin"; then pass; else
            fail "$family: import, export and import again changed the model file"; fi
    # trained by the trainer, then (below) exported and held to transformers again
    "$TRAIN" -e "$work/$family.bin" -i "$work/train.bin" -j "" -t 16 -b 2 -x 10 -n 10 -v 0 -s 0 -l 1e-3 \
        "${TRAIN_FLAGS[@]}" -o "$work/${family}_run" >"$work/${family}_run.log" 2>&1 ||
        fail "$family: training: $(tail -2 "$work/${family}_run.log")"
done

# --- tokenizers, built by the tokenizers package here: a byte-level BPE of 263 tokens saved as a Hugging Face
# directory; and byte-level BPEs written as the project's tokenizer file (a trainer's -tf file, doc/formats.md
# "Tokenizer": its pieces' bytes in id order, the end-of-text token last) beside the package's own JSON, one of 262
# pieces for the export and one of up to 420 for generate's BPE encoder, trained on text with capitals, digits,
# contractions, punctuation, runs of spaces and tabs, and non-ASCII letters, digits and symbols; with the ids the
# package's encoder gives texts that second BPE was not trained on
$HF - "$work/tokenizer" "$work/bpe_tokenizer.bin" "$work/encoder.bin" "$work/encoder_texts.txt" <<'PY' \
    >"$work/encoder.expected" 2>"$work/encoder.err" || fail "tokenizers: building them"
import struct, sys
import tokenizers, transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode
directory, files, texts_path = sys.argv[1], sys.argv[2:4], sys.argv[4]
bpe = tokenizers.ByteLevelBPETokenizer()
bpe.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, vocab_size=263, show_progress=False)
transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(directory)
byte_of = {c: b for b, c in bytes_to_unicode().items()}
corpora = (["the quick brown fox jumps over the lazy dog"],
           ["The quick brown fox's den: 42 foxes, 7 dogs; they'll jump!", "naïve café über straße — “quoted” ½ ٣٤",
            "I'm sure you've seen it's 3.14159 and 2718 ... ok?", "tabs\tand   spaces  end ", "ÆØÅ æøå ΑΒΓ αβγ 東京 123"])
for path, corpus, vocab_size in zip(files, corpora, (262, 420)):
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus * 8, vocab_size=vocab_size, show_progress=False)
    pieces = [bytes(byte_of[c] for c in token) for token, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    pieces.append(b"<|endoftext|>")
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240328, 2, len(pieces), len(pieces) - 1, *([0] * 252)))
        f.write(b"".join(bytes([len(p)]) + p for p in pieces))
    bpe.save(path + ".json")
texts = ["The brown dogs' den: 4242 foxes; we'll see!", "  leading spaces and trailing   ", "über-naïve cafés, “ok”",
         "it's 3.14 or 2718281?? — ½ ٣", "ΑΒΓ δέλτα 東京タワー", "\tx\t\ty", "'S 'LL 'd 've 're 'm 't", "<|endoftext|>x",
         "a", " ", "x  \t  y"]
open(texts_path, "w", encoding="utf-8").write("".join(t + "\n" for t in texts))
for t in texts:
    print(" ".join(str(i) for i in bpe.encode(t).ids))
print(f"{len(pieces)} pieces, {sum(len(bpe.encode(t).ids) for t in texts)} ids of {len(texts)} texts", file=sys.stderr)
PY

# the trained models exported with their debug states from transformers, and GPT-2 exported with each tokenizer
{
    for f in "${FAMILIES[@]}"; do
        echo "$work/$f.trained_export export $work/${f}_run/model_00000010.bin $work/${f}_trained"
        echo "$work/${f}_trained.state state $work/${f}_trained $work/${f}_run/model_00000010.bin $work/${f}_trained"
    done
    echo "$work/tokenized.export export $work/gpt2.bin $work/gpt2_tokenized --tokenizer $work/tokenizer"
    echo "$work/file_tokenized.export export $work/gpt2.bin $work/gpt2_file_tokenizer --tokenizer $work/bpe_tokenizer.bin"
} >"$work/exports.commands"
batch exports
for family in "${FAMILIES[@]}"; do
    families $family
    ran "$work/$family.trained_export" "$family: export of the trained model" && against_transformers "${family}_trained"
done

# --- tokenizers beside the export (--tokenizer): transformers loads the directory's from the exported directory and
# encodes a text into the source's ids; and the tokenizer file's, which encodes texts into the BPE's own ids
ran "$work/tokenized.export" "export with --tokenizer" && ran "$work/file_tokenized.export" "export with --tokenizer FILE" &&
    $HF - "$work/tokenizer" "$work/gpt2_tokenized" "$work/bpe_tokenizer.bin.json" "$work/gpt2_file_tokenizer" <<'PY' &&
import sys
import tokenizers, transformers
text = "the lazy fox jumps over the quick dog"
a, b = (transformers.AutoTokenizer.from_pretrained(d)(text)["input_ids"] for d in sys.argv[1:3])
print(f"  tokenizer: {len(a)} ids from the source, {len(b)} from the export")
bpe = tokenizers.Tokenizer.from_file(sys.argv[3])
hf = transformers.AutoTokenizer.from_pretrained(sys.argv[4])
texts = ["the lazy fox jumps over the quick dog", "quick brown  dogs, 42 foxes!\nthe end", "xyz\tthe"]
same = all(bpe.encode(t).ids == hf(t)["input_ids"] and hf.decode(hf(t)["input_ids"]) == t for t in texts)
print(f"  tokenizer file: {len(texts)} texts, {sum(len(hf(t)['input_ids']) for t in texts)} ids, the BPE's own; "
      f"end of text {hf.eos_token_id}")
sys.exit(0 if a == b and len(a) > 0 and same and hf.eos_token_id == 262 else 1)
PY
    pass || fail "an exported tokenizer encodes otherwise"

# --- generate's text prompts (llmc/bpe_encoder.h, through test_host_utils encode) against the tokenizers package's
# encoder, on the second BPE file above
build/test_host_utils encode "$work/encoder.bin" "$work/encoder_texts.txt" >"$work/encoder.got" 2>&1
if cmp -s "$work/encoder.got" "$work/encoder.expected"; then pass; else
    fail "the BPE encoder differs from the tokenizers package's: $(diff "$work/encoder.got" "$work/encoder.expected" |
        head -4 | tr '\n' ' ')"; fi
echo "  BPE encoder: $(cat "$work/encoder.err"), the tokenizers package's"

# --- refusals: one line naming what. The tools' main() runs on each bad input in one Python process (torch and
# transformers load once); each must end with its one line (SystemExit: what the command prints before exiting 1,
# which the last two cases check through the command line)
cp -r "$work/gpt2" "$work/bad"
$HF - "$work/bad/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["activation_function"] = "relu"; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/llama" "$work/sliding"
$HF - "$work/sliding/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["model_type"] = "mistral"; c["sliding_window"] = 16; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/llama" "$work/mla"
$HF - "$work/mla/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["model_type"] = "deepseek_v3"; c["kv_lora_rank"] = 32; json.dump(c, open(sys.argv[1], "w"))
PY
rm -rf "$work/missing" && mkdir -p "$work/missing" && cp "$work/llama/config.json" "$work/missing/"
$HF - "$work/llama/model.safetensors" "$work/missing/model.safetensors" <<'PY'
import sys
from safetensors.torch import load_file, save_file
t = load_file(sys.argv[1]); del t["model.layers.1.mlp.up_proj.weight"]; save_file(t, sys.argv[2])
PY
cp -r "$work/llama" "$work/shape"
$HF - "$work/shape/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["intermediate_size"] = 128; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/mixtral" "$work/top1"
$HF - "$work/top1/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["num_experts_per_tok"] = 1; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/mixtral" "$work/qwen"
$HF - "$work/qwen/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["model_type"] = "qwen2_moe"; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/deepseek_v3" "$work/ds_softmax"
$HF - "$work/ds_softmax/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["scoring_func"] = "softmax"; json.dump(c, open(sys.argv[1], "w"))
PY
cp -r "$work/llama" "$work/kv"
$HF - "$work/kv/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1])); c["num_key_value_heads"] = 3; json.dump(c, open(sys.argv[1], "w"))
PY
$HF - "$work" <<'PY' >"$work/refusals.log" 2>&1
import os, sys
sys.path.insert(0, "scripts")
import hf_export, hf_import
w = sys.argv[1]
cases = [("relu", hf_import, ["bad"]), ("sliding", hf_import, ["sliding"]), ("mla", hf_import, ["mla"]),
         ("missing", hf_import, ["missing"]), ("shape", hf_import, ["shape"]), ("top1", hf_import, ["top1"]),
         ("qwen", hf_import, ["qwen"]), ("ds_softmax", hf_import, ["ds_softmax"]), ("kv", hf_import, ["kv"]),
         ("switch", hf_export, ["build/ref/moe_k1_cf0.5_fp32_model.bin", "switch_exported"])]
for name, tool, args in cases:
    paths = [a if os.path.sep in a else os.path.join(w, a) for a in args]
    try:
        tool.main(paths + ([os.path.join(w, "bad.bin")] if tool is hf_import else []))
        print(f"{name}: accepted")
    except SystemExit as e:
        print(f"{name}: {e}")
PY
refused() {  # CASE NAME EXPECTED: the case's one line holds EXPECTED
    if grep -qF -- "$3" <(grep "^$1: " "$work/refusals.log"); then pass; else
        fail "$2: $(grep "^$1: " "$work/refusals.log" || tail -2 "$work/refusals.log")"; fi
}
refused relu "an activation the trainers lack" "hf_import.py: error: $work/bad: activation 'relu': the GPT-2 kind's MLP is GELU (tanh)"
refused sliding "sliding-window attention" "sliding-window attention (sliding_window 16) is not a kind the trainers have"
refused mla "MLA" "multi-head latent attention (MLA"
refused missing "a missing tensor" "tensor model.layers.1.mlp.up_proj.weight is missing"
refused shape "a shape against the config" \
    "tensor model.layers.0.mlp.gate_proj.weight has shape (96, 64), the config says (128, 64)"
refused top1 "a top-1 Mixtral" "num_experts_per_tok 1: Mixtral renormalises its top-k gates"
refused qwen "Qwen2-MoE" "Qwen2-MoE's sigmoid shared_expert_gate"
refused ds_softmax "DeepSeek with softmax scores" "scoring_func 'softmax': DeepSeek-V3's scores are sigmoid"
refused kv "a shape the reference model refuses, said as the importer's" \
    "hf_import.py: error: $work/kv: 3 key/value heads do not divide the 4 heads"
refused switch "export of an MoE without a Hugging Face class" "hf_export.py: error: build/ref/moe_k1_cf0.5_fp32_model.bin: a gpt2-family MoE"
expect_error "no model directory" "cannot read $work/none/config.json" $HF scripts/hf_import.py "$work/none" "$work/bad.bin"
expect_error "export of no model file" "cannot read model file $work/none.bin" \
    $HF scripts/hf_export.py "$work/none.bin" "$work/none_exported"

echo "hf_interop: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
