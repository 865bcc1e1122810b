"""
dev/test/hf_reference.py: transformers as the reference of Hugging Face interop (doc/formats.md, "Hugging Face
interop"), for dev/test/test_hf.sh. Three modes:
  random FAMILY DIR [FAMILY DIR...] small random Hugging Face models, saved with save_pretrained, nothing downloaded:
                                   gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM, 2 key/value heads of 4, own
                                   lm_head) or mixtral (MixtralForCausalLM, the same with top-2 of 4 experts), 2
                                   layers, V = 263; every bias and norm weight perturbed away from 0 and 1 so that a
                                   dropped or swapped one shows; deepseek_v3 (the llama attention, a dense layer,
                                   then 2 MoE layers of top-2 of 8 experts in 2 of 4 groups with a shared expert,
                                   its tensors drawn here in DeepseekV3ForCausalLM's names and written with the
                                   safetensors package, since the pinned transformers has no DeepSeek-V3 class)
  state DIR MODEL.bin PREFIX       a debug state of transformers' model in DIR (doc/formats.md, "Debug state": its
                                   logits, loss and gradients on a seeded batch, and 10 AdamW steps on it with
                                   train_gpt.py's optimizer) beside MODEL.bin as PREFIX_model.bin: test_gpt PREFIX then
                                   holds the C trainer's forward, backward and steps on MODEL.bin to transformers';
                                   for mixtral also the MoE words and counts test_moe reads: dropless, no balance
                                   losses (Mixtral's loss is the cross-entropy), the choices per expert from
                                   transformers' router logits; deepseek_v3's reference is DeepSeekV3Reference
                                   below, and its counts its own choices
  batch FILE                       commands of these modes and of scripts/hf_import.py and hf_export.py in one
                                   process (run_batch)
Runs with build/hf-venv/bin/python (transformers, safetensors, and Debian's torch through the system site packages).
"""
import math
import os
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import hf_layout  # noqa: E402

ref = hf_layout.ref
TOOL = "hf_reference.py"
# the steps' batch and optimizer, as the Makefile's REF_ARGS (clipping at 0.5, below these models' gradient norm)
ARGS = SimpleNamespace(B=2, T=16, steps=10, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                       grad_clip=0.5, seed=1337)


def random_model(family, directory):
    import transformers

    torch.manual_seed(7)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=263, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
    elif family == "mixtral":
        config = transformers.MixtralConfig(vocab_size=263, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                            rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                                            router_jitter_noise=0.0)
        model = transformers.MixtralForCausalLM(config)
    elif family == "llama":
        config = transformers.LlamaConfig(vocab_size=263, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                          rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif family == "deepseek_v3":
        random_deepseek(directory)
        return
    else:
        hf_layout.fail(TOOL, f"random: family {family!r} (expected gpt2, llama, mixtral or deepseek_v3)")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * ref.PERTURB_STD)
    model.save_pretrained(directory, safe_serialization=True)
    print(f"{TOOL}: a random {type(model).__name__} in {directory}")


# The DeepSeek-V3-style test model without MLA (hf_layout.deepseek_from_hf): DeepseekV3Config's fields, its
# attention Llama's
DEEPSEEK_CONFIG = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 263,
                   "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
                   "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                   "first_k_dense_replace": 1, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4,
                   "topk_group": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                   "topk_method": "noaux_tc", "norm_topk_prob": True, "kv_lora_rank": None, "q_lora_rank": None,
                   "hidden_act": "silu", "attention_bias": False}


