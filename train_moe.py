"""
train_moe.py: the PyTorch reference Switch-Transformer Mixture-of-Experts GPT for switch.cu. It is the GPT-2 of
train_gpt.py (or, with --arch llama, its Llama: RMSNorm, RoPE, GQA, SwiGLU dense layers and SwiGLU experts, no
biases) in which layer l (from 0) has an MoE FFN iff (l + 1) % moe_every == 0, with the routing, capacity,
dropping and balancing losses exactly as doc/moe.md defines them (the routing options: shared experts, sigmoid
scores with a routed scale, the aux-loss-free balancing bias, the sequence-wise and global-batch losses,
device-limited routing; doc/moe.md, "Routing options and the llama MoE"), router
jitter and noisy top-k gating exactly as the router-noise spec (doc/moe.md, "Router noise", shared with the CUDA
side; its sections are cited as "noise_spec §N") defines them, and it writes the files the C test (test_moe) compares
against.

Run from the repository root with a Python that has torch (here Debian's: /usr/bin/python3):
  reference state for test_moe (MoE model file + debug state with logits, losses, routing counts, gradients,
  10 step losses):
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k1 --dtype float32 --cf 0.5
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k2_me2 --topk 2 --moe-every 2 --cf 0
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k2_noisy --topk 2 --noisy-topk 1 --jitter 0.05
    a tiny DeepSeek-shape llama MoE with every routing option on (3 micro-batches of one sequence):
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_ds --arch llama --NH 4 --C 64 --kv-heads 2 --E 16
        --topk 4 --H 32 --shared-experts 1 --shared-hidden 64 --score sigmoid --routed-scale 2.5 --bias-gamma 0.001
        --seq-aux-alpha 0.001 --global-aux 1 --micro-batches 3 --device-limit 2 --ep-groups 4 --cf 0
    a tiny Mixtral-shape llama MoE:
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_mx --arch llama --NH 4 --C 64 --kv-heads 2 --E 8
        --topk 2 --H 64 --cf 0
    (the defaults: --B 3 --T 23 --V 263 --L 2 --NH 3 --C 48 --maxT 32 --E 4 --topk 1 --moe-every 1 --H 96
     --cf 1.25 --aux-alpha 0.01 --z-coef 0.001 --init-scale 0.1 --seed 1337 --steps 10 --lr 1e-3
     --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip 0.5; router noise off:
     --jitter 0 --noisy-topk 0, with --importance-coef 0.1 --load-coef 0.1 for noisy gating's losses)
  training baseline (the C trainer's step line with aux, z and drop; constant lr), on shards that
  train_gpt.py --write-shard writes:
    /usr/bin/python3 train_moe.py --train --input-bin 'build/ref/shard*.bin' --B 4 --T 32 --steps 20
  any mode can start from an MoE model file instead of a fresh init: --model-from-file PATH (fp32 or bf16).
  fine-tuning: train_gpt.py's methods and flags (--ft lora|adapter|prompt|prefix|llama_adapter, --ft-rank, --ft-alpha,
  --ft-targets, --ft-layers, --adapter-from-file; see train_gpt.py's comment at the top) on a frozen MoE model, its
  routers, noise routers, routed and shared experts included (no --bias-gamma: the balancing biases stay too); the
  balancing losses still add to the loss, and their gradients reach the adapter through the routers' input. LoRA's
  qkv and proj take every layer's attention, fc and fc_proj the dense layers' MLPs, experts (experts.fc and
  experts.fc_proj) every expert of every MoE layer, lm_head the classifier; the bottleneck adapters' FFN site is the MoE layer's
  output in an MoE layer; a prompt's P virtual tokens are routed too (P + T tokens per sequence). The reference also
  writes PREFIX_adapter.bin (train_gpt.py's adapter file):
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_lora --topk 2 --moe-every 2 --cf 0.5 \
        --ft lora --ft-rank 4 --ft-alpha 8 --ft-targets qkv,proj,fc,fc_proj,lm_head,experts
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_prompt --topk 2 --moe-every 1 --cf 0.5 \
        --ft prompt --ft-rank 5
    /usr/bin/python3 train_moe.py --train --input-bin 'build/ref/shard*.bin' --B 4 --T 32 --steps 20 \
        --model-from-file build/ref/moe_lora_model.bin --adapter-from-file build/ref/moe_lora_adapter.bin
Its test: /usr/bin/python3 dev/test/test_reference_moe.py

MoE model file: header [0]=20261129, [1]=1 (fp32) or 2 (bf16), [2]=maxT, [3]=V, [4]=L, [5]=NH, [6]=C, [7]=Vp,
[8]=E, [9]=top-k, [10]=moe_every, [11]=H, [12]=1 when noisy gating's noise-router weights routernw (Lm, E, C)
follow routerw, else 0 (and no routernw); [16..21] the GPT-2 file's family words (llama: 1, NKV, theta, the dense
layers' H, eps, tied); [24]=1 when [25]=shared experts, [26]=their H, [27]=score (0 softmax, 1 sigmoid),
[28]=routed scale (fp32 bits), [29]=1 when the balancing biases (Lm, E) end the payload in fp32 (all 0 for today's
Switch models); payload in doc/formats.md's order (see FILE ORDER below).

Debug state: header [0]=20240327, [1]=3, [2]=B, [3]=T, [4]=steps, [5]=V, [6]=Vp, [7]=Lm (MoE layers), [8]=1
when noisy gating is on, else 0; payload x, y (B*T int32 each), logits (B*T*V fp32, the V real columns), CE
loss (fp32), aux loss summed over the MoE layers (fp32), z loss summed over the MoE layers (fp32), with
header[8] = 1 the importance loss and the load loss, each summed over the MoE layers (fp32), then per MoE
layer in layer order: the number of dropped (token, choice) pairs (int32) and the E per-expert counts of
choices before dropping (int32); then the gradient of the total loss (CE + aux + z, + importance + load with
noisy gating) of every parameter in model-file order and layout (fp32; wte's has Vp rows, the padded ones
zero; routernw's after routerw's); then the CE loss of each of `steps` AdamW steps on the same batch (step k's
loss is its forward loss before its update: step 0's equals the CE loss above). With router noise the logits
come from an evaluation pass (no jitter, no noise) and everything else (CE, aux, z, importance, load, drops,
counts, gradients) from training pass 0, the pass step 0 repeats (see the choices below). The routing options' fields:
header [9]=1 when the sequence-wise loss follows the other losses; [10]=K with --micro-batches K > 1 (the batch is
K micro-batches of B/K sequences: losses are means over them, counts sums, gradients those of the mean total loss,
and micro-batch j of step s is training pass s*K + j); [11]=1 when steps x Lm x E fp32 balancing biases, each
step's after its update, end the file. The run's settings (doc/formats.md, "Debug state", which test_moe takes as
its own): [12..17] the optimizer (fp32 bits: lr, beta1, beta2, eps, weight decay, grad clip), [18] the seed, [20, 21]
--cf as the bits of an fp64, [22..29] --aux-alpha, --z-coef, --jitter, --importance-coef, --load-coef, --init-scale,
--bias-gamma, --seq-aux-alpha (fp32 bits), [30] --global-aux, [31] --device-limit, [32] --ep-groups. A bf16
reference also keeps every pass's expert choices, which test_moe's BF16 build routes by (teacher-forced routing,
doc/moe.md): [33] = P, the passes, and after the routing counts P blocks of Lm x (B/K)*T x k int32, per MoE layer per
token its k choices in routing order: the K evaluation passes (the logits'), the K training passes of the gradient,
then the K of each step (P = K * (steps + 2)).
With --ft the debug state is train_gpt.py's fine-tuning one in this layout: [40] = the method (train_gpt.py's
FT_METHODS: 1 lora, 2 adapter, 3 prompt, 4 prefix, 5 llama_adapter), the gradients the adapter's in adapter order
(train_gpt.py's adapter_in_file_order; LoRA's fc and fc_proj stacked over the dense layers) instead of the model's,
and the steps train the adapter only. With a prompt of P virtual tokens the logits are the T real positions', and the
routing counts and expert choices cover the P + T tokens of each sequence ((B/K)*(P + T) per pass and MoE layer).

Choices this reference makes (the C side must make the same ones):
- Capacity = ceil(k * CF * N / E) evaluated in IEEE double left to right, CF held as a double:
  (((double)k * cf) * N) / E, then ceil. It is taken as the rounding gives it: with k=2, CF=1.1, N=25, E=5
  the double result is 11.000000000000002 and the capacity is 12, not 11. CF <= 0: no limit.
- Top-k picks "the k largest probs" by comparing the logits: softmax is strictly increasing, so the order of
  the logits is the order of the exact probabilities, and two different logits never tie just because their
  rounded probs are equal. Equal logits go to the lower expert index. (llmc/moe_router.cuh's router does the same.)
- For k >= 2 the gate renormalises over all k chosen experts, dropped choices included: a dropped choice
  removes its term but does not raise the gates of the kept ones.
- Init: GPT-2's (std 0.02; the projections into the residual, expert ones included, 0.02/sqrt(2L)); the router
  and expert weight matrices then have their std scaled by sqrt(--init-scale) (Switch §2.4: weights drawn with
  std sqrt(s/fan_in), s = 0.1 instead of 1, i.e. a std sqrt(0.1) times the standard one; --init-scale 1 gives
  GPT-2's init). Every bias and LayerNorm parameter, the experts' included, is then perturbed as
  train_gpt.py does, so that a C kernel that drops or swaps one of them changes the results, but with std
  0.02 instead of 0.1 so that the tokens spread over the experts (MOE_PERTURB_STD says why).
- The default H is 96 = 2C, not 4C, so that a C kernel that assumes the expert width is the dense MLP's fails.
- A fresh model with --bias-gamma > 0 draws its balancing biases from N(0, BIAS_INIT_STD) (the C descriptors start
  them at 0), after every parameter, so that pass 0's choices already depend on them; the write-up line says how
  many choices of an evaluation pass they change. A model file without biases run with --bias-gamma > 0 starts
  them at 0. The model file's header decides the family, shared experts, score and routed scale (as it decides the
  shape); the routing flags (--bias-gamma, --seq-aux-alpha, --global-aux, --device-limit) are the run's.
Router noise (noise_spec; off unless --jitter > 0 or --noisy-topk 1):
- Pass numbers (noise_spec §4): --write-reference's gradient forward is training pass 0 and AdamW step k
  (from 0) is pass k; --train's step k (the printed step k + 1) is pass k, the reference having no gradient
  accumulation. Every forward that no backward follows (the debug state's logits) is an evaluation pass: no
  jitter, H = the clean logits. Its routing differs from pass 0's, so the printed routing has a line for each.
- The debug state's CE, aux, z, importance, load and routing counts are training pass 0's, not the evaluation
  pass's (noise_spec §4 says only where the logits come from): they are the losses whose gradients the file
  holds and the step-0 loss repeats, and test_moe takes the logits from a forward without targets and
  everything else from the forward that its backward follows.
- The noise is rank 0's. The jitter multiplier is computed in fp32 as written, (1 - eps) + (2 * eps) * u with eps
  rounded to fp32 and each operation rounded (a C compiler that contracts it into an FMA differs by an ulp);
  router_in = x * multiplier stays fp32 here, where the C BF16 build rounds it to bf16. The normals are
  computed in float64 and rounded to fp32 (C: fp32 throughout; a few ulp apart).
- thr is taken in the routing order (ties to the lower index) of H, the element of H at position k + 1 (a
  chosen expert) or k (any other), and is differentiable: its gradient goes to that element of H.
- Importance and load losses are computed in evaluation passes too (H = clean): printed, never differentiated.
- --train's step line: with noisy gating its aux field is the sum of all three balancing losses, Switch's aux
  + importance + load (each summed over the MoE layers), so that the line keeps its fields; without noisy
  gating it is Switch's aux alone, as before.
- Init: routernw is drawn like routerw (std 0.02, then scaled by sqrt(--init-scale)), not zero as the C
  descriptors start it (noise_spec §5), so that its gradient test is not degenerate. It is drawn from the
  --seed generator after every other parameter, so the other parameters of a noisy model are those of the
  non-noisy model of the same seed.
- A model file with header[12] = 1 turns noisy gating on whatever --noisy-topk says (the file's shape wins, as
  for the shape flags); --noisy-topk 1 with a header[12] = 0 file is refused, and so is noisy gating with
  top-k = E, from flags or from a file.
"""

