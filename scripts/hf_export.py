"""
scripts/hf_export.py: a switch.cu model file -> a Hugging Face model directory (doc/formats.md, "Hugging Face interop").
  build/hf-venv/bin/python scripts/hf_export.py MODEL.bin DIR [--tokenizer SRC]
MODEL.bin is a GPT-2 or llama model file, or an MoE one of the Mixtral kind (llama experts in every layer, softmax
top-k with k >= 2, nothing else) or of the DeepSeek-V3 kind (llama experts with sigmoid scores in every layer after
the dense ones; fp32 or bf16: a trainer's checkpoint model_%08d.bin, or an imported one). DIR gets config.json and
model.safetensors, written by transformers' save_pretrained from GPT2LMHeadModel, LlamaForCausalLM or
MixtralForCausalLM, so that AutoModelForCausalLM.from_pretrained(DIR) loads it, or for DeepSeek-V3, whose class the
pinned transformers lacks, in DeepseekV3ForCausalLM's config fields and tensor names without MLA
(scripts/hf_layout.py has the tables). --tokenizer SRC copies the tokenizer files of the Hugging Face directory SRC
(the one the model was imported from, or a `huggingface-cli download gpt2` directory for a GPT-2 vocabulary) beside
them, checked to fit the model's vocabulary, so that AutoTokenizer.from_pretrained(DIR) loads too; the model file
itself holds no tokenizer.
"""
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_layout  # noqa: E402

TOOL = "hf_export.py"


def main(argv):
    p = hf_layout.parser(TOOL, "switch.cu model file -> Hugging Face model directory")
    p.add_argument("model", help="the model file (GPT-2 or llama family, or a Mixtral- or DeepSeek-V3-kind MoE)")
    p.add_argument("directory", help="the directory to write")
    p.add_argument("--tokenizer", metavar="SRC", help="a Hugging Face directory whose tokenizer files go beside it")
    args = p.parse_args(argv)
    import transformers

    model = hf_layout.read_model(TOOL, args.model)
    config, tensors = hf_layout.hf_from_model(model)
    tokenizer_files = tokenizer_files_of(args.tokenizer, model.config.V) if args.tokenizer else []
    if config["model_type"] in DIRECT_FAMILIES:
        hf_layout.write_hf_directory(args.directory, config, tensors)
        written = config["architectures"][0] + "'s layout"
    else:
        kind = config.pop("model_type")
        config.pop("architectures")
        hf_config = transformers.AutoConfig.for_model(kind, **config)
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
        missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
        if missing or unexpected:  # an exporter out of step with transformers' classes, not a bad input
            hf_layout.fail(TOOL, f"transformers' {type(hf_model).__name__} wants {missing} and does not take "
                                 f"{unexpected}")
        hf_model.save_pretrained(args.directory, safe_serialization=True)
        written = type(hf_model).__name__
    for path in tokenizer_files:
        shutil.copyfile(path, os.path.join(args.directory, os.path.basename(path)))
    tokenizer = f", the tokenizer of {args.tokenizer}" if tokenizer_files else ""
    print(f"{TOOL}: {args.model} -> {args.directory} ({written}{tokenizer})")


# families whose class the pinned transformers (4.45.2) lacks: their config.json and model.safetensors are written
# directly in the layout of the published checkpoints (hf_layout.write_hf_directory)
DIRECT_FAMILIES = ("deepseek_v3",)


# the files of a Hugging Face tokenizer (a fast tokenizer's tokenizer.json, a BPE's vocab.json and merges.txt, a
# SentencePiece model, and their configs)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_files_of(source, V):
    """The tokenizer files of the directory `source`, refused unless transformers loads a tokenizer from them whose
    vocabulary fits the model's V tokens."""
    import transformers

    files = [os.path.join(source, name) for name in TOKENIZER_FILES if os.path.exists(os.path.join(source, name))]
    if not files:
        hf_layout.fail(TOOL, f"--tokenizer {source}: no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    except Exception as e:  # transformers raises many kinds for a directory it cannot read as a tokenizer
        hf_layout.fail(TOOL, f"--tokenizer {source}: transformers reads no tokenizer from it: {e}")
    if len(tokenizer) > V:
        hf_layout.fail(TOOL, f"--tokenizer {source}: {len(tokenizer)} tokens, more than the model's {V}")
    return files


if __name__ == "__main__":
    main(sys.argv[1:])
