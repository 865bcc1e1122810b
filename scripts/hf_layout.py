"""
scripts/hf_layout.py: how a Hugging Face causal language model maps onto switch.cu's model file (doc/formats.md,
"Hugging Face interop"), for scripts/hf_import.py and scripts/hf_export.py: reading a model directory (config.json and
model.safetensors, or a sharded set with its index) through the safetensors package, the checks of a config against
what the trainers implement, and each family's table of tensors in both directions. The model side is train_gpt.py's
reference model (GPT or Llama), whose file reader and writer are the project's own.
Families: gpt2 (GPT2LMHeadModel: Conv1D weights stored [in, out], transposed here) and llama (LlamaForCausalLM: q, k,
v and gate, up concatenated into the packed qkv and [gate | up]; Hugging Face's q and k rows are already in the
rotate-half order that the project's RoPE uses, so they are taken as they are).
Needs torch and safetensors (scripts/install_deps.sh makes build/hf-venv with both, and transformers for the tests).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_gpt as ref  # noqa: E402  (the reference model and its model-file reader and writer)


def fail(tool, message):
    """Bad input ends the run with one line on stderr and exit status 1."""
    raise SystemExit(f"{tool}: error: {message}")


def parser(tool, description):
    """argparse whose bad flag gets one line (no usage block) and exit status 1, as any other bad input."""

    class OneLineParser(argparse.ArgumentParser):
        def error(self, message):
            fail(tool, message)

    return OneLineParser(description=description)


def read_hf_directory(tool, directory):
    """(config dict, {tensor name: fp32 tensor}) of a Hugging Face model directory."""
    from safetensors.torch import load_file

    config_path = os.path.join(directory, "config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except OSError as e:
        fail(tool, f"cannot read {config_path}: {e.strerror}")
    except json.JSONDecodeError as e:
        fail(tool, f"{config_path} is not JSON: {e}")
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            files = sorted(set(json.load(f).get("weight_map", {}).values()))
        if not files:
            fail(tool, f"{index_path} has no weight_map")
    else:
        files = ["model.safetensors"]
    tensors = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            fail(tool, f"{path} is missing (the model's weights: model.safetensors, or the index's shards)")
        try:
            tensors.update({k: v.float() for k, v in load_file(path).items()})
        except Exception as e:  # safetensors raises its own error types for a damaged file
            fail(tool, f"{path} is not a safetensors file the package reads: {e}")
    return config, tensors


def refuse_features(tool, config, where):
    """The model features the trainers do not have, each refused by name."""
    kind = config.get("model_type")
    if config.get("kv_lora_rank") or config.get("q_lora_rank"):
        fail(tool, f"{where}: multi-head latent attention (MLA: kv_lora_rank, q_lora_rank) is not a kind the trainers have")
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        fail(tool, f"{where}: sliding-window attention (sliding_window {config['sliding_window']}) is not a kind the "
                   "trainers have")
    if config.get("rope_scaling"):
        fail(tool, f"{where}: RoPE scaling ({config['rope_scaling']}) is not a kind the trainers have")
    if kind not in ("gpt2", "llama"):
        fail(tool, f"{where}: model_type {kind!r}: the importer reads the gpt2 and llama families")


def tensor(tool, tensors, name, shape, where):
    if name not in tensors:
        fail(tool, f"{where}: tensor {name} is missing")
    t = tensors[name]
    if tuple(t.shape) != tuple(shape):
        fail(tool, f"{where}: tensor {name} has shape {tuple(t.shape)}, the config says {tuple(shape)}")
    return t


def padded_rows(t, Vp):
    """A (V, C) embedding as the model file's (Vp, C): the rows past V zero."""
    out = torch.zeros(Vp, t.shape[1])
    out[: t.shape[0]] = t
    return out