import os

# torch reads these when it starts (see train_gpt.py): two threads, and threads that sleep while they wait
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import train_gpt
from train_gpt import (FAMILY_LLAMA, FAMILY_WORD, FT_METHODS, INIT_STD, LN_EPS, PERTURB_STD, REFERENCE_B_STD,
                       STATE_FT_WORD, CausalSelfAttention, GPTConfig, GroupedQueryAttention, LlamaConfig, MASKED, MLP,
                       OneLineParser, RMSNorm, SwiGLUMLP, adapter_in_file_order, adapter_shape, add_arch_flags,
                       add_ft_flags, add_run_flags, add_shape_flags, backward, bf16_bits, bf16_to_float,
                       check_arch_flags, check_ft_flags, check_llama_shape, check_run_flags, classifier,
                       debug_state_header, fp32, fp32_bits, fp32_from_bits, header, make_deterministic, pick_device,
                       read_file, real_positions, reference_batch, reference_step_losses, rope_cos_sin, train_loop,
                       uses_adapter, with_adapter, with_prompt, write_adapter_file, write_file)

MOE_MODEL_MAGIC = 20261129
MOE_VERSION_FP32 = 1
MOE_VERSION_BF16 = 2
PROGRAM = "train_moe.py"
# train_gpt.py perturbs the biases and LayerNorm parameters with std 0.1. Biases that add into the residual
# stream are the same for every token, and at 0.1 they are 3-4 times the tokens' own part (wte + wpe, std
# 0.02 each), so LayerNorm hands the router nearly the same vector for every token and all 69 tokens of the
# test batch go to one expert. At 0.02 the tokens spread over the experts, and a dropped or swapped bias
# still moves the results far above any test tolerance.
MOE_PERTURB_STD = 0.02
# A fresh model with a balancing bias (--bias-gamma > 0) starts it from N(0, this) instead of DeepSeek's zero, so
# that pass 0's selection already depends on it and a C kernel that drops the bias, or adds it to the gates,
# changes the results. The sigmoid affinities of the test models spread by about 0.01 around 0.5; a bias of
# this size moves some choices and leaves the rest (the write-up line counts the choices it moves).
BIAS_INIT_STD = 0.005
# The MoE model file's routing-option words (doc/formats.md, "MoE model file"); words 16..21 are the GPT-2 file's
MOE_REVISION_WORD = 24  # 0: today's Switch file, words 25..32 zero; 1: words 25..29 defined; 2: 25..32
SHARED_WORD, SHARED_HIDDEN_WORD, SCORE_WORD, ROUTED_SCALE_WORD, BIAS_WORD = 25, 26, 27, 28, 29
FIRST_DENSE_WORD, GROUPS_WORD, KEPT_GROUPS_WORD = 30, 31, 32
SCORES = ("softmax", "sigmoid")  # word 27: the index
# The debug state's words from 20 on (doc/formats.md, "Debug state"): every routing and loss setting the C trainer
# takes as a flag, in state_words' order, then the number of passes whose expert choices follow the routing counts.
# The capacity factor is the bits of an fp64 (low word first): both sides compute the capacity in double, and an fp32
# capacity factor can change it (CF 0.1, N 50, E 5: 1 slot in double, 2 from the fp32 0.1).
STATE_SETTINGS_WORD = 20


def fail(message):
    """Bad input ends the run with one line on stderr and exit status 1."""
    raise SystemExit(f"{PROGRAM}: error: {message}")


@contextmanager
def errors_named_here():
    """The helpers reused from train_gpt.py end bad input with a line that names train_gpt.py; a user who ran
    this program should see its name instead."""
    prefix = "train_gpt.py: error: "
    try:
        yield
    except SystemExit as e:
        if isinstance(e.code, str) and e.code.startswith(prefix):
            fail(e.code[len(prefix) :])
        raise


# ----------------------------------------------------------------------------------------------------------
# The model


@dataclass
class MoEConfig(GPTConfig):
    E: int  # experts per MoE layer
    topk: int  # experts each token is sent to (1 = Switch, 2 = GShard)
    moe_every: int  # layer l is an MoE layer iff l >= first_dense and (l + 1 - first_dense) % moe_every == 0
    H: int  # expert hidden size
    noisy: bool = False  # noisy top-k gating: every MoE layer has a noise router (model file header[12])
    # -arch llama (header words 16..21 as in the GPT-2 file): RMSNorm, RoPE, GQA, SwiGLU dense layers and
    # experts, no biases; dense_H is the dense layers' SwiGLU hidden size
    arch: str = "gpt2"
    NKV: int = 0
    rope_theta: float = 0.0
    dense_H: int = 0
    norm_eps: float = 0.0
    tied: bool = True
    # the routing options (header words 24..29)
    shared: int = 0  # shared experts per MoE layer, which every token goes through
    shared_H: int = 0  # their hidden size
    score: str = "softmax"  # softmax or sigmoid
    routed_scale: float = 1.0  # the gates' factor (an fp32 value, as the file stores it)
    balance_bias: bool = False  # every MoE layer has an aux-loss-free balancing bias (E,), stored in the file
    # header words 30..32: the dense layers before the first MoE layer, the expert groups and those kept
    first_dense: int = 0
    expert_groups: int = 0
    kept_groups: int = 0

    def is_moe(self, layer):
        return layer >= self.first_dense and (layer + 1 - self.first_dense) % self.moe_every == 0

    def moe_index(self, layer):
        """Layer `layer`'s index among the MoE layers (0-based): the m of the noise seeds."""
        return sum(self.is_moe(l) for l in range(layer))

    @property
    def Lm(self):
        return sum(self.is_moe(l) for l in range(self.L))

    @property
    def llama(self):
        return self.arch == "llama"

    def llama_config(self):
        """train_gpt.py's LlamaConfig of this model: its attention, norms and dense SwiGLU layers are Llama's."""
        return LlamaConfig(maxT=self.maxT, V=self.V, L=self.L, NH=self.NH, C=self.C, NKV=self.NKV,
                           rope_theta=self.rope_theta, H=self.dense_H, norm_eps=self.norm_eps, tied=self.tied)


@dataclass
class RoutingSettings:
    """What the routing and its losses depend on beyond the weights (not stored in the model file). Whether
    the gating is noisy is the model's (it needs the noise router's weights); the rest is here."""
    capacity_factor: float  # <= 0: no limit (dropless)
    aux_alpha: float  # load-balancing loss coefficient
    z_coef: float  # router z-loss coefficient
    jitter: float = 0.0  # router jitter epsilon (0: off)
    importance_coef: float = 0.1  # noisy gating's importance loss coefficient
    load_coef: float = 0.1  # noisy gating's load loss coefficient
    training: bool = False  # a training forward pass: jitter and gating noise are on; evaluation: both off
    pass_number: int = 0  # the training forward pass whose noise this is (noise_spec §4)
    seq_alpha: float = 0.0  # sequence-wise balance loss coefficient (0: off)
    global_aux: bool = False  # the Switch loss's f from the step's micro-batches so far, not this one's alone
    device_limit: int = 0  # each token's experts lie within at most this many expert groups (0: no limit)
    ep_groups: int = 1  # the expert-parallel degree that splits the experts into groups (device limit only)


def training_pass(settings, pass_number):
    """The settings of training forward pass `pass_number` (its jitter and gating noise)."""
    return replace(settings, training=True, pass_number=pass_number)


# ----------------------------------------------------------------------------------------------------------
# Router noise (noise_spec §1): a counter-based generator, so that a value depends only on (seed, index) and
# the C kernels, which draw the same values in any thread order, can be compared with this reference.

SQ5_BIT_NOISE = (0xD2A80A3F, 0xA884F197, 0x6C736F4B, 0xB79F3ABB, 0x1B56C4F5)  # llmc/common.cuh's constants
NOISE_RANK_SEED = 20261201  # rank_base = squirrel_noise5(rank, this)
NOISE_JITTER, NOISE_GATING = 0, 1  # the `kind` that separates a layer's two noise streams
PASS_STRIDE = 512  # seed positions per pass: two kinds for each of up to 256 MoE layers
REFERENCE_RANK = 0  # the reference is one process: data-parallel rank 0
U32 = np.uint64(0xFFFFFFFF)


