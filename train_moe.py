"""
train_moe.py: the PyTorch reference Switch-Transformer Mixture-of-Experts GPT for switch.cu. It is the GPT-2 of
train_gpt.py in which layer l (from 0) has an MoE FFN iff (l + 1) % moe_every == 0, with the routing, capacity,
dropping and balancing losses exactly as doc/moe.md defines them, router
jitter and noisy top-k gating exactly as the router-noise spec (doc/moe.md, "Router noise", shared with the CUDA
side; its sections are cited as "noise_spec §N") defines them, and it writes the files the C test (test_moe) compares
against.

Run from the repository root with a Python that has torch (here Debian's: /usr/bin/python3):
  reference state for test_moe (MoE model file + debug state with logits, losses, routing counts, gradients,
  10 step losses):
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k1 --dtype float32 --cf 0.5
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k2_me2 --topk 2 --moe-every 2 --cf 0
    /usr/bin/python3 train_moe.py --write-reference build/ref/moe_k2_noisy --topk 2 --noisy-topk 1 --jitter 0.05
    (the defaults: --B 3 --T 23 --V 263 --L 2 --NH 3 --C 48 --maxT 32 --E 4 --topk 1 --moe-every 1 --H 96
     --cf 1.25 --aux-alpha 0.01 --z-coef 0.001 --init-scale 0.1 --seed 1337 --steps 10 --lr 1e-3
     --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 --grad-clip 0.5; router noise off:
     --jitter 0 --noisy-topk 0, with --importance-coef 0.1 --load-coef 0.1 for noisy gating's losses)
  training baseline (the C trainer's step line with aux, z and drop; constant lr), on shards that
  train_gpt.py --write-shard writes:
    /usr/bin/python3 train_moe.py --train --input-bin 'build/ref/shard*.bin' --B 4 --T 32 --steps 20
  any mode can start from an MoE model file instead of a fresh init: --model-from-file PATH (fp32 or bf16).
Its test: /usr/bin/python3 dev/test/test_reference_moe.py

MoE model file: header [0]=20261129, [1]=1 (fp32) or 2 (bf16), [2]=maxT, [3]=V, [4]=L, [5]=NH, [6]=C, [7]=Vp,
[8]=E, [9]=top-k, [10]=moe_every, [11]=H, [12]=1 when noisy gating's noise-router weights routernw (Lm, E, C)
follow routerw, else 0 (and no routernw); payload in doc/formats.md's order (see FILE ORDER below).

Debug state: header [0]=20240327, [1]=2, [2]=B, [3]=T, [4]=steps, [5]=V, [6]=Vp, [7]=Lm (MoE layers), [8]=1
when noisy gating is on, else 0; payload x, y (B*T int32 each), logits (B*T*V fp32, the V real columns), CE
loss (fp32), aux loss summed over the MoE layers (fp32), z loss summed over the MoE layers (fp32), with
header[8] = 1 the importance loss and the load loss, each summed over the MoE layers (fp32), then per MoE
layer in layer order: the number of dropped (token, choice) pairs (int32) and the E per-expert counts of
choices before dropping (int32); then the gradient of the total loss (CE + aux + z, + importance + load with
noisy gating) of every parameter in model-file order and layout (fp32; wte's has Vp rows, the padded ones
zero; routernw's after routerw's); then the CE loss of each of `steps` AdamW steps on the same batch (step k's
loss is its forward loss before its update: step 0's equals the CE loss above). With router noise the logits
come from an evaluation pass (no jitter, no noise) and everything else (CE, aux, z, importance, load, drops,
counts, gradients) from training pass 0, the pass step 0 repeats (see the choices below).

Choices this reference makes (the C side must make the same ones):
- Capacity = ceil(k * CF * N / E) evaluated in IEEE double left to right, CF held as a double:
  (((double)k * cf) * N) / E, then ceil. It is taken as the rounding gives it: with k=2, CF=1.1, N=25, E=5
  the double result is 11.000000000000002 and the capacity is 12, not 11. CF <= 0: no limit.
- Top-k picks "the k largest probs" by comparing the logits: softmax is strictly increasing, so the order of
  the logits is the order of the exact probabilities, and two different logits never tie just because their
  rounded probs are equal. Equal logits go to the lower expert index. (llmc/moe.cuh's router does the same.)
- For k >= 2 the gate renormalises over all k chosen experts, dropped choices included: a dropped choice
  removes its term but does not raise the gates of the kept ones.
- Init: GPT-2's (std 0.02; the projections into the residual, expert ones included, 0.02/sqrt(2L)); the router
  and expert weight matrices then have their std scaled by sqrt(--init-scale) (Switch §2.4: weights drawn with
  std sqrt(s/fan_in), s = 0.1 instead of 1, i.e. a std sqrt(0.1) times the standard one; --init-scale 1 gives
  GPT-2's init). Every bias and LayerNorm parameter, the experts' included, is then perturbed as
  train_gpt.py does, so that a C kernel that drops or swaps one of them changes the results, but with std
  0.02 instead of 0.1 so that the tokens spread over the experts (MOE_PERTURB_STD says why).
- The default H is 96 = 2C, not 4C, so that a C kernel that assumes the expert width is the dense MLP's fails.
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
from train_gpt import (INIT_STD, LN_EPS, PERTURB_STD, STATE_MAGIC, STATE_VERSION, CausalSelfAttention, GPTConfig, MLP,
                       OneLineParser, add_run_flags, add_shape_flags, backward, bf16_bits, bf16_to_float,
                       check_run_flags, header, make_deterministic, pick_device, read_file, reference_batch,
                       reference_step_losses, train_loop, write_file)

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
    moe_every: int  # layer l is an MoE layer iff (l + 1) % moe_every == 0
    H: int  # expert hidden size
    noisy: bool = False  # noisy top-k gating: every MoE layer has a noise router (model file header[12])

    def is_moe(self, layer):
        return (layer + 1) % self.moe_every == 0

    def moe_index(self, layer):
        """Layer `layer`'s index among the MoE layers (0-based): the m of the noise seeds."""
        return sum(self.is_moe(l) for l in range(layer))

    @property
    def Lm(self):
        return sum(self.is_moe(l) for l in range(self.L))


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
    probs: torch.Tensor  # (N, E) softmax of the logits
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
        ordered = self.logits.detach().sort(dim=1, descending=True).values
        return float((ordered[:, k - 1] - ordered[:, k]).min())


