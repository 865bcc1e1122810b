"""
scripts/hf_layout.py: how a Hugging Face causal language model maps onto switch.cu's model file (doc/formats.md,
"Hugging Face interop"), for scripts/hf_import.py and scripts/hf_export.py: reading a model directory (config.json and
model.safetensors, or a sharded set with its index) through the safetensors package, the checks of a config against
what the trainers implement, and each family's table of tensors in both directions. The model side is train_gpt.py's
reference model (GPT or Llama), whose file reader and writer are the project's own.
Families: gpt2 (GPT2LMHeadModel: Conv1D weights stored [in, out], transposed here), llama (LlamaForCausalLM: q, k,
v and gate, up concatenated into the packed qkv and [gate | up]; Hugging Face's q and k rows are already in the
rotate-half order that the project's RoPE uses, so they are taken as they are) and mixtral (MixtralForCausalLM: the
llama trunk, and in every layer block_sparse_moe's router `gate` and experts' w1 (gate), w3 (up), w2 (down) as
train_moe.py's MoE layer: softmax top-k renormalised over the k, dropless, which the trainer runs with -cf 0) and
deepseek_v3 (DeepSeek-V3's MoE without MLA: DeepseekV3ForCausalLM's config fields and tensor names, with Llama's
attention, q_proj, k_proj, v_proj and o_proj, in place of multi-head latent attention; deepseek_from_hf says how its
routing maps onto train_moe.py's options).
Needs torch and safetensors (scripts/install_deps.sh makes build/hf-venv with both, and transformers for the tests).
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import train_gpt as ref  # noqa: E402  (the reference model and its model-file reader and writer)
import train_moe as moe_ref  # noqa: E402  (the MoE reference model, its reader and writer)


def fail(tool, message):
    """Bad input ends the run with one line on stderr and exit status 1."""
    raise SystemExit(f"{tool}: error: {message}")


def as_tool(tool, check, *args):
    """check(*args), one of the reference scripts' own checks or readers, its refusal said as the tool's one line."""
    try:
        return check(*args)
    except SystemExit as e:
        fail(tool, str(e).split(": error: ", 1)[-1])


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
    if kind == "qwen2_moe":
        fail(tool, f"{where}: Qwen2-MoE's sigmoid shared_expert_gate (and its attention biases) are not kinds the "
                   "trainers have")
    if kind not in ("gpt2", "llama", "mixtral", "deepseek_v3"):
        fail(tool, f"{where}: model_type {kind!r}: the importer reads the gpt2, llama, mixtral and deepseek_v3 "
                   "families")


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


def llama_shape(tool, config, H, where):
    """The train_gpt.py LlamaConfig fields of a llama-family config (FFN hidden size H), each checked."""
    C, L, NH, V = (int(config[k]) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"))
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
    as_tool(tool, ref.check_llama_shape, NH, C, NKV, theta, H, eps, int(tied), where)
    return dict(maxT=maxT, V=V, L=L, NH=NH, C=C, NKV=NKV, rope_theta=theta, norm_eps=eps, tied=tied)


def llama_trunk_from_hf(tool, model, tensors, where):
    """Everything of a llama-family model but its FFNs, from Hugging Face's names into `model` (train_gpt.py's
    Llama or train_moe.py's llama MoEGPT)."""
    c = model.config
    C, NH, NKV, V = c.C, c.NH, c.NKV, c.V
    HS = C // NH
    model.wte.weight.copy_(padded_rows(tensor(tool, tensors, "model.embed_tokens.weight", (V, C), where), c.Vp))
    for i, block in enumerate(model.h):
        p = f"model.layers.{i}."
        block.ln_1.weight.copy_(tensor(tool, tensors, p + "input_layernorm.weight", (C,), where))
        block.ln_2.weight.copy_(tensor(tool, tensors, p + "post_attention_layernorm.weight", (C,), where))
        q = tensor(tool, tensors, p + "self_attn.q_proj.weight", (NH * HS, C), where)
        k = tensor(tool, tensors, p + "self_attn.k_proj.weight", (NKV * HS, C), where)
        v = tensor(tool, tensors, p + "self_attn.v_proj.weight", (NKV * HS, C), where)
        block.attn.c_attn.weight.copy_(torch.cat((q, k, v)))
        block.attn.c_proj.weight.copy_(tensor(tool, tensors, p + "self_attn.o_proj.weight", (C, C), where))
    model.ln_f.weight.copy_(tensor(tool, tensors, "model.norm.weight", (C,), where))
    if not c.tied:
        model.lm_head.weight.copy_(padded_rows(tensor(tool, tensors, "lm_head.weight", (V, C), where), c.Vp))