def gpt2_from_hf(tool, config, tensors, where):
    """A train_gpt.py GPT holding a GPT2LMHeadModel's tensors (names with or without the 'transformer.' prefix)."""
    tensors = {k[len("transformer."):] if k.startswith("transformer.") else k: v for k, v in tensors.items()}
    C, L, NH, V, maxT = (int(config[k]) for k in ("n_embd", "n_layer", "n_head", "vocab_size", "n_positions"))
    if config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        fail(tool, f"{where}: activation {config['activation_function']!r}: the GPT-2 kind's MLP is GELU (tanh)")
    if config.get("n_inner") not in (None, 4 * C):
        fail(tool, f"{where}: n_inner {config['n_inner']}: the GPT-2 kind's MLP is 4 * n_embd = {4 * C} wide")
    if abs(config.get("layer_norm_epsilon", ref.LN_EPS) - ref.LN_EPS) > 1e-12:
        fail(tool, f"{where}: layer_norm_epsilon {config['layer_norm_epsilon']}: the GPT-2 kind's LayerNorm eps is "
                   f"{ref.LN_EPS}")
    if not config.get("tie_word_embeddings", True) or config.get("scale_attn_by_inverse_layer_idx", False):
        fail(tool, f"{where}: an untied lm_head or attention scaled by layer: the GPT-2 kind has neither")
    if C % NH != 0:
        fail(tool, f"{where}: n_embd {C} is not a multiple of n_head {NH}")
    model = ref.GPT(ref.GPTConfig(maxT=maxT, V=V, L=L, NH=NH, C=C))
    with torch.no_grad():
        model.wte.weight.copy_(padded_rows(tensor(tool, tensors, "wte.weight", (V, C), where), model.config.Vp))
        model.wpe.weight.copy_(tensor(tool, tensors, "wpe.weight", (maxT, C), where))
        for i, block in enumerate(model.h):
            p = f"h.{i}."
            shapes = {"ln_1": C, "ln_2": C}
            for norm in shapes:
                getattr(block, norm).weight.copy_(tensor(tool, tensors, p + norm + ".weight", (C,), where))
                getattr(block, norm).bias.copy_(tensor(tool, tensors, p + norm + ".bias", (C,), where))
            # Conv1D stores [in, out]; the model file's Linear weights are [out, in]
            for module, name, n_in, n_out in ((block.attn.c_attn, "attn.c_attn", C, 3 * C),
                                              (block.attn.c_proj, "attn.c_proj", C, C),
                                              (block.mlp.c_fc, "mlp.c_fc", C, 4 * C),
                                              (block.mlp.c_proj, "mlp.c_proj", 4 * C, C)):
                module.weight.copy_(tensor(tool, tensors, p + name + ".weight", (n_in, n_out), where).t())
                module.bias.copy_(tensor(tool, tensors, p + name + ".bias", (n_out,), where))
        model.ln_f.weight.copy_(tensor(tool, tensors, "ln_f.weight", (C,), where))
        model.ln_f.bias.copy_(tensor(tool, tensors, "ln_f.bias", (C,), where))
    return model


def llama_from_hf(tool, config, tensors, where):
    """A train_gpt.py Llama holding a LlamaForCausalLM's tensors."""
    C, L, NH, V, H = (int(config[k]) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "vocab_size", "intermediate_size"))
    NKV = int(config.get("num_key_value_heads") or NH)
    maxT = int(config.get("max_position_embeddings", 2048))
    if config.get("hidden_act", "silu") != "silu":
        fail(tool, f"{where}: hidden_act {config['hidden_act']!r}: the llama kind's FFN is SwiGLU (silu)")
    if config.get("attention_bias") or config.get("mlp_bias"):
        fail(tool, f"{where}: biases in the attention or the MLP: the llama kind has none")
    if C % NH != 0 or config.get("head_dim", C // NH) != C // NH:
        fail(tool, f"{where}: head_dim {config.get('head_dim')} is not hidden_size / num_attention_heads = {C // NH}")
    tied = bool(config.get("tie_word_embeddings", False))
    theta = ref.fp32(float(config.get("rope_theta", ref.ROPE_THETA)))
    eps = ref.fp32(float(config.get("rms_norm_eps", ref.NORM_EPS)))
    ref.check_llama_shape(NH, C, NKV, theta, H, eps, int(tied), where)
    cfg = ref.LlamaConfig(maxT=maxT, V=V, L=L, NH=NH, C=C, NKV=NKV, rope_theta=theta, H=H, norm_eps=eps, tied=tied)
    model = ref.Llama(cfg)
    HS = C // NH
    with torch.no_grad():
        model.wte.weight.copy_(padded_rows(tensor(tool, tensors, "model.embed_tokens.weight", (V, C), where), cfg.Vp))
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}."
            block.ln_1.weight.copy_(tensor(tool, tensors, p + "input_layernorm.weight", (C,), where))
            block.ln_2.weight.copy_(tensor(tool, tensors, p + "post_attention_layernorm.weight", (C,), where))
            q = tensor(tool, tensors, p + "self_attn.q_proj.weight", (NH * HS, C), where)
            k = tensor(tool, tensors, p + "self_attn.k_proj.weight", (NKV * HS, C), where)
            v = tensor(tool, tensors, p + "self_attn.v_proj.weight", (NKV * HS, C), where)
            block.attn.c_attn.weight.copy_(torch.cat((q, k, v)))
            block.attn.c_proj.weight.copy_(tensor(tool, tensors, p + "self_attn.o_proj.weight", (C, C), where))
            gate = tensor(tool, tensors, p + "mlp.gate_proj.weight", (H, C), where)
            up = tensor(tool, tensors, p + "mlp.up_proj.weight", (H, C), where)
            block.mlp.c_fc.weight.copy_(torch.cat((gate, up)))
            block.mlp.c_proj.weight.copy_(tensor(tool, tensors, p + "mlp.down_proj.weight", (C, H), where))
        model.ln_f.weight.copy_(tensor(tool, tensors, "model.norm.weight", (C,), where))
        if not tied:
            model.lm_head.weight.copy_(padded_rows(tensor(tool, tensors, "lm_head.weight", (V, C), where), cfg.Vp))
    return model


