"""
scripts/hf_export.py: a switch.cu model file -> a Hugging Face model directory (doc/formats.md, "Hugging Face interop").
  .venv/hf/bin/python scripts/hf_export.py MODEL.bin DIR [--tokenizer SRC]
MODEL.bin is a GPT-2 or llama model file, or an MoE one of the Mixtral kind (llama experts in every layer, softmax
top-k with k >= 2, nothing else) or of the DeepSeek-V3 kind (llama experts with sigmoid scores in every layer after
the dense ones; fp32 or bf16: a trainer's checkpoint model_%08d.bin, or an imported one). DIR gets config.json and
model.safetensors, written by transformers' save_pretrained from GPT2LMHeadModel, LlamaForCausalLM or
MixtralForCausalLM, so that AutoModelForCausalLM.from_pretrained(DIR) loads it, or for DeepSeek-V3, whose class the
pinned transformers lacks, in DeepseekV3ForCausalLM's config fields and tensor names without MLA
(scripts/hf_layout.py has the tables). The model file holds no tokenizer; --tokenizer SRC writes one beside it, so
that AutoTokenizer.from_pretrained(DIR) loads too, checked to fit the model's vocabulary: the tokenizer files of the
Hugging Face directory SRC (the one the model was imported from, or a `huggingface-cli download gpt2` directory), or
the project's tokenizer file SRC (a trainer's -tf: GPT-2's vocabulary or the byte level), converted. A model of GPT-2's
vocabulary (V = 50257) without --tokenizer gets data/tinyshakespeare/gpt2_tokenizer.bin's, the trainers' default,
when it is there.
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
    p.add_argument("--tokenizer", metavar="SRC", help="the tokenizer to write beside it: a Hugging Face directory's "
                   "tokenizer files, or the project's tokenizer file (doc/formats.md, \"Tokenizer\")")
    args = p.parse_args(argv)
    import transformers

    model = hf_layout.read_model(TOOL, args.model)
    config, tensors = hf_layout.hf_from_model(model)
    source = args.tokenizer
    if source is None and model.config.V == GPT2_VOCAB and os.path.exists(GPT2_TOKENIZER_FILE):
        source = GPT2_TOKENIZER_FILE  # GPT-2's vocabulary: the trainers' own GPT-2 tokenizer file, when it is there
    tokenizer_files, converted = [], None
    if source is not None and os.path.isdir(source):
        tokenizer_files = tokenizer_files_of(source, model.config.V)
    elif source is not None:
        converted = tokenizer_of_file(source, model.config.V)
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
    if converted is not None:
        converted.save_pretrained(args.directory)
    tokenizer = f", the tokenizer of {source}" if source is not None else ""
    if source is None and model.config.V == GPT2_VOCAB:
        print(f"{TOOL}: note: no {GPT2_TOKENIZER_FILE} (data/tinyshakespeare.py writes it) and no --tokenizer: "
              "no tokenizer files written")
    print(f"{TOOL}: {args.model} -> {args.directory} ({written}{tokenizer})")


# families whose class the pinned transformers (4.45.2) lacks: their config.json and model.safetensors are written
# directly in the layout of the published checkpoints (hf_layout.write_hf_directory)
DIRECT_FAMILIES = ("deepseek_v3",)


# GPT-2's vocabulary, and the file of it that the trainers read by default (-tf): a model of that vocabulary is
# exported with it when no --tokenizer says otherwise
GPT2_VOCAB = 50257
GPT2_TOKENIZER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "tinyshakespeare",
                                   "gpt2_tokenizer.bin")
# GPT-2's pre-tokenisation (tiktoken's r50k_base pattern), which the project's BPE vocabularies share
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def tokenizer_of_file(path, V):
    """A Hugging Face fast tokenizer of the project's tokenizer file (doc/formats.md, "Tokenizer": the pieces in id
    order and the end-of-text id), through transformers' TikTokenConverter: every piece but the end-of-text one is a
    mergeable rank equal to its id (GPT-2's vocabulary and the byte level are in merge order), split by GPT-2's
    pattern, and the end-of-text token is the special token after them. Refused unless the end-of-text token is the last
    id (as in both of the project's vocabularies) and the vocabulary fits the model's V tokens."""
    import base64
    import struct
    import tempfile

    import transformers
    from transformers.convert_slow_tokenizer import TikTokenConverter

    try:
        data = open(path, "rb").read()
    except OSError as e:
        hf_layout.fail(TOOL, f"--tokenizer {path}: cannot read it: {e.strerror}")
    if len(data) < 1024 or struct.unpack_from("<2i", data) != (20240328, 2):
        hf_layout.fail(TOOL, f"--tokenizer {path}: not a tokenizer file (magic 20240328, version 2) nor a directory")
    n, eot = struct.unpack_from("<2i", data, 8)
    pieces, at = [], 1024
    while at < len(data) and len(pieces) < n:
        pieces.append(data[at + 1 : at + 1 + data[at]])
        at += 1 + data[at]
    if len(pieces) != n or at != len(data):
        hf_layout.fail(TOOL, f"--tokenizer {path}: its header says {n} tokens, the file holds otherwise")
    if eot != n - 1:
        hf_layout.fail(TOOL, f"--tokenizer {path}: end-of-text token {eot}, not the last of its {n}: no Hugging Face "
                             "tokenizer keeps its ids")
    if n > V:
        hf_layout.fail(TOOL, f"--tokenizer {path}: {n} tokens, more than the model's {V}")
    with tempfile.NamedTemporaryFile("w", suffix=".tiktoken") as ranks:
        ranks.writelines(f"{base64.b64encode(piece).decode()} {i}\n" for i, piece in enumerate(pieces[:eot]))
        ranks.flush()
        special = pieces[eot].decode("utf-8", errors="replace")
        backend = TikTokenConverter(vocab_file=ranks.name, pattern=GPT2_PATTERN,
                                    additional_special_tokens=[special]).converted()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=special, eos_token=special)


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
