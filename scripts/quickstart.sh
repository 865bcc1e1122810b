#!/usr/bin/env bash
# scripts/quickstart.sh: the project in one command, on the CPU backend. Installs what is missing, prepares
# TinyShakespeare with the byte-level tokenizer (offline, data/tinyshakespeare.py falls back to the King James
# Bible of Debian's bible-kjv, under its own name), builds the trainer (for the GPU when one is present, else the
# CPU backend's FP32 build), trains a small Switch-MoE GPT
# (4 layers, C=256, 4 experts, top-1, MoE every other layer) for 300 steps on 2 cores (a few minutes here),
# sampling text before and after and validating with the expert loads, plots the loss curve, and continues three
# prompts with generate (doc/inference.md: a paged KV cache, the prompts batched).
#   scripts/quickstart.sh          the MoE model
#   scripts/quickstart.sh gpt      the dense GPT of the same size
#   scripts/quickstart.sh deepseek a small DeepSeek-shape MoE (llama blocks; 16 fine-grained SwiGLU experts, top-4,
#                                  and a shared expert; sigmoid scores with routed scale 2.5; dropless), trained
#                                  twice (150 steps of 4x128 tokens each): with aux-loss-free balancing (-rb, no
#                                  balance loss), then with the Switch loss instead; one plot compares their expert
#                                  loads (doc/moe.md, "Telemetry"); 3 minutes here
#   scripts/quickstart.sh lora     pre-trains the dense GPT (200 steps), then fine-tunes it with LoRA (-ft lora, the
#                                  model frozen) on the shipped instruction sample, the loss on the responses only
#                                  (data/instructions.py's loss masks); greedy answers to four prompts before and
#                                  after (the merged model, -fm), both runs' losses in one plot
# Log, checkpoint and loss.png go to build/quickstart_moe/ (or build/quickstart_gpt/, build/quickstart_deepseek/:
# its runs in bias/ and switch/; build/quickstart_lora/: pretrain/, lora/ and the merged model).
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-moe}
case "$model" in
    moe) moe_flags=(-ne 4 -tk 1 -me 2 -cf 1.25 -cfe 2.0) ;;
    gpt) moe_flags=() ;;
    deepseek | lora) ;;
    *) echo "quickstart.sh: unknown model '$model' (expected moe, gpt, deepseek or lora)" >&2; exit 1 ;;
esac
# the GPU build where a GPU answers, else the CPU backend's (the lora quick start's is the GPT trainer)
program=${model/deepseek/moe}
program=${program/lora/gpt}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    trainer=./train_$program
    generator=./generate
else
    trainer=build/train_${program}_fp32
    generator=build/generate_fp32
fi
scripts/install_deps.sh
/usr/bin/python3 data/tinyshakespeare.py --tokenizer bytes
data=data/tinyshakespeare/tinyshakespeare_bytes
tokenizer=data/tinyshakespeare/bytes_tokenizer.bin
if [ ! -e "${data}_train.bin" ]; then
    data=data/fallback_kjv/fallback_kjv_bytes
    tokenizer=data/fallback_kjv/bytes_tokenizer.bin
fi
make -s "$trainer"
out=build/quickstart_$model
rm -rf "$out"
if [ "$model" = deepseek ]; then
    mkdir -p "$out"
    # the shape of ds64 (doc/moe.md, "Descriptors") at a quick start's size: 4 layers of C=256, 2 key/value heads;
    # the bias moves by 0.01 per step rather than ds64's 0.001, so that 150 steps show what it does
    shape=(-e d4 -ev 257 -et 128 -sd 1 -arch llama -kv 2 -ne 16 -tk 4 -me 1 -eh 64 -se 1 -seh 128 -rs sigmoid
           -rsf 2.5 -cf 0)
    run=(-i "${data}_train.bin" -j "${data}_val.bin" -tf "$tokenizer" -b 4 -t 128 -x 150 -l 2e-3 -u 20 -q 0.1 -c 0.1
         -v 50 -m 4 -s 0 -g 0 -n 0)
    "$trainer" "${shape[@]}" "${run[@]}" -rb 0.01 -ra 0 -rz 0 -o "$out/bias"
    "$trainer" "${shape[@]}" "${run[@]}" -rb 0 -ra 0.01 -rz 0.001 -o "$out/switch"
    /usr/bin/python3 scripts/plot_log.py -o "$out/loss.png" --title "aux-loss-free balancing (bias) vs the Switch loss" \
        "$out/bias" "$out/switch"
    echo "quickstart: loss curves and expert loads in $out/loss.png"
    exit 0