def random_deepseek(directory):
    """DEEPSEEK_CONFIG's model with every tensor drawn here: weights N(0, 0.02) as transformers' init, norm weights
    1 + N(0, PERTURB_STD), and e_score_correction_bias N(0, 0.02), the size of the sigmoid scores' spread, so that it
    moves choices."""
    from safetensors.torch import save_file

    c = DEEPSEEK_CONFIG
    generator = torch.Generator().manual_seed(7)
    C, V, H, Hd, E = c["hidden_size"], c["vocab_size"], c["moe_intermediate_size"], c["intermediate_size"], \
        c["n_routed_experts"]
    HS = C // c["num_attention_heads"]
    KV = HS * c["num_key_value_heads"]

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=generator) * std

    def swiglu(prefix, hidden):
        return {prefix + "gate_proj.weight": normal(hidden, C), prefix + "up_proj.weight": normal(hidden, C),
                prefix + "down_proj.weight": normal(C, hidden)}

    tensors = {"model.embed_tokens.weight": normal(V, C), "model.norm.weight": 1 + normal(C, std=ref.PERTURB_STD),
               "lm_head.weight": normal(V, C)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "input_layernorm.weight": 1 + normal(C, std=ref.PERTURB_STD),
                        p + "post_attention_layernorm.weight": 1 + normal(C, std=ref.PERTURB_STD),
                        p + "self_attn.q_proj.weight": normal(C, C), p + "self_attn.k_proj.weight": normal(KV, C),
                        p + "self_attn.v_proj.weight": normal(KV, C), p + "self_attn.o_proj.weight": normal(C, C)})
        if i < c["first_k_dense_replace"]:
            tensors.update(swiglu(p + "mlp.", Hd))
            continue
        tensors.update({p + "mlp.gate.weight": normal(E, C), p + "mlp.gate.e_score_correction_bias": normal(E)})
        for e in range(E):
            tensors.update(swiglu(f"{p}mlp.experts.{e}.", H))
        tensors.update(swiglu(p + "mlp.shared_experts.", c["n_shared_experts"] * H))
    hf_layout.write_hf_directory(directory, c, tensors)
    print(f"{TOOL}: a random DeepSeek-V3-style model (no MLA) in {directory}")


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DeepSeekV3Reference(torch.nn.Module):
    """DeepSeek-V3's forward as its published modelling code defines it (transformers' modeling_deepseek_v3:
    DeepseekV3RMSNorm, DeepseekV3MLP, DeepseekV3TopkRouter, DeepseekV3MoE), written here over the checkpoint's
    tensors by their names, with Llama's attention in place of MLA: the pinned transformers has no DeepSeek-V3
    class, and the ones that do need a newer PyTorch than Debian's. The tensors are its parameters, but
    e_score_correction_bias, a buffer outside the optimizer as in DeepSeek-V3. Every MoE layer's top-k choices of
    the last forward are kept (self.choices)."""

    def __init__(self, config, tensors):
        super().__init__()
        self.c = config
        self.weights = torch.nn.ParameterDict({name.replace(".", "/"): torch.nn.Parameter(t.clone())
                                               for name, t in tensors.items() if "e_score_correction_bias" not in name})
        for name, t in tensors.items():
            if "e_score_correction_bias" in name:
                self.register_buffer(name.replace(".", "/"), t.clone())
        self.choices = []

    def named_hf_parameters(self):
        return {name.replace("/", "."): p for name, p in self.weights.items()}

    def w(self, name):
        key = name.replace(".", "/")
        return self.weights[key] if key in self.weights else getattr(self, key)

    def rms_norm(self, x, name):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.w(name) * (x * torch.rsqrt(variance + self.c["rms_norm_eps"]))

    def mlp(self, x, prefix):
        return F.linear(F.silu(F.linear(x, self.w(prefix + "gate_proj.weight"))) *
                        F.linear(x, self.w(prefix + "up_proj.weight")), self.w(prefix + "down_proj.weight"))

    def moe(self, x, prefix):
        c = self.c
        E, K, G, M = c["n_routed_experts"], c["num_experts_per_tok"], c["n_group"], c["topk_group"]
        tokens = x.reshape(-1, x.shape[-1])
        scores = F.linear(tokens.float(), self.w(prefix + "gate.weight").float()).sigmoid()
        with torch.no_grad():  # DeepseekV3MoE.get_topk_indices
            choice = scores + self.w(prefix + "gate.e_score_correction_bias").unsqueeze(0)
            group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=M, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            score_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
            choice = choice.masked_fill(~score_mask.bool(), 0.0)
            topk_indices = torch.topk(choice, k=K, dim=-1, sorted=False)[1]
        weights = scores.gather(1, topk_indices)
        if c["norm_topk_prob"]:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * c["routed_scaling_factor"]
        self.choices.append(topk_indices)
        out = torch.zeros_like(tokens)
        for e in range(E):
            token, slot = (topk_indices == e).nonzero(as_tuple=True)
            if token.numel():
                expert_out = self.mlp(tokens[token], f"{prefix}experts.{e}.")
                out = out.index_add(0, token, expert_out * weights[token, slot].unsqueeze(-1))
        return out.view(x.shape) + self.mlp(x, prefix + "shared_experts.")

    def attention(self, x, prefix, cos, sin):
        c = self.c
        B, T, C = x.shape
        NH, NKV = c["num_attention_heads"], c["num_key_value_heads"]
        HS = C // NH
        q = F.linear(x, self.w(prefix + "q_proj.weight")).view(B, T, NH, HS).transpose(1, 2)
        k = F.linear(x, self.w(prefix + "k_proj.weight")).view(B, T, NKV, HS).transpose(1, 2)
        v = F.linear(x, self.w(prefix + "v_proj.weight")).view(B, T, NKV, HS).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(NH // NKV, dim=1), v.repeat_interleave(NH // NKV, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(HS)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return F.linear(y, self.w(prefix + "o_proj.weight"))

    def forward(self, x):
        c = self.c
        T = x.shape[1]
        HS = c["hidden_size"] // c["num_attention_heads"]
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, HS, 2, dtype=torch.float32) / HS))
        freqs = torch.outer(torch.arange(T, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        self.choices = []
        h = F.embedding(x, self.w("model.embed_tokens.weight"))
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + self.attention(self.rms_norm(h, p + "input_layernorm.weight"), p + "self_attn.", cos, sin)
            ffn_in = self.rms_norm(h, p + "post_attention_layernorm.weight")
            dense = i < c["first_k_dense_replace"]
            h = h + (self.mlp(ffn_in, p + "mlp.") if dense else self.moe(ffn_in, p + "mlp."))
        h = self.rms_norm(h, "model.norm.weight")
        head = "model.embed_tokens.weight" if c.get("tie_word_embeddings") else "lm_head.weight"
        return SimpleNamespace(logits=F.linear(h, self.w(head)))


def write_state(directory, model_file, prefix):
    import transformers

    ref.make_deterministic()
    config, tensors = hf_layout.read_hf_directory(TOOL, directory)
    deepseek = config["model_type"] == "deepseek_v3"
    if deepseek:
        hf_model = DeepSeekV3Reference(config, tensors)
    else:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32).eval()
    file_model = hf_layout.model_from_hf(TOOL, config, tensors, directory)  # the file's shape, to lay out gradients
    V = file_model.config.V
    generator = torch.Generator().manual_seed(ARGS.seed)
    x = torch.randint(0, V, (ARGS.B, ARGS.T), generator=generator)
    y = torch.randint(0, V, (ARGS.B, ARGS.T), generator=generator)

    moe = isinstance(file_model.config, hf_layout.moe_ref.MoEConfig)
    order = hf_layout.moe_ref.params_in_file_order if moe else ref.params_in_file_order

    def loss_of(model):
        logits = model(x).logits[..., :V]
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))

    logits, loss = loss_of(hf_model)
    loss.backward()
    named = hf_model.named_hf_parameters() if deepseek else dict(hf_model.named_parameters())
    # an expert no token reached has no gradient: the C trainer's is zero
    grads = {name: torch.zeros_like(p) if p.grad is None else p.grad for name, p in named.items()}
    if deepseek:  # the balancing biases are no parameters: model_from_hf reads them as zero gradients
        grads.update({name: torch.zeros_like(t) for name, t in tensors.items() if "e_score_correction_bias" in name})
    if "lm_head.weight" not in grads and config.get("tie_word_embeddings", True):  # tied: wte's gradient has both
        grads["lm_head.weight"] = grads.get("transformer.wte.weight", grads.get("model.embed_tokens.weight"))
    file_grads = ref.flat_parameters(hf_layout.model_from_hf(TOOL, config, grads, directory + " (gradients)"), order)
    moe_blocks = moe_state(hf_model, x, file_model.config, deepseek) if moe else {}
    first_logits = logits.detach().numpy().astype("<f4")
    first_loss = np.array([loss.item()], dtype="<f4")

    optimizer = ref.make_optimizer(hf_model, ARGS, "cpu")
    step_losses = []
    for _ in range(ARGS.steps):
        optimizer.zero_grad(set_to_none=True)
        _, step_loss = loss_of(hf_model)
        ref.backward(step_loss, hf_model)
        ref.clip_gradients(hf_model, ARGS.grad_clip)
        optimizer.step()
        step_losses.append(step_loss.item())
    header = ref.debug_state_header(ARGS, file_model.config, moe_blocks.get("words"))
    losses = np.array([loss.item(), 0.0, 0.0], dtype="<f4") if moe else first_loss  # CE; the aux and z losses 0
    routing = [moe_blocks["routing"]] if moe else []
    ref.write_file(prefix + "_debug_state.bin", header, x.numpy().astype("<i4"), y.numpy().astype("<i4"),
                   first_logits, losses, *routing, file_grads, np.array(step_losses, dtype="<f4"))
    shutil.copyfile(model_file, prefix + "_model.bin")
    source = type(hf_model).__name__ if deepseek else f"transformers' {type(hf_model).__name__}"
    print(f"{TOOL}: {prefix}_debug_state.bin from {source}: loss {first_loss[0]:.6f}, "
          f"10 steps to {step_losses[-1]:.6f}")