def cv_squared(values):
    """The squared coefficient of variation of an (E,) vector: population variance over the squared mean."""
    mean = values.mean()
    return ((values - mean) ** 2).mean() / mean**2


def route(logits, topk, settings, clean=None, std=None):
    """Routing of one group (doc/moe.md, Routing) from its (N, E) router logits. Noisy top-k gating
    passes H as `logits` (it takes the router logits' place everywhere) and its clean logits and noise std,
    which its importance and load losses also need (noise_spec §3)."""
    N, E = logits.shape
    noisy = clean is not None
    probs = F.softmax(logits, dim=1)
    if noisy:
        # the first k of the routing order are the choices; the (k+1)-th gives the chosen experts' threshold
        order = top_k_lower_index(logits, topk + 1)
        choices = order[:, :topk]
    else:
        choices = top_k_lower_index(logits, topk)
    chosen = probs.gather(1, choices)
    gates = chosen if topk == 1 else chosen / chosen.sum(dim=1, keepdim=True)

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

    # f_e counts choices before dropping and is a constant (no gradient); P_e carries the gradient
    fraction_routed = counts.to(probs.dtype) / (N * topk)
    mean_prob = probs.mean(dim=0)
    aux_loss = settings.aux_alpha * E * (fraction_routed * mean_prob).sum()
    z_loss = settings.z_coef * (torch.logsumexp(logits, dim=1) ** 2).mean()
    if not noisy:
        return Routing(logits, probs, choices, gates, kept, counts, capacity, aux_loss, z_loss)

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
                   threshold, load_probs, importance, load, importance_loss, load_loss)


