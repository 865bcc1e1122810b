"""
scripts/hf_export.py: a switch.cu model file -> a Hugging Face model directory (doc/formats.md, "Hugging Face interop").
  build/hf-venv/bin/python scripts/hf_export.py MODEL.bin DIR
MODEL.bin is a GPT-2 or llama model file, or an MoE one of the Mixtral kind (llama experts in every layer, softmax
top-k with k >= 2, nothing else; fp32 or bf16: a trainer's checkpoint model_%08d.bin, or an imported one). DIR gets
config.json and model.safetensors, written by transformers' save_pretrained from GPT2LMHeadModel, LlamaForCausalLM
or MixtralForCausalLM, so that AutoModelForCausalLM.from_pretrained(DIR) loads it (scripts/hf_layout.py has the
tables).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_layout  # noqa: E402

TOOL = "hf_export.py"


def main(argv):
    p = hf_layout.parser(TOOL, "switch.cu model file -> Hugging Face model directory")
    p.add_argument("model", help="the model file (GPT-2 or llama family, or a Mixtral-kind MoE)")
    p.add_argument("directory", help="the directory to write")
    args = p.parse_args(argv)
    import transformers

    model = hf_layout.read_model(TOOL, args.model)
    config, tensors = hf_layout.hf_from_model(model)
    kind = config.pop("model_type")
    config.pop("architectures")
    hf_config = transformers.AutoConfig.for_model(kind, **config)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    if missing or unexpected:  # an exporter out of step with transformers' classes, not a bad input
        hf_layout.fail(TOOL, f"transformers' {type(hf_model).__name__} wants {missing} and does not take {unexpected}")
    hf_model.save_pretrained(args.directory, safe_serialization=True)
    print(f"{TOOL}: {args.model} -> {args.directory} ({type(hf_model).__name__})")


if __name__ == "__main__":
    main(sys.argv[1:])
