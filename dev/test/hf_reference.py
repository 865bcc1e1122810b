"""
dev/test/hf_reference.py: transformers as the reference of Hugging Face interop (doc/formats.md, "Hugging Face
interop"), for dev/test/test_hf.sh. Two modes:
  random FAMILY DIR [FAMILY DIR...] small random Hugging Face models, saved with save_pretrained, nothing downloaded:
                                   gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM, 2 key/value heads of 4, own
                                   lm_head) or mixtral (MixtralForCausalLM, the same with top-2 of 4 experts), 2
                                   layers, V = 263; every bias and norm weight perturbed away from 0 and 1 so that a
                                   dropped or swapped one shows
  state DIR MODEL.bin PREFIX       a debug state of transformers' model in DIR (doc/formats.md, "Debug state": its
                                   logits, loss and gradients on a seeded batch, and 10 AdamW steps on it with
                                   train_gpt.py's optimizer) beside MODEL.bin as PREFIX_model.bin: test_gpt PREFIX then
                                   holds the C trainer's forward, backward and steps on MODEL.bin to transformers';
                                   for mixtral also the MoE words and counts test_moe reads: dropless, no balance
                                   losses (Mixtral's loss is the cross-entropy), the choices per expert from
                                   transformers' router logits
Runs with build/hf-venv/bin/python (transformers, safetensors, and Debian's torch through the system site packages).
"""
import os
import shutil
import sys
from types import SimpleNamespace

import numpy as np
import torch

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
    else:
        hf_layout.fail(TOOL, f"random: family {family!r} (expected gpt2, llama or mixtral)")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * ref.PERTURB_STD)
    model.save_pretrained(directory, safe_serialization=True)
    print(f"{TOOL}: a random {type(model).__name__} in {directory}")


def write_state(directory, model_file, prefix):
    import transformers

    ref.make_deterministic()
    config, tensors = hf_layout.read_hf_directory(TOOL, directory)
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
    grads = {name: p.grad for name, p in hf_model.named_parameters()}
    if "lm_head.weight" not in grads and config.get("tie_word_embeddings", True):  # tied: wte's gradient has both
        grads["lm_head.weight"] = grads.get("transformer.wte.weight", grads.get("model.embed_tokens.weight"))
    file_grads = ref.flat_parameters(hf_layout.model_from_hf(TOOL, config, grads, directory + " (gradients)"), order)
    moe_blocks = moe_state(hf_model, x, file_model.config) if moe else {}
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
    print(f"{TOOL}: {prefix}_debug_state.bin from transformers' {type(hf_model).__name__}: loss {first_loss[0]:.6f}, "
          f"10 steps to {step_losses[-1]:.6f}")


def moe_state(hf_model, x, config):
    """The MoE parts of a debug state of transformers' Mixtral (train_moe.py's state_words and routing block): one
    micro-batch, dropless, no balance losses, and per layer 0 dropped choices and each expert's choices, counted from
    transformers' own router logits (its top-k of the softmax, which the C router must match)."""
    settings = SimpleNamespace(micro_batches=1, seq_aux_alpha=0.0, cf=0.0, aux_alpha=0.0, z_coef=0.0, jitter=0.0,
                               importance_coef=0.0, load_coef=0.0, init_scale=1.0, bias_gamma=0.0, global_aux=0,
                               device_limit=0, ep_groups=0)
    with torch.no_grad():
        router_logits = hf_model(x, output_router_logits=True).router_logits  # per layer (B*T, E)
    routing = []
    for logits in router_logits:
        choices = torch.topk(torch.softmax(logits.float(), dim=-1), config.topk, dim=-1).indices
        routing += [0] + torch.bincount(choices.reshape(-1), minlength=config.E).tolist()
    return {"words": hf_layout.moe_ref.state_words(settings, config, 0), "routing": np.array(routing, dtype="<i4")}


if __name__ == "__main__":
    if len(sys.argv) >= 4 and len(sys.argv) % 2 == 0 and sys.argv[1] == "random":
        for family, directory in zip(sys.argv[2::2], sys.argv[3::2]):
            random_model(family, directory)
    elif len(sys.argv) == 5 and sys.argv[1] == "state":
        write_state(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        hf_layout.fail(TOOL, "usage: hf_reference.py random FAMILY DIR [FAMILY DIR...] | state DIR MODEL.bin PREFIX")