def swiglu_from_hf(tool, mlp, tensors, gate, up, down, H, C, where):
    """A SwiGLU MLP's [gate | up] and down projections from three Hugging Face tensors."""
    mlp.c_fc.weight.copy_(torch.cat((tensor(tool, tensors, gate, (H, C), where),
                                     tensor(tool, tensors, up, (H, C), where))))
    mlp.c_proj.weight.copy_(tensor(tool, tensors, down, (C, H), where))


def llama_from_hf(tool, config, tensors, where):
    """A train_gpt.py Llama holding a LlamaForCausalLM's tensors."""
    H = int(config["intermediate_size"])
    cfg = ref.LlamaConfig(H=H, **llama_shape(tool, config, H, where))
    model = ref.Llama(cfg)
    with torch.no_grad():
        llama_trunk_from_hf(tool, model, tensors, where)
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}.mlp."
            swiglu_from_hf(tool, block.mlp, tensors, p + "gate_proj.weight", p + "up_proj.weight",
                           p + "down_proj.weight", H, cfg.C, where)
    return model


def mixtral_from_hf(tool, config, tensors, where):
    """A train_moe.py MoEGPT (llama family, an MoE layer in every block) holding a MixtralForCausalLM's tensors."""
    H, E, K = (int(config[k]) for k in ("intermediate_size", "num_local_experts", "num_experts_per_tok"))
    if K < 2 or K > E:
        fail(tool, f"{where}: num_experts_per_tok {K}: Mixtral renormalises its top-k gates to sum to 1, which the "
                   f"trainers' routing does for 2 <= k <= num_local_experts ({E}) (their top-1 gate is the probability)")
    if float(config.get("router_jitter_noise") or 0.0) != 0.0:
        fail(tool, f"{where}: router_jitter_noise {config['router_jitter_noise']}: Mixtral's jitter is not the "
                   "trainers' (-rj)")
    shape = llama_shape(tool, config, H, where)
    cfg = moe_ref.MoEConfig(E=E, topk=K, moe_every=1, H=H, arch="llama", dense_H=H, **shape)
    as_tool(tool, moe_ref.check_shape, cfg.maxT, cfg.V, cfg.L, cfg.NH, cfg.C, E, K, 1, H, where)
    model = moe_ref.MoEGPT(cfg)
    with torch.no_grad():
        llama_trunk_from_hf(tool, model, tensors, where)
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}.block_sparse_moe."
            block.moe.router.weight.copy_(tensor(tool, tensors, p + "gate.weight", (E, cfg.C), where))
            for e, expert in enumerate(block.moe.experts):
                q = f"{p}experts.{e}."
                swiglu_from_hf(tool, expert, tensors, q + "w1.weight", q + "w3.weight", q + "w2.weight", H, cfg.C,
                               where)
    return model