class Expert(nn.Module):
    """One expert: the GPT-2 MLP with hidden size H."""

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.C, config.H)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(config.H, config.C)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class SwitchFFN(nn.Module):
    """The MoE FFN: router (with noisy gating's noise router), top-k, capacity, and the gated sum of the kept
    experts' outputs."""

    def __init__(self, config, moe_index):
        super().__init__()
        self.topk = config.topk
        self.moe_index = moe_index  # this layer's m among the MoE layers: it picks the noise streams
        self.router = nn.Linear(config.C, config.E, bias=False)
        self.noise_router = nn.Linear(config.C, config.E, bias=False) if config.noisy else None
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.E))

    def forward(self, h, settings):
        """h: (B, T, C) = ln2(x). Returns (Σ over kept choices of gate * Expert_e(h), Routing); the B*T tokens
        of the micro-batch are one group."""
        B, T, C = h.shape
        N, E = B * T, self.router.out_features
        tokens = h.reshape(N, C)
        # the router runs in (at least) fp32 whatever the precision, outside bf16 autocast (Switch §2.4)
        with torch.autocast(device_type=h.device.type, enabled=False):
            router_in = tokens.to(self.router.weight.dtype)
            if settings.training and settings.jitter > 0:
                # only the router reads the jittered input: the experts below read the tokens themselves
                seed = noise_seed(settings.pass_number, self.moe_index, NOISE_JITTER)
                router_in = router_in * constant_like(jitter_multiplier(seed, N, C, settings.jitter), router_in)
            logits = self.router(router_in)
            if self.noise_router is None:
                routing = route(logits, self.topk, settings)
            else:
                std = F.softplus(self.noise_router(router_in))  # torch's threshold 20 is the spec's
                noisy_logits = logits  # evaluation: H = clean
                if settings.training:
                    seed = noise_seed(settings.pass_number, self.moe_index, NOISE_GATING)
                    noisy_logits = logits + constant_like(gating_noise(seed, N, E), std) * std
                routing = route(noisy_logits, self.topk, settings, clean=logits, std=std)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, choice = (routing.kept & (routing.choices == e)).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            gate = routing.gates[token, choice].unsqueeze(1)
            out = out.index_add(0, token, (gate * expert(tokens[token])).to(out.dtype))
        return out.view(B, T, C), routing


class MoEBlock(nn.Module):
    def __init__(self, config, layer):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.C, eps=LN_EPS)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.C, eps=LN_EPS)
        if config.is_moe(layer):
            self.moe = SwitchFFN(config, config.moe_index(layer))
        else:
            self.mlp = MLP(config)

    def forward(self, x, settings):
        """Returns the block's output and its Routing (None for a dense layer)."""
        x = x + self.attn(self.ln_1(x))
        if hasattr(self, "moe"):
            ffn, routing = self.moe(self.ln_2(x), settings)
            return x + ffn, routing
        return x + self.mlp(self.ln_2(x)), None


@dataclass
class MoEOutput:
    logits: torch.Tensor  # (B, T, V)
    ce_loss: torch.Tensor  # mean cross-entropy: the printed `loss`
    aux_loss: torch.Tensor  # load-balancing losses summed over the MoE layers
    z_loss: torch.Tensor  # router z-losses summed over the MoE layers
    routings: list  # one Routing per MoE layer, in layer order
    importance_loss: torch.Tensor | None = None  # noisy gating: importance losses summed over the MoE layers
    load_loss: torch.Tensor | None = None  # noisy gating: load losses summed over the MoE layers

    @property
    def noisy(self):
        return self.importance_loss is not None

    @property
    def total_loss(self):
        """What training differentiates."""
        loss = self.ce_loss + self.aux_loss + self.z_loss
        return loss + self.importance_loss + self.load_loss if self.noisy else loss

    @property
    def balancing_loss(self):
        """The step line's aux: the Switch loss, plus noisy gating's importance and load losses."""
        return self.aux_loss + self.importance_loss + self.load_loss if self.noisy else self.aux_loss

    @property
    def dropped(self):
        return sum(r.dropped for r in self.routings)


class MoEGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.Vp, config.C)
        self.wpe = nn.Embedding(config.maxT, config.C)
        self.h = nn.ModuleList(MoEBlock(config, l) for l in range(config.L))
        self.ln_f = nn.LayerNorm(config.C, eps=LN_EPS)

    def forward(self, idx, targets, settings):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        routings = []
        for block in self.h:
            x, routing = block(x, settings)
            if routing is not None:
                routings.append(routing)
        # lm_head is tied to wte; the Vp - V padded columns are never used
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.config.V]
        ce_loss = F.cross_entropy(logits.reshape(-1, self.config.V), targets.reshape(-1))
        aux_loss = sum(r.aux_loss for r in routings)
        z_loss = sum(r.z_loss for r in routings)
        if not self.config.noisy:
            return MoEOutput(logits, ce_loss, aux_loss, z_loss, routings)
        importance_loss = sum(r.importance_loss for r in routings)
        load_loss = sum(r.load_loss for r in routings)
        return MoEOutput(logits, ce_loss, aux_loss, z_loss, routings, importance_loss, load_loss)

    def dense_blocks(self):
        return [b for b in self.h if not hasattr(b, "moe")]

    def moe_blocks(self):
        return [b for b in self.h if hasattr(b, "moe")]


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


def params_in_file_order(model):
    """[(file name, [nn.Parameter, ...])] in model-file order; experts by layer, then by global index."""
    dense, moe = model.dense_blocks(), model.moe_blocks()
    order = [(name, [model.get_parameter(path)]) for name, path in GLOBAL_HEAD]
    order += [(name, [b.get_parameter(path) for b in model.h]) for name, path in EVERY_LAYER]
    order += [(name, [b.get_parameter(path) for b in dense]) for name, path in DENSE_LAYERS]
    order += [(name, [b.get_parameter(path) for b in moe]) for name, path in MOE_LAYERS]
    if model.config.noisy:
        order += [(name, [b.get_parameter(path) for b in moe]) for name, path in NOISY_MOE_LAYERS]
    order += [(name, [x.get_parameter(path) for b in moe for x in b.moe.experts]) for name, path in MOE_EXPERTS]
    order += [(name, [model.get_parameter(path)]) for name, path in GLOBAL_TAIL]
    return order


# train_gpt.py's payload functions, in this file's order
flat_parameters = partial(train_gpt.flat_parameters, order=params_in_file_order)
flat_gradients = partial(train_gpt.flat_gradients, order=params_in_file_order)
load_flat_parameters = partial(train_gpt.load_flat_parameters, order=params_in_file_order)


def init_weights(model, generator, init_scale):
    """GPT-2's initialisation and test perturbation (train_gpt.init_weights) with the perturbation shrunk from
    std PERTURB_STD to MOE_PERTURB_STD, then the router and expert weight matrices scaled to std * sqrt(init_scale)
    (Switch's reduced initialisation scale). A noisy-gating model gets the non-noisy model's values and then
    its noise routers, drawn from the same generator after everything else like the router weights."""
    if model.config.noisy:
        twin = MoEGPT(replace(model.config, noisy=False))
        init_weights(twin, generator, init_scale)
        _, unexpected = model.load_state_dict(twin.state_dict(), strict=False)
        assert not unexpected
        with torch.no_grad():
            for block in model.moe_blocks():
                block.moe.noise_router.weight.normal_(0.0, INIT_STD, generator=generator).mul_(math.sqrt(init_scale))
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
    c = model.config
    write_file(path, header(MOE_MODEL_MAGIC, version, c.maxT, c.V, c.L, c.NH, c.C, c.Vp, c.E, c.topk,
                            c.moe_every, c.H, int(c.noisy)),
               train_gpt.model_payload(model, version == MOE_VERSION_BF16, params_in_file_order))


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


def check_noisy_topk(topk, E, where):
    """Noisy gating's load loss compares with the (k+1)-th value of H: it needs k < E."""
    if topk >= E:
        fail(f"{where}: noisy top-k gating needs top-k below E, since its load loss compares with the (k+1)-th "
             f"logit (got top-k {topk} of E = {E})")


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
    model = MoEGPT(MoEConfig(maxT=maxT, V=V, L=L, NH=NH, C=C, E=E, topk=topk, moe_every=moe_every, H=H,
                             noisy=bool(noisy)))
    train_gpt.load_model_payload(model, path, Vp, payload, h[1] == MOE_VERSION_BF16, params_in_file_order)
    return model