fi
if [ "$model" = lora ]; then
    make -s "$generator"
    mkdir -p "$out"
    "$trainer" -e d4 -ev 257 -et 128 -sd 1 -i "${data}_train.bin" -j "${data}_val.bin" -tf "$tokenizer" -b 8 -t 128 \
        -x 200 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 100 -m 8 -s 0 -o "$out/pretrain" -n 200 -nk 1
    base=$out/pretrain/model_00000200.bin
    /usr/bin/python3 data/instructions.py data/instructions_sample.jsonl --out-dir "$out/instructions" \
        --tokenizer bytes >/dev/null
    # questions of the sample's four kinds, none of them in it
    printf '%s\n' "What is 23 plus 41?" "How many letters are in 'planet'?" "What is the capital of Italy?" \
        "Reverse the word 'stone'." >"$out/prompts.txt"
    # each prompt beside its answer (generate prints one line per sample, in the prompts' order)
    answers() {
        "$generator" -e "$1" -i "$out/prompts.txt" -tf "$tokenizer" -g 40 -temp 0 -sn 1 >"$out/answers.txt" \
            2>"$out/generate.log" || { cat "$out/generate.log" >&2; exit 1; }
        grep -v '^$' "$out/answers.txt" | paste -d '|' "$out/prompts.txt" - | sed 's/|/  ->  /'
        echo
    }
    echo "quickstart: the pre-trained model's answers (greedy)"
    answers "$base"
    "$trainer" -e "$base" -ft lora -fr 16 -fs 32 -fw qkv,proj,fc,fc_proj -i "$out/instructions/train.bin" \
        -j "$out/instructions/val.bin" -tf "$tokenizer" -b 8 -t 64 -x 300 -l 3e-3 -u 20 -v 100 -m 4 -s 0 \
        -o "$out/lora" -fm "$out/merged.bin"
    echo "quickstart: the fine-tuned model's answers (greedy; the adapter merged into the model)"
    answers "$out/merged.bin"
    /usr/bin/python3 scripts/plot_log.py -o "$out/loss.png" --title "pre-training, then LoRA on instructions" \
        "$out/pretrain" "$out/lora"
    echo "quickstart: both runs' losses in $out/loss.png"
    exit 0
fi
"$trainer" -e d4 -ev 257 -et 128 -sd 1 "${moe_flags[@]}" -i "${data}_train.bin" -j "${data}_val.bin" -tf "$tokenizer" \
    -b 8 -t 128 -x 300 -l 2e-3 -u 20 -q 0.1 -c 0.1 -v 100 -m 8 -s 300 -g 200 -o "$out" -n 300 -nk 1
/usr/bin/python3 scripts/plot_log.py -o "$out/loss.png" "$out"
echo "quickstart: loss curve in $out/loss.png"
# the trained model continues three prompts, 4 samples each, in one batch through the paged KV cache
make -s "$generator"
printf 'ROMEO:\nFirst Citizen:\nKING HENRY:\n' >"$out/prompts.txt"
echo "quickstart: generate, 4 samples of 100 tokens after each of: $(tr '\n' '|' <"$out/prompts.txt")"
"$generator" -e "$out/model_00000300.bin" -i "$out/prompts.txt" -tf "$tokenizer" -g 100 -sn 4 -temp 0.8 -topk 40