def deepseek_from_hf(tool, config, tensors, where):
    """A train_moe.py MoEGPT (llama family) holding a DeepSeek-V3-style model without MLA. Its attention is Llama's
    (q_proj, k_proj, v_proj, o_proj; rotate-half RoPE over the whole head). Its first_k_dense_replace layers have a
    dense SwiGLU MLP of intermediate_size, the others an MoE layer (moe_every 1 after them), whose routing is
    DeepSeek-V3's noaux_tc: sigmoid scores; e_score_correction_bias added for the choice only (the balancing bias,
    kept fixed unless the trainer runs with -rb); each token keeps topk_group of the n_group expert groups by the sum
    of their two best scores + bias (the model's expert groups; n_group 1: none), then its top-k; the chosen scores
    renormalised (norm_topk_prob) times routed_scaling_factor. The n_shared_experts shared experts are DeepSeek's one
    SwiGLU of n_shared_experts * moe_intermediate_size, which is their sum: one shared expert of that size here."""
    H, E, K, F = (int(config[k]) for k in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                                            "first_k_dense_replace"))
    dense_H = int(config["intermediate_size"])
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    n_shared = int(config.get("n_shared_experts") or 0)
    routed_scale = ref.fp32(float(config.get("routed_scaling_factor", 1.0)))
    HS = int(config["hidden_size"]) // int(config["num_attention_heads"])
    refusals = (
        (config.get("scoring_func", "sigmoid") != "sigmoid", f"scoring_func {config.get('scoring_func')!r}: "
         "DeepSeek-V3's scores are sigmoid"),
        (config.get("topk_method", "noaux_tc") != "noaux_tc", f"topk_method {config.get('topk_method')!r}: the "
         "importer reads DeepSeek-V3's noaux_tc (grouped top-k on the scores + e_score_correction_bias)"),
        (not config.get("norm_topk_prob", True), "norm_topk_prob false: the trainers renormalise the chosen sigmoid "
         "scores"),
        (int(config.get("moe_layer_freq") or 1) != 1, f"moe_layer_freq {config.get('moe_layer_freq')}: MoE layers "
         "every layer after the dense ones"),
        (bool(config.get("rope_interleave", False)), "interleaved RoPE (rope_interleave): the trainers' RoPE rotates "
         "halves"),
        (int(config.get("qk_nope_head_dim") or 0) != 0 or int(config.get("qk_rope_head_dim") or HS) != HS or
         int(config.get("v_head_dim") or HS) != HS, f"head sizes qk_nope_head_dim {config.get('qk_nope_head_dim')}, "
         f"qk_rope_head_dim {config.get('qk_rope_head_dim')}, v_head_dim {config.get('v_head_dim')}: the trainers' "
         f"heads are hidden_size / num_attention_heads = {HS}, RoPE over all of them"),
    )
    for refused, why in refusals:
        if refused:
            fail(tool, f"{where}: {why}")
    shape = llama_shape(tool, config, dense_H, where)
    expert_groups = groups if groups > 1 else 0
    cfg = moe_ref.MoEConfig(E=E, topk=K, moe_every=1, H=H, arch="llama", dense_H=dense_H, shared=int(n_shared > 0),
                            shared_H=n_shared * H, score="sigmoid", routed_scale=routed_scale, balance_bias=True,
                            first_dense=F, expert_groups=expert_groups, kept_groups=kept if expert_groups else 0,
                            **shape)
    as_tool(tool, moe_ref.check_shape, cfg.maxT, cfg.V, cfg.L, cfg.NH, cfg.C, E, K, 1, H, where)
    as_tool(tool, moe_ref.check_layers_and_groups, cfg.L, 1, F, E, K, "sigmoid", cfg.expert_groups, cfg.kept_groups,
            where)
    model = moe_ref.MoEGPT(cfg)
    with torch.no_grad():
        llama_trunk_from_hf(tool, model, tensors, where)
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}.mlp."
            if not cfg.is_moe(i):
                swiglu_from_hf(tool, block.mlp, tensors, p + "gate_proj.weight", p + "up_proj.weight",
                               p + "down_proj.weight", dense_H, cfg.C, where)
                continue
            block.moe.router.weight.copy_(tensor(tool, tensors, p + "gate.weight", (E, cfg.C), where))
            block.moe.balance_bias.copy_(tensor(tool, tensors, p + "gate.e_score_correction_bias", (E,), where))
            for e, expert in enumerate(block.moe.experts):
                q = f"{p}experts.{e}."
                swiglu_from_hf(tool, expert, tensors, q + "gate_proj.weight", q + "up_proj.weight",
                               q + "down_proj.weight", H, cfg.C, where)
            if n_shared:
                q = p + "shared_experts."
                swiglu_from_hf(tool, block.moe.shared[0], tensors, q + "gate_proj.weight", q + "up_proj.weight",
                               q + "down_proj.weight", n_shared * H, cfg.C, where)
    return model


def model_from_hf(tool, config, tensors, where):
    refuse_features(tool, config, where)
    build = {"gpt2": gpt2_from_hf, "llama": llama_from_hf, "mixtral": mixtral_from_hf,
             "deepseek_v3": deepseek_from_hf}[config["model_type"]]
    try:
        return build(tool, config, tensors, where)
    except KeyError as e:
        fail(tool, f"{where}: config.json lacks {e}")