def squirrel_noise5(position, seed):
    """llmc/common.cuh's squirrel_noise5, elementwise over an array of positions (or one position). The uint32
    arithmetic is done in uint64 and masked back to 32 bits after every step: a product of two uint32 fits in
    a uint64, so nothing wraps that should not, and numpy has no overflow to warn about."""
    m = np.asarray(position, dtype=np.uint64) & U32
    n1, n2, n3, n4, n5 = (np.uint64(c) for c in SQ5_BIT_NOISE)
    m = (m * n1) & U32
    m = (m + np.uint64(int(seed) & 0xFFFFFFFF)) & U32
    m ^= m >> np.uint64(9)
    m = (m + n2) & U32
    m ^= m >> np.uint64(11)
    m = (m * n3) & U32
    m ^= m >> np.uint64(13)
    m = (m + n4) & U32
    m ^= m >> np.uint64(15)
    m = (m * n5) & U32
    m ^= m >> np.uint64(17)
    return m


def noise_seed(pass_number, moe_layer, kind, rank=REFERENCE_RANK):
    """The seed of one noise stream: training pass `pass_number`, MoE layer `moe_layer` (0-based among the MoE
    layers), kind NOISE_JITTER or NOISE_GATING, data-parallel rank `rank`; uint32 wrap-around as in C."""
    rank_base = int(squirrel_noise5(rank, NOISE_RANK_SEED))
    return int(squirrel_noise5((pass_number * PASS_STRIDE + moe_layer * 2 + kind) & 0xFFFFFFFF, rank_base))


def uniform_from_bits(bits):
    """A uint32 hash -> float32 in (0, 1): the top 23 bits as the odd integer 2·b + 1 < 2^24, times 2^-24.
    Both steps are exact in fp32, so C and Python get the same value, and neither 0 nor 1 can come out."""
    odd = (np.asarray(bits, dtype=np.uint64) >> np.uint64(9)) * np.uint64(2) + np.uint64(1)
    return odd.astype(np.float32) * np.float32(2.0**-24)


def moe_uniform(seed, index):
    return uniform_from_bits(squirrel_noise5(index, seed))


def moe_normal(seed, index):
    """Box-Muller from the uniforms at 2·i and 2·i + 1, computed in float64 and rounded to float32 (C computes
    it in fp32; the two differ by a few ulp, far below any tolerance)."""
    index = np.asarray(index, dtype=np.uint64)
    u1 = moe_uniform(seed, (np.uint64(2) * index) & U32).astype(np.float64)
    u2 = moe_uniform(seed, (np.uint64(2) * index + np.uint64(1)) & U32).astype(np.float64)
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)


def jitter_multiplier(seed, N, C, eps):
    """(N, C) float32 multipliers U(1 - eps, 1 + eps) of the router input, index t·C + c, in fp32 as C computes
    them: eps rounded to fp32, then (1 - eps) + (2·eps)·u with each operation rounded."""
    eps = np.float32(eps)
    u = moe_uniform(seed, np.arange(N * C, dtype=np.uint64)).reshape(N, C)
    return (np.float32(1.0) - eps) + (np.float32(2.0) * eps) * u


def gating_noise(seed, N, E):
    """(N, E) float32 standard normals n[t, e] of noisy top-k gating, index t·E + e."""
    return moe_normal(seed, np.arange(N * E, dtype=np.uint64)).reshape(N, E)


def constant_like(values, like):
    """A numpy array as a constant tensor (no gradient) of `like`'s dtype and device."""
    return torch.from_numpy(values).to(dtype=like.dtype, device=like.device)


# ----------------------------------------------------------------------------------------------------------
# Routing


def expert_capacity(N, E, topk, capacity_factor):
    """Slots per expert in a group of N tokens, or None for no limit. Double arithmetic, left to right, as the C
    code computes it; the result of the rounding is taken as it is (see the comment at the top)."""
    if capacity_factor <= 0:
        return None
    return math.ceil(topk * capacity_factor * N / E)


def top_k_lower_index(logits, k):
    """(N, k) expert indices of the k largest logits per row, largest first, equal logits to the lower index.
    Written out because torch.topk does not promise any order among equal values."""
    E = logits.shape[1]
    index = torch.arange(E, device=logits.device).expand_as(logits)
    remaining = logits.detach().clone()
    choices = []
    for _ in range(k):
        best = remaining.max(dim=1, keepdim=True).values
        first = torch.where(remaining == best, index, E).min(dim=1).values
        choices.append(first)
        remaining.scatter_(1, first[:, None], -math.inf)  # a taken expert never wins again
    return torch.stack(choices, dim=1)


@dataclass
class Routing:
    """The routing of one MoE layer over one group of N tokens."""
    logits: torch.Tensor  # (N, E) router logits (noisy gating: H, the clean logits plus the noise)
    probs: torch.Tensor  # (N, E) softmax of the logits; sigmoid scores: the affinities normalised to sum 1
    choices: torch.Tensor  # (N, k) chosen experts, best first
    gates: torch.Tensor  # (N, k) gate of each choice (differentiable)
    kept: torch.Tensor  # (N, k) bool: the choice got a slot in its expert
    counts: torch.Tensor  # (E,) choices routed to each expert before dropping
    capacity: int | None  # slots per expert; None: no limit
    aux_loss: torch.Tensor  # load-balancing loss of this layer (scalar)
    z_loss: torch.Tensor  # router z-loss of this layer (scalar)
    # noisy top-k gating only (None without it):
    clean: torch.Tensor | None = None  # (N, E) clean logits router_in · W_g^T
    std: torch.Tensor | None = None  # (N, E) noise std softplus(router_in · W_noise^T)
    order: torch.Tensor | None = None  # (N, k + 1) the k + 1 largest of H in routing order
    threshold: torch.Tensor | None = None  # (N, E) thr: H's (k+1)-th value for a chosen expert, else its k-th
    load_probs: torch.Tensor | None = None  # (N, E) P = Phi((clean - thr) / std)
    importance: torch.Tensor | None = None  # (E,) sum of the gates of the choices of each expert
    load: torch.Tensor | None = None  # (E,) sum over tokens of P
    importance_loss: torch.Tensor | None = None  # w_imp · CV²(importance) (scalar)
    load_loss: torch.Tensor | None = None  # w_load · CV²(load) (scalar)
    key: torch.Tensor | None = None  # (N, E) what top-k compared, when not the logits (bias, device limit)
    seq_loss: torch.Tensor | None = None  # sequence-wise balance loss of this layer (scalar; None when off)

    @property
    def dropped(self):
        return int((~self.kept).sum())

    @property
    def threshold_margin(self):
        """Noisy gating: the smallest gap between a token's (k+1)-th and (k+2)-th value of H (inf when
        k + 1 = E): how far the choice of the element thr takes (and so where its gradient goes) is from
        flipping."""
        k = self.choices.shape[1]
        if k + 1 >= self.logits.shape[1]:
            return math.inf
        ordered = self.logits.detach().sort(dim=1, descending=True).values
        return float((ordered[:, k] - ordered[:, k + 1]).min())

    @property
    def margin(self):
        """The smallest gap between a token's k-th and (k+1)-th logit (inf when k = E): how far the routing is
        from flipping, which tells how closely a C implementation must match to route the same."""
        k = self.choices.shape[1]
        if k == self.logits.shape[1]:
            return math.inf
        key = self.logits if self.key is None else self.key
        ordered = key.detach().sort(dim=1, descending=True).values
        return float((ordered[:, k - 1] - ordered[:, k]).min())


def cv_squared(values):
    """The squared coefficient of variation of an (E,) vector: population variance over the squared mean."""
    mean = values.mean()
    return ((values - mean) ** 2).mean() / mean**2