def model_for_run(args):
    """The model of --model-from-file (whose header gives the shape), or a fresh init of the shape the flags
    give, drawn from a generator seeded with --seed."""
    if args.model_from_file:
        model = read_model_file(args.model_from_file)
        if args.noisy_topk and not model.config.noisy:
            fail(f"--noisy-topk 1: {args.model_from_file} has no noise-router weights (header[12] = 0)")
        return model  # header[12] = 1 turns noisy gating on, as the file's shape overrides the shape flags
    config = MoEConfig(maxT=args.maxT, V=args.V, L=args.L, NH=args.NH, C=args.C, E=args.E, topk=args.topk,
                       moe_every=args.moe_every, H=args.H, noisy=bool(args.noisy_topk))
    model = MoEGPT(config)
    init_weights(model, torch.Generator().manual_seed(args.seed), args.init_scale)
    return model


def routing_settings(args):
    """The settings of an evaluation pass; training_pass gives a training pass's."""
    return RoutingSettings(capacity_factor=args.cf, aux_alpha=args.aux_alpha, z_coef=args.z_coef,
                           jitter=args.jitter, importance_coef=args.importance_coef, load_coef=args.load_coef)


def moe_losses(settings):
    """train_gpt.gpt_losses for the MoE GPT routed with `settings`: training differentiates the total loss
    (CE + aux + z, + importance + load with noisy gating) and prints the CE loss, and the step line adds aux
    (with noisy gating: aux + importance + load), z and the fraction of dropped choices. Every call is the next
    training forward pass, numbered from 0: the loops that call this take one forward pass per optimizer step
    (no gradient accumulation), so step k (from 0) is pass k, as noise_spec §4 numbers them."""
    passes = itertools.count()

    def losses(model, x, y):
        output = model(x, y, training_pass(settings, next(passes)))
        choices = sum(r.kept.numel() for r in output.routings)  # MoE layers x B*T tokens x top-k
        fields = lambda: (f"aux {output.balancing_loss.item():f} | z {output.z_loss.item():f} | "
                          f"drop {output.dropped / choices:.4f} | ")
        return output.total_loss, output.ce_loss, fields

    return losses


def describe_routing(output, label=""):
    """One line per MoE layer: capacity, dropped choices, per-expert counts before dropping, margin (of H with
    noisy gating, which also adds the threshold margin and the layer's importance and load losses)."""
    lines = []
    for i, r in enumerate(output.routings):
        capacity = "none" if r.capacity is None else r.capacity
        line = (f"MoE layer {i}{label}: capacity {capacity} | dropped {r.dropped} of {r.kept.numel()} choices | "
                f"counts {r.counts.tolist()} | logit margin {r.margin:.3e}")
        if r.importance_loss is not None:
            line += (f" | threshold margin {r.threshold_margin:.3e} | importance {r.importance_loss.item():.6f} | "
                     f"load {r.load_loss.item():.6f}")
        lines.append(line)
    return lines


# ----------------------------------------------------------------------------------------------------------
# The modes