def llama_trunk_to_hf(model, config, sd):
    """The inverse of llama_trunk_from_hf: the llama config's trunk fields into `config`, its tensors into `sd`."""
    c = model.config
    HS = c.C // c.NH
    config.update({"vocab_size": c.V, "hidden_size": c.C, "num_hidden_layers": c.L, "num_attention_heads": c.NH,
                   "num_key_value_heads": c.NKV, "max_position_embeddings": c.maxT, "rms_norm_eps": c.norm_eps,
                   "rope_theta": c.rope_theta, "tie_word_embeddings": c.tied, "hidden_act": "silu",
                   "attention_bias": False, "torch_dtype": "float32"})
    sd["model.embed_tokens.weight"] = model.wte.weight[: c.V]
    for i, block in enumerate(model.h):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = block.ln_1.weight
        sd[p + "post_attention_layernorm.weight"] = block.ln_2.weight
        q, k, v = block.attn.c_attn.weight.split([c.NH * HS, c.NKV * HS, c.NKV * HS])
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = q, k
        sd[p + "self_attn.v_proj.weight"] = v
        sd[p + "self_attn.o_proj.weight"] = block.attn.c_proj.weight
    sd["model.norm.weight"] = model.ln_f.weight
    sd["lm_head.weight"] = (model.wte.weight if c.tied else model.lm_head.weight)[: c.V]


def swiglu_to_hf(mlp, H, gate, up, down, sd):
    sd[gate], sd[up] = mlp.c_fc.weight.split(H)
    sd[down] = mlp.c_proj.weight


def mixtral_config_refusal(c):
    """Why an MoE model has no MixtralForCausalLM (None when it has one)."""
    if not c.llama:
        return "a gpt2-family MoE (GELU experts with biases)"
    if c.moe_every != 1 or c.first_dense or c.shared or c.score != "softmax" or c.routed_scale != 1.0 or c.noisy \
            or c.balance_bias:
        return "MoE layers not in every block, shared experts, sigmoid scores, a routed scale, noisy gating or a " \
               "balancing bias"
    if c.topk < 2:
        return "top-1 routing (Mixtral renormalises its gates, whose top-1 gate would be 1)"
    return None


def deepseek_config_refusal(c):
    """Why an MoE model has no DeepSeek-V3 layout (None when it has one)."""
    if not c.llama:
        return "a gpt2-family MoE (GELU experts with biases)"
    if c.score != "sigmoid" or c.moe_every != 1 or c.noisy:
        return "softmax scores, MoE layers not in every block after the dense ones, or noisy gating"
    if c.shared and (c.shared * c.shared_H) % c.H != 0:
        return f"{c.shared} shared experts of hidden size {c.shared_H}, not a multiple of the experts' {c.H}"
    return None


def deepseek_to_hf(model, config, sd):
    """The inverse of deepseek_from_hf: the DeepSeek-V3 config fields without MLA into `config`, the tensors into
    `sd` (the shared experts joined into one SwiGLU; a model without balancing biases gets zero ones)."""
    c = model.config
    HS = c.C // c.NH
    n_shared = c.shared * c.shared_H // c.H
    config.update({"intermediate_size": c.dense_H, "moe_intermediate_size": c.H, "n_routed_experts": c.E,
                   "num_experts_per_tok": c.topk, "first_k_dense_replace": c.first_dense, "moe_layer_freq": 1,
                   "n_group": c.expert_groups or 1, "topk_group": c.kept_groups or 1, "n_shared_experts": n_shared,
                   "routed_scaling_factor": c.routed_scale, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
                   "norm_topk_prob": True, "kv_lora_rank": None, "q_lora_rank": None, "qk_rope_head_dim": HS,
                   "qk_nope_head_dim": 0, "v_head_dim": HS, "head_dim": HS, "rope_interleave": False,
                   "rope_scaling": None, "attention_dropout": 0.0})
    llama_trunk_to_hf(model, config, sd)
    for i, block in enumerate(model.h):
        p = f"model.layers.{i}.mlp."
        if not c.is_moe(i):
            swiglu_to_hf(block.mlp, c.dense_H, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight",
                         sd)
            continue
        sd[p + "gate.weight"] = block.moe.router.weight
        sd[p + "gate.e_score_correction_bias"] = block.moe.balance_bias if c.balance_bias else torch.zeros(c.E)
        for e, expert in enumerate(block.moe.experts):
            q = f"{p}experts.{e}."
            swiglu_to_hf(expert, c.H, q + "gate_proj.weight", q + "up_proj.weight", q + "down_proj.weight", sd)
        if c.shared:
            q = p + "shared_experts."
            fc = [shared.c_fc.weight.split(c.shared_H) for shared in block.moe.shared]
            sd[q + "gate_proj.weight"] = torch.cat([gate for gate, _ in fc])
            sd[q + "up_proj.weight"] = torch.cat([up for _, up in fc])
            sd[q + "down_proj.weight"] = torch.cat([shared.c_proj.weight for shared in block.moe.shared], dim=1)
    if c.tied:
        del sd["lm_head.weight"]  # a tied checkpoint holds embed_tokens only, as save_pretrained writes it


