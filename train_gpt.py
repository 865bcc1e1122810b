"""
train_gpt.py: the PyTorch reference GPT-2 for switch.cu. It builds GPT-2 exactly as train_gpt.cu does and
writes the files the C side tests against (formats: doc/formats.md). --arch llama builds the Llama-style
model instead (RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases; definition: doc/kernels.md, "The
Llama-style model"), written in the same model-file format with its header words 16-21.

Run from the repository root with a Python that has torch (here Debian's: /usr/bin/python3):
  reference state for test_gpt (model file + debug state with logits, loss, gradients, 10 step losses):
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt --dtype float32
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt_bf16 --dtype bfloat16
  the same for the Llama-style model (here grouped-query attention with 2 key/value heads for 4 query heads):
    /usr/bin/python3 train_gpt.py --write-reference build/ref/llama --arch llama --NH 4 --C 64 --kv-heads 2
  test data for the trainers' command-line tests:
    /usr/bin/python3 train_gpt.py --write-shard build/ref/shard.bin --shard-tokens 4096 --V 257 --seed 1
    /usr/bin/python3 train_gpt.py --write-tokenizer build/ref/tokenizer.bin --V 257
  training baseline (the same step line as the C trainer; constant lr):
    /usr/bin/python3 train_gpt.py --train --input-bin 'build/ref/shard*.bin' --B 4 --T 32 --steps 20
    python train_gpt.py --train --input-bin 'data/<name>/*train*.bin' --L 12 --NH 12 --C 768 --V 50257 \
        --maxT 1024 --B 16 --T 1024 --lr 6e-4 --device cuda --compile --dtype bfloat16
  any mode can start from a model file instead of a fresh init: --model-from-file PATH (fp32 or bf16 file).
  LoRA fine-tuning (--ft lora): the base model frozen, a trainable low-rank update on each --ft-targets Linear of
  every block (lm_head: on the classifier, once); the reference also writes PREFIX_adapter.bin (the adapter it starts
  from; format: ADAPTER_MAGIC below), and --train starts from a fresh adapter or --adapter-from-file PATH:
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt_lora --ft lora --ft-targets qkv,proj,fc,fc_proj
    /usr/bin/python3 train_gpt.py --write-reference build/ref/llama_lora --arch llama --NH 4 --C 64 --kv-heads 2 \
        --ft lora --ft-rank 4 --ft-targets qkv,proj,fc,fc_proj
    /usr/bin/python3 train_gpt.py --train --input-bin 'build/ref/shard*.bin' --B 4 --T 32 --steps 20 \
        --model-from-file build/ref/gpt_lora_model.bin --adapter-from-file build/ref/gpt_lora_adapter.bin
  bottleneck adapters (--ft adapter, Houlsby et al. 2019): the base model frozen, in every block a trainable
  h + up(gelu(down(h))) of width --ft-rank on the attention's output and on the MLP's, before their residual adds;
  the same files and modes as LoRA's:
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt_adapter --ft adapter --ft-rank 8
    /usr/bin/python3 train_gpt.py --write-reference build/ref/llama_adapter --arch llama --NH 4 --C 64 --kv-heads 2 \
        --ft adapter --ft-rank 8
  prompt tuning (--ft prompt, Lester et al. 2021): the base model frozen, --ft-rank P trainable input embeddings (the
  virtual tokens) before every sequence, which the model runs on P + T positions (P + T <= maxT) and whose logits and
  loss are the T real positions'; the same files and modes as LoRA's:
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt_prompt --ft prompt --ft-rank 8
    /usr/bin/python3 train_gpt.py --write-reference build/ref/llama_prompt --arch llama --NH 4 --C 64 --kv-heads 2 \
        --ft prompt --ft-rank 8
  prefix tuning (--ft prefix, Li and Liang 2021): the base model frozen, --ft-rank P trainable keys and values in every
  block's attention, which every query sees beside the causal keys, in one softmax; LLaMA-Adapter (--ft llama_adapter,
  Zhang et al. 2023): --ft-rank P trainable prompt rows in each of the top --ft-layers K blocks (default: every block),
  projected by the block's frozen k and v, attended to in a softmax of their own whose output, times a trainable gate
  (zero in a fresh adapter), adds to the attention's; the same files and modes as LoRA's:
    /usr/bin/python3 train_gpt.py --write-reference build/ref/gpt_prefix --ft prefix --ft-rank 8
    /usr/bin/python3 train_gpt.py --write-reference build/ref/llama_lladapter --arch llama --NH 4 --C 64 \
        --kv-heads 2 --ft llama_adapter --ft-rank 8 --ft-layers 1
Its own test: /usr/bin/python3 dev/test/test_reference.py

The debug state extends the llm.c one (version 3): header [4] = number of step losses, [5] = V, [6] = Vp, [12..17] =
the steps' lr, beta1, beta2, eps, weight decay and grad clip (fp32 bits), [18] = the seed, [40] = the fine-tuning
method (0 = none, 1 = lora, 2 = adapter, 3 = prompt, 4 = prefix, 5 = llama_adapter); payload x, y (B*T int32), logits (B*T*V fp32, the V real
columns; with a prompt, the T real positions'), loss, every parameter gradient in model-file order and layout (fp32;
wte's has Vp rows, the padded ones zero; with --ft, the adapter's gradients in adapter order instead), then the loss
of each training step on the same batch (step k's loss is its forward loss before its update: step 0's equals the
loss above; with --ft the steps train the adapter only).
"""

import os

# torch reads these when it starts: two threads suit this 2-core machine (torch would use one otherwise), and
# threads that sleep instead of spinning while they wait keep a busy machine from slowing a step 5-50x.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import glob
import inspect
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HEADER_INTS = 256
MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3
MODEL_VERSION_BF16 = 5
STATE_MAGIC = 20240327
STATE_VERSION = 3
# The debug state's words 12..18 (doc/formats.md, "Debug state"): the steps' optimizer as fp32 bits (lr, beta1,
# beta2, eps, weight decay, grad clip) and the seed, so that a test takes its settings from the file it compares with
STATE_OPTIMIZER_WORD = 12
STATE_SEED_WORD = 18
STATE_FT_WORD = 40  # the fine-tuning method: 0 = none (every parameter trains), else FT_METHODS' number
SHARD_MAGIC = 20240520
MASK_MAGIC = 20261206  # a shard's loss mask, PATH.mask (doc/formats.md, "Loss mask")
MASK_VERSION = 1
MASKED = -1  # a target that does not count (the C kernels' convention too)
# An adapter file (LoRA's, the bottleneck adapters' or the prompt's): 256 int32 header words, then the adapter's
# parameters (fp32, adapter order). The words: 0, 1 magic, version; 2 method (FT_METHODS); 3 rank r (LoRA's rank, the
# bottleneck width, the rows P of a prompt, a prefix or an adaption prompt); 4 targets (lora: bit i = LORA_TARGETS[i];
# adapter: bit i = ADAPTER_SITES[i], always both; prompt and prefix: PROMPT_SITES_WORD, bit 0 the input or every
# attention; llama_adapter: K, its top layers); 5 alpha (fp32 bits; LoRA's only, the others 0.0); 6, 7 the base model file's checkpoint checksum and 8, 9 its size in bytes (low 32 bits
# first); 10 step; 11 the number of parameter values; 12 1 when optimizer state follows the parameters (the C
# trainer's checkpoints; not read here).
ADAPTER_MAGIC = 20261207
ADAPTER_VERSION = 1
FT_METHODS = {"lora": 1, "adapter": 2, "prompt": 3, "prefix": 4, "llama_adapter": 5}
LORA_RANK = 8
LORA_ALPHA = 16.0
LORA_TARGETS_DEFAULT = "qkv,proj"
ADAPTER_RANK = 8  # the bottleneck width's default
ADAPTER_DOWN_STD = 0.02  # a bottleneck adapter's down.weight, fresh and in the reference
PROMPT_LENGTH = 8  # the prompt's virtual tokens' default
PROMPT_STD = 0.02  # the prompt's draw, fresh and in the reference
PREFIX_LENGTH = 8  # the prefix's keys and values per layer, default
PREFIX_STD = 0.02  # their draw, fresh and in the reference
ADAPTION_LENGTH = 8  # llama_adapter's prompt rows per layer, default
ADAPTION_STD = 1.0  # their draw, fresh and in the reference: the scale of the normed rows the projection reads
REFERENCE_GATE_STD = 0.5  # the reference's draw of llama_adapter's gates (fresh: zero), so that its prompts get gradients
# The reference's draw of what a fresh fine-tune zeroes: LoRA's B, and a bottleneck adapter's down.bias, up.weight
# and up.bias. Zero, they leave the logits as the base's and some gradients zero (LoRA's A's; the bottleneck's
# down.weight's and down.bias's); the reference draws them too, so that the adapter changes the logits and the
# gradients of all of the adapter's tensors (A and B; down.weight, down.bias, up.weight and up.bias) are non-zero.
REFERENCE_B_STD = 0.02
TOKENIZER_MAGIC = 20240328
TOKENIZER_VERSION = 2
BYTE_VOCAB_SIZE = 257  # the 256 bytes and the end-of-text token
EOT_TEXT = b"<|endoftext|>"
VOCAB_PAD = 128  # the C side pads the vocabulary so that the lm_head matmul has aligned shapes
LN_EPS = 1e-5
INIT_STD = 0.02
# The reference perturbs every bias and LayerNorm parameter away from 0 and 1, so that a C kernel that
# drops or swaps one of them changes the results the test compares.
PERTURB_STD = 0.1
# The model file's architecture (header word 16; doc/formats.md): 0 in every GPT-2 file, as llm.c leaves it
FAMILY_WORD = 16
FAMILY_GPT2 = 0
FAMILY_LLAMA = 1
ROPE_THETA = 10000.0
NORM_EPS = 1e-5  # RMSNorm's

# Feature tests, not version tests: torch 1.13 (this machine) has neither; a current torch on a GPU has both.
HAS_SDPA = hasattr(F, "scaled_dot_product_attention")
HAS_COMPILE = hasattr(torch, "compile")


def fail(message):
    """Bad input ends the run with one line on stderr and exit status 1."""
    raise SystemExit(f"train_gpt.py: error: {message}")