def model_from_hf(tool, config, tensors, where):
    refuse_features(tool, config, where)
    build = gpt2_from_hf if config["model_type"] == "gpt2" else llama_from_hf
    try:
        return build(tool, config, tensors, where)
    except KeyError as e:
        fail(tool, f"{where}: config.json lacks {e}")


def hf_from_model(model):
    """(config dict, {Hugging Face tensor name: tensor}) of a train_gpt.py GPT or Llama: the inverse of model_from_hf
    (the padded vocabulary rows dropped)."""
    c = model.config
    sd = {}
    if isinstance(c, ref.LlamaConfig):
        HS = c.C // c.NH
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": c.V,
                  "hidden_size": c.C, "intermediate_size": c.H, "num_hidden_layers": c.L,
                  "num_attention_heads": c.NH, "num_key_value_heads": c.NKV, "max_position_embeddings": c.maxT,
                  "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_theta, "tie_word_embeddings": c.tied,
                  "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32"}
        sd["model.embed_tokens.weight"] = model.wte.weight[: c.V]
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}."
            sd[p + "input_layernorm.weight"] = block.ln_1.weight
            sd[p + "post_attention_layernorm.weight"] = block.ln_2.weight
            q, k, v = block.attn.c_attn.weight.split([c.NH * HS, c.NKV * HS, c.NKV * HS])
            sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = q, k
            sd[p + "self_attn.v_proj.weight"] = v
            sd[p + "self_attn.o_proj.weight"] = block.attn.c_proj.weight
            sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = block.mlp.c_fc.weight.split(c.H)
            sd[p + "mlp.down_proj.weight"] = block.mlp.c_proj.weight
        sd["model.norm.weight"] = model.ln_f.weight
        sd["lm_head.weight"] = (model.wte.weight if c.tied else model.lm_head.weight)[: c.V]
    else:
        config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": c.V, "n_embd": c.C,
                  "n_layer": c.L, "n_head": c.NH, "n_positions": c.maxT, "n_ctx": c.maxT, "n_inner": None,
                  "activation_function": "gelu_new", "layer_norm_epsilon": ref.LN_EPS, "tie_word_embeddings": True,
                  "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": c.V - 1,
                  "eos_token_id": c.V - 1, "torch_dtype": "float32"}
        sd["transformer.wte.weight"] = model.wte.weight[: c.V]
        sd["transformer.wpe.weight"] = model.wpe.weight
        for i, block in enumerate(model.h):
            p = f"transformer.h.{i}."
            for norm in ("ln_1", "ln_2"):
                sd[p + norm + ".weight"] = getattr(block, norm).weight
                sd[p + norm + ".bias"] = getattr(block, norm).bias
            for module, name in ((block.attn.c_attn, "attn.c_attn"), (block.attn.c_proj, "attn.c_proj"),
                                 (block.mlp.c_fc, "mlp.c_fc"), (block.mlp.c_proj, "mlp.c_proj")):
                sd[p + name + ".weight"] = module.weight.t()
                sd[p + name + ".bias"] = module.bias
        sd["transformer.ln_f.weight"] = model.ln_f.weight
        sd["transformer.ln_f.bias"] = model.ln_f.bias
        sd["lm_head.weight"] = model.wte.weight[: c.V]
    return config, {k: v.detach().float().contiguous().clone() for k, v in sd.items()}
