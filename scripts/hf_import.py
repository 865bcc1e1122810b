"""
scripts/hf_import.py: a Hugging Face model directory -> a switch.cu model file (doc/formats.md, "Hugging Face interop").
  build/hf-venv/bin/python scripts/hf_import.py DIR OUT.bin [--dtype float32|bfloat16]
DIR holds config.json and model.safetensors (or a sharded set with model.safetensors.index.json), as
`huggingface-cli download gpt2 --local-dir DIR` or save_pretrained leaves it. The gpt2, llama, mixtral and
deepseek_v3 (without MLA) families are read (scripts/hf_layout.py); a feature the trainers lack, a missing tensor or a
shape that contradicts the config is refused with one line. The model file is what train_gpt.py writes (train_moe.py
for mixtral and deepseek_v3, which train_moe runs dropless: -cf 0): fp32 (the default) or bf16.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_layout  # noqa: E402

TOOL = "hf_import.py"


def main(argv):
    p = hf_layout.parser(TOOL, "Hugging Face model directory -> switch.cu model file")
    p.add_argument("directory", help="the Hugging Face model directory")
    p.add_argument("out", help="the model file to write")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the file's payload")
    args = p.parse_args(argv)
    config, tensors = hf_layout.read_hf_directory(TOOL, args.directory)
    model = hf_layout.model_from_hf(TOOL, config, tensors, args.directory)
    hf_layout.write_model(model, args.out, args.dtype)
    print(f"{TOOL}: {args.directory} ({config['model_type']}, {sum(t.numel() for t in tensors.values())} values) -> "
          f"{args.out} ({args.dtype})")


if __name__ == "__main__":
    main(sys.argv[1:])