def moe_state(hf_model, x, config, deepseek):
    """The MoE parts of a debug state of transformers' Mixtral or of DeepSeekV3Reference (train_moe.py's state_words
    and routing block): one micro-batch, dropless, no balance losses and the balancing bias fixed, and per layer 0
    dropped choices and each expert's choices, counted from the reference's own choices (Mixtral: transformers' top-k
    of the softmax of its router logits), which the C router must match."""
    settings = SimpleNamespace(micro_batches=1, seq_aux_alpha=0.0, cf=0.0, aux_alpha=0.0, z_coef=0.0, jitter=0.0,
                               importance_coef=0.0, load_coef=0.0, init_scale=1.0, bias_gamma=0.0, global_aux=0,
                               device_limit=0, ep_groups=0)
    with torch.no_grad():
        if deepseek:
            hf_model(x)
            layer_choices = hf_model.choices
        else:
            router_logits = hf_model(x, output_router_logits=True).router_logits  # per layer (B*T, E)
            layer_choices = [torch.topk(torch.softmax(logits.float(), dim=-1), config.topk, dim=-1).indices
                             for logits in router_logits]
    routing = []
    for choices in layer_choices:
        routing += [0] + torch.bincount(choices.reshape(-1), minlength=config.E).tolist()
    words = hf_layout.moe_ref.state_words(settings, config, 0)
    words[11] = 0  # the balancing biases (DeepSeek-V3's e_score_correction_bias) stay fixed: no biases per step follow
    return {"words": words, "routing": np.array(routing, dtype="<i4")}