# ----------------------------------------------------------------------------------------------------------
# The model


@dataclass
class GPTConfig:
    maxT: int  # longest sequence (rows of wpe)
    V: int  # vocabulary size
    L: int  # layers
    NH: int  # attention heads
    C: int  # channels

    @property
    def Vp(self):
        return (self.V + VOCAB_PAD - 1) // VOCAB_PAD * VOCAB_PAD


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.NH = config.NH
        # one projection whose output is [q | k | v], heads contiguous within each, as the C side lays it out
        self.c_attn = nn.Linear(config.C, 3 * config.C)
        self.c_proj = nn.Linear(config.C, config.C)
        self.NKV, self.HS = config.NH, config.C // config.NH
        no_shared_keys(self)

    def forward(self, x):
        B, T, C = x.shape
        head_size = C // self.NH
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.NH, head_size).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        y = attention_with_shared_keys(self, q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(hs), future masked) v for q, k, v (B, NH, T, hs)."""
    if HAS_SDPA:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    T, head_size = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(head_size)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
    return F.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v


def no_shared_keys(attn):
    """An attention without prefix tuning's keys and values or LLaMA-Adapter's prompt (add_prefix, add_adaption)."""
    attn.prefix_keys = attn.prefix_values = None  # (P, NKV*HS) each
    attn.adaption_prompt = attn.adaption_gate = None  # (P, C) and (1,)


def key_heads(rows, attn):
    """Shared rows (P, NKV*HS) as the heads' keys or values (1, NH, P, HS), key/value head j serving query heads
    j*NH/NKV .. (j+1)*NH/NKV - 1."""
    P = rows.shape[0]
    heads = rows.view(P, attn.NKV, attn.HS).transpose(0, 1)  # (NKV, P, HS)
    return heads.repeat_interleave(attn.NH // attn.NKV, dim=0).unsqueeze(0)


def attention_with_shared_keys(attn, q, k, v):
    """Causal attention of q, k, v (B, NH, T, HS; the key/value heads repeated for the query heads), with the
    attention's shared keys, which every query sees and which carry no position:
    prefix tuning: its P keys and values join the causal ones in one softmax;
    LLaMA-Adapter: its prompt (P, C) projected by the frozen c_attn gives P keys and values, attended to in a softmax
    of their own, whose output times the gate adds to the causal attention's.
    Both compute in fp32 and round once to the working precision, as the C kernels do."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if attn.prefix_keys is not None:
        T, P = q.shape[-2], attn.prefix_keys.shape[0]
        keys = torch.cat((key_heads(attn.prefix_keys, attn).float().expand(q.shape[0], -1, -1, -1), k.float()), dim=2)
        values = torch.cat((key_heads(attn.prefix_values, attn).float().expand(q.shape[0], -1, -1, -1), v.float()),
                           dim=2)
        future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(diagonal=1)
        hidden = torch.cat((torch.zeros(T, P, dtype=torch.bool, device=q.device), future), dim=1)
        scores = (q.float() @ keys.transpose(-2, -1)) * scale
        return (F.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ values).to(q.dtype)
    y = causal_attention(q, k, v)
    if attn.adaption_prompt is None:
        return y
    C = attn.NH * attn.HS
    _, pk, pv = attn.c_attn(attn.adaption_prompt).split([C, attn.NKV * attn.HS, attn.NKV * attn.HS], dim=1)
    probs = F.softmax((q.float() @ key_heads(pk, attn).float().transpose(-2, -1)) * scale, dim=-1)
    return (y.float() + attn.adaption_gate.float() * (probs @ key_heads(pv, attn).float())).to(q.dtype)


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.C, 4 * config.C)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.C, config.C)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.C, eps=LN_EPS)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.C, eps=LN_EPS)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.Vp, config.C)
        self.wpe = nn.Embedding(config.maxT, config.C)
        self.h = nn.ModuleList(Block(config) for _ in range(config.L))
        self.ln_f = nn.LayerNorm(config.C, eps=LN_EPS)
        self.classifier_lora = None  # the lm_head target's ClassifierLora (add_lora), added to the logits
        self.prompt = None  # prompt tuning's virtual tokens (add_prompt), before every sequence

    def forward(self, idx, targets):
        """Returns the logits of the V real tokens (B, T, V) and the mean cross-entropy over the B*T targets that
        count (a masked target is MASKED). With a prompt of P virtual tokens the model runs on P + T positions, the
        virtual ones at 0..P-1, and the logits are the T real positions'."""
        x = with_prompt(self, self.wte(idx))
        x = x + self.wpe(torch.arange(x.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        # lm_head is tied to wte; the Vp - V padded columns are never used
        logits = classifier(self, real_positions(self, self.ln_f(x)), self.wte.weight)
        loss = F.cross_entropy(logits.reshape(-1, self.config.V), targets.reshape(-1), ignore_index=MASKED)
        return logits, loss


def classifier(model, h, out_embedding):
    """The logits of the V real tokens: h E^T over the Vp rows of the output embedding E, plus the LoRA update of the
    lm_head target when the model has one, then the V real columns."""
    logits = F.linear(h, out_embedding)
    if model.classifier_lora is not None:
        logits = logits + model.classifier_lora(h)
    return logits[..., : model.config.V]


def with_prompt(model, x):
    """The token embeddings x (B, T, C) with the model's prompt (P, C) before every sequence, (B, P + T, C); x itself
    when the model has none."""
    if model.prompt is None:
        return x
    return torch.cat((model.prompt.expand(x.shape[0], -1, -1), x), dim=1)


def real_positions(model, h):
    """The last T of h's (B, P + T, C) positions, the real tokens' (h itself without a prompt): the virtual tokens
    have no targets."""
    return h if model.prompt is None else h[:, model.prompt.shape[0] :]


# ----------------------------------------------------------------------------------------------------------
# The Llama-style model of -arch llama (definition: doc/kernels.md, "The Llama-style model"). Each piece computes in
# fp32 and rounds its output once to the working precision, where the kernels do (doc/kernels.md, doc/attention.md).


@dataclass
class LlamaConfig(GPTConfig):
    NKV: int  # key/value heads (grouped-query attention); divides NH
    rope_theta: float  # RoPE base; an fp32 value, as the model file stores it
    H: int  # SwiGLU hidden size
    norm_eps: float  # RMSNorm eps; an fp32 value, as the model file stores it
    tied: bool  # the output embedding is wte (no lm_head)

    @property
    def HS(self):
        return self.C // self.NH


def default_ffn_hidden(C):
    """Llama's SwiGLU hidden size rule with multiple_of = 64: floor(8C/3), rounded up to a multiple of 64."""
    return (8 * C // 3 + 63) // 64 * 64


def upcast(x):
    """The arithmetic precision of the pieces below: fp32, or float64 when the model runs in float64 (the
    reference's own tests compare such a model against float64 code)."""
    return x.double() if x.dtype == torch.float64 else x.float()


def rmsnorm(x, weight, eps):
    """x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension, rounded once."""
    xf = upcast(x)
    rstd = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * rstd * weight.to(xf.dtype)).to(x.dtype)


def swiglu(inp):
    """silu(gate) * up over the fused [gate (H) | up (H)] last dimension, rounded once. (N, 2H) -> (N, H)"""
    gate, up = upcast(inp).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(inp.dtype)


def rope_cos_sin(T, HS, theta, device=None):
    """doc/attention.md's table: angles in float64, cos and sin rounded once to fp32. (T, HS/2) each"""
    inv_freq = theta ** (-torch.arange(0, HS, 2, dtype=torch.float64, device=device) / HS)  # (HS/2,)
    angle = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv_freq  # (T, HS/2)
    return angle.cos().float(), angle.sin().float()


def rope_rotate(x, cos, sin):
    """doc/attention.md's "rotate_half" RoPE of x (B, nh, T, HS) with cos, sin (T, HS/2), rounded once."""
    lo, hi = upcast(x).chunk(2, dim=-1)
    cos, sin = cos.to(lo.dtype), sin.to(lo.dtype)
    return torch.cat((lo * cos - hi * sin, hi * cos + lo * sin), dim=-1).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, C, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(C))
        self.eps = eps

    def forward(self, x):
        return rmsnorm(x, self.weight, self.eps)


class GroupedQueryAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.NH, self.NKV, self.HS = config.NH, config.NKV, config.HS
        # the packed qkv of doc/attention.md: [NH query heads | NKV key heads | NKV value heads]
        self.c_attn = nn.Linear(config.C, (config.NH + 2 * config.NKV) * config.HS, bias=False)
        self.c_proj = nn.Linear(config.C, config.C, bias=False)
        no_shared_keys(self)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split([self.NH * self.HS, self.NKV * self.HS, self.NKV * self.HS], dim=2)
        q = q.view(B, T, self.NH, self.HS).transpose(1, 2)  # (B, NH, T, HS)
        k, v = (t.view(B, T, self.NKV, self.HS).transpose(1, 2) for t in (k, v))  # (B, NKV, T, HS)
        q, k = rope_rotate(q, cos, sin), rope_rotate(k, cos, sin)
        # key/value head j serves query heads j*NH/NKV .. (j+1)*NH/NKV - 1
        group = self.NH // self.NKV
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, NH, T, HS)
        y = attention_with_shared_keys(self, q, k, v)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class SwiGLUMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.C, 2 * config.H, bias=False)  # rows [gate (H) | up (H)]
        self.c_proj = nn.Linear(config.H, config.C, bias=False)

    def forward(self, x):
        return self.c_proj(swiglu(self.c_fc(x)))


class LlamaBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = RMSNorm(config.C, config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.ln_2 = RMSNorm(config.C, config.norm_eps)
        self.mlp = SwiGLUMLP(config)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.ln_1(x), cos, sin)
        return x + self.mlp(self.ln_2(x))