def hf_from_model(model):
    """(config dict, {Hugging Face tensor name: tensor}) of a train_gpt.py GPT or Llama, or of a train_moe.py MoEGPT
    of the Mixtral or DeepSeek-V3 kind: the inverse of model_from_hf (the padded vocabulary rows dropped)."""
    c = model.config
    sd = {}
    if isinstance(c, moe_ref.MoEConfig) and mixtral_config_refusal(c) is not None:
        config = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
        deepseek_to_hf(model, config, sd)
    elif isinstance(c, moe_ref.MoEConfig):
        config = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "intermediate_size": c.H,
                  "num_local_experts": c.E, "num_experts_per_tok": c.topk, "sliding_window": None,
                  "router_jitter_noise": 0.0}
        llama_trunk_to_hf(model, config, sd)
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}.block_sparse_moe."
            sd[p + "gate.weight"] = block.moe.router.weight
            for e, expert in enumerate(block.moe.experts):
                q = f"{p}experts.{e}."
                swiglu_to_hf(expert, c.H, q + "w1.weight", q + "w3.weight", q + "w2.weight", sd)
    elif isinstance(c, ref.LlamaConfig):
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "intermediate_size": c.H,
                  "mlp_bias": False}
        llama_trunk_to_hf(model, config, sd)
        for i, block in enumerate(model.h):
            p = f"model.layers.{i}.mlp."
            swiglu_to_hf(block.mlp, c.H, p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight", sd)
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


def write_model(model, path, dtype):
    """The model file of a train_gpt.py or train_moe.py model: fp32 or bf16 (rounded), under a temporary name that
    is then renamed, so that a file under the final name is whole."""
    moe = isinstance(model.config, moe_ref.MoEConfig)
    writer = moe_ref.write_model_file if moe else ref.write_model_file
    versions = (moe_ref.MOE_VERSION_FP32, moe_ref.MOE_VERSION_BF16) if moe else (ref.MODEL_VERSION_FP32,
                                                                                 ref.MODEL_VERSION_BF16)
    order = moe_ref.params_in_file_order if moe else ref.params_in_file_order
    if dtype == "bfloat16":
        ref.load_flat_parameters(model, ref.bf16_to_float(ref.bf16_bits(ref.flat_parameters(model, order))), order)
    tmp = path + ".tmp"
    writer(tmp, model, versions[dtype == "bfloat16"])
    os.replace(tmp, path)


def read_model(tool, path):
    """A model file of either trainer (its magic says which) as its reference model, for export."""
    try:
        with open(path, "rb") as f:
            magic = int.from_bytes(f.read(4), "little")
    except OSError as e:
        fail(tool, f"cannot read model file {path}: {e.strerror}")
    if magic != moe_ref.MOE_MODEL_MAGIC:
        return as_tool(tool, ref.read_model_file, path)
    model = as_tool(tool, moe_ref.read_model_file, path)
    why_mixtral, why_deepseek = mixtral_config_refusal(model.config), deepseek_config_refusal(model.config)
    if why_mixtral and why_deepseek:
        why = why_mixtral if why_mixtral == why_deepseek else f"{why_mixtral} (Mixtral), {why_deepseek} (DeepSeek-V3)"
        fail(tool, f"{path}: {why} has no Hugging Face layout: the exporter writes the Mixtral and DeepSeek-V3 kinds "
                   "of MoE")
    return model


def write_hf_directory(directory, config, tensors):
    """config.json and model.safetensors as save_pretrained lays them out, for a family whose class the pinned
    transformers lacks (DeepSeek-V3): the safetensors package writes the tensors, with save_pretrained's metadata."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