def write_reference(args):
    device = pick_device(args.device)
    make_deterministic()
    model = model_for_run(args)
    config = model.config
    settings = routing_settings(args)
    x, y = reference_batch(args, config)

    version = MOE_VERSION_FP32
    if args.dtype == "bfloat16":
        # the C BF16 build starts from these rounded values; the reference still computes in fp32
        load_flat_parameters(model, bf16_to_float(bf16_bits(flat_parameters(model))))
        version = MOE_VERSION_BF16
    write_model_file(args.write_reference + "_model.bin", model, version)

    model.to(device)
    x, y = x.to(device), y.to(device)
    # the logits come from an evaluation pass (no jitter, no noise); everything else in the debug state (the
    # losses, the routing counts, the gradients) from training pass 0, which step 0 repeats (noise_spec §4)
    with torch.no_grad():
        evaluation = model(x, y, settings)
    first = model(x, y, training_pass(settings, 0))
    backward(first.total_loss, model)
    routing_ints = []
    for r in first.routings:
        routing_ints += [r.dropped] + r.counts.tolist()
    losses = [first.ce_loss.item(), first.aux_loss.item(), first.z_loss.item()]
    if config.noisy:
        losses += [first.importance_loss.item(), first.load_loss.item()]
    first_grads = flat_gradients(model)
    step_losses = reference_step_losses(model, args, device, x, y, moe_losses(settings))

    state_path = args.write_reference + "_debug_state.bin"
    write_file(
        state_path,
        header(STATE_MAGIC, STATE_VERSION, args.B, args.T, args.steps, config.V, config.Vp, config.Lm,
               int(config.noisy)),
        x.cpu().numpy().astype("<i4"), y.cpu().numpy().astype("<i4"),
        evaluation.logits.detach().float().cpu().numpy().astype("<f4"),
        np.array(losses, dtype="<f4"), np.array(routing_ints, dtype="<i4"), first_grads,
        np.array(step_losses, dtype="<f4"),
    )
    noisy_losses = (f" | importance {first.importance_loss.item():.6f} | load {first.load_loss.item():.6f}"
                    if config.noisy else "")
    print(f"wrote {args.write_reference}_model.bin (version {version}) and {state_path}: "
          f"loss {first.ce_loss.item():.6f} | aux {first.aux_loss.item():.6f} | z {first.z_loss.item():.6f}"
          f"{noisy_losses} | dropped {first.dropped}")
    noisy_run = config.noisy or args.jitter > 0
    # with noise the evaluation pass routes differently: its margins tell how closely C must match the logits
    for line in describe_routing(first, ", training pass 0" if noisy_run else ""):
        print(line)
    if noisy_run:
        for line in describe_routing(evaluation, ", evaluation"):
            print(line)
    if step_losses:
        print(f"losses of {args.steps} steps: {step_losses[0]:.6f} ... {step_losses[-1]:.6f}")


def train(args):
    train_loop(args, model_for_run, moe_losses(routing_settings(args)))


# ----------------------------------------------------------------------------------------------------------


def parse_args(argv):
    p = OneLineParser(description="PyTorch reference Switch-MoE GPT for switch.cu (see the comment at the top).")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write-reference", metavar="PREFIX", help="write PREFIX_model.bin and PREFIX_debug_state.bin")
    mode.add_argument("--train", action="store_true", help="train on --input-bin shards, printing step lines")
    p.add_argument("--model-from-file", metavar="PATH",
                   help="start from this MoE model file (fp32 or bf16); its header overrides the shape flags")
    p.add_argument("--input-bin", metavar="PATTERN", help="glob of training shards (--train)")
    add_shape_flags(p)
    p.add_argument("--E", type=int, default=4, help="experts per MoE layer")
    p.add_argument("--topk", type=int, default=1, help="experts per token (1 = Switch, 2 = GShard)")
    p.add_argument("--moe-every", type=int, default=1, help="layer l is MoE iff (l + 1) %% N == 0")
    p.add_argument("--H", type=int, default=96, help="expert hidden size")
    p.add_argument("--cf", type=float, default=1.25, help="capacity factor (<= 0: no limit, dropless)")
    p.add_argument("--aux-alpha", type=float, default=0.01, help="load-balancing loss coefficient")
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
    args = p.parse_args(argv)

    if not (0 <= args.jitter < 1):  # also refuses nan; 1 would allow a zero multiplier
        fail(f"--jitter must be in [0, 1) (got {args.jitter})")
    if args.noisy_topk not in (0, 1):
        fail(f"--noisy-topk must be 0 or 1 (got {args.noisy_topk})")
    if min(args.B, args.T) < 1:
        fail("--B and --T must be positive")
    if not args.model_from_file:
        check_shape(args.maxT, args.V, args.L, args.NH, args.C, args.E, args.topk, args.moe_every, args.H,
                    "flags --maxT --V --L --NH --C --E --topk --moe-every --H")
        if args.noisy_topk:
            check_noisy_topk(args.topk, args.E, "--noisy-topk 1")
    if args.init_scale <= 0:
        fail(f"--init-scale must be positive (got {args.init_scale})")
    if not all(map(math.isfinite, (args.cf, args.aux_alpha, args.z_coef, args.importance_coef, args.load_coef))):
        fail("--cf --aux-alpha --z-coef --importance-coef --load-coef must be finite")
    check_run_flags(args)
    return args


def main(argv=None):
    with errors_named_here():
        args = parse_args(argv)
        if args.write_reference is not None:
            write_reference(args)
        else:
            train(args)


if __name__ == "__main__":
    main()