class Llama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.Vp, config.C)
        self.h = nn.ModuleList(LlamaBlock(config) for _ in range(config.L))
        self.ln_f = RMSNorm(config.C, config.norm_eps)
        if not config.tied:
            self.lm_head = nn.Linear(config.C, config.Vp, bias=False)
        self.classifier_lora = None  # the lm_head target's ClassifierLora (add_lora), added to the logits
        self.prompt = None  # prompt tuning's virtual tokens (add_prompt), before every sequence
        cos, sin = rope_cos_sin(config.maxT, config.HS, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets):
        """Returns the logits of the V real tokens (B, T, V) and the mean cross-entropy over the B*T targets that
        count (a masked target is MASKED). With a prompt of P virtual tokens the model runs on P + T positions, the
        virtual ones at 0..P-1, and the logits are the T real positions'."""
        x = with_prompt(self, self.wte(idx))
        T = x.shape[1]
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # position t is row t: every sequence starts at 0
        for block in self.h:
            x = block(x, cos, sin)
        out_embedding = self.wte.weight if self.config.tied else self.lm_head.weight
        logits = classifier(self, real_positions(self, self.ln_f(x)), out_embedding)
        loss = F.cross_entropy(logits.reshape(-1, self.config.V), targets.reshape(-1), ignore_index=MASKED)
        return logits, loss


# The model file's tensors in file order. Per-layer tensors are stored stacked over the layers (L, ...), so
# each name lists one nn.Parameter per layer, and the payload is the concatenation of every listed
# Parameter flattened, in this order.
GLOBAL_HEAD = [("wte", "wte.weight"), ("wpe", "wpe.weight")]
PER_LAYER = [
    ("ln1w", "ln_1.weight"), ("ln1b", "ln_1.bias"),
    ("qkvw", "attn.c_attn.weight"), ("qkvb", "attn.c_attn.bias"),
    ("attprojw", "attn.c_proj.weight"), ("attprojb", "attn.c_proj.bias"),
    ("ln2w", "ln_2.weight"), ("ln2b", "ln_2.bias"),
    ("fcw", "mlp.c_fc.weight"), ("fcb", "mlp.c_fc.bias"),
    ("fcprojw", "mlp.c_proj.weight"), ("fcprojb", "mlp.c_proj.bias"),
]
GLOBAL_TAIL = [("lnfw", "ln_f.weight"), ("lnfb", "ln_f.bias")]
# The Llama file (header word 16 = 1): no wpe, no biases, and lm_head after lnfw unless the embedding is tied
LLAMA_GLOBAL_HEAD = [("wte", "wte.weight")]
LLAMA_PER_LAYER = [
    ("ln1w", "ln_1.weight"), ("qkvw", "attn.c_attn.weight"), ("attprojw", "attn.c_proj.weight"),
    ("ln2w", "ln_2.weight"), ("fcw", "mlp.c_fc.weight"), ("fcprojw", "mlp.c_proj.weight"),
]
LLAMA_GLOBAL_TAIL = [("lnfw", "ln_f.weight")]
LLAMA_LM_HEAD = [("lm_head", "lm_head.weight")]


def params_in_file_order(model):
    """[(file name, [nn.Parameter, ...])] in model-file order (GPT-2's or Llama's)."""
    head, per_layer, tail = GLOBAL_HEAD, PER_LAYER, GLOBAL_TAIL
    if isinstance(model.config, LlamaConfig):
        head, per_layer = LLAMA_GLOBAL_HEAD, LLAMA_PER_LAYER
        tail = LLAMA_GLOBAL_TAIL + ([] if model.config.tied else LLAMA_LM_HEAD)
    order = [(name, [model.get_parameter(path)]) for name, path in head]
    order += [(name, [block.get_parameter(path) for block in model.h]) for name, path in per_layer]
    order += [(name, [model.get_parameter(path)]) for name, path in tail]
    return order


# The functions below take the file order as `order` so that train_moe.py, whose file has another order,
# uses them with its own params_in_file_order.


def flat_parameters(model, order=params_in_file_order):
    """All parameters as one fp32 numpy vector laid out as the model file's payload."""
    tensors = [p.detach().float().reshape(-1).cpu() for _, ps in order(model) for p in ps]
    return torch.cat(tensors).numpy()


def flat_gradients(model, order=params_in_file_order):
    """All parameter gradients as one fp32 numpy vector in the model file's order and layout."""
    tensors = [p.grad.float().reshape(-1).cpu() for _, ps in order(model) for p in ps]
    return torch.cat(tensors).numpy()


def load_flat_parameters(model, flat, order=params_in_file_order):
    """Copies a payload-ordered vector into the model's parameters (the inverse of flat_parameters)."""
    offset = 0
    with torch.no_grad():
        for _, ps in order(model):
            for p in ps:
                values = torch.from_numpy(flat[offset : offset + p.numel()].copy()).view(p.shape)
                p.copy_(values.to(p.dtype))
                offset += p.numel()


def init_weights(model, generator):
    """GPT-2's initialisation, then the test perturbation of every bias and LayerNorm parameter. A Llama gets the
    same: its matrices (wte, qkvw, fcw, lm_head: std 0.02; attprojw, fcprojw, the projections into the residual:
    0.02/sqrt(2L)) and RMSNorm weights (1, then perturbed) drawn in the same order, parameter registration order,
    and lm_head's padded rows zero like wte's."""
    residual_std = INIT_STD / math.sqrt(2 * model.config.L)  # the projections that add into the residual
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                std = residual_std if name.endswith("c_proj.weight") else INIT_STD
                p.normal_(0.0, std, generator=generator)
            elif name.endswith("weight"):  # LayerNorm gain
                p.fill_(1.0)
            else:
                p.zero_()
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=generator) * PERTURB_STD)
        model.wte.weight[model.config.V :].zero_()
        if hasattr(model, "lm_head"):
            model.lm_head.weight[model.config.V :].zero_()


# ----------------------------------------------------------------------------------------------------------
# LoRA fine-tuning (--ft lora): a trainable low-rank update on target Linears of every block and on the classifier,
# the base model frozen

# The targets in adapter order, each with its module path in a block (the same in GPT-2's and the Llama's blocks:
# the qkv projection, the attention's output projection, the MLP's first Linear (the Llama's [gate | up]) and its
# output Linear), then lm_head, the classifier, with no path: one adapter for the whole model (ClassifierLora), and
# last the experts' first and output Linears, a * in the path standing for every expert (train_moe.py's MoE blocks).
# Entry i is bit i of the adapter file's targets word. --ft-targets experts names both experts targets.
LORA_TARGETS = [("qkv", "attn.c_attn"), ("proj", "attn.c_proj"), ("fc", "mlp.c_fc"), ("fc_proj", "mlp.c_proj"),
                ("lm_head", None), ("experts.fc", "moe.experts.*.c_fc"), ("experts.fc_proj", "moe.experts.*.c_proj")]
LORA_TARGET_NAMES = [name for name, _ in LORA_TARGETS]
LORA_TARGET_GROUPS = {"experts": ("experts.fc", "experts.fc_proj")}