def run_batch(path):
    """batch FILE: each line `LOG COMMAND ARG...` (COMMAND random, state, import or export: this tool's modes and
    scripts/hf_import.py's and hf_export.py's) run in order in this one process, which imports torch and transformers
    once (each on its own, they were most of a command's 1.0-1.4 s). A command's output goes to LOG, whose last line is
    `status: 0`, or `status: ` and the one line it failed with."""
    import contextlib
    import shlex
    import hf_export
    import hf_import
    tools = {"import": hf_import.main, "export": hf_export.main, "random": main, "state": main}
    for line in open(path):
        if not line.strip():
            continue
        log, command, *args = shlex.split(line)
        with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                tools[command]([command] + args if tools[command] is main else args)
                status = "0"
            except SystemExit as e:
                status = "0" if e.code in (0, None) else str(e)
            except Exception as e:  # a crash is this command's failure; the next commands still run
                status = f"{type(e).__name__}: {e}"
            print(f"status: {status}")


def main(argv):
    if len(argv) >= 3 and len(argv) % 2 == 1 and argv[0] == "random":
        for family, directory in zip(argv[1::2], argv[2::2]):
            random_model(family, directory)
    elif len(argv) == 4 and argv[0] == "state":
        write_state(argv[1], argv[2], argv[3])
    elif len(argv) == 2 and argv[0] == "batch":
        run_batch(argv[1])
    else:
        hf_layout.fail(TOOL, "usage: hf_reference.py random FAMILY DIR [FAMILY DIR...] | state DIR MODEL.bin PREFIX | "
                             "batch FILE")


if __name__ == "__main__":
    main(sys.argv[1:])
