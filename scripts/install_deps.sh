#!/usr/bin/env bash
# scripts/install_deps.sh: installs what a fresh Debian machine lacks to build and test switch.cu on the
# CPU backend: Open MPI (mpirun, mpicxx), OpenBLAS (its OpenMP build), PCRE2, PyTorch for the reference
# model (Debian's python3-torch, CPU), and .venv/hf with transformers and safetensors for Hugging Face
# interop. The CUDA toolkit is expected under /usr/local/cuda.
# Run as root (or with sudo available); does nothing when everything is present. .ci/run calls it.
set -euo pipefail
need=()
command -v mpicxx >/dev/null 2>&1 && command -v mpirun >/dev/null 2>&1 || need+=(libopenmpi-dev openmpi-bin)
# OpenBLAS built for OpenMP: its threads are the same team that runs the kernels
compgen -G "/usr/lib/*/openblas-openmp/libopenblas.so" >/dev/null || need+=(libopenblas-openmp-dev)
# PCRE2: GPT-2's pre-tokenizer pattern (Unicode classes, a lookahead) for generate's text prompts (llmc/bpe_encoder.h)
[ -f /usr/include/pcre2.h ] || need+=(libpcre2-dev)
# the PyTorch references (train_gpt.py, train_moe.py), the data scripts and the plots: Debian's python under
# /usr/bin/python3 with torch, numpy, tqdm, matplotlib, pip; the King James Bible is the offline fallback corpus
/usr/bin/python3 -c "import torch, numpy" >/dev/null 2>&1 || need+=(python3-torch python3-numpy)
/usr/bin/python3 -c "import tqdm, matplotlib" >/dev/null 2>&1 || need+=(python3-tqdm python3-matplotlib)
/usr/bin/python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v bible >/dev/null 2>&1 || need+=(bible-kjv)
/usr/bin/python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
    sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    echo "install_deps: installing ${need[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# the GPT-2 tokenizer (tiktoken) and FineWeb's parquet files (pyarrow; before 18, which needs NumPy 2)
if ! /usr/bin/python3 -c "import tiktoken, pyarrow.parquet" >/dev/null 2>&1; then
    echo "install_deps: installing tiktoken and pyarrow for /usr/bin/python3"
    /usr/bin/python3 -m pip install -q --break-system-packages tiktoken "pyarrow<18"
fi
# Hugging Face interop (scripts/hf_import.py, scripts/hf_export.py, dev/test/test_hf.sh): transformers and safetensors,
# pinned, in a venv over Debian's python, PyTorch and NumPy (transformers 4.45.2 runs on Debian's PyTorch 1.13)
hf_venv="$(dirname "$0")/../.venv/hf"
if ! "$hf_venv/bin/python" -c "from importlib.metadata import version as v
assert (v('transformers'), v('safetensors')) == ('4.45.2', '0.4.5')" >/dev/null 2>&1; then
    echo "install_deps: making .venv/hf with transformers 4.45.2 and safetensors 0.4.5"
    /usr/bin/python3 -m venv --system-site-packages "$hf_venv"
    "$hf_venv/bin/python" -m pip install -q --disable-pip-version-check transformers==4.45.2 safetensors==0.4.5
fi
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
    echo "install_deps: the CUDA toolkit (nvcc, headers) is missing; install it under /usr/local/cuda" >&2
    exit 1
fi