class LoraLinear(nn.Module):
    """A Linear with LoRA's update: y = x W^T + b + s (x A^T) B^T, A (r, in), B (out, r). It takes the Linear's place
    in the module tree but holds that Linear's own weight and bias Parameters under their names, so a path such as
    attn.c_attn.weight still names the base weight: params_in_file_order, the payload functions and write_model_file
    see the base model as before."""

    def __init__(self, base, r, s):
        super().__init__()
        self.register_parameter("weight", base.weight)
        self.register_parameter("bias", base.bias)  # None in the Llama
        self.s = s
        out_features, in_features = base.weight.shape
        like = {"dtype": base.weight.dtype, "device": base.weight.device}
        self.lora_A = nn.Parameter(torch.zeros(r, in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(out_features, r, **like))

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + self.s * F.linear(F.linear(x, self.lora_A), self.lora_B)


class ClassifierLora(nn.Module):
    """LoRA's update of the classifier, s (h A^T) B^T with A (r, C) and B (Vp, r), which the model's forward adds to
    the logits h E^T over all Vp columns before it keeps the V real ones (so B's padded rows get a zero gradient).
    It sits beside the output embedding E rather than in its place: E is wte in GPT-2 and in a tied Llama, and the
    update must not reach wte's input lookup."""

    def __init__(self, out_embedding, r, s):
        super().__init__()
        self.s = s
        Vp, C = out_embedding.shape
        like = {"dtype": out_embedding.dtype, "device": out_embedding.device}
        self.lora_A = nn.Parameter(torch.zeros(r, C, **like))
        self.lora_B = nn.Parameter(torch.zeros(Vp, r, **like))

    def forward(self, h):
        return self.s * F.linear(F.linear(h, self.lora_A), self.lora_B)


def modules_at(block, path):
    """The block's modules at `path`, a * standing for every child of a container, in order: in GPT-2 and the Llama
    every block has one of every block target's; in train_moe.py's model only its dense blocks have the MLP's (fc,
    fc_proj), and only its MoE blocks the experts' (one per expert)."""
    found = [block]
    for part in path.split("."):
        found = [child for m in found for child in (m.children() if part == "*" else [getattr(m, part, None)])
                 if isinstance(child, nn.Module)]
    return found


def lora_scale(alpha, r):
    """s = alpha / r in fp32 arithmetic, as the C side computes it (float s = alpha / (float)r)."""
    return float(np.float32(alpha) / np.float32(r))


def add_lora(model, r, alpha, targets):
    """Freezes every parameter of the model and puts a LoraLinear (A and B zero) in place of each target Linear of
    every block that has it, and with lm_head a ClassifierLora (A and B zero) on the model: afterwards only the
    adapter's A and B train."""
    for p in model.parameters():
        p.requires_grad_(False)
    s = lora_scale(alpha, r)
    if "lm_head" in targets:
        model.classifier_lora = ClassifierLora(model.wte.weight, r, s)  # the Llama's lm_head.weight has its shape
    for name, path in LORA_TARGETS:
        if name not in targets or path is None:
            continue
        parent_path, _, child = path.rpartition(".")
        parents = [parent for block in model.h for parent in modules_at(block, parent_path) if hasattr(parent, child)]
        if not parents:
            fail(f"--ft-targets {','.join(targets)}: this model has no {name} Linear")
        for parent in parents:
            setattr(parent, child, LoraLinear(getattr(parent, child), r, s))
    return model


# ----------------------------------------------------------------------------------------------------------
# Bottleneck adapters (--ft adapter; Houlsby et al. 2019): in every block a small trainable MLP added to the
# attention's output and one added to the MLP's output, before their residual adds, the base model frozen

# The sites in adapter order: the block's module whose output the adapter takes (the same names in GPT-2's and the
# Llama's blocks). Entry i is bit i of the adapter file's targets word; a file has both (ADAPTER_SITES_WORD).
ADAPTER_SITES = ["attn", "mlp"]
ADAPTER_SITES_WORD = 3
# One site's tensors in adapter order, by their paths in a BottleneckAdapter
BOTTLENECK_TENSORS = ["down.weight", "down.bias", "up.weight", "up.bias"]


class BottleneckAdapter(nn.Module):
    """h + up(gelu(down(h))): down a Linear C -> r and up one r -> C, both with a bias, and the tanh GELU (GPT-2's,
    in the Llama too). With up zero it passes h through unchanged. Its parameters start zero (init_adapter draws
    them) and the construction draws nothing from torch's global generator."""

    def __init__(self, C, r, like):
        super().__init__()
        self.down = nn.utils.skip_init(nn.Linear, C, r, **like)
        self.gelu = nn.GELU(approximate="tanh")
        self.up = nn.utils.skip_init(nn.Linear, r, C, **like)
        with torch.no_grad():
            for p in self.parameters():
                p.zero_()

    def forward(self, h):
        return h + self.up(self.gelu(self.down(h)))


def apply_bottleneck(site, inputs, output):
    """The forward hook add_bottlenecks puts on a site module: its output through the adapter it holds. A site that
    returns a tuple (train_moe.py's MoE layer: its output and its routing) has the adapter on the first element."""
    if isinstance(output, tuple):
        return (site.bottleneck(output[0]), *output[1:])
    return site.bottleneck(output)


def adapter_site(block, path):
    """A block's module of the site `path` (ADAPTER_SITES): the module at that path, or the one the block's
    `site_paths` names for it (train_moe.py's MoE blocks: their MoE layer, moe, is the FFN site mlp)."""
    return block.get_submodule(getattr(block, "site_paths", {}).get(path, path))


def add_bottlenecks(model, r):
    """Freezes every parameter of the model and gives the attn and the mlp (adapter_site) of every block a
    BottleneckAdapter of width r (zero) under .bottleneck, which a forward hook applies to that module's output, so
    the block's residual add takes the adapted output. The site modules stay in their places, so a path such as
    attn.c_attn.weight still names the base weight: params_in_file_order, the payload functions and write_model_file
    see the base model as before; the hook, not a wrapper's forward, passes the Llama attention's (x, cos, sin) on
    unchanged."""
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.h:
        for path in ADAPTER_SITES:
            site = adapter_site(block, path)
            base = next(site.parameters())
            site.bottleneck = BottleneckAdapter(model.config.C, r, {"dtype": base.dtype, "device": base.device})
            site.register_forward_hook(apply_bottleneck)
    return model


def has_bottlenecks(model):
    return hasattr(adapter_site(model.h[0], ADAPTER_SITES[0]), "bottleneck")


# ----------------------------------------------------------------------------------------------------------
# Prompt tuning (--ft prompt; Lester et al. 2021): P trainable input embeddings, the virtual tokens, before every
# sequence, the base model frozen

PROMPT_SITES_WORD = 1  # the adapter file's targets word of a prompt: bit 0, the input


def add_prompt(model, P):
    """Freezes every parameter of the model and gives it a prompt (P, C) of zeros, which its forward puts before
    every sequence (with_prompt): afterwards only the prompt trains. It is the model's parameter `prompt`, outside
    the model file's paths: params_in_file_order, the payload functions and write_model_file see the base model as
    before."""
    for p in model.parameters():
        p.requires_grad_(False)
    like = {"dtype": model.wte.weight.dtype, "device": model.wte.weight.device}
    model.prompt = nn.Parameter(torch.zeros(P, model.config.C, **like))
    return model


def check_prompt_length(args, config):
    """The model runs on P + T positions, which its position embeddings (GPT-2's wpe, the Llama's rope tables)
    must cover."""
    P = args.ft_rank
    if P + args.T > config.maxT:
        fail(f"--ft-rank {P}: P + T = {P} + {args.T} = {P + args.T} exceeds the model's maxT {config.maxT} (the "
             f"virtual tokens take positions too)")


# ----------------------------------------------------------------------------------------------------------
# Prefix tuning (--ft prefix; Li and Liang 2021) and LLaMA-Adapter (--ft llama_adapter; Zhang et al. 2023): shared keys
# and values in the attention (attention_with_shared_keys), the base model frozen

def attention_modules(model):
    return [block.attn for block in model.h]


def add_prefix(model, P):
    """Freezes the model and gives every block's attention P trainable keys and values (P, NKV*HS) each, zeros."""
    for p in model.parameters():
        p.requires_grad_(False)
    like = {"dtype": model.wte.weight.dtype, "device": model.wte.weight.device}
    for attn in attention_modules(model):
        attn.prefix_keys = nn.Parameter(torch.zeros(P, attn.NKV * attn.HS, **like))
        attn.prefix_values = nn.Parameter(torch.zeros(P, attn.NKV * attn.HS, **like))
    return model


def add_adaption(model, P, K):
    """Freezes the model and gives the attention of each of the top K blocks a trainable prompt (P, C) and gate (1,),
    zeros."""
    for p in model.parameters():
        p.requires_grad_(False)
    like = {"dtype": model.wte.weight.dtype, "device": model.wte.weight.device}
    for attn in attention_modules(model)[len(model.h) - K :]:
        attn.adaption_prompt = nn.Parameter(torch.zeros(P, model.config.C, **like))
        attn.adaption_gate = nn.Parameter(torch.zeros(1, **like))
    return model


def has_shared_keys(model, kind):
    attn = model.h[-1].attn
    return (attn.prefix_keys if kind == "prefix" else attn.adaption_prompt) is not None


def adapter_in_file_order(model):
    """[(name, [nn.Parameter per layer])] in adapter order. LoRA: for each target the model has, in LORA_TARGETS'
    order, A stacked over the layers that have its Linear (L, r, in; train_moe.py's fc and fc_proj: its dense layers;
    its experts': every expert of every MoE layer, (Lm, E, r, in)), then B (L, out, r); lm_head's, one pair for the
    model, as one layer's: A (1, r, C), B (1, Vp, r). Bottleneck adapters: for each site, in ADAPTER_SITES' order, down.weight stacked over
    the layers (L, r, C), down.bias (L, r), up.weight (L, C, r), up.bias (L, C). A prompt: the one tensor prompt
    (P, C), row-major. A prefix: the keys stacked over the layers (L, P, NKV*HS), then the values. LLaMA-Adapter: the
    prompts of its K layers, bottom up (K, P, C), then their gates (K). It is an `order` for flat_parameters and the
    functions beside it, which then read and write the adapter instead of the model."""
    if model.prompt is not None:
        return [("prompt", [model.prompt])]
    if has_shared_keys(model, "prefix"):
        attns = attention_modules(model)
        return [("prefix.keys", [a.prefix_keys for a in attns]), ("prefix.values", [a.prefix_values for a in attns])]
    if has_shared_keys(model, "llama_adapter"):
        attns = [a for a in attention_modules(model) if a.adaption_prompt is not None]
        return [("adaption.prompts", [a.adaption_prompt for a in attns]),
                ("adaption.gates", [a.adaption_gate for a in attns])]
    if has_bottlenecks(model):
        return [(f"{path}.{tensor}", [adapter_site(block, path).bottleneck.get_parameter(tensor) for block in model.h])
                for path in ADAPTER_SITES for tensor in BOTTLENECK_TENSORS]
    order = []
    for name, path in LORA_TARGETS:
        if path is None:
            if model.classifier_lora is not None:
                order += [(name + "_A", [model.classifier_lora.lora_A]), (name + "_B", [model.classifier_lora.lora_B])]
            continue
        linears = [m for block in model.h for m in modules_at(block, path)]
        if linears and isinstance(linears[0], LoraLinear):
            order += [(name + "_A", [m.lora_A for m in linears]), (name + "_B", [m.lora_B for m in linears])]
    return order


def init_adapter(model, generator, b_std):
    """LoRA: every A ~ N(0, std 1/r), in adapter order, then every B ~ N(0, b_std), or B = 0 when b_std is 0 (a fresh
    fine-tune's start: the model computes what its base does until B moves). The A's do not depend on b_std.
    Bottleneck adapters: in adapter order, each layer's down.weight ~ N(0, ADAPTER_DOWN_STD) and each of its other
    tensors ~ N(0, b_std), or zero when b_std is 0 (a fresh fine-tune's start: with up zero every site passes its
    output through unchanged). A prompt: ~ N(0, PROMPT_STD) whatever b_std (no prompt leaves the logits as the base's,
    so a fresh one has no reason to start zero), and so are a prefix's keys and values (PREFIX_STD). LLaMA-Adapter:
    the prompts ~ N(0, ADAPTION_STD), then the gates ~ N(0, REFERENCE_GATE_STD) when b_std > 0, else zero (a fresh
    fine-tune's start: the model is its base)."""
    order = adapter_in_file_order(model)
    if model.prompt is not None:
        with torch.no_grad():
            model.prompt.normal_(0.0, PROMPT_STD, generator=generator)
        return
    if has_shared_keys(model, "prefix") or has_shared_keys(model, "llama_adapter"):
        with torch.no_grad():
            for name, ps in order:
                std = {"adaption.prompts": ADAPTION_STD, "adaption.gates": REFERENCE_GATE_STD if b_std > 0 else 0.0}
                for p in ps:
                    if std.get(name, PREFIX_STD) > 0:
                        p.normal_(0.0, std.get(name, PREFIX_STD), generator=generator)
                    else:
                        p.zero_()
        return
    if has_bottlenecks(model):
        with torch.no_grad():
            for name, ps in order:
                std = ADAPTER_DOWN_STD if name.endswith("down.weight") else b_std
                for p in ps:
                    if std > 0:
                        p.normal_(0.0, std, generator=generator)
                    else:
                        p.zero_()
        return
    with torch.no_grad():
        for name, ps in order:
            for p in ps:
                if name.endswith("_A"):
                    p.normal_(0.0, 1.0 / p.shape[0], generator=generator)
        for name, ps in order:
            for p in ps:
                if not name.endswith("_B"):
                    continue
                if b_std > 0:
                    p.normal_(0.0, b_std, generator=generator)
                else:
                    p.zero_()


FT_FILE_CONTENTS = {"adapter": "bottleneck adapters", "prompt": "a prompt", "prefix": "a prefix",
                    "llama_adapter": "an adaption prompt"}  # what a non-LoRA adapter file holds


def uses_adapter(args):
    return args.ft is not None or args.adapter_from_file is not None


def add_adapter(model, args):
    """Puts the run's adapter (--ft and its flags, args.ft*) on the model, its parameters zero (a prompt's P + T
    positions checked against the model's maxT)."""
    if args.ft == "adapter":
        add_bottlenecks(model, args.ft_rank)
    elif args.ft == "prompt":
        check_prompt_length(args, model.config)
        add_prompt(model, args.ft_rank)
    elif args.ft == "prefix":
        add_prefix(model, args.ft_rank)
    elif args.ft == "llama_adapter":
        if args.ft_layers > model.config.L:
            fail(f"--ft-layers {args.ft_layers}: more than the model's {model.config.L} layers")
        add_adaption(model, args.ft_rank, args.ft_layers or model.config.L)
    else:
        add_lora(model, args.ft_rank, args.ft_alpha, args.ft_targets)


def adapter_shape(args):
    """The run's adapter in words, for messages."""
    if args.ft == "adapter":
        return f"rank {args.ft_rank} at {','.join(ADAPTER_SITES)}"
    if args.ft == "prompt":
        return f"{args.ft_rank} virtual tokens at the input"
    if args.ft == "prefix":
        return f"{args.ft_rank} keys and values in every attention"
    if args.ft == "llama_adapter":
        return f"{args.ft_rank} prompt rows in " + (f"the top {args.ft_layers} layers" if args.ft_layers else
                                                       "every layer")
    return f"rank {args.ft_rank} on {','.join(args.ft_targets)}"


def adapter_for_run(model, args, b_std):
    """Puts the adapter of --adapter-from-file on the model, or a fresh one of --ft's method (init_adapter with a
    generator seeded with --seed + 1 and b_std), and returns its step. With a file, the file's method, rank, and with
    LoRA its targets and alpha become the run's (args.ft*): a flag given that says otherwise is refused (with a
    bottleneck adapter or prompt file, --ft-alpha and --ft-targets at all), as is a file made for another base than
    --model-from-file."""
    if args.adapter_from_file is None:
        add_adapter(model, args)
        init_adapter(model, torch.Generator().manual_seed(args.seed + 1), b_std)
        return 0
    path = args.adapter_from_file
    h, payload = read_adapter_file(path)
    found = {"ft": next(name for name, number in FT_METHODS.items() if number == h[2]), "ft_rank": int(h[3])}
    if found["ft"] == "llama_adapter":
        found["ft_layers"] = int(h[4])
    if found["ft"] == "lora":
        found["ft_targets"] = tuple(name for i, name in enumerate(LORA_TARGET_NAMES) if h[4] >> i & 1)
        found["ft_alpha"] = fp32_from_bits(h[5])
    else:
        given = [flag for flag in LORA_ONLY_FLAGS if getattr(args, FT_FLAGS[flag]) is not None]
        if given:
            fail(f"{given[0]} applies to --ft lora only; {path} holds {FT_FILE_CONTENTS[found['ft']]} (--ft "
                 f"{found['ft']})")
    for name, value in found.items():
        given = getattr(args, name)
        if given is not None and given != value:
            show = (lambda v: ",".join(v)) if name == "ft_targets" else str
            fail(f"--{name.replace('_', '-')} {show(given)} disagrees with {path}, made with {show(value)}")
        setattr(args, name, value)
    add_adapter(model, args)
    count = sum(p.numel() for _, ps in adapter_in_file_order(model) for p in ps)
    if h[11] != count:
        fail(f"{path}: holds {h[11]} adapter values; {adapter_shape(args)} of this model needs {count}")
    if len(payload) < count * 4:
        fail(f"{path}: payload is {len(payload)} bytes, its {count} adapter values need {count * 4}")
    if args.model_from_file is not None:
        size, checksum = file_checksum(args.model_from_file)
        if (size, checksum) != (u64_from_words(h[8:10]), u64_from_words(h[6:8])):
            fail(f"{path} was made for another base model than {args.model_from_file}: it names checksum "
                 f"{u64_from_words(h[6:8]):#018x}, size {u64_from_words(h[8:10])}; the model file has "
                 f"{checksum:#018x}, {size}")
    load_flat_parameters(model, np.frombuffer(payload, dtype="<f4", count=count), adapter_in_file_order)
    return int(h[10])


# ----------------------------------------------------------------------------------------------------------
# bf16 and the files


def bf16_bits(values):
    """float32 -> bf16 bit patterns (uint16), rounding to nearest, ties to even; NaN stays a quiet NaN."""
    bits = np.ascontiguousarray(values, dtype="<f4").view("<u4").astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return np.where(np.isnan(values), (bits >> 16) | 0x40, rounded).astype("<u2")


def bf16_to_float(bits):
    """bf16 bit patterns (uint16) -> float32, exactly."""
    return (bits.astype("<u4") << 16).view("<f4")


def header(*fields):
    h = np.zeros(HEADER_INTS, dtype="<i4")
    h[: len(fields)] = fields
    return h


def write_file(path, *arrays):
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "wb") as f:
            for a in arrays:
                f.write(a.tobytes())
    except OSError as e:
        fail(f"cannot write {path}: {e.strerror}")