def limit_to_groups(key, groups, limit):
    """Device-limited routing (doc/moe.md): the experts split into `groups` groups of consecutive indices (the
    expert-parallel members); each token keeps the `limit` groups with the largest best key (ties to the lower
    group) and the other groups' keys become -inf, so that top-k cannot pick them."""
    N, E = key.shape
    best = key.detach().view(N, groups, E // groups).max(dim=2).values  # (N, groups)
    kept = F.one_hot(top_k_lower_index(best, limit), groups).sum(dim=1) > 0  # (N, groups)
    return torch.where(kept.repeat_interleave(E // groups, dim=1), key.detach(), -math.inf)


def keep_expert_groups(key, group_values, groups, kept):
    """The model's expert groups (doc/moe.md, "Routing options" 11; DeepSeek-V3's): the experts split into
    `groups` groups of consecutive indices, a group's score the fp32 sum of its two largest `group_values` (the
    affinities plus the bias); each token keeps the `kept` groups of largest score (ties to the lower group) and the
    other groups' keys become -inf, so that top-k cannot pick them."""
    N, E = key.shape
    top2 = group_values.detach().view(N, groups, E // groups).topk(2, dim=2).values  # (N, groups, 2)
    score = top2[..., 0] + top2[..., 1]
    keep = F.one_hot(top_k_lower_index(score, kept), groups).sum(dim=1) > 0  # (N, groups)
    return torch.where(keep.repeat_interleave(E // groups, dim=1), key.detach(), -math.inf)


def route(logits, topk, settings, clean=None, std=None, score="softmax", routed_scale=1.0, bias=None, seq_len=None,
          prior_counts=None, groups=None):
    """Routing of one group (doc/moe.md, Routing) from its (N, E) router logits. Noisy top-k gating
    passes H as `logits` (it takes the router logits' place everywhere) and its clean logits and noise std,
    which its importance and load losses also need (noise_spec §3). score: softmax or sigmoid affinities;
    bias: the (E,) balancing bias, added to the affinities for the choice only; seq_len: the tokens of one
    sequence (the sequence-wise loss); prior_counts: (counts (E,), choices) of the step's earlier micro-batches
    (the global-batch Switch loss); groups: (G, M) of the model's expert groups, or None."""
    N, E = logits.shape
    noisy = clean is not None
    if score == "softmax":
        probs = F.softmax(logits, dim=1)
        affinity = probs
    else:
        affinity = torch.sigmoid(logits)
        probs = affinity / affinity.sum(dim=1, keepdim=True)  # what the balance losses average
    # Top-k compares the logits (both scores are increasing functions of them, so their order is the scores'
    # exact order), or, with a bias, the fp32 sums affinity + bias
    key = None if bias is None else affinity + bias
    if settings.device_limit > 0:
        key = limit_to_groups(logits if key is None else key, settings.ep_groups, settings.device_limit)
    if groups is not None:
        group_values = affinity if bias is None else key
        key = keep_expert_groups(logits if key is None else key, group_values, *groups)
    if noisy:
        # the first k of the routing order are the choices; the (k+1)-th gives the chosen experts' threshold
        order = top_k_lower_index(logits, topk + 1)
        choices = order[:, :topk]
    else:
        choices = top_k_lower_index(logits if key is None else key, topk)
    chosen = affinity.gather(1, choices)
    gates = chosen if topk == 1 and score == "softmax" else chosen / chosen.sum(dim=1, keepdim=True)
    gates = gates * routed_scale

    # Slots in priority order: every token's first choice in token order, then every second choice, and so
    # on. A choice's position in its expert's queue is the number of earlier choices in that order that went
    # to the same expert; it keeps its slot iff that position is below the capacity.
    in_priority_order = choices.t().reshape(-1)
    one_hot = F.one_hot(in_priority_order, E)
    position = (one_hot.cumsum(dim=0) * one_hot).sum(dim=1) - 1
    capacity = expert_capacity(N, E, topk, settings.capacity_factor)
    kept = torch.ones_like(position, dtype=torch.bool) if capacity is None else position < capacity
    kept = kept.view(topk, N).t()
    counts = one_hot.sum(dim=0)

    # f_e counts choices before dropping and is a constant (no gradient); P_e carries the gradient. The
    # global-batch loss takes f_e from the step's micro-batches so far, this one included.
    if prior_counts is None:
        fraction_routed = counts.to(probs.dtype) / (N * topk)
    else:
        earlier_counts, earlier_choices = prior_counts
        fraction_routed = (earlier_counts + counts).to(probs.dtype) / (earlier_choices + N * topk)
    mean_prob = probs.mean(dim=0)
    aux_loss = settings.aux_alpha * E * (fraction_routed * mean_prob).sum()
    z_loss = settings.z_coef * (torch.logsumexp(logits, dim=1) ** 2).mean()
    seq_loss = None
    if settings.seq_alpha > 0:
        # DeepSeek-V3's complementary loss per sequence of seq_len tokens, then the mean over the sequences
        sequences = N // seq_len
        seq_counts = F.one_hot(choices.reshape(sequences, seq_len * topk), E).sum(dim=1)  # (sequences, E)
        seq_fraction = seq_counts.to(probs.dtype) / (seq_len * topk)
        seq_prob = probs.view(sequences, seq_len, E).mean(dim=1)
        seq_loss = settings.seq_alpha * E * (seq_fraction * seq_prob).sum(dim=1).mean()
    if not noisy:
        return Routing(logits, probs, choices, gates, kept, counts, capacity, aux_loss, z_loss, key=key,
                       seq_loss=seq_loss)

    # Shazeer 2017's balancing losses. Importance sums the gates of all k choices before dropping, so its
    # gradient enters through the gates. thr is one element of H (the k-th or (k+1)-th in routing order):
    # gather keeps it differentiable, so its gradient goes to that element of H and on to clean and std.
    importance = torch.zeros(E, dtype=gates.dtype, device=gates.device).index_add(0, choices.reshape(-1),
                                                                                  gates.reshape(-1))
    kth = logits.gather(1, order[:, topk - 1 : topk])
    next_after = logits.gather(1, order[:, topk : topk + 1])
    chosen = F.one_hot(choices, E).sum(dim=1) > 0
    threshold = torch.where(chosen, next_after, kth)
    load_probs = 0.5 * torch.erfc(-((clean - threshold) / std) / math.sqrt(2.0))
    load = load_probs.sum(dim=0)
    importance_loss = settings.importance_coef * cv_squared(importance)
    load_loss = settings.load_coef * cv_squared(load)
    return Routing(logits, probs, choices, gates, kept, counts, capacity, aux_loss, z_loss, clean, std, order,
                   threshold, load_probs, importance, load, importance_loss, load_loss, seq_loss=seq_loss)


@dataclass
class ExpertShape:
    """What an expert's MLP reads of a config: the model width C and its hidden size H."""
    C: int
    H: int


class Expert(nn.Module):
    """One gpt2-family expert: the GPT-2 MLP with hidden size H. (A llama-family expert is train_gpt.py's
    SwiGLUMLP with its own H.)"""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.C, config.H)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.H, config.C)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


def make_expert(config, H):
    """An expert of the model's family with hidden size H: GELU MLP with biases, or SwiGLU without."""
    shape = ExpertShape(config.C, H)
    return SwiGLUMLP(shape) if config.llama else Expert(shape)


class SwitchFFN(nn.Module):
    """The MoE FFN: router (with noisy gating's noise router), top-k, capacity, the gated sum of the kept
    experts' outputs, and the shared experts' outputs."""

    def __init__(self, config, moe_index):
        super().__init__()
        self.topk = config.topk
        self.score, self.routed_scale = config.score, config.routed_scale
        self.groups = (config.expert_groups, config.kept_groups) if config.expert_groups else None
        self.moe_index = moe_index  # this layer's m among the MoE layers: it picks the noise streams
        self.router = nn.Linear(config.C, config.E, bias=False)
        self.noise_router = nn.Linear(config.C, config.E, bias=False) if config.noisy else None
        self.experts = nn.ModuleList(make_expert(config, config.H) for _ in range(config.E))
        if config.shared > 0:
            self.shared = nn.ModuleList(make_expert(config, config.shared_H) for _ in range(config.shared))
        if config.balance_bias:
            # routing state, not a parameter: no gradient, no weight decay; fp32 whatever the precision
            self.register_buffer("balance_bias", torch.zeros(config.E, dtype=torch.float32))

    def forward(self, h, settings, prior_counts=None):
        """h: (B, T, C) = ln2(x). Returns (Σ over kept choices of gate * Expert_e(h) + Σ_i Shared_i(h),
        Routing); the B*T tokens of the micro-batch are one group."""
        B, T, C = h.shape
        N, E = B * T, self.router.out_features
        tokens = h.reshape(N, C)
        bias = getattr(self, "balance_bias", None)
        # the router runs in (at least) fp32 whatever the precision, outside bf16 autocast (Switch §2.4)
        with torch.autocast(device_type=h.device.type, enabled=False):
            router_in = tokens.to(self.router.weight.dtype)
            if settings.training and settings.jitter > 0:
                # only the router reads the jittered input: the experts below read the tokens themselves
                seed = noise_seed(settings.pass_number, self.moe_index, NOISE_JITTER)
                router_in = router_in * constant_like(jitter_multiplier(seed, N, C, settings.jitter), router_in)
            logits = self.router(router_in)
            options = dict(score=self.score, routed_scale=self.routed_scale, bias=bias, seq_len=T,
                           prior_counts=prior_counts, groups=self.groups)
            if self.noise_router is None:
                routing = route(logits, self.topk, settings, **options)
            else:
                std = F.softplus(self.noise_router(router_in))  # torch's threshold 20 is the spec's
                noisy_logits = logits  # evaluation: H = clean
                if settings.training:
                    seed = noise_seed(settings.pass_number, self.moe_index, NOISE_GATING)
                    noisy_logits = logits + constant_like(gating_noise(seed, N, E), std) * std
                routing = route(noisy_logits, self.topk, settings, clean=logits, std=std, **options)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, choice = (routing.kept & (routing.choices == e)).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate = routing.gates[token, choice].unsqueeze(1)
            out = out.index_add(0, token, (gate * expert(tokens[token])).to(out.dtype))
        for expert in getattr(self, "shared", []):  # dense: every token, no gate, no capacity
            out = out + expert(tokens).to(out.dtype)
        return out.view(B, T, C), routing


class MoEBlock(nn.Module):
    """A transformer block of either family (gpt2: LayerNorm and causal attention with biases; llama: RMSNorm
    and train_gpt.py's grouped-query attention with RoPE) whose FFN is MoE or dense (GELU MLP or SwiGLU)."""

    def __init__(self, config, layer):
        super().__init__()
        if config.llama:
            llama = config.llama_config()
            self.ln_1 = RMSNorm(config.C, config.norm_eps)
            self.attn = GroupedQueryAttention(llama)
            self.ln_2 = RMSNorm(config.C, config.norm_eps)
        else:
            self.ln_1 = nn.LayerNorm(config.C, eps=LN_EPS)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = nn.LayerNorm(config.C, eps=LN_EPS)
        if config.is_moe(layer):
            self.moe = SwitchFFN(config, config.moe_index(layer))
            self.site_paths = {"mlp": "moe"}  # --ft adapter's FFN site (train_gpt.adapter_site): the MoE layer
        else:
            self.mlp = SwiGLUMLP(llama) if config.llama else MLP(config)

    def forward(self, x, settings, rope=(), prior_counts=None):
        """Returns the block's output and its Routing (None for a dense layer). rope: llama's (cos, sin)."""
        x = x + self.attn(self.ln_1(x), *rope)
        if hasattr(self, "moe"):
            ffn, routing = self.moe(self.ln_2(x), settings, prior_counts)
            return x + ffn, routing
        return x + self.mlp(self.ln_2(x)), None


def sum_present(values):
    """The sum of the values that are not None, or None when all are."""
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass
class MoEOutput:
    logits: torch.Tensor  # (B, T, V)
    ce_loss: torch.Tensor  # mean cross-entropy over the targets that count: the printed `loss`
    aux_loss: torch.Tensor  # load-balancing losses summed over the MoE layers
    z_loss: torch.Tensor  # router z-losses summed over the MoE layers
    routings: list  # one Routing per MoE layer, in layer order
    importance_loss: torch.Tensor | None = None  # noisy gating: importance losses summed over the MoE layers
    load_loss: torch.Tensor | None = None  # noisy gating: load losses summed over the MoE layers
    seq_loss: torch.Tensor | None = None  # sequence-wise balance losses summed over the MoE layers (when on)

    @property
    def noisy(self):
        return self.importance_loss is not None

    @property
    def total_loss(self):
        """What training differentiates."""
        loss = self.ce_loss + self.aux_loss + self.z_loss
        if self.noisy:
            loss = loss + self.importance_loss + self.load_loss
        return loss if self.seq_loss is None else loss + self.seq_loss

    @property
    def balancing_loss(self):
        """The step line's aux: the Switch loss, plus noisy gating's importance and load losses and the
        sequence-wise loss when they are on."""
        loss = self.aux_loss + self.importance_loss + self.load_loss if self.noisy else self.aux_loss
        return loss if self.seq_loss is None else loss + self.seq_loss

    @property
    def dropped(self):
        return sum(r.dropped for r in self.routings)


class MoEGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.Vp, config.C)
        if not config.llama:
            self.wpe = nn.Embedding(config.maxT, config.C)
        self.h = nn.ModuleList(MoEBlock(config, l) for l in range(config.L))
        self.ln_f = RMSNorm(config.C, config.norm_eps) if config.llama else nn.LayerNorm(config.C, eps=LN_EPS)
        if config.llama:
            if not config.tied:
                self.lm_head = nn.Linear(config.C, config.Vp, bias=False)
            cos, sin = rope_cos_sin(config.maxT, config.llama_config().HS, config.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # train_gpt.py's fine-tuning (--ft) puts its adapters on this model as on its own (train_gpt.add_adapter)
        self.classifier_lora = None  # the lm_head target's ClassifierLora, added to the logits
        self.prompt = None  # prompt tuning's virtual tokens, before every sequence

    def forward(self, idx, targets, settings, prior_counts=None):
        """prior_counts: per MoE layer, the (counts, choices) of the step's earlier micro-batches, when the
        global-batch Switch loss is on. With a prompt of P virtual tokens the model runs on P + T positions, the
        virtual ones at 0..P-1 (the MoE layers route all P + T tokens of a sequence), and the logits are the T real
        positions'."""
        x = with_prompt(self, self.wte(idx))
        T = x.shape[1]
        if self.config.llama:
            rope = (self.rope_cos[:T], self.rope_sin[:T])  # position t is row t: every sequence starts at 0
        else:
            x = x + self.wpe(torch.arange(T, device=idx.device))
            rope = ()
        routings = []
        for block in self.h:
            prior = None if prior_counts is None or not hasattr(block, "moe") else prior_counts[len(routings)]
            x, routing = block(x, settings, rope, prior)
            if routing is not None:
                routings.append(routing)
        # the padded Vp - V columns are never used; gpt2's output embedding is wte, llama's wte or lm_head
        out_embedding = self.lm_head.weight if hasattr(self, "lm_head") else self.wte.weight
        logits = classifier(self, real_positions(self, self.ln_f(x)), out_embedding)
        ce_loss = F.cross_entropy(logits.reshape(-1, self.config.V), targets.reshape(-1), ignore_index=MASKED)
        aux_loss = sum(r.aux_loss for r in routings)
        z_loss = sum(r.z_loss for r in routings)
        seq_loss = sum_present(r.seq_loss for r in routings)
        if not self.config.noisy:
            return MoEOutput(logits, ce_loss, aux_loss, z_loss, routings, seq_loss=seq_loss)
        importance_loss = sum(r.importance_loss for r in routings)
        load_loss = sum(r.load_loss for r in routings)
        return MoEOutput(logits, ce_loss, aux_loss, z_loss, routings, importance_loss, load_loss, seq_loss)

    def dense_blocks(self):
        return [b for b in self.h if not hasattr(b, "moe")]

    def moe_blocks(self):
        return [b for b in self.h if hasattr(b, "moe")]

    def balance_biases(self):
        """(Lm, E) fp32 numpy copy of the balancing biases (the model must have them)."""
        return np.stack([b.moe.balance_bias.cpu().numpy() for b in self.moe_blocks()]).astype("<f4")

    def update_balance_biases(self, layer_counts, gamma):
        """Aux-loss-free balancing after an optimizer step: b_e += gamma * sign(mean load - load_e) with the loads
        (choices before dropping) summed over the step's micro-batches. The sign compares the integers Σ load
        and E * load_e, so no mean is rounded; gamma is an fp32 and the sum is rounded once, in fp32."""
        gamma = torch.tensor(fp32(gamma), dtype=torch.float32)
        for block, counts in zip(self.moe_blocks(), layer_counts):
            direction = torch.sign(counts.sum() - self.config.E * counts).to(torch.float32)
            block.moe.balance_bias += (gamma * direction).to(block.moe.balance_bias.device)


# FILE ORDER: the model file's tensors, each stacked over the layers (or layers and experts) that have it.
GLOBAL_HEAD = [("wte", "wte.weight"), ("wpe", "wpe.weight")]
EVERY_LAYER = [
    ("ln1w", "ln_1.weight"), ("ln1b", "ln_1.bias"),
    ("qkvw", "attn.c_attn.weight"), ("qkvb", "attn.c_attn.bias"),
    ("attprojw", "attn.c_proj.weight"), ("attprojb", "attn.c_proj.bias"),
    ("ln2w", "ln_2.weight"), ("ln2b", "ln_2.bias"),
]
DENSE_LAYERS = [("fcw", "mlp.c_fc.weight"), ("fcb", "mlp.c_fc.bias"),
                ("fcprojw", "mlp.c_proj.weight"), ("fcprojb", "mlp.c_proj.bias")]
MOE_LAYERS = [("routerw", "moe.router.weight")]
NOISY_MOE_LAYERS = [("routernw", "moe.noise_router.weight")]  # after routerw, in a noisy-gating model only
MOE_EXPERTS = [("expert_fcw", "c_fc.weight"), ("expert_fcb", "c_fc.bias"),
               ("expert_fcprojw", "c_proj.weight"), ("expert_fcprojb", "c_proj.bias")]
GLOBAL_TAIL = [("lnfw", "ln_f.weight"), ("lnfb", "ln_f.bias")]
# A llama MoE file: no wpe, no biases; SwiGLU dense layers and experts (fcw rows [gate (H) | up (H)]); lm_head last
# unless the output embedding is tied
LLAMA_GLOBAL_HEAD = [("wte", "wte.weight")]
LLAMA_EVERY_LAYER = [("ln1w", "ln_1.weight"), ("qkvw", "attn.c_attn.weight"), ("attprojw", "attn.c_proj.weight"),
                     ("ln2w", "ln_2.weight")]
LLAMA_DENSE_LAYERS = [("fcw", "mlp.c_fc.weight"), ("fcprojw", "mlp.c_proj.weight")]
LLAMA_MOE_EXPERTS = [("expert_fcw", "c_fc.weight"), ("expert_fcprojw", "c_proj.weight")]
LLAMA_GLOBAL_TAIL = [("lnfw", "ln_f.weight")]
LLAMA_LM_HEAD = [("lm_head", "lm_head.weight")]


def params_in_file_order(model):
    """[(file name, [nn.Parameter, ...])] in model-file order; experts by layer, then by global index; the shared
    experts (tensors named shared_*, laid out as the experts') after the routed ones."""
    c = model.config
    head, every, dense_layers, experts, tail = GLOBAL_HEAD, EVERY_LAYER, DENSE_LAYERS, MOE_EXPERTS, GLOBAL_TAIL
    if c.llama:
        head, every, dense_layers, experts = LLAMA_GLOBAL_HEAD, LLAMA_EVERY_LAYER, LLAMA_DENSE_LAYERS, LLAMA_MOE_EXPERTS
        tail = LLAMA_GLOBAL_TAIL + ([] if c.tied else LLAMA_LM_HEAD)
    dense, moe = model.dense_blocks(), model.moe_blocks()
    order = [(name, [model.get_parameter(path)]) for name, path in head]
    order += [(name, [b.get_parameter(path) for b in model.h]) for name, path in every]
    order += [(name, [b.get_parameter(path) for b in dense]) for name, path in dense_layers]
    order += [(name, [b.get_parameter(path) for b in moe]) for name, path in MOE_LAYERS]
    if c.noisy:
        order += [(name, [b.get_parameter(path) for b in moe]) for name, path in NOISY_MOE_LAYERS]
    order += [(name, [x.get_parameter(path) for b in moe for x in b.moe.experts]) for name, path in experts]
    if c.shared:
        order += [(name.replace("expert_", "shared_"), [x.get_parameter(path) for b in moe for x in b.moe.shared])
                  for name, path in experts]
    order += [(name, [model.get_parameter(path)]) for name, path in tail]
    return order


# train_gpt.py's payload functions, in this file's order
flat_parameters = partial(train_gpt.flat_parameters, order=params_in_file_order)
flat_gradients = partial(train_gpt.flat_gradients, order=params_in_file_order)
load_flat_parameters = partial(train_gpt.load_flat_parameters, order=params_in_file_order)


def init_weights(model, generator, init_scale):
    """GPT-2's initialisation and test perturbation (train_gpt.init_weights) with the perturbation shrunk from
    std PERTURB_STD to MOE_PERTURB_STD, then the router and expert weight matrices scaled to std * sqrt(init_scale)
    (Switch's reduced initialisation scale). A noisy-gating model gets the non-noisy model's values and then
    its noise routers, drawn from the same generator after everything else like the router weights; a model with
    balancing biases then draws them (std BIAS_INIT_STD, layer by layer) after that."""
    c = model.config
    if c.noisy or c.balance_bias:
        twin = MoEGPT(replace(c, noisy=False, balance_bias=False))
        init_weights(twin, generator, init_scale)
        _, unexpected = model.load_state_dict(twin.state_dict(), strict=False)
        assert not unexpected
        with torch.no_grad():
            for block in model.moe_blocks() if c.noisy else []:
                block.moe.noise_router.weight.normal_(0.0, INIT_STD, generator=generator).mul_(math.sqrt(init_scale))
            for block in model.moe_blocks() if c.balance_bias else []:
                block.moe.balance_bias.normal_(0.0, BIAS_INIT_STD, generator=generator)
        return
    train_gpt.init_weights(model, generator)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if name.endswith("weight") else 0.0  # LayerNorm gains start at 1, biases at 0
                p.copy_(base + (p - base) * (MOE_PERTURB_STD / PERTURB_STD))
            elif ".moe." in name:
                p.mul_(math.sqrt(init_scale))


def write_model_file(path, model, version):
    """The MoE model file (doc/formats.md): words 16..21 for a llama model, 24..29 when a routing option is on
    (all zero otherwise, so that a Switch model's file is today's), and the balancing biases in fp32 after the
    parameters when the model has them."""
    c = model.config
    fields = [MOE_MODEL_MAGIC, version, c.maxT, c.V, c.L, c.NH, c.C, c.Vp, c.E, c.topk, c.moe_every, c.H, int(c.noisy)]
    if c.llama:
        fields += [0] * (FAMILY_WORD - len(fields))
        fields += [FAMILY_LLAMA, c.NKV, fp32_bits(c.rope_theta), c.dense_H, fp32_bits(c.norm_eps), int(c.tied)]
    revision2 = c.first_dense > 0 or c.expert_groups > 0
    if revision2 or c.shared or c.score != "softmax" or c.routed_scale != 1.0 or c.balance_bias:
        fields += [0] * (MOE_REVISION_WORD - len(fields))
        fields += [2 if revision2 else 1, c.shared, c.shared_H, SCORES.index(c.score), fp32_bits(c.routed_scale),
                   int(c.balance_bias)]
        if revision2:
            fields += [c.first_dense, c.expert_groups, c.kept_groups]
    arrays = [train_gpt.model_payload(model, version == MOE_VERSION_BF16, params_in_file_order)]
    if c.balance_bias:
        arrays.append(model.balance_biases())
    write_file(path, header(*fields), *arrays)


def check_shape(maxT, V, L, NH, C, E, topk, moe_every, H, where):
    """Refuses a shape the model cannot have; `where` names the flags or the file."""
    if min(maxT, V, L, NH, C, E, topk, moe_every, H) < 1:
        fail(f"{where}: maxT={maxT} V={V} L={L} NH={NH} C={C} E={E} topk={topk} moe_every={moe_every} H={H} "
             f"must all be positive")
    if C % NH != 0:
        fail(f"{where}: C={C} is not a multiple of NH={NH}")
    if topk > E:
        fail(f"{where}: top-k {topk} is more than the {E} experts")
    if moe_every > L:
        fail(f"{where}: moe_every={moe_every} leaves no MoE layer among L={L} layers")


def check_layers_and_groups(L, moe_every, first_dense, E, topk, score, groups, kept, where):
    """Refuses dense layers first that leave no MoE layer, and expert groups the routing cannot have (doc/moe.md,
    "Routing options" 11): G dividing E in groups of at least 2, M <= G groups holding k experts, sigmoid scores."""
    if first_dense < 0 or first_dense >= L or moe_every > L - first_dense:
        fail(f"{where}: {first_dense} dense layers first and an MoE layer every {moe_every} leave no MoE layer "
             f"among L={L} layers")
    if groups < 0 or kept < 0 or (groups > 0) != (kept > 0):
        fail(f"{where}: {groups} expert groups, {kept} kept: both positive, or both 0")
    if groups == 0:
        return
    if E % groups != 0 or E // groups < 2:
        fail(f"{where}: {groups} expert groups must divide the {E} experts into groups of at least 2")
    if kept > groups or kept * (E // groups) < topk:
        fail(f"{where}: {kept} kept of {groups} expert groups must be at most all of them and hold top-k = {topk}")
    if score != "sigmoid":
        fail(f"{where}: expert groups need sigmoid scores (a group's score sums two affinities), not {score}")


def check_noisy_topk(topk, E, where):
    """Noisy gating's load loss compares with the (k+1)-th value of H: it needs k < E."""
    if topk >= E:
        fail(f"{where}: noisy top-k gating needs top-k below E, since its load loss compares with the (k+1)-th "
             f"logit (got top-k {topk} of E = {E})")


def check_routing_model(shared, shared_H, score, routed_scale, noisy, where):
    """Refuses shared experts, scores and a routed scale the model cannot have."""
    if shared < 0 or shared_H < 0 or (shared == 0) != (shared_H == 0):
        fail(f"{where}: {shared} shared experts of hidden size {shared_H}: both positive, or both 0")
    if not (math.isfinite(routed_scale) and routed_scale > 0):
        fail(f"{where}: routed scale {routed_scale} must be finite and positive (as an fp32)")
    if noisy and score != "softmax":
        fail(f"{where}: noisy top-k gating is defined on softmax scores only (got {score})")


def read_model_file(path):
    """Builds an MoEGPT from an MoE model file (fp32 or bf16); bf16 values are widened exactly to fp32."""
    h, payload = read_file(path, "model file")
    if h[0] == train_gpt.MODEL_MAGIC:
        fail(f"{path} is a dense GPT model file (magic {h[0]}), not an MoE one (magic {MOE_MODEL_MAGIC})")
    if h[0] != MOE_MODEL_MAGIC:
        fail(f"{path} is not an MoE model file (magic {h[0]}, expected {MOE_MODEL_MAGIC})")
    if h[1] not in (MOE_VERSION_FP32, MOE_VERSION_BF16):
        fail(f"{path}: MoE model file version {h[1]} is unknown (1 = fp32, 2 = bf16)")
    maxT, V, L, NH, C, Vp, E, topk, moe_every, H, noisy = (int(v) for v in h[2:13])
    check_shape(maxT, V, L, NH, C, E, topk, moe_every, H, path)
    if noisy not in (0, 1):
        fail(f"{path}: header[12] = {noisy} (noise router present) must be 0 or 1")
    if noisy:
        check_noisy_topk(topk, E, f"{path} (header[12] = 1)")
    arch = {}
    family = int(h[FAMILY_WORD])
    if family == FAMILY_LLAMA:
        NKV, theta_bits, dense_H, eps_bits, tied = (int(v) for v in h[FAMILY_WORD + 1 : FAMILY_WORD + 6])
        theta, eps = fp32_from_bits(theta_bits), fp32_from_bits(eps_bits)
        check_llama_shape(NH, C, NKV, theta, dense_H, eps, tied, path)
        arch = dict(arch="llama", NKV=NKV, rope_theta=theta, dense_H=dense_H, norm_eps=eps, tied=bool(tied))
    elif family != 0:
        fail(f"{path}: model family header[{FAMILY_WORD}] = {family} is unknown (0 = gpt2, 1 = llama)")
    elif h[FAMILY_WORD + 1 : FAMILY_WORD + 6].any():
        fail(f"{path}: a gpt2-family file (header[{FAMILY_WORD}] = 0) with non-zero llama words "
             f"header[{FAMILY_WORD + 1}..{FAMILY_WORD + 5}]")
    revision = int(h[MOE_REVISION_WORD])
    routing = {}
    if revision in (1, 2):
        shared, shared_H, score, scale_bits, bias = (int(v) for v in h[SHARED_WORD : BIAS_WORD + 1])
        if score not in (0, 1):
            fail(f"{path}: header[{SCORE_WORD}] = {score} (score function) must be 0 (softmax) or 1 (sigmoid)")
        if bias not in (0, 1):
            fail(f"{path}: header[{BIAS_WORD}] = {bias} (balancing bias present) must be 0 or 1")
        routed_scale = 1.0 if scale_bits == 0 else fp32_from_bits(scale_bits)
        check_routing_model(shared, shared_H, SCORES[score], routed_scale, noisy, path)
        if bias and score != 1:
            fail(f"{path}: header[{BIAS_WORD}] = 1 (balancing bias) needs sigmoid scores (header[{SCORE_WORD}] = 1)")
        routing = dict(shared=shared, shared_H=shared_H, score=SCORES[score], routed_scale=routed_scale,
                       balance_bias=bool(bias))
    elif revision != 0:
        fail(f"{path}: MoE header revision header[{MOE_REVISION_WORD}] = {revision} is unknown (0, 1 or 2)")
    elif h[SHARED_WORD : BIAS_WORD + 1].any():
        fail(f"{path}: header[{MOE_REVISION_WORD}] = 0 with non-zero words header[{SHARED_WORD}..{BIAS_WORD}]")
    if revision == 2:
        first_dense, groups, kept = (int(v) for v in h[FIRST_DENSE_WORD : KEPT_GROUPS_WORD + 1])
        check_layers_and_groups(L, moe_every, first_dense, E, topk, routing["score"], groups, kept, path)
        routing.update(first_dense=first_dense, expert_groups=groups, kept_groups=kept)
    elif h[FIRST_DENSE_WORD : KEPT_GROUPS_WORD + 1].any():
        fail(f"{path}: header[{MOE_REVISION_WORD}] = {revision} with non-zero words "
             f"header[{FIRST_DENSE_WORD}..{KEPT_GROUPS_WORD}]")
    model = MoEGPT(MoEConfig(maxT=maxT, V=V, L=L, NH=NH, C=C, E=E, topk=topk, moe_every=moe_every, H=H,
                             noisy=bool(noisy), **arch, **routing))
    bias_bytes = model.config.Lm * E * 4 if model.config.balance_bias else 0
    if len(payload) < bias_bytes:
        fail(f"{path}: payload is {len(payload)} bytes, shorter than its {bias_bytes} bytes of balancing biases")
    weights = payload[: len(payload) - bias_bytes]
    train_gpt.load_model_payload(model, path, Vp, weights, h[1] == MOE_VERSION_BF16, params_in_file_order)
    if bias_bytes:
        biases = np.frombuffer(payload[len(weights) :], dtype="<f4").reshape(model.config.Lm, E)
        if not np.isfinite(biases).all():
            fail(f"{path}: a balancing bias is not finite")
        with torch.no_grad():
            for block, bias in zip(model.moe_blocks(), biases):
                block.moe.balance_bias.copy_(torch.from_numpy(bias.copy()))
    return model


def check_routing_options(config, args, where):
    """Refuses the routing flags that the model (from the flags or a file, named by `where`) cannot run."""
    if args.bias_gamma > 0 and config.score != "sigmoid":
        fail(f"--bias-gamma needs sigmoid scores (got {config.score} from {where}): the balancing bias is added to "
             f"the affinities, and softmax's top-k is defined on the logits")
    if args.device_limit > 0 and config.expert_groups > 0:
        fail(f"--device-limit: {where} has its own expert groups; device-limited routing would group them again")
    if args.device_limit > 0:
        if config.E % args.ep_groups != 0:
            fail(f"--ep-groups {args.ep_groups} does not divide the {config.E} experts of {where}")
        if args.device_limit * (config.E // args.ep_groups) < config.topk:
            fail(f"--device-limit {args.device_limit} groups of {config.E // args.ep_groups} experts hold fewer than "
                 f"top-k = {config.topk} experts")
        if config.noisy:
            fail(f"--device-limit: noisy top-k gating's threshold is defined on all E experts ({where} is noisy)")


def model_for_run(args):
    """The model of --model-from-file (whose header gives the shape, architecture, shared experts and scores), or
    a fresh init of those the flags give, drawn from a generator seeded with --seed."""
    if args.model_from_file:
        model = read_model_file(args.model_from_file)
        if args.noisy_topk and not model.config.noisy:
            fail(f"--noisy-topk 1: {args.model_from_file} has no noise-router weights (header[12] = 0)")
        check_routing_options(model.config, args, args.model_from_file)
        if args.bias_gamma > 0 and not model.config.balance_bias:
            # a model without stored biases starts them at zero, as DeepSeek-V3 does
            with_bias = MoEGPT(replace(model.config, balance_bias=True))
            _, unexpected = with_bias.load_state_dict(model.state_dict(), strict=False)
            assert not unexpected
            model = with_bias
        return model  # header[12] = 1 turns noisy gating on, as the file's shape overrides the shape flags
    llama = args.arch == "llama"
    arch = dict(arch="llama", NKV=args.kv_heads, rope_theta=args.rope_theta, dense_H=args.ffn_hidden,
                norm_eps=args.norm_eps, tied=bool(args.tie_embeddings)) if llama else {}
    config = MoEConfig(maxT=args.maxT, V=args.V, L=args.L, NH=args.NH, C=args.C, E=args.E, topk=args.topk,
                       moe_every=args.moe_every, H=args.H, noisy=bool(args.noisy_topk), **arch,
                       shared=args.shared_experts, shared_H=args.shared_hidden, score=args.score,
                       routed_scale=args.routed_scale, balance_bias=args.bias_gamma > 0, first_dense=args.first_dense,
                       expert_groups=args.expert_groups, kept_groups=args.kept_groups)
    check_routing_options(config, args, "the flags")
    model = MoEGPT(config)
    init_weights(model, torch.Generator().manual_seed(args.seed), args.init_scale)
    return model


def routing_settings(args):
    """The settings of an evaluation pass; training_pass gives a training pass's."""
    return RoutingSettings(capacity_factor=args.cf, aux_alpha=args.aux_alpha, z_coef=args.z_coef,
                           jitter=args.jitter, importance_coef=args.importance_coef, load_coef=args.load_coef,
                           seq_alpha=args.seq_aux_alpha, global_aux=bool(args.global_aux),
                           device_limit=args.device_limit, ep_groups=max(args.ep_groups, 1))


def micro_batch_outputs(model, x, y, micro_batches, settings, passes=None):
    """One step's forward passes: (x, y) split along B into `micro_batches` micro-batches, each its own group
    (doc/moe.md). Training passes take the next numbers of `passes` (noise_spec §4: the micro-steps of step s
    are passes s·K .. s·K + K-1); passes None is an evaluation. With the global-batch loss each micro-batch's
    Switch loss sees the counts of the step's micro-batches before it. Returns the K MoEOutputs."""
    outputs, prior = [], None
    for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
        pass_settings = settings if passes is None else training_pass(settings, next(passes))
        output = model(xm, ym, pass_settings, prior)
        if settings.global_aux:
            prior = [(r.counts, r.kept.numel()) if prior is None else (prior[m][0] + r.counts, prior[m][1] +
                                                                       r.kept.numel())
                     for m, r in enumerate(output.routings)]
        outputs.append(output)
    if micro_batches > 1 and bool((y == MASKED).any()):
        # a loss mask: the step's cross-entropy is the mean over all its targets that count, so each micro-batch's
        # mean weighs by its share of them (mean_over then divides by K)
        counts = [int((ym != MASKED).sum()) for ym in y.chunk(micro_batches)]
        outputs = [replace(o, ce_loss=o.ce_loss * (count * micro_batches / sum(counts)))
                   for o, count in zip(outputs, counts)]
    return outputs


def mean_over(outputs, field):
    """A loss averaged over the micro-batches (each micro-batch's loss is its mean; the step's the mean of those),
    or None when the outputs do not have it."""
    values = [getattr(o, field) for o in outputs]
    return None if values[0] is None else sum(values) / len(values)


def layer_counts(outputs):
    """Per MoE layer, the choices routed to each expert before dropping, summed over the micro-batches. (E,)"""
    return [sum(o.routings[m].counts for o in outputs) for m in range(len(outputs[0].routings))]


class MoESteps:
    """train_gpt.gpt_losses's counterpart for the MoE GPT routed with `settings`, over `micro_batches`
    micro-batches per step: training differentiates the mean over the micro-batches of the total loss (CE + aux +
    z, + importance + load with noisy gating, + the sequence-wise loss) and prints the mean CE loss, and the step
    line adds aux (with noisy gating: aux + importance + load; plus the sequence-wise loss), z and the fraction of
    dropped choices. Every call is the next step; its micro-batches are the next training passes, numbered from
    0. after_step moves the balancing biases by the step's loads and records them."""

    def __init__(self, settings, micro_batches=1, bias_gamma=0.0, record_choices=False):
        self.settings, self.micro_batches, self.bias_gamma = settings, micro_batches, bias_gamma
        self.passes = itertools.count()
        self.last = None  # the latest step's MoEOutputs
        self.biases = []  # (Lm, E) balancing biases after each step's update
        self.choices = [] if record_choices else None  # each training pass's expert choices (pass_choices)

    def __call__(self, model, x, y):
        outputs = micro_batch_outputs(model, x, y, self.micro_batches, self.settings, self.passes)
        self.last = outputs
        if self.choices is not None:
            self.choices += [pass_choices(o) for o in outputs]
        choices = sum(r.kept.numel() for o in outputs for r in o.routings)  # MoE layers x B*T tokens x top-k
        fields = lambda: (f"aux {mean_over(outputs, 'balancing_loss').item():f} | "
                          f"z {mean_over(outputs, 'z_loss').item():f} | "
                          f"drop {sum(o.dropped for o in outputs) / choices:.4f} | ")
        return mean_over(outputs, "total_loss"), mean_over(outputs, "ce_loss"), fields

    def after_step(self, model):
        if self.bias_gamma > 0:
            model.update_balance_biases(layer_counts(self.last), self.bias_gamma)
            self.biases.append(model.balance_biases())


def pass_choices(output):
    """One pass's expert choices: per MoE layer, per token, its k choices in routing order. (Lm, N, k) int32"""
    return np.stack([r.choices.cpu().numpy() for r in output.routings]).astype("<i4")


def state_words(args, config, choice_passes):
    """The debug state's MoE words: 7..11 and, from STATE_SETTINGS_WORD, the run's routing and loss settings and the
    number of passes whose expert choices the file holds."""
    K = args.micro_batches
    words = {7: config.Lm, 8: int(config.noisy), 9: int(args.seq_aux_alpha > 0), 10: K if K > 1 else 0,
             11: int(config.balance_bias)}
    cf_bits = [int(w) for w in np.array([args.cf], dtype="<f8").view("<i4")]
    coefficients = (args.aux_alpha, args.z_coef, args.jitter, args.importance_coef, args.load_coef, args.init_scale,
                    args.bias_gamma, args.seq_aux_alpha)
    settings_words = [*cf_bits, *(fp32_bits(c) for c in coefficients), args.global_aux, args.device_limit,
                      args.ep_groups, choice_passes]
    words.update(enumerate(settings_words, STATE_SETTINGS_WORD))
    return words


def describe_routing(output, label=""):
    """One line per MoE layer: capacity, dropped choices, per-expert counts before dropping, margin (of H with
    noisy gating, which also adds the threshold margin and the layer's importance and load losses; of the keys
    affinity + bias, or of the keys within the kept groups, with a bias or a device limit)."""
    lines = []
    for i, r in enumerate(output.routings):
        capacity = "none" if r.capacity is None else r.capacity
        line = (f"MoE layer {i}{label}: capacity {capacity} | dropped {r.dropped} of {r.kept.numel()} choices | "
                f"counts {r.counts.tolist()} | {'logit' if r.key is None else 'key'} margin {r.margin:.3e}")
        if r.importance_loss is not None:
            line += (f" | threshold margin {r.threshold_margin:.3e} | importance {r.importance_loss.item():.6f} | "
                     f"load {r.load_loss.item():.6f}")
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------------
# The modes


def bias_moved_choices(model, x, y, args, settings):
    """How many of the evaluation pass's choices the balancing biases change (they are set to zero for a second
    forward pass and put back): what tells that the reference's biases are big enough to test a C kernel."""
    saved = [b.moe.balance_bias.clone() for b in model.moe_blocks()]
    with torch.no_grad():
        with_bias = micro_batch_outputs(model, x, y, args.micro_batches, settings)
        for block in model.moe_blocks():
            block.moe.balance_bias.zero_()
        without = micro_batch_outputs(model, x, y, args.micro_batches, settings)
        for block, bias in zip(model.moe_blocks(), saved):
            block.moe.balance_bias.copy_(bias)
    pairs = [(a.choices, b.choices) for p, q in zip(with_bias, without) for a, b in zip(p.routings, q.routings)]
    return sum(int((a != b).sum()) for a, b in pairs), sum(a.numel() for a, _ in pairs)


def write_reference(args):
    device = pick_device(args.device)
    make_deterministic()
    model = model_for_run(args)
    config = model.config
    settings = routing_settings(args)
    x, y = reference_batch(args, config)
    K = args.micro_batches

    version = MOE_VERSION_FP32
    if args.dtype == "bfloat16":
        # the C BF16 build starts from these rounded values; the reference still computes in fp32 (the
        # balancing biases are routing state, not parameters: they stay fp32)
        load_flat_parameters(model, bf16_to_float(bf16_bits(flat_parameters(model))))
        version = MOE_VERSION_BF16
    model_path = args.write_reference + "_model.bin"
    write_model_file(model_path, model, version)
    order, words, wrote = params_in_file_order, {}, f"{model_path} (version {version})"
    if uses_adapter(args):
        step = train_gpt.adapter_for_run(model, args, REFERENCE_B_STD)
        order, words = adapter_in_file_order, {STATE_FT_WORD: FT_METHODS[args.ft]}
        if args.dtype == "bfloat16":  # the C BF16 build holds the adapter in bf16 too
            load_flat_parameters(model, bf16_to_float(bf16_bits(flat_parameters(model, order=order))), order=order)
        adapter_path = args.write_reference + "_adapter.bin"
        write_adapter_file(adapter_path, model, args, model_path, step)
        wrote += f", {adapter_path} ({args.ft} {adapter_shape(args)})"

    model.to(device)
    x, y = x.to(device), y.to(device)
    # the logits come from an evaluation pass (no jitter, no noise); everything else in the debug state (the
    # losses, the routing counts, the gradients) from the training passes of step 0's micro-batches, which step 0
    # repeats (noise_spec §4)
    with torch.no_grad():
        evaluation = micro_batch_outputs(model, x, y, K, settings)
    first = micro_batch_outputs(model, x, y, K, settings, itertools.count())
    backward(mean_over(first, "total_loss"), model)
    routing_ints = []
    for m, counts in enumerate(layer_counts(first)):
        routing_ints += [sum(o.routings[m].dropped for o in first)] + counts.tolist()
    fields = ["ce_loss", "aux_loss", "z_loss"] + (["importance_loss", "load_loss"] if config.noisy else [])
    fields += ["seq_loss"] if settings.seq_alpha > 0 else []
    losses = {field: mean_over(first, field).item() for field in fields}
    first_grads = flat_gradients(model, order=order)  # with --ft the adapter's: the base is frozen
    # a bf16 reference keeps every pass's expert choices: test_moe's BF16 build routes as they say (teacher-forced
    # routing, doc/moe.md), where its rounding would flip a near-tie and send a token to another expert
    bf16 = args.dtype == "bfloat16"
    steps = MoESteps(settings, K, args.bias_gamma, record_choices=bf16)
    step_losses = reference_step_losses(model, args, device, x, y, steps, steps.after_step)

    state_path = args.write_reference + "_debug_state.bin"
    # the evaluation passes' (the logits), the gradient check's, then each step's, K passes each
    choices = [pass_choices(o) for o in evaluation + first] + steps.choices if bf16 else []
    choice_rows = [np.stack(choices).reshape(-1)] if choices else []
    bias_rows = [np.stack(steps.biases).reshape(-1)] if config.balance_bias and steps.biases else []
    write_file(
        state_path, debug_state_header(args, config, state_words(args, config, len(choices)) | words),
        x.cpu().numpy().astype("<i4"), y.cpu().numpy().astype("<i4"),
        torch.cat([o.logits for o in evaluation]).detach().float().cpu().numpy().astype("<f4"),
        np.array(list(losses.values()), dtype="<f4"), np.array(routing_ints, dtype="<i4"), *choice_rows, first_grads,
        np.array(step_losses, dtype="<f4"), *bias_rows,
    )
    named = " | ".join(f"{'loss' if field == 'ce_loss' else field[: -len('_loss')]} {value:.6f}"
                       for field, value in losses.items())
    print(f"wrote {wrote} and {state_path}: {named} | dropped {sum(o.dropped for o in first)}")
    noisy_run = config.noisy or args.jitter > 0
    # with noise the evaluation pass routes differently: its margins tell how closely C must match the logits
    for j, output in enumerate(first):
        micro = f", micro-batch {j}" if K > 1 else ""
        for line in describe_routing(output, (", training pass 0" if noisy_run else "") + micro):
            print(line)
    if noisy_run:
        for line in describe_routing(evaluation[0], ", evaluation"):
            print(line)
    if config.balance_bias:
        moved, total = bias_moved_choices(model, x, y, args, settings)
        print(f"balancing biases after the {args.steps} steps: {model.balance_biases().reshape(-1).tolist()} | "
              f"they change {moved} of the {total} choices of an evaluation pass")
    if step_losses:
        print(f"losses of {args.steps} steps: {step_losses[0]:.6f} ... {step_losses[-1]:.6f}")


def train(args):
    steps = MoESteps(routing_settings(args), 1, args.bias_gamma)
    train_loop(args, with_adapter(model_for_run, train_gpt.adapter_for_run), steps, steps.after_step)


# ----------------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = OneLineParser(description="PyTorch reference Switch-MoE GPT for switch.cu (see the comment at the top).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-reference", metavar="PREFIX", help="write PREFIX_model.bin and PREFIX_debug_state.bin")
    mode.add_argument("--train", action="store_true", help="train on --input-bin shards, printing step lines")
    p.add_argument("--model-from-file", metavar="PATH",
                   help="start from this MoE model file (fp32 or bf16); its header overrides the shape, --arch, "
                        "shared-expert and score flags")
    p.add_argument("--input-bin", metavar="PATTERN", help="glob of training shards (--train)")
    add_shape_flags(p)
    add_arch_flags(p)
    p.add_argument("--E", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--topk", type=int, default=1, help="experts per token (1 = Switch, 2 = GShard)")
    p.add_argument("--moe-every", type=int, default=1, help="layer l is MoE iff (l + 1) %% N == 0")
    p.add_argument("--H", type=int, default=96, help="expert hidden size")
    p.add_argument("--shared-experts", type=int, default=0, metavar="N",
                   help="shared experts per MoE layer: every token goes through them, ungated (0: none)")
    p.add_argument("--shared-hidden", type=int, metavar="H", help="the shared experts' hidden size (default --H)")
    p.add_argument("--score", choices=SCORES, default="softmax", help="router scores: softmax, or sigmoid affinities")
    p.add_argument("--routed-scale", type=float, default=1.0, metavar="F", help="the routed experts' gates times F")
    p.add_argument("--cf", type=float, default=1.25, help="capacity factor (<= 0: no limit, dropless)")
    p.add_argument("--aux-alpha", type=float, default=0.01, help="load-balancing loss coefficient")
    p.add_argument("--global-aux", type=int, default=0, metavar="0|1",
                   help="the load-balancing loss's expert fractions from the step's micro-batches so far")
    p.add_argument("--seq-aux-alpha", type=float, default=0.0, metavar="A",
                   help="sequence-wise balance loss coefficient (DeepSeek-V3; 0: off)")
    p.add_argument("--bias-gamma", type=float, default=0.0, metavar="G",
                   help="aux-loss-free balancing: the biases' step after each update (needs --score sigmoid; 0: off)")
    p.add_argument("--device-limit", type=int, default=0, metavar="M",
                   help="each token's experts within at most M of the --ep-groups expert groups (0: no limit)")
    p.add_argument("--ep-groups", type=int, default=0, metavar="G",
                   help="the expert-parallel degree that splits the experts into G groups (--device-limit only)")
    p.add_argument("--first-dense", type=int, default=0, metavar="F",
                   help="dense layers before the first MoE layer (--moe-every counts from layer F)")
    p.add_argument("--expert-groups", type=int, default=0, metavar="G",
                   help="the model's expert groups: each token's experts within --kept-groups of them (sigmoid)")
    p.add_argument("--kept-groups", type=int, default=0, metavar="M", help="the expert groups each token keeps")
    p.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="--write-reference: each step is K micro-batches of B/K sequences (gradient accumulation)")
    p.add_argument("--z-coef", type=float, default=0.001, help="router z-loss coefficient")
    p.add_argument("--init-scale", type=float, default=0.1,
                   help="router and expert weights get std * sqrt(this) (Switch's 0.1; 1 = GPT-2's init)")
    p.add_argument("--jitter", type=float, default=0.0, metavar="EPS",
                   help="router jitter: training passes multiply the router input by U(1-EPS, 1+EPS) (0: off)")
    p.add_argument("--noisy-topk", type=int, default=0, metavar="0|1",
                   help="noisy top-k gating (Shazeer 2017) with a noise router; needs --topk below --E")
    p.add_argument("--importance-coef", type=float, default=0.1, help="noisy gating's importance loss coefficient")
    p.add_argument("--load-coef", type=float, default=0.1, help="noisy gating's load loss coefficient")
    add_run_flags(p, "reference: bf16-round the written parameters; train: bf16 autocast (router in fp32)",
                  grad_clip=0.5)
    add_ft_flags(p)
    args = p.parse_args(argv)

    if not (0 <= args.jitter < 1):  # also refuses nan; 1 would allow a zero multiplier
        fail(f"--jitter must be in [0, 1) (got {args.jitter})")
    if args.noisy_topk not in (0, 1):
        fail(f"--noisy-topk must be 0 or 1 (got {args.noisy_topk})")
    if args.global_aux not in (0, 1):
        fail(f"--global-aux must be 0 or 1 (got {args.global_aux})")
    if min(args.B, args.T) < 1:
        fail("--B and --T must be positive")
    if args.micro_batches < 1 or args.B % args.micro_batches != 0:
        fail(f"--micro-batches {args.micro_batches} must be positive and divide --B {args.B}")
    if args.train and args.micro_batches != 1:
        fail("--micro-batches applies to --write-reference only (--train takes one micro-batch per step)")
    if args.shared_hidden is not None and args.shared_experts == 0:
        fail("--shared-hidden needs --shared-experts")
    if args.shared_hidden is None:
        args.shared_hidden = args.H if args.shared_experts > 0 else 0
    args.routed_scale = fp32(args.routed_scale)  # the file stores an fp32
    if not (math.isfinite(args.bias_gamma) and args.bias_gamma >= 0):
        fail(f"--bias-gamma must be finite and >= 0 (got {args.bias_gamma})")
    if not (math.isfinite(args.seq_aux_alpha) and args.seq_aux_alpha >= 0):
        fail(f"--seq-aux-alpha must be finite and >= 0 (got {args.seq_aux_alpha})")
    if args.device_limit < 0 or args.ep_groups < 0:
        fail("--device-limit and --ep-groups must be >= 0")
    if (args.device_limit > 0) != (args.ep_groups > 0):
        fail("--device-limit M and --ep-groups G go together: the limit counts the groups G makes")
    if args.device_limit > args.ep_groups:
        fail(f"--device-limit {args.device_limit} is more than the {args.ep_groups} --ep-groups")
    with errors_named_here():
        check_arch_flags(args)
    if not args.model_from_file:
        check_shape(args.maxT, args.V, args.L, args.NH, args.C, args.E, args.topk, args.moe_every, args.H,
                    "flags --maxT --V --L --NH --C --E --topk --moe-every --H")
        if args.noisy_topk:
            check_noisy_topk(args.topk, args.E, "--noisy-topk 1")
        check_routing_model(args.shared_experts, args.shared_hidden, args.score, args.routed_scale,
                            bool(args.noisy_topk), "flags --shared-experts --shared-hidden --score --routed-scale")
        check_layers_and_groups(args.L, args.moe_every, args.first_dense, args.E, args.topk, args.score,
                                args.expert_groups, args.kept_groups,
                                "flags --L --moe-every --first-dense --E --topk --score --expert-groups --kept-groups")
    if args.init_scale <= 0:
        fail(f"--init-scale must be positive (got {args.init_scale})")
    if not all(map(math.isfinite, (args.cf, args.aux_alpha, args.z_coef, args.importance_coef, args.load_coef))):
        fail("--cf --aux-alpha --z-coef --importance-coef --load-coef must be finite")
    check_run_flags(args)
    check_moe_ft_flags(args)
    return args


def check_moe_ft_flags(args):
    """train_gpt.py's --ft checks, and the MoE's own: fine-tuning freezes the base, balancing biases included."""
    with errors_named_here():
        check_ft_flags(args)
    if uses_adapter(args) and args.bias_gamma > 0:
        fail(f"--bias-gamma {args.bias_gamma:g} with fine-tuning (--ft, --adapter-from-file): the base model is "
             f"frozen, its balancing biases too; give --bias-gamma 0")


def main(argv=None):
    with errors_named_here():
        args = parse_args(argv)
        if args.write_reference is not None:
            write_reference(args)
        else:
            train(args)


if __name__ == "__main__":
    main()