def read_file(path, what):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        fail(f"cannot read {what} {path}: {e.strerror}")
    if len(data) < HEADER_INTS * 4:
        fail(f"{what} {path} is too short for its {HEADER_INTS * 4}-byte header ({len(data)} bytes)")
    return np.frombuffer(data, dtype="<i4", count=HEADER_INTS), data[HEADER_INTS * 4 :]


def fp32_bits(value):
    """The bits of value rounded to fp32, as the int32 a header word holds."""
    return int(np.array([value], dtype="<f4").view("<i4")[0])


def fp32_from_bits(word):
    return float(np.array([word], dtype="<i4").view("<f4")[0])


def fp32(value):
    """value rounded to fp32 (the C side's eps and theta are floats, and the file stores those)."""
    with np.errstate(over="ignore"):  # a value beyond fp32's range becomes inf, which the checks refuse
        return float(np.float32(value))


def debug_state_header(args, config, words=None):
    """The debug state's header: B, T, the steps, V and Vp, the steps' optimizer and the seed, then `words`
    ({index: value}: train_moe.py's own)."""
    h = header(STATE_MAGIC, STATE_VERSION, args.B, args.T, args.steps, config.V, config.Vp)
    optimizer = (args.lr, args.beta1, args.beta2, args.eps, args.weight_decay, args.grad_clip)
    h[STATE_OPTIMIZER_WORD : STATE_OPTIMIZER_WORD + len(optimizer)] = [fp32_bits(value) for value in optimizer]
    h[STATE_SEED_WORD] = args.seed
    for index, value in (words or {}).items():
        h[index] = value
    return h


def write_model_file(path, model, version):
    c = model.config
    fields = [MODEL_MAGIC, version, c.maxT, c.V, c.L, c.NH, c.C, c.Vp]
    if isinstance(c, LlamaConfig):
        fields += [0] * (FAMILY_WORD - len(fields))
        fields += [FAMILY_LLAMA, c.NKV, fp32_bits(c.rope_theta), c.H, fp32_bits(c.norm_eps), int(c.tied)]
    write_file(path, header(*fields), model_payload(model, version == MODEL_VERSION_BF16))


def model_payload(model, bf16, order=params_in_file_order):
    """A model file's payload: the parameters in file order, fp32, or rounded to bf16 bit patterns."""
    flat = flat_parameters(model, order)
    return bf16_bits(flat) if bf16 else flat


def load_model_payload(model, path, Vp, payload, bf16, order=params_in_file_order):
    """Fills a model built from a model file's header with the file's payload (bf16 values widened exactly to
    fp32), after checking that the header's padded vocabulary Vp and the payload's size fit the model."""
    if Vp != model.config.Vp:
        fail(f"{path}: padded vocabulary {Vp} is not V={model.config.V} rounded up to a multiple of {VOCAB_PAD}")
    count = sum(p.numel() for p in model.parameters())
    item = 2 if bf16 else 4
    if len(payload) != count * item:
        fail(f"{path}: payload is {len(payload)} bytes, the header's shape needs {count * item}")
    flat = bf16_to_float(np.frombuffer(payload, dtype="<u2")) if bf16 else np.frombuffer(payload, dtype="<f4")
    load_flat_parameters(model, flat, order)


def read_model_file(path):
    """Builds a GPT from a model file (fp32 or bf16); bf16 values are widened exactly to fp32."""
    h, payload = read_file(path, "model file")
    if h[0] != MODEL_MAGIC:
        fail(f"{path} is not a GPT model file (magic {h[0]}, expected {MODEL_MAGIC})")
    if h[1] not in (MODEL_VERSION_FP32, MODEL_VERSION_BF16):
        fail(f"{path}: model file version {h[1]} is unknown (3 = fp32, 5 = bf16)")
    maxT, V, L, NH, C, Vp = (int(v) for v in h[2:8])
    if min(maxT, V, L, NH, C) < 1 or C % NH != 0:
        fail(f"{path}: bad model shape maxT={maxT} V={V} L={L} NH={NH} C={C}")
    family = int(h[FAMILY_WORD])
    if family == FAMILY_GPT2:
        if h[FAMILY_WORD + 1 : FAMILY_WORD + 6].any():
            fail(f"{path}: a GPT-2 file (header[{FAMILY_WORD}] = 0) with non-zero Llama words "
                 f"header[{FAMILY_WORD + 1}..{FAMILY_WORD + 5}]")
        model = GPT(GPTConfig(maxT=maxT, V=V, L=L, NH=NH, C=C))
    elif family == FAMILY_LLAMA:
        NKV, theta_bits, H, eps_bits, tied = (int(v) for v in h[FAMILY_WORD + 1 : FAMILY_WORD + 6])
        theta, eps = fp32_from_bits(theta_bits), fp32_from_bits(eps_bits)
        check_llama_shape(NH, C, NKV, theta, H, eps, tied, path)
        model = Llama(LlamaConfig(maxT=maxT, V=V, L=L, NH=NH, C=C, NKV=NKV, rope_theta=theta, H=H, norm_eps=eps,
                                  tied=bool(tied)))
    else:
        fail(f"{path}: model family header[{FAMILY_WORD}] = {family} is unknown (0 = gpt2, 1 = llama)")
    load_model_payload(model, path, Vp, payload, h[1] == MODEL_VERSION_BF16)
    return model


def file_checksum(path):
    """(size in bytes, checksum) of a file, the C side's checkpoint_checksum: the file's complete 64-bit
    little-endian words w in order, h = ((h ^ w) * 0x9E3779B97F4A7C15) mod 2^64, h ^= h >> 29, from h =
    0xcbf29ce484222325; then each trailing byte c, h = ((h ^ c) * 0x100000001b3) mod 2^64. Read in 1 MiB chunks as
    the C side reads it (a chunk but the last is a whole number of words). Each word depends on the hash before it,
    so this is a Python loop: about 10 s for a 500 MB model file."""
    mask = (1 << 64) - 1
    h, size = 0xCBF29CE484222325, 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                words = len(chunk) // 8
                for w in np.frombuffer(chunk, dtype="<u8", count=words).tolist():
                    h = ((h ^ w) * 0x9E3779B97F4A7C15) & mask
                    h ^= h >> 29
                for c in chunk[8 * words :]:
                    h = ((h ^ c) * 0x100000001B3) & mask
                size += len(chunk)
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    return size, h


def u64_words(value):
    """A uint64 as two int32 header words, the low 32 bits first."""
    return [int(w) for w in np.array([value], dtype="<u8").view("<i4")]


def u64_from_words(words):
    return int(np.array(words, dtype="<i4").view("<u8")[0])


def write_adapter_file(path, model, args, base_path, step):
    """The adapter file (layout: ADAPTER_MAGIC) of the model's adapter, for the base model file base_path."""
    size, checksum = file_checksum(base_path)
    flat = flat_parameters(model, adapter_in_file_order)
    if args.ft == "adapter":
        targets, alpha = ADAPTER_SITES_WORD, 0.0
    elif args.ft in ("prompt", "prefix"):
        targets, alpha = PROMPT_SITES_WORD, 0.0
    elif args.ft == "llama_adapter":
        targets, alpha = args.ft_layers or model.config.L, 0.0
    else:
        targets = sum(1 << i for i, name in enumerate(LORA_TARGET_NAMES) if name in args.ft_targets)
        alpha = args.ft_alpha
    fields = [ADAPTER_MAGIC, ADAPTER_VERSION, FT_METHODS[args.ft], args.ft_rank, targets, fp32_bits(alpha),
              *u64_words(checksum), *u64_words(size), step, flat.size, 0]
    write_file(path, header(*fields), flat.astype("<f4"))


def read_adapter_file(path):
    """An adapter file's header and payload, after the checks that need no model: magic, version, method, rank,
    targets and alpha (a bottleneck adapter's: both sites, alpha 0.0; a prompt's: the input, alpha 0.0;
    adapter_for_run checks the rest)."""
    h, payload = read_file(path, "adapter file")
    if h[0] != ADAPTER_MAGIC:
        fail(f"{path} is not an adapter file (magic {h[0]}, expected {ADAPTER_MAGIC})")
    if h[1] != ADAPTER_VERSION:
        fail(f"{path}: adapter file version {h[1]} is unknown (expected {ADAPTER_VERSION})")
    if h[2] not in FT_METHODS.values():
        fail(f"{path}: fine-tuning method {h[2]} is unknown (1 = lora, 2 = adapter, 3 = prompt, 4 = prefix, "
             f"5 = llama_adapter)")
    if h[2] == FT_METHODS["adapter"]:
        if h[3] < 1:
            fail(f"{path}: bottleneck width {h[3]} must be >= 1")
        if h[4] != ADAPTER_SITES_WORD:
            fail(f"{path}: a bottleneck adapter file's sites word is {h[4]}, must be {ADAPTER_SITES_WORD} "
                 f"(both sites: {','.join(ADAPTER_SITES)})")
        if h[5] != fp32_bits(0.0):
            fail(f"{path}: a bottleneck adapter file's alpha word is {int(h[5]) & 0xFFFFFFFF:#010x}, must be 0 (fp32 "
                 f"0.0: no alpha)")
    elif h[2] in (FT_METHODS["prompt"], FT_METHODS["prefix"], FT_METHODS["llama_adapter"]):
        what = next(name for name, number in FT_METHODS.items() if number == h[2])
        if h[3] < 1:
            fail(f"{path}: a {what} file's length {h[3]} must be >= 1")
        if h[2] == FT_METHODS["llama_adapter"] and h[4] < 1:
            fail(f"{path}: a llama_adapter file's layers word is {h[4]}, must be >= 1")
        if h[2] != FT_METHODS["llama_adapter"] and h[4] != PROMPT_SITES_WORD:
            fail(f"{path}: a {what} file's targets word is {h[4]}, must be {PROMPT_SITES_WORD}")
        if h[5] != fp32_bits(0.0):
            fail(f"{path}: a {what} file's alpha word is {int(h[5]) & 0xFFFFFFFF:#010x}, must be 0 (fp32 0.0: no "
                 f"alpha)")
    else:
        if h[3] < 1:
            fail(f"{path}: LoRA rank {h[3]} must be >= 1")
        if not 1 <= h[4] < 1 << len(LORA_TARGETS):
            fail(f"{path}: targets word {h[4]} names no target or an unknown one (bits 0..{len(LORA_TARGETS) - 1}: "
                 f"{','.join(LORA_TARGET_NAMES)})")
        if not math.isfinite(fp32_from_bits(h[5])):
            fail(f"{path}: LoRA alpha {fp32_from_bits(h[5])} must be finite")
    if h[10] < 0:
        fail(f"{path}: negative step {h[10]} in header word 10")
    return h, payload


def check_llama_shape(NH, C, NKV, theta, H, eps, tied, where):
    """Refuses a Llama shape the model cannot have; `where` names the flags or the file."""
    if NKV < 1 or NH % NKV != 0:
        fail(f"{where}: {NKV} key/value heads do not divide the {NH} heads")
    if (C // NH) % 2 != 0:
        fail(f"{where}: RoPE needs an even head size (C={C} / NH={NH} = {C // NH})")
    if not (math.isfinite(theta) and theta > 0):
        fail(f"{where}: RoPE theta {theta} must be finite and positive (as an fp32)")
    if H < 1:
        fail(f"{where}: SwiGLU hidden size {H} must be positive")
    if not (math.isfinite(eps) and eps > 0):
        fail(f"{where}: RMSNorm eps {eps} must be finite and positive (as an fp32)")
    if tied not in (0, 1):
        fail(f"{where}: tied output embedding is {tied}, must be 0 or 1")


def read_shard(path):
    """The tokens of one data shard (version 1: uint16, version 2: uint32) as int64."""
    h, payload = read_file(path, "data shard")
    if h[0] != SHARD_MAGIC:
        fail(f"{path} is not a data shard (magic {h[0]}, expected {SHARD_MAGIC})")
    if h[1] not in (1, 2):
        fail(f"{path}: shard version {h[1]} is unknown (1 = uint16, 2 = uint32)")
    dtype = "<u2" if h[1] == 1 else "<u4"
    if len(payload) != h[2] * np.dtype(dtype).itemsize:
        fail(f"{path}: header says {h[2]} tokens, the payload holds {len(payload) // np.dtype(dtype).itemsize}")
    return np.frombuffer(payload, dtype=dtype).astype(np.int64)


def read_mask(path, ntok):
    """A shard's loss mask, PATH.mask: one flag per token (1: counts as a target), as bool; None without one."""
    if not os.path.exists(path + ".mask"):
        return None
    h, payload = read_file(path + ".mask", "loss mask")
    if h[0] != MASK_MAGIC or h[1] != MASK_VERSION:
        fail(f"{path}.mask is not a loss mask (magic {h[0]}, version {h[1]}; expected {MASK_MAGIC}, {MASK_VERSION})")
    if h[2] != ntok or len(payload) != ntok:
        fail(f"{path}.mask: {len(payload)} flags; expected one per token of {path} ({ntok})")
    return np.frombuffer(payload, dtype=np.uint8) == 1


class ShardLoader:
    """Sequential (B, T) batches over the shards matching a glob, in sorted order, wrapping around; a target whose
    shard's loss mask hides it is MASKED."""

    def __init__(self, pattern, B, T, V):
        self.files = sorted(glob.glob(pattern))
        if not self.files:
            fail(f"no data shard matches {pattern}")
        self.B, self.T, self.V = B, T, V
        self.shard = -1
        self.next_shard()

    def next_shard(self):
        self.shard = (self.shard + 1) % len(self.files)
        path = self.files[self.shard]
        self.tokens = read_shard(path)
        self.mask = read_mask(path, len(self.tokens))
        if len(self.tokens) < self.B * self.T + 1:
            fail(f"{path} holds {len(self.tokens)} tokens, one batch needs {self.B * self.T + 1}")
        if self.tokens.max() >= self.V:
            fail(f"{path} holds token {self.tokens.max()}, outside the model's vocabulary V={self.V}")
        self.position = 0

    def next_batch(self):
        n = self.B * self.T
        if self.position + n + 1 > len(self.tokens):
            self.next_shard()
        chunk = torch.from_numpy(self.tokens[self.position : self.position + n + 1])
        x, y = chunk[:-1].view(self.B, self.T), chunk[1:].clone().view(self.B, self.T)  # y's masking leaves x
        if self.mask is not None:
            y[torch.from_numpy(~self.mask[self.position + 1 : self.position + n + 1]).view(self.B, self.T)] = MASKED
        self.position += n
        return x, y


# ----------------------------------------------------------------------------------------------------------
# Training pieces shared by the reference and the baseline


def trainable_parameters(model):
    """The parameters that train: all of them, or with --ft only the adapter's (add_lora, add_bottlenecks and
    add_prompt freeze the others)."""
    return [p for p in model.parameters() if p.requires_grad]


def make_optimizer(model, args, device):
    """AdamW over the trainable parameters, with weight decay on the 2-D ones (wte, wpe, the matmul weights, a LoRA
    adapter's A and B, a bottleneck adapter's down.weight and up.weight, the prompt) only."""
    decay = [p for p in trainable_parameters(model) if p.dim() >= 2]
    no_decay = [p for p in trainable_parameters(model) if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]  # a LoRA adapter or a prompt has no 1-D parameter
    extra = {"fused": True} if device == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps, **extra)


def clip_gradients(model, grad_clip):
    """Clips the global gradient norm of the trainable parameters to grad_clip (<= 0: no clipping); returns the norm
    before clipping."""
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    return torch.nn.utils.clip_grad_norm_(trainable_parameters(model), max_norm).item()


def model_for_run(args):
    """The model of --model-from-file (whose header gives the shape and the architecture), or a fresh init of
    the architecture and shape the flags give, drawn from a generator seeded with --seed."""
    if args.model_from_file:
        return read_model_file(args.model_from_file)
    if args.arch == "llama":
        model = Llama(LlamaConfig(maxT=args.maxT, V=args.V, L=args.L, NH=args.NH, C=args.C, NKV=args.kv_heads,
                                  rope_theta=args.rope_theta, H=args.ffn_hidden, norm_eps=args.norm_eps,
                                  tied=bool(args.tie_embeddings)))
    else:
        model = GPT(GPTConfig(maxT=args.maxT, V=args.V, L=args.L, NH=args.NH, C=args.C))
    init_weights(model, torch.Generator().manual_seed(args.seed))
    return model


def pick_device(name):
    if name == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device")
    return name


def backward(loss, model):
    """loss.backward(), then a zero gradient for every trainable parameter the loss did not reach (in train_moe.py,
    an expert that got no token; in GPT-2 the loss reaches every parameter): torch's AdamW skips a parameter
    without a gradient, with no weight decay and no moment update, where the C trainer updates every
    parameter every step. A frozen parameter (--ft) keeps no gradient."""
    loss.backward()
    for p in trainable_parameters(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def gpt_losses(model, x, y):
    """One forward pass as the loops below take it: (the loss to differentiate, the loss to print, the step
    line's fields between loss and norm). GPT-2 differentiates the loss it prints and adds no fields."""
    _, loss = model(x, y)
    return loss, loss, lambda: ""


def check_sequence_length(args, config):
    if args.T > config.maxT:
        fail(f"--T {args.T} is longer than the model's maxT {config.maxT}")


def make_deterministic():
    """The C tests compare against the reference's numbers: no TF32 and no nondeterministic kernels."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # a GPU op without a deterministic kernel warns
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def reference_batch(args, config):
    """The (x, y) batch the reference trains on. It has its own generator, so that --model-from-file with the
    same seed sees the same batch, and train_moe.py draws the same batch as this file for the same --seed."""
    check_sequence_length(args, config)
    generator = torch.Generator().manual_seed(args.seed)
    x = torch.randint(0, config.V, (args.B, args.T), generator=generator)
    y = torch.randint(0, config.V, (args.B, args.T), generator=generator)
    if args.mask_fraction > 0:  # a loss mask: each target hidden with this probability
        y[torch.rand((args.B, args.T), generator=generator) < args.mask_fraction] = MASKED
    return x, y


def reference_step_losses(model, args, device, x, y, losses, after_step=None):
    """The printed loss of each of --steps AdamW steps on the batch (x, y): each step's forward loss before
    its update. `losses` is gpt_losses or its train_moe.py counterpart; after_step(model), if given, runs after
    each update (train_moe.py's balancing-bias update)."""
    optimizer = make_optimizer(model, args, device)
    step_losses = []
    for _ in range(args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss, printed_loss, _ = losses(model, x, y)
        backward(loss, model)
        clip_gradients(model, args.grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step(model)
        step_losses.append(printed_loss.item())
    return step_losses


def train_loop(args, build_model, losses, after_step=None):
    """--train's loop (here and in train_moe.py): --steps AdamW steps on --input-bin batches, one step line each,
    for the model build_model(args) gives. `losses` is gpt_losses or its train_moe.py counterpart; after_step(model),
    if given, runs after each update."""
    device = pick_device(args.device)
    if device == "cuda":  # a speed baseline: the C trainer's fp32 matmuls use TF32 too
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    model = build_model(args)
    config = model.config
    check_sequence_length(args, config)
    loader = ShardLoader(args.input_bin, args.B, args.T, config.V)
    model.to(device)
    optimizer = make_optimizer(model, args, device)
    step_model = model
    if args.compile:
        if not HAS_COMPILE:
            fail(f"--compile: this torch ({torch.__version__}) has no torch.compile")
        step_model = torch.compile(model)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16) if args.dtype == "bfloat16" else nullcontext()

    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        x, y = (t.to(device) for t in loader.next_batch())
        with autocast:
            loss, printed_loss, extra_fields = losses(step_model, x, y)
        backward(loss, model)
        norm = clip_gradients(model, args.grad_clip)
        optimizer.step()
        if after_step is not None:
            after_step(model)
        optimizer.zero_grad(set_to_none=True)
        loss_value = printed_loss.item()  # waits for the device
        elapsed = time.perf_counter() - start
        print(f"step {step}/{args.steps} | loss {loss_value:f} | {extra_fields()}norm {norm:f} | lr {args.lr:e} | "
              f"{elapsed * 1000:.2f} ms | {args.B * args.T / elapsed:.0f} tok/s", flush=True)


# ----------------------------------------------------------------------------------------------------------
# The modes


def write_reference(args):
    device = pick_device(args.device)
    make_deterministic()
    model = model_for_run(args)
    config = model.config
    x, y = reference_batch(args, config)

    version = MODEL_VERSION_FP32
    if args.dtype == "bfloat16":
        # the C BF16 build starts from these rounded values; the reference still computes in fp32
        load_flat_parameters(model, bf16_to_float(bf16_bits(flat_parameters(model))))
        version = MODEL_VERSION_BF16
    model_path = args.write_reference + "_model.bin"
    write_model_file(model_path, model, version)
    order, words, wrote = params_in_file_order, None, f"{model_path} (version {version})"
    if uses_adapter(args):
        step = adapter_for_run(model, args, REFERENCE_B_STD)
        order, words = adapter_in_file_order, {STATE_FT_WORD: FT_METHODS[args.ft]}
        if args.dtype == "bfloat16":  # the C BF16 build holds the adapter in bf16 too
            load_flat_parameters(model, bf16_to_float(bf16_bits(flat_parameters(model, order))), order)
        adapter_path = args.write_reference + "_adapter.bin"
        write_adapter_file(adapter_path, model, args, model_path, step)
        wrote += f", {adapter_path} ({args.ft} {adapter_shape(args)})"

    model.to(device)
    x, y = x.to(device), y.to(device)
    logits, loss = model(x, y)
    loss.backward()
    first_logits = logits.detach().float().cpu().numpy().astype("<f4")
    first_loss = np.array([loss.item()], dtype="<f4")
    first_grads = flat_gradients(model, order)  # with --ft the adapter's: the base is frozen
    step_losses = reference_step_losses(model, args, device, x, y, gpt_losses)

    state_path = args.write_reference + "_debug_state.bin"
    write_file(
        state_path, debug_state_header(args, config, words),
        x.cpu().numpy().astype("<i4"), y.cpu().numpy().astype("<i4"),
        first_logits, first_loss, first_grads, np.array(step_losses, dtype="<f4"),
    )
    print(f"wrote {wrote} and {state_path}: loss {first_loss[0]:.6f}")
    if step_losses:
        print(f"losses of {args.steps} steps: {step_losses[0]:.6f} ... {step_losses[-1]:.6f}")


def write_shard(args):
    if not 1 <= args.V <= 65536:
        fail(f"--write-shard stores uint16 tokens: --V must be in 1..65536 (got {args.V})")
    if args.shard_tokens < 1:
        fail(f"--shard-tokens must be positive (got {args.shard_tokens})")
    generator = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, args.V, (args.shard_tokens,), generator=generator).numpy().astype("<u2")
    write_file(args.write_shard, header(SHARD_MAGIC, 1, args.shard_tokens), tokens)
    print(f"wrote {args.write_shard}: {args.shard_tokens} tokens in [0, {args.V})")


def write_tokenizer(args):
    if args.V != BYTE_VOCAB_SIZE:
        fail(f"--write-tokenizer writes the byte-level vocabulary only: it needs --V {BYTE_VOCAB_SIZE} (got {args.V})")
    eot = BYTE_VOCAB_SIZE - 1
    entries = b"".join(bytes([1, b]) for b in range(256)) + bytes([len(EOT_TEXT)]) + EOT_TEXT
    write_file(args.write_tokenizer, header(TOKENIZER_MAGIC, TOKENIZER_VERSION, BYTE_VOCAB_SIZE, eot),
               np.frombuffer(entries, dtype=np.uint8))
    print(f"wrote {args.write_tokenizer}: byte-level vocabulary of {BYTE_VOCAB_SIZE} tokens, EOT {eot}")


def train(args):
    train_loop(args, with_adapter(model_for_run, adapter_for_run), gpt_losses)


def with_adapter(model_for_run, adapter_for_run):
    """--train's model builder: model_for_run's model, with --ft adapter_for_run's adapter on it (fresh: LoRA's B, the
    bottleneck's up zero; a prompt drawn). train_moe.py passes its own two."""
    def build(args):
        model = model_for_run(args)
        if uses_adapter(args):
            adapter_for_run(model, args, b_std=0.0)
        return model
    return build


# ----------------------------------------------------------------------------------------------------------


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag gets one line (no usage block) and exit status 1 like any other bad input."""

    def error(self, message):
        fail(message)


def parse_args(argv):
    p = OneLineParser(description="PyTorch reference GPT-2 (and --arch llama) for switch.cu "
                                  "(see the comment at the top).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-reference", metavar="PREFIX", help="write PREFIX_model.bin and PREFIX_debug_state.bin")
    mode.add_argument("--write-shard", metavar="PATH", help="write a data shard of seeded random tokens")
    mode.add_argument("--write-tokenizer", metavar="PATH", help="write the byte-level tokenizer file (--V 257)")
    mode.add_argument("--train", action="store_true", help="train on --input-bin shards, printing step lines")
    p.add_argument("--model-from-file", metavar="PATH",
                   help="start from this model file (fp32 or bf16); its header overrides the shape and --arch flags")
    p.add_argument("--input-bin", metavar="PATTERN", help="glob of training shards (--train)")
    p.add_argument("--shard-tokens", type=int, default=4096, help="tokens in the shard (--write-shard)")
    add_shape_flags(p)
    add_arch_flags(p)
    add_run_flags(p, "reference: bf16-round the written parameters; train: bf16 autocast", grad_clip=1.0)
    add_ft_flags(p)
    args = p.parse_args(argv)

    if min(args.B, args.T, args.V, args.L, args.NH, args.C, args.maxT) < 1:
        fail("--B --T --V --L --NH --C --maxT must all be positive")
    if args.C % args.NH != 0:
        fail(f"--C {args.C} is not a multiple of --NH {args.NH}")
    check_arch_flags(args)
    check_run_flags(args)
    check_ft_flags(args)
    return args


FT_FLAGS = {"--ft-rank": "ft_rank", "--ft-alpha": "ft_alpha", "--ft-targets": "ft_targets", "--ft-layers": "ft_layers"}
LORA_ONLY_FLAGS = ["--ft-alpha", "--ft-targets"]


def add_ft_flags(p):
    p.add_argument("--ft", choices=list(FT_METHODS), help="fine-tune with a parameter-efficient method: lora = a "
                   "trainable low-rank update of the target Linears on a frozen base; adapter = a trainable "
                   "bottleneck h + up(gelu(down(h))) on each block's attention and MLP outputs on a frozen base; "
                   "prompt = --ft-rank trainable virtual tokens before every sequence on a frozen base; prefix = "
                   "--ft-rank trainable keys and values in every attention; llama_adapter = --ft-rank trainable "
                   "prompt rows in the top --ft-layers attentions, gated (default: none, all parameters train)")
    p.add_argument("--ft-rank", type=int, metavar="R", help=f"LoRA rank r (default {LORA_RANK}), the bottleneck "
                   f"adapters' width r (default {ADAPTER_RANK}), or the prompt's virtual tokens P (default "
                   f"{PROMPT_LENGTH}; P + T <= maxT), the prefix's keys and values per layer (default "
                   f"{PREFIX_LENGTH}) or llama_adapter's prompt rows per layer (default {ADAPTION_LENGTH})")
    p.add_argument("--ft-layers", type=int, metavar="K", help="llama_adapter: the top K layers adapted (default: "
                   "every layer)")
    p.add_argument("--ft-alpha", type=float, metavar="A",
                   help=f"LoRA alpha: the update is scaled by alpha / r (default {LORA_ALPHA:g})")
    p.add_argument("--ft-targets", metavar="LIST", help="the Linears that get an adapter, comma-separated, any of "
                   f"{','.join(LORA_TARGET_NAMES)} (lm_head: the classifier, once; the others: in every block; default "
                   f"{LORA_TARGETS_DEFAULT})")
    p.add_argument("--adapter-from-file", metavar="PATH", help="start from this adapter file instead of a fresh "
                   "adapter; its method, rank, and with lora its targets and alpha, are the run's")


def check_ft_flags(args):
    """Checks the --ft flags given and turns --ft-targets into the target names in adapter order. Without
    --adapter-from-file it fills in the defaults; with one, the file gives what the flags leave out
    (adapter_for_run)."""
    if not uses_adapter(args):
        given = [flag for flag, name in FT_FLAGS.items() if getattr(args, name) is not None]
        if given:
            fail(f"{given[0]} applies to --ft lora only" if given[0] in LORA_ONLY_FLAGS else
                 f"{given[0]} applies to fine-tuning (--ft) only")
        return
    if args.ft != "lora":
        given = [flag for flag in LORA_ONLY_FLAGS if getattr(args, FT_FLAGS[flag]) is not None]
        if given:
            fail(f"{given[0]} applies to --ft lora only, not to --ft {args.ft}")
    if args.ft_layers is not None and (args.ft != "llama_adapter" or args.ft_layers < 1):
        fail(f"--ft-layers {args.ft_layers}: " + ("applies to --ft llama_adapter only" if args.ft != "llama_adapter"
                                                  else "must be >= 1"))
    if args.ft_rank is not None and args.ft_rank < 1:
        fail(f"--ft-rank must be >= 1 (got {args.ft_rank})")
    if args.ft_alpha is not None:
        args.ft_alpha = fp32(args.ft_alpha)
        if not math.isfinite(args.ft_alpha):
            fail(f"--ft-alpha {args.ft_alpha} must be finite (as an fp32)")
    if args.ft_targets is not None:
        args.ft_targets = parse_ft_targets(args.ft_targets)
    if args.adapter_from_file is None:
        defaults = {"ft_rank": LORA_RANK, "ft_alpha": LORA_ALPHA, "ft_targets": parse_ft_targets(LORA_TARGETS_DEFAULT)}
        if args.ft == "adapter":
            defaults = {"ft_rank": ADAPTER_RANK}
        elif args.ft == "prompt":
            defaults = {"ft_rank": PROMPT_LENGTH}
        elif args.ft == "prefix":
            defaults = {"ft_rank": PREFIX_LENGTH}
        elif args.ft == "llama_adapter":
            defaults = {"ft_rank": ADAPTION_LENGTH, "ft_layers": 0}
        for name, value in defaults.items():
            if getattr(args, name) is None:
                setattr(args, name, value)


def parse_ft_targets(value):
    """--ft-targets' comma-separated names as a tuple in adapter order (the list's own order does not matter)."""
    allowed = f"any of {','.join(LORA_TARGET_NAMES + list(LORA_TARGET_GROUPS))}"
    if value == "":
        fail(f"--ft-targets is empty: give a comma-separated list, {allowed}")
    names = [target for name in value.split(",") for target in LORA_TARGET_GROUPS.get(name, (name,))]
    for name in names:
        if name not in LORA_TARGET_NAMES:
            fail(f"--ft-targets {value}: unknown target {name!r} (allowed: {allowed})")
        if names.count(name) > 1:
            fail(f"--ft-targets {value} names {name} twice (allowed: {allowed}, each once)")
    return tuple(name for name in LORA_TARGET_NAMES if name in names)


LLAMA_FLAGS = {"--kv-heads": "kv_heads", "--rope-theta": "rope_theta", "--ffn-hidden": "ffn_hidden",
               "--norm-eps": "norm_eps", "--tie-embeddings": "tie_embeddings"}


def add_arch_flags(p):
    p.add_argument("--arch", choices=["gpt2", "llama"], default="gpt2",
                   help="gpt2, or llama: RMSNorm, RoPE, SwiGLU, grouped-query attention, no biases (doc/kernels.md)")
    p.add_argument("--kv-heads", type=int, help="llama: key/value heads, dividing --NH (default --NH)")
    p.add_argument("--rope-theta", type=float, help=f"llama: RoPE base theta (default {ROPE_THETA:g})")
    p.add_argument("--ffn-hidden", type=int, help="llama: SwiGLU hidden size H (default floor(8C/3) rounded up "
                   "to a multiple of 64)")
    p.add_argument("--norm-eps", type=float, help=f"llama: RMSNorm eps (default {NORM_EPS:g})")
    p.add_argument("--tie-embeddings", type=int, choices=[0, 1],
                   help="llama: 1 = the output embedding is wte, 0 = its own lm_head (default 0)")


def check_arch_flags(args):
    """Fills in the llama flags' defaults (theta and eps rounded to the fp32 the file stores) and refuses a llama
    flag with --arch gpt2 or a llama shape the model cannot have."""
    if args.arch == "gpt2":
        given = [flag for flag, name in LLAMA_FLAGS.items() if getattr(args, name) is not None]
        if given:
            fail(f"{given[0]} applies to --arch llama only")
        return
    defaults = {"kv_heads": args.NH, "rope_theta": ROPE_THETA, "ffn_hidden": default_ffn_hidden(args.C),
                "norm_eps": NORM_EPS, "tie_embeddings": 0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.rope_theta, args.norm_eps = fp32(args.rope_theta), fp32(args.norm_eps)
    check_llama_shape(args.NH, args.C, args.kv_heads, args.rope_theta, args.ffn_hidden, args.norm_eps,
                      args.tie_embeddings, "--arch llama")


# The flags train_moe.py shares, in the order --help lists them there too


def add_shape_flags(p):
    p.add_argument("--B", type=int, default=3, help="batch size")
    p.add_argument("--T", type=int, default=23, help="sequence length")
    p.add_argument("--V", type=int, default=263, help="vocabulary size")
    p.add_argument("--L", type=int, default=2, help="layers")
    p.add_argument("--NH", type=int, default=3, help="attention heads")
    p.add_argument("--C", type=int, default=48, help="channels")
    p.add_argument("--maxT", type=int, default=32, help="longest sequence")


def add_run_flags(p, dtype_help, grad_clip):
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help=dtype_help)
    p.add_argument("--steps", type=int, default=10, help="training steps")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (constant)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay of the 2-D parameters")
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--grad-clip", type=float, default=grad_clip, help="global gradient norm limit (<= 0: none)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (--train)")
    p.add_argument("--mask-fraction", type=float, default=0.0, metavar="F",
                   help="--write-reference: hide each target of the batch with probability F (a loss mask: the loss "
                        "is the mean over the others; default 0)")


def check_run_flags(args):
    if args.steps < 0:
        fail(f"--steps must be >= 0 (got {args.steps})")
    if not 0 <= args.mask_fraction < 1:
        fail(f"--mask-fraction must be in [0, 1) (got {args.mask_fraction})")
    if not 0 <= args.seed < 2**31:  # the debug state keeps it in an int32 word
        fail(f"--seed must be in 0..2147483647 (got {args.seed})")
    if args.train and not args.input_bin:
        fail("--train needs --input-bin PATTERN")


def main(argv=None):
    args = parse_args(argv)
    if args.write_reference is not None:
        write_reference(args)
    elif args.write_shard is not None:
        write_shard(args)
    elif args.write_tokenizer is not None:
        write_tokenizer(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
