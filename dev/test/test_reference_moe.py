"""
dev/test/test_reference_moe.py: checks the PyTorch reference train_moe.py against things it did not compute
itself: the MoE model file and debug state laid out from doc/formats.md, an independent float64 numpy MoE GPT
forward with a loop-by-loop routing (softmax, top-k with ties to the lower index, capacity, slots in priority
order, drops), central finite differences of the total loss, hand-worked routing cases, the balancing and z
losses and their gradients from their formulas, the dense GPT of train_gpt.py (E=1, k=1, no capacity limit),
and an AdamW written out from its formula. Router noise (jitter, noisy top-k gating; doc/moe.md, "Router noise",
cited as noise_spec): the noise generator against a plain-int squirrel_noise5 and values a C program printed,
statistics of its normals, the jittered and noisy routing (thr, Phi, CV²) in the numpy forward, and finite
differences with the noise on. Fine-tuning (--ft, train_gpt.py's methods): the debug state's layout and a frozen
base, routers, experts and balancing biases included.
Run from the repository root: /usr/bin/python3 dev/test/test_reference_moe.py
Prints one line per failed check and ends with "test_reference_moe: N passed, N failed" (exit 1 on a failure).
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")  # as train_moe.py sets them, before torch starts
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import math
import re
import subprocess
import tempfile
from collections import namedtuple
from functools import lru_cache

import numpy as np
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "dev", "test"))
import train_gpt  # noqa: E402  (after the path and thread settings)
import train_moe  # noqa: E402
import test_reference  # noqa: E402  (its check() counts this test's checks too)
from test_reference import HEADER_BYTES, check, np_gelu_tanh, np_layernorm, read_header, run_main  # noqa: E402


def fails_with(argv, needle, label):
    """A bad input must end the run with one line that names this program and the problem."""
    message, _ = run_main(train_moe, argv)
    good = message is not None and "\n" not in message and message.startswith("train_moe.py: error:")
    check(good and needle in message, f"{label}: got {message!r}")


# ----------------------------------------------------------------------------------------------------------
# The formats, written out from doc/formats.md and doc/moe.md (not taken from train_moe.py)

B, T, V, L, NH, C, MAXT, E, H, STEPS = 3, 23, 263, 2, 3, 48, 32, 4, 96, 10
VP = 384  # 263 rounded up to a multiple of 128
ALPHA, Z_COEF = 0.01, 0.001
# the AdamW weight-decayed tensors: the 2-D+ ones
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw", "routerw", "routernw", "expert_fcw",
           "expert_fcprojw"}


class Shape:
    """A model's shape as the file header gives it (noisy: header[12], the noise router routernw is stored)."""

    def __init__(self, maxT, V, L, NH, C, E, topk, moe_every, H, noisy=False):
        self.maxT, self.V, self.L, self.NH, self.C = maxT, V, L, NH, C
        self.E, self.topk, self.moe_every, self.H, self.noisy = E, topk, moe_every, H, noisy
        self.Vp = (V + 127) // 128 * 128
        self.moe_layers = [l for l in range(L) if (l + 1) % moe_every == 0]
        self.dense_layers = [l for l in range(L) if (l + 1) % moe_every != 0]

    def tensors(self):
        """[(file name, shape)] in payload order."""
        C, L, Ld, Lm, E, H = self.C, self.L, len(self.dense_layers), len(self.moe_layers), self.E, self.H
        return [
            ("wte", (self.Vp, C)), ("wpe", (self.maxT, C)),
            ("ln1w", (L, C)), ("ln1b", (L, C)), ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
            ("attprojw", (L, C, C)), ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)),
            ("fcw", (Ld, 4 * C, C)), ("fcb", (Ld, 4 * C)), ("fcprojw", (Ld, C, 4 * C)), ("fcprojb", (Ld, C)),
            ("routerw", (Lm, E, C)), *([("routernw", (Lm, E, C))] if self.noisy else []),
            ("expert_fcw", (Lm, E, H, C)), ("expert_fcb", (Lm, E, H)),
            ("expert_fcprojw", (Lm, E, C, H)), ("expert_fcprojb", (Lm, E, C)),
            ("lnfw", (C,)), ("lnfb", (C,)),
        ]

    def nparams(self):
        return sum(math.prod(s) for _, s in self.tensors())

    def header(self, version):
        return [20261129, version, self.maxT, self.V, self.L, self.NH, self.C, self.Vp, self.E, self.topk,
                self.moe_every, self.H, int(self.noisy)]


DEFAULT = Shape(MAXT, V, L, NH, C, E, 1, 1, H)


def split(flat, shape):
    """Flat payload -> {name: array view of the file's shape}, plus each name's (start, end) offsets."""
    tensors, ranges, offset = {}, {}, 0
    for name, dims in shape.tensors():
        n = math.prod(dims)
        tensors[name] = flat[offset : offset + n].reshape(dims)
        ranges[name] = (offset, offset + n)
        offset += n
    return tensors, ranges


def torch_names(name, shape):
    """The PyTorch parameter names of file tensor `name`, in the file's stacking order."""
    per_layer = {"ln1w": "ln_1.weight", "ln1b": "ln_1.bias", "qkvw": "attn.c_attn.weight",
                 "qkvb": "attn.c_attn.bias", "attprojw": "attn.c_proj.weight", "attprojb": "attn.c_proj.bias",
                 "ln2w": "ln_2.weight", "ln2b": "ln_2.bias"}
    dense = {"fcw": "mlp.c_fc.weight", "fcb": "mlp.c_fc.bias", "fcprojw": "mlp.c_proj.weight",
             "fcprojb": "mlp.c_proj.bias"}
    expert = {"expert_fcw": "c_fc.weight", "expert_fcb": "c_fc.bias", "expert_fcprojw": "c_proj.weight",
              "expert_fcprojb": "c_proj.bias"}
    if name in per_layer:
        return [f"h.{l}.{per_layer[name]}" for l in range(shape.L)]
    if name in dense:
        return [f"h.{l}.{dense[name]}" for l in shape.dense_layers]
    if name == "routerw":
        return [f"h.{l}.moe.router.weight" for l in shape.moe_layers]
    if name == "routernw":
        return [f"h.{l}.moe.noise_router.weight" for l in shape.moe_layers]
    if name in expert:
        return [f"h.{l}.moe.experts.{e}.{expert[name]}" for l in shape.moe_layers for e in range(shape.E)]
    return [{"wte": "wte.weight", "wpe": "wpe.weight", "lnfw": "ln_f.weight", "lnfb": "ln_f.bias"}[name]]


def moe_state_header(Lm, cf, noisy=0, seq_alpha=0.0, K=0, biases=0, alpha=ALPHA, z_coef=Z_COEF, jitter=0.0,
                     importance=0.1, load=0.1, init_scale=0.1, gamma=0.0, global_aux=0, limit=0, groups=0, passes=0,
                     shape=(B, T, STEPS, V, VP)):
    """The 256 header words of an MoE debug state of reference_args' optimizer (doc/formats.md's table): the MoE words
    7..11 and, from word 20, the settings (the capacity factor as an fp64's two words, low first) and the passes of
    expert choices."""
    cf_low, cf_high = (int(w) for w in np.array([cf], dtype="<f8").view("<i4"))
    coefficients = [test_reference.fp32_word(c) for c in (alpha, z_coef, jitter, importance, load, init_scale, gamma,
                                                          seq_alpha)]
    words = [(7, Lm), (8, noisy), (9, int(seq_alpha > 0)), (10, K), (11, biases), (20, cf_low), (21, cf_high),
             *zip(range(22, 30), coefficients), (30, global_aux), (31, limit), (32, groups), (33, passes)]
    return test_reference.debug_state_header(grad_clip=0.5, words=words, shape=shape)


def read_debug_state(data, shape):
    """The MoE debug state, field by field as the brief, noise_spec §6 and doc/formats.md lay it out (a bf16
    reference's expert choices: (passes, Lm, tokens of a micro-batch, k))."""
    h = read_header(data)
    b, t, v, lm, noisy, passes = int(h[2]), int(h[3]), int(h[5]), int(h[7]), int(h[8]), int(h[33])
    ints = np.frombuffer(data, dtype="<i4", offset=HEADER_BYTES)
    floats = np.frombuffer(data, dtype="<f4", offset=HEADER_BYTES)
    offset = 2 * b * t
    state = {"x": ints[: b * t].reshape(b, t), "y": ints[b * t : offset].reshape(b, t)}
    state["logits"] = floats[offset : offset + b * t * v].reshape(b, t, v)
    offset += b * t * v
    state["ce"], state["aux"], state["z"] = (float(f) for f in floats[offset : offset + 3])
    offset += 3
    state["importance"] = state["load"] = None
    if noisy:  # header[8] = 1: the importance and load losses follow z
        state["importance"], state["load"] = (float(f) for f in floats[offset : offset + 2])
        offset += 2
    state["dropped"], state["counts"] = [], []
    for _ in range(lm):
        state["dropped"].append(int(ints[offset]))
        state["counts"].append(ints[offset + 1 : offset + 1 + shape.E].copy())
        offset += 1 + shape.E
    n = b // max(int(h[10]), 1) * t
    state["choices"] = ints[offset : offset + passes * lm * n * shape.topk].reshape(passes, lm, n, shape.topk)
    offset += state["choices"].size
    state["grads"] = floats[offset : offset + shape.nparams()]
    offset += shape.nparams()
    state["steps"] = floats[offset:]
    return state


# ----------------------------------------------------------------------------------------------------------
# Router noise written out from noise_spec §1-2 with plain Python ints (not train_moe's numpy uint64)

MASK32 = 0xFFFFFFFF


def py_squirrel_noise5(position, seed):
    """llmc/common.cuh's squirrel_noise5 on Python ints, reduced mod 2^32 after every step that can overflow."""
    m = position & MASK32
    m = (m * 0xD2A80A3F) & MASK32
    m = (m + seed) & MASK32
    m ^= m >> 9
    m = (m + 0xA884F197) & MASK32
    m ^= m >> 11
    m = (m * 0x6C736F4B) & MASK32
    m ^= m >> 13
    m = (m + 0xB79F3ABB) & MASK32
    m ^= m >> 15
    m = (m * 0x1B56C4F5) & MASK32
    return m ^ (m >> 17)


def py_seed(pass_number, moe_layer, kind, rank=0):
    rank_base = py_squirrel_noise5(rank, 20261201)
    return py_squirrel_noise5((pass_number * 512 + moe_layer * 2 + kind) & MASK32, rank_base)


def py_uniform(seed, i):
    """Exact in float64: an odd integer below 2^24 times 2^-24."""
    return ((py_squirrel_noise5(i, seed) >> 9) * 2 + 1) / 2**24


def py_normal(seed, i):
    """float64 Box-Muller (the spec lets Python round this to fp32 where C computes in fp32)."""
    return math.sqrt(-2 * math.log(py_uniform(seed, 2 * i))) * math.cos(2 * math.pi * py_uniform(seed, 2 * i + 1))


@lru_cache(maxsize=None)
def py_jitter(seed, N, C_, eps):
    """(N, C) multipliers (1 - eps) + (2·eps)·u[t·C + c] with fp32 rounding of eps and of every operation: done
    in float64 and rounded, which is exact for one fp32 addition or multiplication."""
    f32 = lambda v: float(np.float32(v))
    e = f32(eps)
    low, width = f32(1.0 - e), f32(2.0 * e)
    return np.array([f32(low + f32(width * py_uniform(seed, i))) for i in range(N * C_)]).reshape(N, C_)


@lru_cache(maxsize=None)
def py_gating_noise(seed, N, E_):
    """(N, E) normals n[t, e] = normal(seed, t·E + e), rounded to fp32 as train_moe rounds them."""
    return np.array([float(np.float32(py_normal(seed, i))) for i in range(N * E_)]).reshape(N, E_)


# Printed by a short C program built with g++ -x c++: a verbatim copy of llmc/common.cuh's squirrel_noise5 and
#   moe_uniform(s, i) = (float)((squirrel_noise5(i, s) >> 9) * 2u + 1u) * 0x1p-24f
#   moe_normal(s, i) = sqrtf(-2.0f * logf(moe_uniform(s, 2u * i))) * cosf(6.283185307f * moe_uniform(s, 2u * i + 1u))
#   seed(pass, m, kind, r) = squirrel_noise5(pass * 512u + m * 2u + kind, squirrel_noise5(r, 20261201u))
# (uniforms printed with %a, normals with %.9g).
C_SQUIRREL = {(0, 0): 377036288, (1, 0): 3365260061, (0, 1): 603375697, (12345, 67890): 1033611947,
              (0xFFFFFFFF, 0xFFFFFFFF): 3198444886, (0, 20261201): 887232513, (1, 20261201): 1226094440}
C_SEEDS = {(0, 0, 0, 0): 612470998, (0, 0, 1, 0): 1624774269, (0, 1, 0, 0): 3273109643, (3, 1, 1, 0): 2763759368,
           (9, 0, 1, 0): 2725601369, (8388613, 2, 1, 0): 3274866196, (0, 0, 1, 1): 3488450979}  # (pass, m, kind, rank)
C_UNIFORM = {0: "0x1.07ce08p-3", 1: "0x1.86ab22p-1", 2: "0x1.ff19e2p-1", 3: "0x1.a5ec96p-1",
             2**31 - 1: "0x1.d1dafp-4"}  # moe_uniform(seed (0, 0, 1, 0), i), exact
C_NORMAL = {0: 0.165494114, 1: 0.0266047306, 2: 0.701365471, 3: -1.19354928,
            2**31 - 1: 0.643263876}  # moe_normal(seed (0, 0, 1, 0), i), fp32 printed with %.9g


# ----------------------------------------------------------------------------------------------------------
# Routing and the MoE GPT forward in float64 numpy, loop by loop from the definition


def np_route(logits, k, cf):
    """(probs, choices, gates, kept, counts before dropping, capacity) of one group, from its (N, E) logits."""
    N, E = logits.shape
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs = exp / exp.sum(axis=1, keepdims=True)
    # the k largest probs: softmax is increasing, so they are the k largest logits; equal logits, lower index
    choices = np.array([sorted(range(E), key=lambda e: (-logits[n, e], e))[:k] for n in range(N)], dtype=np.int64)
    chosen = np.take_along_axis(probs, choices, axis=1)
    gates = chosen if k == 1 else chosen / chosen.sum(axis=1, keepdims=True)
    capacity = math.ceil(k * cf * N / E) if cf > 0 else None
    used = [0] * E
    kept = np.zeros((N, k), dtype=bool)
    for j in range(k):  # every first choice in token order, then every second choice, ...
        for n in range(N):
            e = choices[n, j]
            if capacity is None or used[e] < capacity:
                kept[n, j] = True
                used[e] += 1
    counts = np.bincount(choices.reshape(-1), minlength=E)
    return probs, choices, gates, kept, counts, capacity


def np_balancing_losses(logits, probs, counts, k, alpha, z_coef):
    """α·E·Σ_e f_e·P_e and c_z·mean(logsumexp²)."""
    N, E = probs.shape
    f = counts / (N * k)
    P = probs.mean(axis=0)
    top = logits.max(axis=1)
    logsumexp = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
    return alpha * E * float((f * P).sum()), z_coef * float((logsumexp**2).mean())


def routing_order(logits, count):
    """(N, count) the first `count` experts of each row in routing order: descending, ties to the lower index."""
    N, E_ = logits.shape
    return np.array([sorted(range(E_), key=lambda e: (-logits[n, e], e))[:count] for n in range(N)], dtype=np.int64)


def np_noisy_losses(noisy_logits, clean, std, choices, gates, w_imp, w_load):
    """Shazeer's importance and load losses of one group, loop by loop from noise_spec §3. Returns (importance
    loss, load loss, thr, P, importance, load)."""
    N, E_ = noisy_logits.shape
    k = choices.shape[1]
    importance = np.zeros(E_)
    for n in range(N):
        for j in range(k):  # every choice, dropped or not
            importance[choices[n, j]] += gates[n, j]
    thr, P = np.zeros((N, E_)), np.zeros((N, E_))
    for n, order in enumerate(routing_order(noisy_logits, E_)):
        for e in range(E_):
            position = k + 1 if e in order[:k] else k  # 1-based position in the routing order
            thr[n, e] = noisy_logits[n, order[position - 1]]
            P[n, e] = 0.5 * math.erfc(-((clean[n, e] - thr[n, e]) / std[n, e]) / math.sqrt(2))
    load = P.sum(axis=0)
    cv2 = lambda v: float(np.var(v) / np.mean(v) ** 2)  # np.var: the population variance
    return w_imp * cv2(importance), w_load * cv2(load), thr, P, importance, load


# The router noise of one forward: jitter eps, training (noise on) or evaluation (off), the pass number, the
# importance and load coefficients. Noisy gating itself is the model's (Shape.noisy).
Noise = namedtuple("Noise", "jitter training pass_number w_imp w_load", defaults=(0.0, False, 0, 0.1, 0.1))
NpOutput = namedtuple("NpOutput", "logits ce aux z routings importance load")


def np_forward(flat, x, y, shape, cf, alpha=ALPHA, z_coef=Z_COEF, noise=Noise()):
    """The forward of the model whose payload is flat: logits, CE, aux, z, [(choices, kept, counts, order) per MoE
    layer] (order: with noisy gating the k + 1 first experts in routing order, else the choices), and the
    importance and load losses summed over the MoE layers (0 without noisy gating)."""
    P, _ = split(np.asarray(flat, dtype=np.float64), shape)
    b, t = x.shape
    c, nh = shape.C, shape.NH
    hs = c // nh
    h = P["wte"][x] + P["wpe"][:t]
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    aux = z = importance = load = 0.0
    routings = []
    for l in range(shape.L):
        qkv = np_layernorm(h, P["ln1w"][l], P["ln1b"][l]) @ P["qkvw"][l].T + P["qkvb"][l]
        q, kk, vv = (qkv[..., i * c : (i + 1) * c].reshape(b, t, nh, hs).transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(future, -np.inf, q @ kk.transpose(0, 1, 3, 2) / math.sqrt(hs))
        att = np.exp(scores - scores.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        h = h + (att @ vv).transpose(0, 2, 1, 3).reshape(b, t, c) @ P["attprojw"][l].T + P["attprojb"][l]
        normed = np_layernorm(h, P["ln2w"][l], P["ln2b"][l]).reshape(b * t, c)
        if l in shape.dense_layers:
            d = shape.dense_layers.index(l)
            hidden = np_gelu_tanh(normed @ P["fcw"][d].T + P["fcb"][d])
            h = h + (hidden @ P["fcprojw"][d].T + P["fcprojb"][d]).reshape(b, t, c)
            continue
        m = shape.moe_layers.index(l)
        router_in = normed  # only the router reads the jittered input; the experts below read normed
        if noise.training and noise.jitter > 0:
            router_in = normed * py_jitter(py_seed(noise.pass_number, m, 0), b * t, c, noise.jitter)
        router_logits = clean = router_in @ P["routerw"][m].T
        if shape.noisy:
            noise_logits = router_in @ P["routernw"][m].T
            std = np.where(noise_logits > 20, noise_logits, np.log1p(np.exp(np.minimum(noise_logits, 20))))
            if noise.training:
                router_logits = clean + py_gating_noise(py_seed(noise.pass_number, m, 1), b * t, shape.E) * std
        probs, choices, gates, kept, counts, _ = np_route(router_logits, shape.topk, cf)
        out = np.zeros_like(normed)
        for n in range(b * t):
            for j in range(shape.topk):
                if kept[n, j]:
                    e = choices[n, j]
                    hidden = np_gelu_tanh(P["expert_fcw"][m, e] @ normed[n] + P["expert_fcb"][m, e])
                    out[n] += gates[n, j] * (P["expert_fcprojw"][m, e] @ hidden + P["expert_fcprojb"][m, e])
        h = h + out.reshape(b, t, c)
        layer_aux, layer_z = np_balancing_losses(router_logits, probs, counts, shape.topk, alpha, z_coef)
        aux += layer_aux
        z += layer_z
        order = choices
        if shape.noisy:
            layer_importance, layer_load, *_ = np_noisy_losses(router_logits, clean, std, choices, gates,
                                                               noise.w_imp, noise.w_load)
            importance += layer_importance
            load += layer_load
            order = routing_order(router_logits, shape.topk + 1)
        routings.append((choices, kept, counts, order))
    logits = np_layernorm(h, P["lnfw"], P["lnfb"]) @ P["wte"][: shape.V].T
    top = logits.max(-1, keepdims=True)
    logsumexp = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return NpOutput(logits, float((logsumexp - picked).mean()), aux, z, routings, importance, load)


def same_routing(a, b):
    """The same choices, drops and (noisy gating) the same element for thr: the loss is smooth between flips."""
    return all(np.array_equal(ca, cb) and np.array_equal(ka, kb) and np.array_equal(oa, ob)
               for (ca, ka, _, oa), (cb, kb, _, ob) in zip(a, b))


# ----------------------------------------------------------------------------------------------------------


def reference_args(prefix, extra=()):
    return ["--write-reference", prefix, "--B", str(B), "--T", str(T), "--V", str(V), "--L", str(L), "--NH", str(NH),
            "--C", str(C), "--maxT", str(MAXT), "--E", str(E), "--topk", "1", "--moe-every", "1", "--H", str(H),
            "--cf", "1.25", "--aux-alpha", str(ALPHA), "--z-coef", str(Z_COEF), "--seed", "1337",
            "--steps", str(STEPS), "--lr", "1e-3", "--weight-decay", "0.1", "--beta1", "0.9", "--beta2", "0.95",
            "--eps", "1e-8", "--grad-clip", "0.5", *extra]


def test_files(tmp):
    """(a) sizes, headers, layout and contents of the files, and the debug state against the numpy forward."""
    prefix = os.path.join(tmp, "moe")
    proc = subprocess.run([sys.executable, "train_moe.py", *reference_args(prefix, ["--dtype", "float32"])],
                          cwd=REPO, capture_output=True, text=True)  # the brief's command line, as a real process
    check(proc.returncode == 0, f"--write-reference exits 0 (stderr: {proc.stderr.strip()})")
    check("dropped" in proc.stdout and "MoE layer 1:" in proc.stdout and "logit margin" in proc.stdout, f"prints the routing: {proc.stdout!r}")
    message, _ = run_main(train_moe, reference_args(prefix + "_bf16", ["--dtype", "bfloat16"]))
    check(message is None, f"--dtype bfloat16 runs: {message}")
    mixed = Shape(MAXT, V, 3, NH, C, E, 2, 2, H)  # layers 0, 2 dense, layer 1 MoE, top-2
    message, _ = run_main(train_moe, reference_args(prefix + "_mixed", ["--L", "3", "--topk", "2", "--moe-every", "2",
                                                                         "--cf", "0.5"]))
    check(message is None, f"--L 3 --topk 2 --moe-every 2 --cf 0.5 runs: {message}")

    for suffix, shape, version, item, cf in (("", DEFAULT, 1, 4, 1.25), ("_bf16", DEFAULT, 2, 2, 1.25),
                                             ("_mixed", mixed, 1, 4, 0.5)):
        model_data = open(prefix + suffix + "_model.bin", "rb").read()
        check(len(model_data) == HEADER_BYTES + item * shape.nparams(), f"{suffix} model file size {len(model_data)}")
        check(list(read_header(model_data)[:13]) == shape.header(version), f"{suffix} model header")
        check(not read_header(model_data)[13:].any(), f"{suffix} model header: unused fields are zero")
        state_data = open(prefix + suffix + "_debug_state.bin", "rb").read()
        Lm = len(shape.moe_layers)
        passes = STEPS + 2 if version == 2 else 0  # a bf16 reference's expert choices: K = 1 pass of each kind
        choices = passes * Lm * B * T * shape.topk
        expected = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 3 + Lm * (1 + E) + choices + shape.nparams() + STEPS)
        check(len(state_data) == expected, f"{suffix} debug state size {len(state_data)}, expected {expected}")
        check(np.array_equal(read_header(state_data), moe_state_header(Lm, cf, passes=passes)),
              f"{suffix} debug state header")

    for suffix, shape, extra in (("", DEFAULT, []), ("_mixed", mixed, ["--L", "3", "--topk", "2", "--moe-every", "2"])):
        flat = np.frombuffer(open(prefix + suffix + "_model.bin", "rb").read()[HEADER_BYTES:], dtype="<f4")
        check_layout(prefix + suffix, flat, shape, extra)
    return prefix, mixed


def check_layout(prefix, flat, shape, extra):
    """The file's tensors are the model's, in doc/formats.md's order and (out, in) layout, with the init the
    reference documents, and they read back unchanged."""
    P, _ = split(flat, shape)
    model = train_moe.model_for_run(train_moe.parse_args(reference_args(prefix, extra)))
    params = dict(model.named_parameters())
    for name, dims in shape.tensors():
        stacked = [params[n].detach().numpy() for n in torch_names(name, shape)]
        if not stacked:  # the dense MLP of a model whose every layer is MoE: an empty tensor
            same = P[name].size == 0
        elif len(dims) == 1 or name in ("wte", "wpe"):
            same = np.array_equal(P[name], stacked[0])
        else:
            same = np.array_equal(P[name].reshape(-1), np.concatenate([s.reshape(-1) for s in stacked]))
        check(same, f"{prefix}: file tensor {name} equals the model's {torch_names(name, shape)[:1]}...")
    check(not P["wte"][V:].any(), "padded wte rows are zero")
    # GPT-2's std, Switch's sqrt(0.1) on the router and experts; 12% covers the sampling error of ~400 draws
    residual = 0.02 / math.sqrt(2 * shape.L)
    scale = math.sqrt(0.1)
    for name, std in (("wte", 0.02), ("qkvw", 0.02), ("attprojw", residual), ("routerw", 0.02 * scale),
                      ("expert_fcw", 0.02 * scale), ("expert_fcprojw", residual * scale),
                      *([("routernw", 0.02 * scale)] if shape.noisy else [])):  # drawn like the router's
        sample = P[name][:V] if name == "wte" else P[name]
        check(abs(sample.std() / std - 1) < 0.12, f"{prefix}: {name} init std {sample.std():.5f}, expected {std:.5f}")
    for name in ("ln1w", "ln1b", "qkvb", "attprojb", "ln2w", "ln2b", "expert_fcb", "expert_fcprojb", "lnfw", "lnfb"):
        deviation = np.abs(P[name] - (1.0 if name.endswith("w") else 0.0))
        check(deviation.min() > 0 and 0.01 < deviation.max() < 0.2, f"{prefix}: {name} is perturbed")
    reloaded = train_moe.read_model_file(prefix + "_model.bin")
    check(all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters()),
          f"{prefix}: model file reads back to the same tensors")


def check_debug_state(prefix, shape, cf, fd_entries, noise=Noise()):
    """The debug state against the numpy forward: batch, logits, CE, aux, z (noisy gating: importance, load),
    routing counts and drops, and the fp32 gradients against float64 central differences of the total loss
    (fd_entries per tensor). With router noise the logits are an evaluation pass's and the rest training pass
    0's (noise_spec §4)."""
    flat = np.frombuffer(open(prefix + "_model.bin", "rb").read()[HEADER_BYTES:], dtype="<f4")
    s = read_debug_state(open(prefix + "_debug_state.bin", "rb").read(), shape)
    x, y = s["x"], s["y"]
    check(x.min() >= 0 and x.max() < V and y.min() >= 0 and y.max() < V, f"{prefix}: tokens in [0, V)")
    train_noise = noise._replace(training=True, pass_number=0)
    first = np_forward(flat, x, y, shape, cf, noise=train_noise)
    noisy_run = shape.noisy or noise.jitter > 0
    evaluation = np_forward(flat, x, y, shape, cf, noise=noise._replace(training=False)) if noisy_run else first
    _, ce, aux, z, routings, importance, load = first
    err = np.abs(evaluation.logits - s["logits"]).max()
    check(err < 1e-5, f"{prefix}: logits match the numpy forward (max error {err:.2e}, tolerance 1e-5)")
    if noisy_run:  # control: the noise changes the forward, and the file holds the evaluation pass's logits
        check(np.abs(first.logits - s["logits"]).max() > 1e-4 and abs(first.ce - evaluation.ce) > 1e-6,
              f"{prefix}: control: training pass 0's logits differ from the evaluation pass's")
    check(abs(ce - s["ce"]) < 1e-5, f"{prefix}: CE {s['ce']} = numpy {ce}")
    check(abs(aux - s["aux"]) < 1e-7 + 1e-5 * aux and aux > 0, f"{prefix}: aux {s['aux']} = numpy {aux}")
    check(abs(z - s["z"]) < 1e-8 + 1e-5 * z and z > 0, f"{prefix}: z {s['z']} = numpy {z}")
    if shape.noisy:
        check(s["importance"] is not None and abs(importance - s["importance"]) < 1e-8 + 1e-5 * importance
              and importance > 0, f"{prefix}: importance loss {s['importance']} = numpy {importance}")
        check(s["load"] is not None and abs(load - s["load"]) < 1e-9 + 1e-5 * load and load > 0,
              f"{prefix}: load loss {s['load']} = numpy {load}")
    else:
        check(s["importance"] is None, f"{prefix}: no importance and load losses without noisy gating")
    for m, (choices, kept, counts, _) in enumerate(routings):
        check(np.array_equal(s["counts"][m], counts), f"{prefix}: layer {m} counts {s['counts'][m]} = numpy {counts}")
        check(s["dropped"][m] == int((~kept).sum()), f"{prefix}: layer {m} dropped {s['dropped'][m]} = numpy")

    _, ranges = split(flat, shape)
    base = flat.astype(np.float64)
    rng = np.random.default_rng(0)
    step = 1e-5
    grads = s["grads"]

    def total(values):
        out = np_forward(values, x, y, shape, cf, noise=train_noise)  # the same pass: the same noise
        return out.ce + out.aux + out.z + out.importance + out.load, out.routings

    for name, (start, end) in ranges.items():
        if start == end:
            continue
        g = grads[start:end]
        stop = start + V * C if name == "wte" else end  # padded wte rows have no gradient to check here
        entries = [start + int(np.abs(g[: stop - start]).argmax())] + list(rng.integers(start, stop, fd_entries - 1))
        for i in entries:
            plus, minus = base.copy(), base.copy()
            plus[i] += step
            minus[i] -= step
            (loss_plus, routing_plus), (loss_minus, routing_minus) = total(plus), total(minus)
            if not (same_routing(routing_plus, routings) and same_routing(routing_minus, routings)):
                check(False, f"{prefix}: {name}[{i - start}]: a perturbation of {step} flips the routing (skipped)")
                continue
            fd = (loss_plus - loss_minus) / (2 * step)
            tolerance = 1e-3 * abs(fd) + 1e-4 * np.abs(g).max()
            check(abs(grads[i] - fd) <= tolerance,
                  f"{prefix}: gradient {name}[{i - start}] = {grads[i]:.6e}, finite difference {fd:.6e}")
    start, end = ranges["wte"]
    check(not grads[start + V * C : end].any(), f"{prefix}: gradient of the padded wte rows is zero")
    return flat, s


def check_finite_differences(model, x, y, settings, routing_key, step, seed, label):
    """Central finite differences (float64) of the total loss against the autograd gradients in the parameters'
    .grad, for the largest-gradient entry and two random ones of every parameter (wte's padded rows excluded: no
    token reaches them). Routing is piecewise constant: routing_key(output) lists the tensors that must not change
    under a perturbation (choices, drops, ...); a perturbation that changes one counts as a failure."""
    base = routing_key(model(x, y, settings))
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            rows = model.config.V if name == "wte.weight" else p.shape[0]
            flat_p, flat_g = p.view(-1), p.grad.view(-1)
            used = rows * (p.numel() // p.shape[0])
            for i in [int(flat_g[:used].abs().argmax())] + list(rng.integers(0, used, 2)):
                saved = flat_p[i].item()
                losses = []
                for value in (saved + step, saved - step):
                    flat_p[i] = value
                    out = model(x, y, settings)
                    flipped = not all(torch.equal(a, b) for a, b in zip(routing_key(out), base))
                    losses.append(None if flipped else out.total_loss.item())
                flat_p[i] = saved
                if None in losses:
                    check(False, f"{label}: {name}[{i}]: a perturbation of {step} flips the routing")
                    continue
                fd = (losses[0] - losses[1]) / (2 * step)
                check(abs(flat_g[i].item() - fd) <= 1e-6 * abs(fd) + 1e-9,
                      f"{label}: float64 autograd {name}[{i}] = {flat_g[i].item():.9e}, finite difference {fd:.9e}")


def test_autograd_float64():
    """(b) train_moe's autograd gradients of the total loss in float64 against central finite differences of the
    same model, for three entries of every parameter (router, experts, backbone), top-1 and top-2 with tokens
    dropped, and large aux and z coefficients so that their gradients weigh. Routing is piecewise constant: each
    perturbation is checked not to change a choice or a drop; one that does counts as a failure."""
    settings = train_moe.RoutingSettings(capacity_factor=0.5, aux_alpha=0.3, z_coef=0.05)
    for k, L_, moe_every in ((1, 2, 1), (2, 3, 2)):
        config = train_moe.MoEConfig(maxT=8, V=37, L=L_, NH=2, C=16, E=4, topk=k, moe_every=moe_every, H=24)
        model = train_moe.MoEGPT(config)
        train_moe.init_weights(model, torch.Generator().manual_seed(7), 1.0)
        model.double()
        generator = torch.Generator().manual_seed(8)
        x = torch.randint(0, config.V, (2, 6), generator=generator)
        y = torch.randint(0, config.V, (2, 6), generator=generator)
        output = model(x, y, settings)
        train_moe.backward(output.total_loss, model)
        check(output.dropped > 0, f"k={k}: the finite-difference config drops choices ({output.dropped})")
        check_finite_differences(model, x, y, settings,
                                 lambda out: [t for r in out.routings for t in (r.choices, r.kept)], 1e-6, 1, f"k={k}")


def test_routing():
    """(c) train_moe.route against the loop-by-loop numpy routing on random logits, with exact ties, and (e) its
    aux and z losses and their gradients against the formulas; hand-worked cases of ties, priority and capacity."""
    rng = np.random.default_rng(5)
    for E_ in (1, 3, 4, 8):
        for kind in ("normal", "ties", "equal rows"):
            N = 37
            if kind == "normal":
                logits = rng.normal(0, 2, (N, E_))
            elif kind == "ties":  # three values: most rows hold exact ties, some in the top k
                logits = rng.integers(0, 3, (N, E_)).astype(np.float64)
            else:
                logits = np.full((N, E_), 0.7)
            for k in range(1, min(E_, 3) + 1):
                for cf in (0.0, -1.0, 0.3, 0.5, 1.0, 1.25, 3.0):
                    check_route_case(logits, k, cf, f"E={E_} {kind} k={k} cf={cf}")

    settings = train_moe.RoutingSettings(capacity_factor=1.0, aux_alpha=0.01, z_coef=0.001)
    r = train_moe.route(torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64), 2, settings)
    check(r.choices.tolist() == [[1, 2], [0, 1]], f"ties go to the lower index: {r.choices.tolist()}")
    check(torch.allclose(r.gates, torch.full((2, 2), 0.5, dtype=torch.float64)), "top-2 gates renormalise to 1/2")
    # two different fp32 logits whose fp32 probs round to the same value: the larger logit wins
    r = train_moe.route(torch.tensor([[0.0, 1e-8, -1.0]]), 1, settings)
    check(r.probs[0, 0] == r.probs[0, 1] and r.choices.tolist() == [[1]],
          f"top-k compares logits, not rounded probs: {r.probs.tolist()} -> {r.choices.tolist()}")
    # three tokens, two experts, top-2 with choices (0,1), (1,0), (0,1); capacity ceil(2 * 0.5 * 3 / 2) = 2:
    # expert 0 takes the first choices of tokens 0 and 2, so token 1's second choice is dropped; expert 1 takes
    # token 1's first choice, then token 0's second, so token 2's second is dropped
    logits = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    r = train_moe.route(logits, 2, train_moe.RoutingSettings(0.5, 0.01, 0.001))
    check(r.capacity == 2 and r.kept.tolist() == [[True, True], [True, False], [True, False]],
          f"slot priority: capacity {r.capacity}, kept {r.kept.tolist()}")
    check(r.counts.tolist() == [3, 3], f"counts before dropping {r.counts.tolist()}")
    # the capacity in double arithmetic, as the C code computes it
    for N, E_, k, cf, want in ((69, 4, 1, 1.25, 22), (69, 4, 1, 0.5, 9), (69, 4, 2, 0.5, 18), (64, 4, 1, 1.0, 16),
                               (25, 5, 2, 1.1, 12), (69, 4, 1, 0.0, None), (69, 4, 1, -1.0, None)):
        got = train_moe.expert_capacity(N, E_, k, cf)
        check(got == want, f"capacity(N={N}, E={E_}, k={k}, cf={cf}) = {got}, expected {want}")


def check_route_case(logits, k, cf, label):
    alpha, z_coef = 0.02, 0.003
    probs, choices, gates, kept, counts, capacity = np_route(logits, k, cf)
    logits_t = torch.tensor(logits, requires_grad=True)
    r = train_moe.route(logits_t, k, train_moe.RoutingSettings(cf, alpha, z_coef))
    same = (np.array_equal(r.choices.numpy(), choices) and np.array_equal(r.kept.numpy(), kept)
            and np.array_equal(r.counts.numpy(), counts) and r.capacity == capacity
            and np.abs(r.gates.detach().numpy() - gates).max() < 1e-12)
    check(same, f"routing {label}: choices/kept/counts/gates/capacity agree with numpy")
    want_aux, want_z = np_balancing_losses(logits, probs, counts, k, alpha, z_coef)
    check(abs(r.aux_loss.item() - want_aux) < 1e-12 and abs(r.z_loss.item() - want_z) < 1e-12,
          f"losses {label}: aux {r.aux_loss.item()} vs {want_aux}, z {r.z_loss.item()} vs {want_z}")
    # the gradients: f is a constant, so d aux / d logit[n, j] = α·E/N · p[n, j]·(f_j − Σ_e f_e·p[n, e]), and
    # d z / d logit[n, j] = c_z·2·logsumexp_n·p[n, j] / N
    N, E_ = logits.shape
    f = counts / (N * k)
    want_aux_grad = alpha * E_ / N * probs * (f[None, :] - (probs * f[None, :]).sum(axis=1, keepdims=True))
    aux_grad = torch.autograd.grad(r.aux_loss, logits_t, retain_graph=True)[0].numpy()
    logsumexp = logits.max(axis=1) + np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1))
    want_z_grad = z_coef * 2 * logsumexp[:, None] * probs / N
    z_grad = torch.autograd.grad(r.z_loss, logits_t)[0].numpy()
    check(np.abs(aux_grad - want_aux_grad).max() < 1e-14 and np.abs(z_grad - want_z_grad).max() < 1e-14,
          f"loss gradients {label}: f carries no gradient")


def dense_to_moe_file(gpt_path, moe_path, routerw_std):
    """Rewrites a dense GPT model file as an E=1, k=1, moe_every=1, H=4C MoE file whose expert is each layer's
    MLP, laid out from doc/formats.md (router weights random: with one expert the prob is 1 whatever they are)."""
    data = open(gpt_path, "rb").read()
    h = read_header(data)
    maxT, V_, L_, NH_, C_ = (int(v) for v in h[2:7])
    flat = np.frombuffer(data[HEADER_BYTES:], dtype="<f4")
    dense_shape = Shape(maxT, V_, L_, NH_, C_, 1, 1, L_ + 1, 4 * C_)  # moe_every > L: every layer dense
    P, _ = split(flat, dense_shape)
    moe = Shape(maxT, V_, L_, NH_, C_, 1, 1, 1, 4 * C_)
    routerw = np.random.default_rng(3).normal(0, routerw_std, (L_, 1, C_)).astype("<f4")
    parts = [P[n] for n in ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b")]
    parts += [routerw, P["fcw"], P["fcb"], P["fcprojw"], P["fcprojb"], P["lnfw"], P["lnfb"]]
    header = np.zeros(256, dtype="<i4")
    header[:13] = moe.header(1)
    open(moe_path, "wb").write(header.tobytes() + np.concatenate([p.reshape(-1) for p in parts]).tobytes())
    return moe


def test_dense_equivalence(tmp):
    """(d) E=1, k=1, no capacity limit is the dense GPT of train_gpt.py when the expert is the dense MLP: same
    logits, CE loss and gradients, and (router weights zero, so that the z loss and its gradient vanish) the
    same 10 AdamW step losses. Controls: a capacity limit, or z loss through a non-zero router, changes them."""
    dense = os.path.join(tmp, "dense")
    message, _ = run_main(train_gpt, ["--write-reference", dense, "--grad-clip", "0.5"])
    check(message is None, f"train_gpt.py --write-reference: {message}")
    dense_shape = Shape(MAXT, V, L, NH, C, 1, 1, L + 1, 4 * C)
    d = read_debug_state_dense(open(dense + "_debug_state.bin", "rb").read(), dense_shape.nparams())

    results = {}
    for label, router_std, cf in (("zero router", 0.0, "0"), ("random router", 1.0, "0"), ("cf 0.5", 0.0, "0.5")):
        moe_file = os.path.join(tmp, label.replace(" ", "_") + "_model.bin")
        moe_shape = dense_to_moe_file(dense + "_model.bin", moe_file, router_std)
        prefix = os.path.join(tmp, label.replace(" ", "_"))
        message, _ = run_main(train_moe, ["--write-reference", prefix, "--model-from-file", moe_file, "--cf", cf,
                                          "--grad-clip", "0.5"])
        check(message is None, f"{label}: train_moe.py --model-from-file: {message}")
        results[label] = read_debug_state(open(prefix + "_debug_state.bin", "rb").read(), moe_shape)

    m = results["zero router"]
    check(np.array_equal(m["x"], d["x"]) and np.array_equal(m["y"], d["y"]), "the same --seed draws the same batch")
    err = np.abs(m["logits"] - d["logits"]).max()
    check(err < 1e-5, f"E=1 logits = dense logits (max error {err:.2e})")
    check(abs(m["ce"] - d["loss"]) < 1e-6, f"E=1 CE {m['ce']} = dense loss {d['loss']}")
    check(abs(m["aux"] - L * ALPHA) < 1e-8 and m["z"] == 0.0,
          f"E=1: aux = α·1·1·1 per layer ({m['aux']}), z = 0 ({m['z']})")
    check(m["dropped"] == [0, 0] and [c.tolist() for c in m["counts"]] == [[B * T]] * L, "E=1: every token kept")
    # the gradients, mapped tensor by tensor: the expert's are the MLP's, the router's are zero
    moe_shape = Shape(MAXT, V, L, NH, C, 1, 1, 1, 4 * C)
    Gd, _ = split(d["grads"], dense_shape)
    Gm, _ = split(m["grads"], moe_shape)
    pairs = [(n, n) for n in ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb", "ln2w", "ln2b",
                              "lnfw", "lnfb")]
    pairs += [("fcw", "expert_fcw"), ("fcb", "expert_fcb"), ("fcprojw", "expert_fcprojw"),
              ("fcprojb", "expert_fcprojb")]
    for dn, mn in pairs:
        gd, gm = Gd[dn].reshape(-1), Gm[mn].reshape(-1)
        err = np.abs(gd - gm).max()
        check(err <= 1e-5 * np.abs(gd).max() + 1e-9, f"E=1 gradient {mn} = dense {dn} (max error {err:.2e})")
    check(not Gm["routerw"].any(), "E=1: the router gets no gradient (softmax of one logit is constant)")
    err = np.abs(m["steps"] - d["steps"]).max()
    check(err < 1e-5, f"E=1 step losses = dense step losses (max error {err:.2e})")

    r = results["random router"]
    err = np.abs(r["logits"] - d["logits"]).max()
    check(err < 1e-5 and r["z"] > 0, f"E=1 with a random router: the same logits ({err:.2e}), z > 0 ({r['z']})")
    c = results["cf 0.5"]
    check(c["dropped"][0] > 0 and np.abs(c["logits"] - d["logits"]).max() > 1e-3,
          f"control: capacity 0.5 drops {c['dropped']} and changes the logits")


def read_debug_state_dense(data, nparams):
    """The dense GPT's debug state (doc/formats.md's table)."""
    h = read_header(data)
    b, t, v = int(h[2]), int(h[3]), int(h[5])
    ints = np.frombuffer(data, dtype="<i4", offset=HEADER_BYTES)
    floats = np.frombuffer(data, dtype="<f4", offset=HEADER_BYTES)
    offset = 2 * b * t + b * t * v
    return {"x": ints[: b * t].reshape(b, t), "y": ints[b * t : 2 * b * t].reshape(b, t),
            "logits": floats[2 * b * t : offset].reshape(b, t, v), "loss": float(floats[offset]),
            "grads": floats[offset + 1 : offset + 1 + nparams], "steps": floats[offset + 1 + nparams :]}


def test_drops(tmp):
    """(f) the default config drops choices at --cf 0.5 and none with --cf 0 (dropless), and prints the count."""
    for cf, expect_drops in (("0.5", True), ("0", False)):
        prefix = os.path.join(tmp, f"cf{cf}")
        message, out = run_main(train_moe, reference_args(prefix, ["--cf", cf, "--steps", "0"]))
        printed = re.search(r"\| dropped (\d+)", out)
        s = read_debug_state(open(prefix + "_debug_state.bin", "rb").read(), DEFAULT)
        check(message is None and printed is not None and int(printed.group(1)) == sum(s["dropped"]),
              f"--cf {cf}: prints the drop count of the debug state ({out!r})")
        check((sum(s["dropped"]) > 0) == expect_drops, f"--cf {cf}: dropped {s['dropped']}")
        check(all(c.sum() == B * T for c in s["counts"]), f"--cf {cf}: the counts add up to N·k")
        check(sum(int((c > 0).sum()) for c in s["counts"]) >= 6, f"--cf {cf}: the tokens spread over the experts")
        check_debug_state(prefix, DEFAULT, float(cf), fd_entries=1)


def adamw_losses(flat, x, y, shape, steps, grad_clip, cf, lr=1e-3, wd=0.1, beta1=0.9, beta2=0.95, eps=1e-8,
                 noise=Noise(), passes=None):
    """CE losses of AdamW written from its formula (clip the global norm, decoupled weight decay on the DECAYED
    tensors, bias-corrected moments), over the file payload in float64, with train_moe's float64 forward and
    backward of the total loss (checked against finite differences above). Step t (from 0) is training pass
    passes[t] (default: t, as noise_spec §4 numbers them)."""
    config = train_moe.MoEConfig(maxT=shape.maxT, V=shape.V, L=shape.L, NH=shape.NH, C=shape.C, E=shape.E,
                                 topk=shape.topk, moe_every=shape.moe_every, H=shape.H, noisy=shape.noisy)
    model = train_moe.MoEGPT(config).double()
    settings = train_moe.RoutingSettings(cf, ALPHA, Z_COEF, jitter=noise.jitter, importance_coef=noise.w_imp,
                                         load_coef=noise.w_load)
    passes = list(range(steps)) if passes is None else passes
    _, ranges = split(flat, shape)
    decay = np.zeros(len(flat))
    for name in DECAYED & ranges.keys():
        decay[slice(*ranges[name])] = 1.0
    params = flat.astype(np.float64)
    m = np.zeros_like(params)
    v = np.zeros_like(params)
    losses, norms = [], []
    xt, yt = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
    for t in range(1, steps + 1):
        train_moe.load_flat_parameters(model, params)
        model.zero_grad(set_to_none=True)
        output = model(xt, yt, train_moe.training_pass(settings, passes[t - 1]))
        train_moe.backward(output.total_loss, model)
        losses.append(output.ce_loss.item())
        g = np.concatenate([p.grad.reshape(-1).numpy() for _, ps in train_moe.params_in_file_order(model) for p in ps])
        norm = np.sqrt((g**2).sum())
        norms.append(norm)
        if grad_clip > 0 and norm > grad_clip:
            g = g * grad_clip / norm
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        params = params - lr * (m / (1 - beta1**t) / (np.sqrt(v / (1 - beta2**t)) + eps) + wd * decay * params)
    return np.array(losses), norms


def test_training(prefix, mixed):
    """The 10 step losses: step 0's is the first CE, they fall, and they match AdamW written out."""
    for suffix, shape, cf in (("", DEFAULT, 1.25), ("_mixed", mixed, 0.5)):
        flat, s = check_debug_state(prefix + suffix, shape, cf, fd_entries=3)
        steps = s["steps"]
        check(len(steps) == STEPS, f"{suffix}: {len(steps)} step losses")
        check(steps[0] == np.float32(s["ce"]), f"{suffix}: step 0's loss is the first forward's CE")
        check(steps[-1] < steps[0] - 0.3, f"{suffix}: 10 steps lower the loss by more than 0.3: {steps}")
        losses, norms = adamw_losses(flat, s["x"], s["y"], shape, STEPS, 0.5, cf)
        err = np.abs(losses - steps).max()
        check(err < 1e-5, f"{suffix}: losses match the written-out AdamW (max error {err:.2e}, tolerance 1e-5)")
        check(max(norms) > 0.5, f"{suffix}: --grad-clip 0.5 is active (norms up to {max(norms):.3f})")
        unclipped, _ = adamw_losses(flat, s["x"], s["y"], shape, STEPS, 0.0, cf)
        check(np.abs(unclipped - steps).max() > 1e-4, f"{suffix}: control: clipping changes the losses")


def test_bf16_and_model_from_file(prefix, tmp):
    """The bf16 model file is the bf16 rounding of the fp32 parameters and its debug state is the fp32 forward of
    the rounded values; --model-from-file reproduces both files byte for byte, from either version."""
    bf16_payload = np.frombuffer(open(prefix + "_bf16_model.bin", "rb").read()[HEADER_BYTES:], dtype="<u2")
    fp32_payload = np.frombuffer(open(prefix + "_model.bin", "rb").read()[HEADER_BYTES:], dtype="<f4")
    torch_bits = torch.from_numpy(fp32_payload.copy()).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    check(np.array_equal(bf16_payload, torch_bits), "bf16 model file = torch's bf16 cast of the fp32 parameters")
    widened = (bf16_payload.astype("<u4") << 16).view("<f4")
    s = read_debug_state(open(prefix + "_bf16_debug_state.bin", "rb").read(), DEFAULT)
    logits, ce, aux, z, routings, *_ = np_forward(widened, s["x"], s["y"], DEFAULT, 1.25)
    check(np.abs(logits - s["logits"]).max() < 1e-5 and abs(ce - s["ce"]) < 1e-5 and abs(aux - s["aux"]) < 1e-7,
          "bf16 debug state = fp32 forward of the rounded parameters")
    # its expert choices: the evaluation pass's, the gradient's and step 0's are the forward's routing (no noise: the
    # same parameters route the same), every step's experts valid
    choices = s["choices"]
    forward = np.stack([c for c, *_ in routings])  # (Lm, N, k)
    check(choices.shape == (STEPS + 2, len(DEFAULT.moe_layers), B * T, 1), f"bf16 choices of shape {choices.shape}")
    check(all(np.array_equal(choices[p], forward) for p in (0, 1, 2)),
          "bf16 choices of the evaluation, gradient and first step passes = the forward's routing")
    check(choices.min() >= 0 and choices.max() < E, "bf16 choices: experts in [0, E)")
    for suffix, dtype in (("", "float32"), ("_bf16", "bfloat16")):
        again = os.path.join(tmp, "again" + suffix)
        argv = reference_args(again, ["--dtype", dtype, "--model-from-file", prefix + suffix + "_model.bin",
                                      "--E", "7", "--L", "5"])  # the file's shape wins over the flags
        message, _ = run_main(train_moe, argv)
        check(message is None, f"--model-from-file {dtype}: {message}")
        for part in ("_model.bin", "_debug_state.bin"):
            same = open(prefix + suffix + part, "rb").read() == open(again + part, "rb").read()
            check(same, f"--model-from-file {dtype} reproduces {part} byte for byte")


def test_train_mode(prefix, tmp):
    """--train prints the step line with aux, z and drop; under bf16 autocast the router stays fp32."""
    shard = os.path.join(tmp, "shard_000.bin")
    run_main(train_gpt, ["--write-shard", shard, "--shard-tokens", "1000", "--V", str(V), "--seed", "5"])
    message, out = run_main(train_moe, ["--train", "--input-bin", os.path.join(tmp, "shard_*.bin"), "--B", "2",
                                        "--T", "16", "--steps", "2", "--model-from-file", prefix + "_model.bin"])
    lines = out.strip().splitlines()
    line = re.compile(r"^step \d/2 \| loss \d+\.\d{6} \| aux \d\.\d{6} \| z \d\.\d{6} \| drop \d\.\d{4} \| "
                      r"norm \d+\.\d{6} \| lr 1\.000000e-03 \| \d+\.\d\d ms \| \d+ tok/s$")
    check(message is None and len(lines) == 2 and all(line.match(s) for s in lines), f"--train step lines: {lines}")
    model = train_moe.read_model_file(prefix + "_model.bin")
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        output = model(x, x, train_moe.RoutingSettings(1.25, ALPHA, Z_COEF))
    check(all(r.logits.dtype == torch.float32 for r in output.routings), "router logits are fp32 under bf16 autocast")


def test_bad_input(prefix, tmp):
    """Bad input: one clear line naming train_moe.py and a non-zero exit."""
    out = os.path.join(tmp, "x")
    proc = subprocess.run([sys.executable, "train_moe.py", "--write-reference", out, "--model-from-file",
                           os.path.join(tmp, "missing.bin")], cwd=REPO, capture_output=True, text=True)
    check(proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1
          and proc.stderr.startswith("train_moe.py: error:") and "missing.bin" in proc.stderr,
          f"missing model file: rc {proc.returncode}, stderr {proc.stderr!r}")
    fails_with(["--write-reference", out, "--model-from-file", os.path.join(tmp, "dense_model.bin")], "dense GPT",
               "a dense GPT model file")
    data = bytearray(open(prefix + "_model.bin", "rb").read())
    for label, position, value, needle in (("wrong magic", 0, 20240327, "magic"), ("version 3", 1, 3, "version"),
                                           ("top-k above E", 9, 5, "top-k"), ("moe_every above L", 10, 3, "moe_every"),
                                           ("H of 0", 11, 0, "positive")):
        bad = bytearray(data)
        bad[4 * position : 4 * position + 4] = value.to_bytes(4, "little", signed=True)
        path = os.path.join(tmp, label.replace(" ", "_") + ".bin")
        open(path, "wb").write(bad)
        fails_with(["--write-reference", out, "--model-from-file", path], needle, label)
    truncated = os.path.join(tmp, "truncated.bin")
    open(truncated, "wb").write(data[:-4])
    fails_with(["--write-reference", out, "--model-from-file", truncated], "payload", "truncated file")
    fails_with(["--write-reference", out, "--topk", "5"], "top-k", "--topk above --E")
    fails_with(["--write-reference", out, "--moe-every", "3"], "no MoE layer", "--moe-every above --L")
    fails_with(["--write-reference", out, "--E", "0"], "positive", "--E 0")
    fails_with(["--write-reference", out, "--jitter", "-0.1"], "--jitter", "--jitter negative")
    fails_with(["--write-reference", out, "--jitter", "1"], "--jitter", "--jitter 1")
    fails_with(["--write-reference", out, "--jitter", "nan"], "--jitter", "--jitter nan")
    fails_with(["--write-reference", out, "--noisy-topk", "2"], "--noisy-topk", "--noisy-topk 2")
    fails_with(["--write-reference", out, "--noisy-topk", "1", "--topk", "4"], "--noisy-topk", "--noisy-topk, topk = E")
    fails_with(["--write-reference", out, "--noisy-topk", "1", "--load-coef", "inf"], "--load-coef", "--load-coef inf")
    fails_with(["--write-reference", out, "--noisy-topk", "1", "--model-from-file", prefix + "_model.bin"],
               "--noisy-topk", "--noisy-topk 1 with a file without routernw")
    fails_with(["--write-reference", out, "--init-scale", "0"], "--init-scale", "--init-scale 0")
    fails_with(["--write-reference", out, "--bogus"], "--bogus", "unknown flag")
    fails_with(["--write-reference", out, "--C", "50"], "NH", "C not a multiple of NH")
    fails_with(["--write-reference", out, "--T", "40"], "maxT", "T over maxT")
    fails_with(["--train"], "--input-bin", "--train without --input-bin")
    fails_with(["--train", "--input-bin", os.path.join(tmp, "nothing_*.bin")], "no data shard", "no shard matches")


# ----------------------------------------------------------------------------------------------------------
# Router noise: jitter and noisy top-k gating (doc/moe.md, "Router noise" = noise_spec)


def test_noise_generator():
    """noise_spec §1: squirrel_noise5, the seeds, moe_uniform and moe_normal against the plain-int version and
    the values the C program printed; uniforms strictly inside (0, 1) and exact; normals' moments."""
    for (position, seed), want in C_SQUIRREL.items():
        got = int(train_moe.squirrel_noise5(position, seed))
        check(got == want == py_squirrel_noise5(position, seed),
              f"squirrel_noise5({position}, {seed}) = {got}, plain ints {py_squirrel_noise5(position, seed)}, C {want}")
    rng = np.random.default_rng(11)
    for seed in [0, 1, 20261201, 0xFFFFFFFF] + [int(s) for s in rng.integers(0, 2**32, 4, dtype=np.uint64)]:
        positions = np.concatenate([np.arange(300), rng.integers(0, 2**32, 300, dtype=np.uint64),
                                    [2**31 - 1, 2**31, 2**32 - 1]]).astype(np.uint64)
        got = train_moe.squirrel_noise5(positions, seed)
        check(got.dtype == np.uint64 and [int(v) for v in got] == [py_squirrel_noise5(int(p), seed) for p in positions],
              f"squirrel_noise5 over 603 positions, seed {seed}: = the plain-int version")
    for (pass_number, m, kind, rank), want in C_SEEDS.items():
        got = train_moe.noise_seed(pass_number, m, kind, rank)
        check(got == want == py_seed(pass_number, m, kind, rank),
              f"seed(pass {pass_number}, m {m}, kind {kind}, rank {rank}) = {got}, C {want}")
    # pass * 512 wraps around in uint32: pass 2^23 + 5 draws pass 5's noise
    check(train_moe.noise_seed(2**23 + 5, 2, 1) == train_moe.noise_seed(5, 2, 1), "the seed position wraps mod 2^32")
    check(len({train_moe.noise_seed(p, m, k) for p in range(20) for m in range(4) for k in range(2)}) == 160,
          "160 (pass, layer, kind) streams get 160 different seeds")

    seed = C_SEEDS[(0, 0, 1, 0)]
    for i, hexadecimal in C_UNIFORM.items():
        got = train_moe.moe_uniform(seed, i)
        check(got.dtype == np.float32 and float(got) == float.fromhex(hexadecimal) == py_uniform(seed, i),
              f"moe_uniform(seed, {i}) = {float(got)!r}, C {float.fromhex(hexadecimal)!r}")
    for i, want in C_NORMAL.items():
        got = train_moe.moe_normal(seed, i)
        check(got.dtype == np.float32 and abs(float(got) - want) <= 1e-6 * max(1, abs(want))
              and float(got) == float(np.float32(py_normal(seed, i))),
              f"moe_normal(seed, {i}) = {float(got)!r}, C (fp32) {want}, plain ints {py_normal(seed, i)}")
    extremes = train_moe.uniform_from_bits(np.array([0, 511, 512, 0xFFFFFFFF], dtype=np.uint64))
    check(extremes.dtype == np.float32 and extremes.tolist() == [2**-24, 2**-24, 3 * 2**-24, 1 - 2**-24]
          and 0 < extremes.min() and extremes.max() < 1, f"uniform_from_bits at the ends: {extremes.tolist()}")

    count = 200_000
    index = np.arange(count, dtype=np.uint64)
    u = train_moe.moe_uniform(seed, index).astype(np.float64)
    scaled = u * 2**24  # exact: each value is an odd integer times 2^-24
    check(u.min() > 0 and u.max() < 1 and np.all(scaled == np.round(scaled)) and np.all(scaled % 2 == 1),
          f"moe_uniform: {count} values strictly inside (0, 1), odd multiples of 2^-24 (min {u.min()}, max {u.max()})")
    check(all(u[i] == py_uniform(seed, i) for i in range(0, count, 997)), "moe_uniform = the plain-int version")
    check(abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / count), f"moe_uniform mean {u.mean():.5f}")
    n = train_moe.moe_normal(seed, index).astype(np.float64)
    # 5 sigma bounds: the mean's sigma is 1/sqrt(count), the std's ~1/sqrt(2 count), P(|n| < 1)'s sqrt(p(1-p)/count)
    check(abs(n.mean()) < 5 / math.sqrt(count), f"moe_normal mean {n.mean():.5f} over {count}")
    check(abs(n.std() - 1) < 5 / math.sqrt(2 * count), f"moe_normal std {n.std():.5f} over {count}")
    inside = float((np.abs(n) < 1).mean())
    check(abs(inside - 0.682689) < 5 * math.sqrt(0.6827 * 0.3173 / count), f"moe_normal P(|n| < 1) = {inside:.5f}")
    check(abs(((n - n.mean()) ** 4).mean() / n.var() ** 2 - 3) < 0.05, "moe_normal kurtosis 3")
    check(all(float(np.float32(py_normal(seed, i))) == n[i] for i in range(0, count, 4999)),
          "moe_normal = the plain-int Box-Muller rounded to fp32")
    other = train_moe.moe_normal(C_SEEDS[(0, 0, 0, 0)], index).astype(np.float64)
    check(abs(np.corrcoef(n, other)[0, 1]) < 5 / math.sqrt(count), "two seeds' normals are uncorrelated")

    # the (N, C) and (N, E) arrays: index t*C + c and t*E + e, fp32 as the spec writes it
    for eps in (0.1, 0.05, 0.3):
        mult = train_moe.jitter_multiplier(seed, 7, 5, eps)
        e32 = np.float32(eps)
        check(mult.dtype == np.float32 and np.array_equal(mult, py_jitter(seed, 7, 5, eps).astype(np.float32))
              and mult.min() >= np.float32(1) - e32 and mult.max() <= np.float32(1) + e32,
              f"jitter multipliers (eps {eps}) = the plain-int ones, inside [1 - eps, 1 + eps]")
    noise = train_moe.gating_noise(seed, 7, 3)
    check(noise.dtype == np.float32 and np.array_equal(noise, py_gating_noise(seed, 7, 3).astype(np.float32))
          and noise[2, 1] == np.float32(py_normal(seed, 2 * 3 + 1)), "gating noise n[t, e] = normal(seed, t*E + e)")


def test_noisy_routing():
    """train_moe.route with noisy gating's clean logits and std against np_noisy_losses (random H, exact ties in
    H), torch's gradcheck of the two losses, and a hand-worked case."""
    rng = np.random.default_rng(21)
    for E_ in (2, 3, 4, 8):
        for kind in ("normal", "ties"):
            N = 29
            clean = rng.normal(0, 1, (N, E_))
            std = np.log1p(np.exp(rng.normal(0, 1, (N, E_))))
            if kind == "normal":
                noisy = clean + rng.normal(0, 1, (N, E_)) * std
            else:  # integer H: most rows hold exact ties, the routing order decides thr
                noisy = rng.integers(0, 3, (N, E_)).astype(np.float64)
            for k in range(1, E_):
                for cf in (0.0, 0.5):
                    check_noisy_route_case(noisy, clean, std, k, cf, f"E={E_} {kind} k={k} cf={cf}",
                                           gradients=kind == "normal" and cf == 0.5 and E_ in (3, 4))

    # hand-worked: 2 tokens, 3 experts, top-1, std 1, H = clean (an evaluation pass). Token 0: H = (0, 1, 2)
    # chooses 2; thr = 1 (the 2nd value) for expert 2, 2 (the 1st) for the others: P = (Phi(-2), Phi(-1), Phi(1)).
    # Token 1: H = (1, 1, 0) chooses 0 (the tie goes to the lower index); thr = 1 for all: P = (1/2, 1/2, Phi(-1)).
    phi = lambda u: 0.5 * math.erfc(-u / math.sqrt(2))
    H_ = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    r = train_moe.route(H_, 1, train_moe.RoutingSettings(0.0, 0.01, 0.001, importance_coef=1.0, load_coef=1.0),
                        clean=H_, std=torch.ones_like(H_))
    load = [phi(-2) + 0.5, phi(-1) + 0.5, phi(1) + phi(-1)]  # the last is 1
    e = math.e
    importance = [e / (2 * e + 1), 0.0, e**2 / (1 + e + e**2)]  # the chosen softmax probs
    cv2 = lambda v: sum((a - sum(v) / 3) ** 2 for a in v) / 3 / (sum(v) / 3) ** 2
    check(r.choices.tolist() == [[2], [0]] and r.threshold.tolist() == [[2.0, 2.0, 1.0], [1.0, 1.0, 1.0]],
          f"hand-worked thr: choices {r.choices.tolist()}, thr {r.threshold.tolist()}")
    check(np.allclose(r.load.numpy(), load, atol=1e-15, rtol=0) and np.allclose(r.importance.numpy(), importance,
          atol=1e-15, rtol=0), f"hand-worked load {r.load.tolist()} and importance {r.importance.tolist()}")
    check(abs(r.load_loss.item() - cv2(load)) < 1e-15 and abs(r.importance_loss.item() - cv2(importance)) < 1e-15,
          f"hand-worked CV²: load {r.load_loss.item()} vs {cv2(load)}, importance {r.importance_loss.item()}")


def check_noisy_route_case(noisy, clean, std, k, cf, label, gradients):
    w_imp, w_load = 0.4, 0.7
    settings = train_moe.RoutingSettings(cf, 0.02, 0.003, importance_coef=w_imp, load_coef=w_load)
    r = train_moe.route(torch.tensor(noisy), k, settings, clean=torch.tensor(clean), std=torch.tensor(std))
    probs, choices, gates, kept, counts, capacity = np_route(noisy, k, cf)
    want_imp, want_load, thr, P, importance, load = np_noisy_losses(noisy, clean, std, choices, gates, w_imp, w_load)
    same = (np.array_equal(r.choices.numpy(), choices) and np.array_equal(r.kept.numpy(), kept)
            and np.array_equal(r.order.numpy(), routing_order(noisy, k + 1))
            and np.array_equal(r.threshold.numpy(), thr))
    check(same, f"noisy routing {label}: choices, kept, routing order and thr agree with numpy")
    errors = (np.abs(r.load_probs.numpy() - P).max(), np.abs(r.importance.numpy() - importance).max(),
              np.abs(r.load.numpy() - load).max(), abs(r.importance_loss.item() - want_imp),
              abs(r.load_loss.item() - want_load))
    check(max(errors) < 1e-12, f"noisy losses {label}: P, importance, load and their losses agree (errors {errors})")
    if gradients:  # finite differences of both losses in H, clean and std, on 10 tokens (no flip: gaps >> 1e-6)
        def losses(noisy_t, clean_t, std_t):
            out = train_moe.route(noisy_t, k, settings, clean=clean_t, std=std_t)
            return out.importance_loss + out.load_loss
        inputs = tuple(torch.tensor(a[:10], requires_grad=True) for a in (noisy, clean, std))
        good = torch.autograd.gradcheck(losses, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, raise_exception=False)
        check(good, f"noisy losses {label}: autograd = finite differences in H, clean, std")


def test_autograd_noise_float64():
    """train_moe's float64 autograd of the total loss with jitter 0.2 and noisy gating on, in training pass 5
    (its noise is fixed: every forward of the pass draws the same), against central finite differences of
    every parameter tensor (the noise router's included), top-1 and top-2, with drops and without, and
    importance and load coefficients large enough that their gradients weigh. A perturbation must change
    neither a choice, a drop, nor the element of H that thr takes; one that does counts as a failure."""
    base = train_moe.RoutingSettings(0.5, 0.3, 0.05, jitter=0.2, importance_coef=0.7, load_coef=0.9)
    for k, cf in ((1, 0.5), (2, 0.5), (2, 0.0)):
        config = train_moe.MoEConfig(maxT=8, V=37, L=2, NH=2, C=16, E=4, topk=k, moe_every=1, H=24, noisy=True)
        model = train_moe.MoEGPT(config)
        train_moe.init_weights(model, torch.Generator().manual_seed(7), 1.0)
        model.double()
        with torch.no_grad():  # a noise std that varies over the tokens: softplus away from its linear part
            for block in model.moe_blocks():
                block.moe.noise_router.weight.mul_(30.0)
        generator = torch.Generator().manual_seed(8)
        x = torch.randint(0, config.V, (2, 6), generator=generator)
        y = torch.randint(0, config.V, (2, 6), generator=generator)
        settings = train_moe.training_pass(replace_cf(base, cf), 5)
        output = model(x, y, settings)
        again = model(x, y, settings)
        other = model(x, y, train_moe.training_pass(replace_cf(base, cf), 6))
        check(output.total_loss.item() == again.total_loss.item() != other.total_loss.item(),
              f"k={k}: a pass's noise is fixed, another pass draws other noise")
        train_moe.backward(output.total_loss, model)
        check((output.dropped > 0) == (cf > 0) and output.importance_loss.item() > 1e-3
              and output.load_loss.item() > 1e-4,
              f"k={k} cf={cf}: drops {output.dropped}, importance {output.importance_loss.item():.2e}, "
              f"load {output.load_loss.item():.2e}")
        for block in model.moe_blocks():
            g = block.moe.noise_router.weight.grad
            check(g.abs().max() > 1e-4, f"k={k}: the noise router gets a gradient")
        # step 1e-5: the loss (~6) has more terms than above: at 1e-6 its rounding error (~1e-9) reaches the tolerance
        check_finite_differences(model, x, y, settings,
                                 lambda out: [t for r in out.routings for t in (r.choices, r.kept, r.order)],
                                 1e-5, 2, f"noise k={k} cf={cf}")


def replace_cf(settings, cf):
    return train_moe.RoutingSettings(cf, settings.aux_alpha, settings.z_coef, settings.jitter,
                                     settings.importance_coef, settings.load_coef)


def noise_shape(topk, moe_every, noisy):
    return Shape(MAXT, V, L, NH, C, E, topk, moe_every, H, noisy)


# the brief's three reference states (MOE_REF_ARGS plus these): (name, flags, shape, cf, noise)
NOISE_REFS = (
    ("k1_jitter", ["--topk", "1", "--moe-every", "1", "--cf", "0.5", "--jitter", "0.1"], noise_shape(1, 1, False),
     0.5, Noise(jitter=0.1)),
    ("k2_noisy", ["--topk", "2", "--moe-every", "1", "--cf", "0.5", "--noisy-topk", "1"], noise_shape(2, 1, True),
     0.5, Noise()),
    ("k1_noisy_jitter", ["--topk", "1", "--moe-every", "2", "--cf", "0", "--noisy-topk", "1", "--jitter", "0.05"],
     noise_shape(1, 2, True), 0.0, Noise(jitter=0.05)),
)


def test_noise_files(tmp):
    """The three noise reference states: file layouts with routernw (header[12]) and header[8] written out from
    noise_spec §6, the init, the debug state against the numpy forward with noise (logits from an evaluation
    pass, the rest from training pass 0) and finite differences, the step losses against AdamW written out with
    step k at pass k, and bf16 and --model-from-file round trips."""
    for name, flags, shape, cf, noise in NOISE_REFS:
        prefix = os.path.join(tmp, "noise_" + name)
        message, out = run_main(train_moe, reference_args(prefix, flags + ["--dtype", "float32"]))
        check(message is None and "training pass 0:" in out and ", evaluation:" in out,
              f"{name}: runs and prints both passes' routing: {message} {out!r}")
        model_data = open(prefix + "_model.bin", "rb").read()
        check(len(model_data) == HEADER_BYTES + 4 * shape.nparams(), f"{name}: model file size {len(model_data)}")
        check(list(read_header(model_data)[:13]) == shape.header(1) and not read_header(model_data)[13:].any(),
              f"{name}: model header {list(read_header(model_data)[:14])}")
        state_data = open(prefix + "_debug_state.bin", "rb").read()
        Lm = len(shape.moe_layers)
        extra = 2 if shape.noisy else 0  # importance and load
        expected = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 3 + extra + Lm * (1 + E) + shape.nparams() + STEPS)
        check(len(state_data) == expected, f"{name}: debug state size {len(state_data)}, expected {expected}")
        check(np.array_equal(read_header(state_data), moe_state_header(Lm, cf, int(shape.noisy), jitter=noise.jitter)),
              f"{name}: debug state header")
        flat = np.frombuffer(model_data[HEADER_BYTES:], dtype="<f4")
        check_layout(prefix, flat, shape, flags)
        flat, s = check_debug_state(prefix, shape, cf, fd_entries=2, noise=noise)
        steps = s["steps"]
        check(len(steps) == STEPS and steps[0] == np.float32(s["ce"]),
              f"{name}: step 0's loss is training pass 0's CE ({steps[0]} vs {s['ce']})")
        check(steps[-1] < steps[0] - 0.3, f"{name}: 10 steps lower the loss by more than 0.3: {steps}")
        losses, _ = adamw_losses(flat, s["x"], s["y"], shape, STEPS, 0.5, cf, noise=noise)
        err = np.abs(losses - steps).max()
        check(err < 1e-5, f"{name}: losses match the written-out AdamW, step k at pass k (max error {err:.2e})")
        if name == "k2_noisy":  # control: a fixed pass would give other losses
            fixed, _ = adamw_losses(flat, s["x"], s["y"], shape, STEPS, 0.5, cf, noise=noise, passes=[0] * STEPS)
            check(np.abs(fixed - steps).max() > 1e-4, f"{name}: control: the same noise every step changes the losses")

    # a noisy model is the non-noisy model of the same seed plus its noise routers; jitter is not in the model
    noisy_flat = np.frombuffer(open(os.path.join(tmp, "noise_k2_noisy_model.bin"), "rb").read()[HEADER_BYTES:], "<f4")
    Pn, _ = split(noisy_flat, noise_shape(2, 1, True))
    plain = train_moe.flat_parameters(train_moe.model_for_run(train_moe.parse_args(
        reference_args(os.path.join(tmp, "unused"), NOISE_REFS[1][1][:6]))))
    Pp, _ = split(plain, noise_shape(2, 1, False))
    check(all(np.array_equal(Pn[n], Pp[n]) for n in Pp), "the noisy model's other tensors are the plain model's")
    check(not np.array_equal(Pn["routernw"], Pn["routerw"]), "routernw is drawn apart from routerw")
    check(open(os.path.join(tmp, "noise_k1_jitter_model.bin"), "rb").read()
          == open(os.path.join(tmp, "cf0.5_model.bin"), "rb").read(), "jitter leaves the model file as it is")

    # bf16: routernw rounded too; --model-from-file (without --noisy-topk: header[12] turns it on) reproduces both
    name, flags, shape, cf, noise = NOISE_REFS[1]
    prefix = os.path.join(tmp, "noise_" + name)
    message, _ = run_main(train_moe, reference_args(prefix + "_bf16", flags + ["--dtype", "bfloat16"]))
    bf16_data = open(prefix + "_bf16_model.bin", "rb").read()
    check(message is None and len(bf16_data) == HEADER_BYTES + 2 * shape.nparams()
          and list(read_header(bf16_data)[:13]) == shape.header(2), f"{name} bf16 model file: {message}")
    for suffix, dtype in (("", "float32"), ("_bf16", "bfloat16")):
        again = os.path.join(tmp, "noise_again" + suffix)
        argv = reference_args(again, ["--cf", "0.5", "--dtype", dtype,
                                      "--model-from-file", prefix + suffix + "_model.bin"])
        message, _ = run_main(train_moe, argv)
        same = all(open(prefix + suffix + part, "rb").read() == open(again + part, "rb").read()
                   for part in ("_model.bin", "_debug_state.bin"))
        check(message is None and same, f"{name} --model-from-file {dtype} reproduces both files: {message}")
    return prefix


def test_train_mode_noisy(noisy_prefix, tmp):
    """--train with noisy gating and jitter: step 1 is training pass 0, its aux field is Switch's aux + importance +
    load and its loss and z are the numpy forward's of that pass on the first batch."""
    shard = os.path.join(tmp, "shard_000.bin")  # test_train_mode's
    message, out = run_main(train_moe, ["--train", "--input-bin", shard, "--B", "2", "--T", "16", "--steps", "1",
                                        "--jitter", "0.1", "--model-from-file", noisy_prefix + "_model.bin"])
    fields = re.match(r"^step 1/1 \| loss (\S+) \| aux (\S+) \| z (\S+) \| drop (\S+) \| ", out)
    check(message is None and fields is not None, f"--train noisy step line: {message} {out!r}")
    if fields is None:
        return
    loss, aux, z, _ = (float(f) for f in fields.groups())
    tokens = train_gpt.read_shard(shard)[: 2 * 16 + 1]
    flat = np.frombuffer(open(noisy_prefix + "_model.bin", "rb").read()[HEADER_BYTES:], dtype="<f4")
    want = np_forward(flat, tokens[:-1].reshape(2, 16), tokens[1:].reshape(2, 16), noise_shape(2, 1, True), 1.25,
                      noise=Noise(jitter=0.1, training=True, pass_number=0))
    balancing = want.aux + want.importance + want.load
    check(abs(aux - balancing) < 2e-6 and abs(aux - want.aux) > 1e-4,
          f"--train aux {aux} = aux + importance + load {balancing} (Switch aux alone {want.aux})")
    check(abs(loss - want.ce) < 2e-5 and abs(z - want.z) < 2e-6,
          f"--train loss {loss}, z {z}: numpy {want.ce}, {want.z}")


def test_noise_bad_input(noisy_prefix, tmp):
    """Noisy-gating model files: header[12] must be 0 or 1, agree with the payload, and come with top-k < E."""
    out = os.path.join(tmp, "x")
    data = bytearray(open(noisy_prefix + "_model.bin", "rb").read())
    plain = bytearray(open(os.path.join(tmp, "cf0.5_model.bin"), "rb").read())
    for label, source, position, value, needle in (("header[12] = 2", data, 12, 2, "header[12]"),
                                                   ("noisy file with top-k = E", data, 9, 4, "noisy"),
                                                   ("header[12] = 0 with routernw", data, 12, 0, "payload"),
                                                   ("header[12] = 1 without routernw", plain, 12, 1, "payload")):
        bad = bytearray(source)
        bad[4 * position : 4 * position + 4] = value.to_bytes(4, "little", signed=True)
        path = os.path.join(tmp, "bad_noise.bin")
        open(path, "wb").write(bad)
        fails_with(["--write-reference", out, "--model-from-file", path], needle, label)


# ----------------------------------------------------------------------------------------------------------
# The routing options (doc/moe.md, "Routing options"): sigmoid scores with the balancing bias, the routed
# scale, device-limited routing, shared experts, the sequence-wise and global-batch losses, the bias update, llama
# experts; and the file fields (doc/formats.md). The numpy code below is written from those pages.


def np_sigmoid_route(logits, k, cf, score="softmax", bias=None, routed_scale=1.0, groups=1, limit=0):
    """(probs for the balance losses, choices, gates, kept, counts before dropping) of one group, loop by loop."""
    N, E_ = logits.shape
    if score == "softmax":
        exp = np.exp(logits - logits.max(axis=1, keepdims=True))
        affinity = exp / exp.sum(axis=1, keepdims=True)
        probs = affinity
    else:
        affinity = 1.0 / (1.0 + np.exp(-logits))
        probs = affinity / affinity.sum(axis=1, keepdims=True)
    key = logits if bias is None else affinity + bias
    size = E_ // groups
    choices = np.zeros((N, k), dtype=np.int64)
    for n in range(N):
        allowed = range(E_)
        if limit > 0:
            best = [max(key[n, g * size : (g + 1) * size]) for g in range(groups)]
            kept_groups = sorted(range(groups), key=lambda g: (-best[g], g))[:limit]
            allowed = [e for e in range(E_) if e // size in kept_groups]
        choices[n] = sorted(allowed, key=lambda e: (-key[n, e], e))[:k]
    chosen = np.take_along_axis(affinity, choices, axis=1)
    gates = chosen if (k == 1 and score == "softmax") else chosen / chosen.sum(axis=1, keepdims=True)
    gates = gates * routed_scale
    capacity = math.ceil(k * cf * N / E_) if cf > 0 else None
    used = [0] * E_
    kept = np.zeros((N, k), dtype=bool)
    for j in range(k):
        for n in range(N):
            if capacity is None or used[choices[n, j]] < capacity:
                kept[n, j] = True
                used[choices[n, j]] += 1
    return probs, choices, gates, kept, np.bincount(choices.reshape(-1), minlength=E_)


def np_expert(h, weights, llama):
    """One expert on rows h (n, C): GELU MLP (fcw, fcb, fcprojw, fcprojb) or SwiGLU (fcw rows [gate | up], fcprojw)."""
    if llama:
        fcw, fcprojw = weights
        a = h @ fcw.T
        H_ = a.shape[1] // 2
        gate, up = a[:, :H_], a[:, H_:]
        return (gate / (1.0 + np.exp(-gate)) * up) @ fcprojw.T
    fcw, fcb, fcprojw, fcprojb = weights
    return np_gelu_tanh(h @ fcw.T + fcb) @ fcprojw.T + fcprojb


def np_moe_layer(h, routerw, experts, shared, llama, k, cf, alpha, seq_alpha, score, bias, routed_scale, groups,
                 limit, prior=None):
    """doc/moe.md's MoE layer on h (B, T, C): (output (N, C), choices, gates, kept, counts, aux, seq loss)."""
    B_, T_, C_ = h.shape
    x = h.reshape(B_ * T_, C_)
    logits = x @ routerw.T
    N, E_ = logits.shape
    probs, choices, gates, kept, counts = np_sigmoid_route(logits, k, cf, score, bias, routed_scale, groups, limit)
    out = np.zeros_like(x)
    for n in range(N):
        for j in range(k):
            if kept[n, j]:
                out[n] += gates[n, j] * np_expert(x[n : n + 1], experts[choices[n, j]], llama)[0]
    for weights in shared:
        out += np_expert(x, weights, llama)
    earlier_counts, earlier_choices = prior if prior is not None else (np.zeros(E_), 0)
    f = (earlier_counts + counts) / (earlier_choices + N * k)
    aux = alpha * E_ * float((f * probs.mean(axis=0)).sum())
    seq = 0.0
    for b in range(B_):
        rows = range(b * T_, (b + 1) * T_)
        seq_counts = np.zeros(E_)
        for n in rows:
            for e in choices[n]:
                seq_counts[e] += 1
        seq += seq_alpha * E_ * float((seq_counts / (T_ * k) * probs[list(rows)].mean(axis=0)).sum())
    return out, choices, gates, kept, counts, aux, seq / B_


RoutingCase = namedtuple("RoutingCase", "label llama E k cf score bias scale groups limit shared prior")
ROUTING_CASES = (
    # every option at once on gpt2-family experts, with drops and the counts of two earlier micro-batches
    RoutingCase("gpt2 sigmoid+bias+limit+shared+drops+global", False, 8, 3, 1.0, "sigmoid", True, 2.5, 4, 2, 2,
                (np.array([5, 0, 3, 9, 1, 2, 7, 3]), 30)),
    # llama SwiGLU experts, sigmoid without a bias (top-k on the logits), one shared expert, dropless
    RoutingCase("llama sigmoid dropless shared", True, 6, 2, 0.0, "sigmoid", False, 1.0, 1, 0, 1, None),
    # llama softmax top-2 within one of two groups, scaled gates, with drops
    RoutingCase("llama softmax k2 limit scale", True, 4, 2, 0.5, "softmax", False, 1.5, 2, 1, 0, None),
)


def routing_case_layer(case, seed):
    """A float64 SwitchFFN of the case with random weights, input and bias, its settings, and the numpy weights."""
    shape = dict(maxT=8, V=11, L=1, NH=2, C=8, E=case.E, topk=case.k, moe_every=1, H=6, shared=case.shared,
                 shared_H=5 if case.shared else 0, score=case.score, routed_scale=case.scale, balance_bias=case.bias)
    if case.llama:
        shape.update(arch="llama", NKV=1, rope_theta=10000.0, dense_H=16, norm_eps=1e-5, tied=True)
    config = train_moe.MoEConfig(**shape)
    torch.manual_seed(seed)
    layer = train_moe.SwitchFFN(config, 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.5)  # router logits of order 1: scores far from each other and from saturation
        if case.bias:
            layer.balance_bias.normal_(0.0, 0.05)  # of the order of the affinities' gaps: it moves choices
    settings = train_moe.RoutingSettings(capacity_factor=case.cf, aux_alpha=0.01, z_coef=0.0, seq_alpha=0.02,
                                         global_aux=case.prior is not None, device_limit=case.limit,
                                         ep_groups=case.groups)
    h = torch.randn(3, 5, 8, dtype=torch.float64)
    return layer, settings, h


def np_layer_weights(layer, llama):
    names = ("c_fc.weight", "c_proj.weight") if llama else ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
    get = lambda m: [m.get_parameter(n).detach().numpy() for n in names]
    shared = [get(m) for m in getattr(layer, "shared", [])]
    return layer.router.weight.detach().numpy(), [get(m) for m in layer.experts], shared


def test_routing_options():
    """SwitchFFN in float64 against np_moe_layer: the output, choices, gates, drops, counts, the Switch loss (with
    the earlier micro-batches' counts) and the sequence-wise loss. Tolerance 1e-12 relative: both sides are float64
    and differ only in summation order (~1e-15). Then the autograd gradients of out·R + aux + seq loss against
    central differences of np_moe_layer (step 1e-6; tolerance 1e-6 of the largest gradient: the differences' error
    is ~1e-10), with a check that no difference flips a choice."""
    for i, case in enumerate(ROUTING_CASES):
        layer, settings, h = routing_case_layer(case, 100 + i)
        bias = layer.balance_bias.numpy().astype(np.float64) if case.bias else None
        prior = None if case.prior is None else (torch.tensor(case.prior[0]), case.prior[1])
        h.requires_grad_(True)
        out, routing = layer(h, settings, prior)
        routerw, experts, shared = np_layer_weights(layer, case.llama)
        args = (case.llama, case.k, case.cf, 0.01, 0.02, case.score, bias, case.scale, case.groups, case.limit,
                case.prior)
        np_out, choices, gates, kept, counts, aux, seq = np_moe_layer(h.detach().numpy(), routerw, experts, shared,
                                                                       *args)
        label = f"routing options, {case.label}"
        check(np.array_equal(routing.choices.numpy(), choices), f"{label}: choices")
        check(np.array_equal(routing.kept.numpy(), kept), f"{label}: kept")
        check(np.array_equal(routing.counts.numpy(), counts), f"{label}: counts")
        check(np.allclose(routing.gates.detach().numpy(), gates, rtol=1e-12, atol=0), f"{label}: gates")
        check(np.allclose(out.detach().reshape(-1, 8).numpy(), np_out, rtol=1e-12, atol=1e-14), f"{label}: output")
        check(math.isclose(routing.aux_loss.item(), aux, rel_tol=1e-12), f"{label}: aux {routing.aux_loss.item()} "
                                                                         f"vs {aux}")
        check(math.isclose(routing.seq_loss.item(), seq, rel_tol=1e-12), f"{label}: seq {routing.seq_loss.item()} "
                                                                         f"vs {seq}")
        check(0 < kept.sum() and (case.cf <= 0 or not kept.all()), f"{label}: the case drops as intended")
        if case.limit:
            size = case.E // case.groups
            check(all(len({int(e) // size for e in row}) <= case.limit for row in choices), f"{label}: group limit")
            unlimited = np_sigmoid_route(h.detach().numpy().reshape(-1, 8) @ routerw.T, case.k, case.cf, case.score,
                                         bias, case.scale)[1]
            check(not np.array_equal(unlimited, choices), f"{label}: the limit moves some choices")
        if case.bias:
            unbiased = np_sigmoid_route(h.detach().numpy().reshape(-1, 8) @ routerw.T, case.k, case.cf, case.score,
                                        None, case.scale, case.groups, case.limit)[1]
            check(not np.array_equal(unbiased, choices), f"{label}: the bias moves some choices")

        R = np.random.default_rng(i).standard_normal(np_out.shape)
        (out.reshape(-1, 8) * torch.from_numpy(R)).sum().add(routing.aux_loss + routing.seq_loss).backward()
        targets = [("h", h.detach().numpy().copy(), h.grad.numpy()),
                   ("routerw", routerw.copy(), layer.router.weight.grad.numpy())]
        if shared:
            targets.append(("shared fcw", shared[0][0].copy(), layer.shared[0].c_fc.weight.grad.numpy()))
        for name, base, grad in targets:
            rng = np.random.default_rng(7)
            for index in [np.unravel_index(np.abs(grad).argmax(), grad.shape)] + [
                    tuple(rng.integers(0, s) for s in grad.shape) for _ in range(3)]:
                values = []
                for sign in (1, -1):
                    moved = base.copy()
                    moved[index] += sign * 1e-6
                    hh = moved if name == "h" else h.detach().numpy()
                    rw = moved if name == "routerw" else routerw
                    sh = [[moved] + w[1:] for w in shared[:1]] + shared[1:] if name == "shared fcw" else shared
                    o, c, *_, a, s = np_moe_layer(hh, rw, experts, sh, *args)
                    check(np.array_equal(c, choices), f"{label}: d{name}{index} keeps the choices")
                    values.append(float((o * R).sum()) + a + s)
                fd = (values[0] - values[1]) / 2e-6
                check(abs(fd - grad[index]) <= 1e-6 * np.abs(grad).max(),
                      f"{label}: d{name}{index} autograd {grad[index]} vs central difference {fd}")


def test_bias_update():
    """update_balance_biases against b + fp32(gamma) * sign(mean load - load) computed in numpy fp32, bit for bit,
    on loads with ties to the mean, and an under-loaded, over-loaded expert in each layer."""
    config = train_moe.MoEConfig(maxT=8, V=11, L=2, NH=2, C=8, E=4, topk=2, moe_every=1, H=6, score="sigmoid",
                                 balance_bias=True)
    model = train_moe.MoEGPT(config)
    start = np.array([[0.1, -0.2, 0.3, 1e-3], [0.0, 0.0, -0.7, 0.25]], dtype=np.float32)
    with torch.no_grad():
        for block, b in zip(model.moe_blocks(), start):
            block.moe.balance_bias.copy_(torch.from_numpy(b))
    loads = [np.array([3, 5, 4, 4]), np.array([0, 9, 2, 1])]  # means 4 and 3
    model.update_balance_biases([torch.tensor(l) for l in loads], 0.001)
    gamma = np.float32(0.001)
    expected = np.stack([b + gamma * np.sign(l.mean() - l).astype(np.float32) for b, l in zip(start, loads)])
    check(np.array_equal(model.balance_biases(), expected.astype(np.float32)), "bias update: b + gamma*sign(mean-load)")


def routing_options_file_tensors(shape):
    """[(name, shape)] of a llama MoE file's payload (doc/formats.md, "MoE model file"), shared experts included."""
    C_, L_, Lm, E_, H_, S, Hs, HS = shape["C"], shape["L"], shape["Lm"], shape["E"], shape["H"], shape["S"], \
        shape["Hs"], shape["C"] // shape["NH"]
    return [("wte", (shape["Vp"], C_)), ("ln1w", (L_, C_)), ("qkvw", (L_, (shape["NH"] + 2 * shape["NKV"]) * HS, C_)),
            ("attprojw", (L_, C_, C_)), ("ln2w", (L_, C_)), ("routerw", (Lm, E_, C_)),
            ("expert_fcw", (Lm, E_, 2 * H_, C_)), ("expert_fcprojw", (Lm, E_, C_, H_)),
            ("shared_fcw", (Lm, S, 2 * Hs, C_)), ("shared_fcprojw", (Lm, S, C_, Hs)), ("lnfw", (C_,)),
            ("lm_head", (shape["Vp"], C_))]


DEEPSEEK_ARGS = ["--B", "4", "--T", "9", "--V", "263", "--L", "2", "--NH", "4", "--C", "32", "--maxT", "16",
                 "--arch", "llama", "--kv-heads", "2", "--E", "8", "--topk", "3", "--H", "16", "--shared-experts", "2",
                 "--shared-hidden", "24", "--score", "sigmoid", "--routed-scale", "2.5", "--bias-gamma", "0.001",
                 "--seq-aux-alpha", "0.001", "--global-aux", "1", "--micro-batches", "2", "--device-limit", "2",
                 "--ep-groups", "4", "--cf", "0", "--steps", "3"]


def test_routing_options_files(tmp):
    """A DeepSeek-shape llama reference: the header words, the payload laid out from doc/formats.md against the
    model's modules, the fp32 biases after the payload, the debug state's size and words 9..11, and its first bias
    row recomputed from the file's biases and the debug state's counts (bit for bit)."""
    prefix = os.path.join(tmp, "ds")
    message, _ = run_main(train_moe, ["--write-reference", prefix] + DEEPSEEK_ARGS)
    check(message is None, f"DeepSeek-shape reference: {message}")
    data = open(prefix + "_model.bin", "rb").read()
    h = read_header(data)
    as_float = lambda word: float(np.array([word], dtype="<i4").view("<f4")[0])
    check(list(h[:13]) == [20261129, 1, 16, 263, 2, 4, 32, 384, 8, 3, 1, 16, 0], f"words 0..12: {list(h[:13])}")
    check(list(h[16:18]) == [1, 2] and as_float(h[18]) == 10000.0 and h[19] == 128
          and as_float(h[20]) == np.float32(1e-5) and h[21] == 0, f"llama words 16..21: {list(h[16:22])}")
    check(list(h[24:28]) == [1, 2, 24, 1] and as_float(h[28]) == 2.5 and h[29] == 1, f"words 24..29: {list(h[24:30])}")
    check(not h[13:16].any() and not h[22:24].any() and not h[30:].any(), "every other word is 0")
    shape = dict(C=32, L=2, Lm=2, E=8, H=16, S=2, Hs=24, NH=4, NKV=2, Vp=384)
    tensors = routing_options_file_tensors(shape)
    count = sum(int(np.prod(s)) for _, s in tensors)
    check(len(data) == HEADER_BYTES + 4 * count + 4 * 2 * 8, f"model file size {len(data)}")
    flat = np.frombuffer(data[HEADER_BYTES : HEADER_BYTES + 4 * count], dtype="<f4")
    biases = np.frombuffer(data[HEADER_BYTES + 4 * count :], dtype="<f4").reshape(2, 8)
    args = train_moe.parse_args(["--write-reference", prefix] + DEEPSEEK_ARGS)
    model = train_moe.model_for_run(args)  # the same seed: the same parameters and initial biases
    modules = {"wte": lambda l, i: model.wte.weight, "ln1w": lambda l, i: model.h[l].ln_1.weight,
               "qkvw": lambda l, i: model.h[l].attn.c_attn.weight,
               "attprojw": lambda l, i: model.h[l].attn.c_proj.weight,
               "ln2w": lambda l, i: model.h[l].ln_2.weight, "routerw": lambda l, i: model.h[l].moe.router.weight,
               "expert_fcw": lambda l, i: model.h[l].moe.experts[i].c_fc.weight,
               "expert_fcprojw": lambda l, i: model.h[l].moe.experts[i].c_proj.weight,
               "shared_fcw": lambda l, i: model.h[l].moe.shared[i].c_fc.weight,
               "shared_fcprojw": lambda l, i: model.h[l].moe.shared[i].c_proj.weight,
               "lnfw": lambda l, i: model.ln_f.weight, "lm_head": lambda l, i: model.lm_head.weight}
    offset = 0
    for name, s in tensors:
        values = flat[offset : offset + int(np.prod(s))].reshape(s)
        offset += values.size
        if name in ("wte", "lnfw", "lm_head"):
            same = np.array_equal(values, modules[name](0, 0).detach().numpy())
        elif name.startswith(("expert", "shared")):
            same = all(np.array_equal(values[l, i], modules[name](l, i).detach().numpy())
                       for l in range(s[0]) for i in range(s[1]))
        else:
            same = all(np.array_equal(values[l], modules[name](l, 0).detach().numpy()) for l in range(s[0]))
        check(same, f"DeepSeek-shape file: {name} at its doc/formats.md place")
    check(np.array_equal(biases, model.balance_biases()) and np.abs(biases).max() > 0, "biases after the payload")
    # bf16: the weights rounded to nearest even, the biases the same fp32 values
    message, _ = run_main(train_moe, ["--write-reference", prefix + "_bf16"] + DEEPSEEK_ARGS[:-2] +
                          ["--steps", "0", "--dtype", "bfloat16"])
    bf16 = open(prefix + "_bf16_model.bin", "rb").read()
    check(message is None and read_header(bf16)[1] == 2 and len(bf16) == HEADER_BYTES + 2 * count + 4 * 16,
          f"bf16 DeepSeek-shape file: {message}, size {len(bf16)}")
    bits = flat.view("<u4").astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")
    check(np.array_equal(np.frombuffer(bf16[HEADER_BYTES : HEADER_BYTES + 2 * count], dtype="<u2"), rounded)
          and bf16[HEADER_BYTES + 2 * count :] == data[HEADER_BYTES + 4 * count :], "bf16 weights rounded, fp32 biases")

    state = open(prefix + "_debug_state.bin", "rb").read()
    sh = read_header(state)
    B_, T_, V_, steps = 4, 9, 263, 3
    want = moe_state_header(2, 0.0, seq_alpha=0.001, K=2, biases=1, gamma=0.001, global_aux=1, limit=2, groups=4,
                            shape=(B_, T_, steps, V_, VP))
    check(np.array_equal(sh, want), f"debug state words 0..32: {list(sh[:33])}, expected {list(want[:33])}")
    n_losses = 4  # CE, aux, z, seq
    ints = 2 * (1 + 8)
    size = HEADER_BYTES + 4 * (2 * B_ * T_ + B_ * T_ * V_ + n_losses + ints + count + steps + steps * 2 * 8)
    check(len(state) == size, f"debug state size {len(state)}, expected {size}")
    offset = HEADER_BYTES + 4 * (2 * B_ * T_ + B_ * T_ * V_ + n_losses)
    routing_ints = np.frombuffer(state[offset : offset + 4 * ints], dtype="<i4").reshape(2, 9)
    check(all(r[0] == 0 and r[1:].sum() == B_ * T_ * 3 for r in routing_ints), "dropless counts sum to N·k")
    rows = np.frombuffer(state[len(state) - 4 * steps * 16 :], dtype="<f4").reshape(steps, 2, 8)
    gamma = np.float32(0.001)
    loads = routing_ints[:, 1:]
    first = biases + gamma * np.sign(loads.sum(axis=1, keepdims=True) - 8 * loads).astype(np.float32)
    check(np.array_equal(rows[0], first.astype(np.float32)), "bias row 0 = file biases moved by step 0's loads")
    steps_moved = np.diff(np.concatenate([biases[None], rows]), axis=0)
    check(np.allclose(np.abs(steps_moved[np.abs(steps_moved) > 1e-7]), 1e-3, rtol=1e-3), "every move is ±gamma or 0")


def test_global_aux_micro_batches():
    """--global-aux 1 over K = 3 micro-batches: micro-batch j's Switch loss is α·E·Σ_e f_e·P_e with f_e from the
    counts of micro-batches 0..j over (j + 1)·N·k choices (doc/moe.md, "Routing options" 8), recomputed in float64
    from each micro-batch's own probs and counts; tolerance 1e-6 relative (fp32 sums of 8 terms). Without it, f is
    the micro-batch's own, and the two differ."""
    args = train_moe.parse_args(["--write-reference", "unused", "--B", "6", "--topk", "2", "--E", "8", "--cf", "0",
                                 "--score", "sigmoid", "--global-aux", "1", "--micro-batches", "3"])
    model = train_moe.model_for_run(args)
    x, y = train_gpt.reference_batch(args, model.config)
    with torch.no_grad():
        outputs = train_moe.micro_batch_outputs(model, x, y, 3, train_moe.routing_settings(args))
    for m in range(model.config.Lm):
        counts = np.zeros(8)
        for j, output in enumerate(outputs):
            r = output.routings[m]
            counts += r.counts.numpy()
            N = r.probs.shape[0]
            f = counts / ((j + 1) * N * 2)
            expected = 0.01 * 8 * float((f * r.probs.double().mean(dim=0).numpy()).sum())
            own = 0.01 * 8 * float((r.counts.numpy() / (N * 2) * r.probs.double().mean(dim=0).numpy()).sum())
            check(math.isclose(r.aux_loss.item(), expected, rel_tol=1e-6), f"global aux, layer {m} micro-batch {j}: "
                                                                          f"{r.aux_loss.item()} vs {expected}")
            if j > 0:
                check(not math.isclose(expected, own, rel_tol=1e-4), f"global aux, layer {m} micro-batch {j} differs")


def test_llama_moe_is_llama():
    """A llama MoE with one expert and top-1 softmax (gate exactly 1) is train_gpt.py's Llama with that expert as
    its MLP: logits within 1e-5 and the same CE loss (fp32; only the order of operations differs)."""
    args = train_gpt.parse_args(["--write-reference", "unused", "--arch", "llama", "--NH", "4", "--C", "32",
                                 "--kv-heads", "2", "--ffn-hidden", "48", "--L", "2"])
    llama = train_gpt.model_for_run(args)
    config = train_moe.MoEConfig(maxT=32, V=263, L=2, NH=4, C=32, E=1, topk=1, moe_every=1, H=48, arch="llama",
                                 NKV=2, rope_theta=10000.0, dense_H=48, norm_eps=float(np.float32(1e-5)), tied=False)
    moe = train_moe.MoEGPT(config)
    with torch.no_grad():
        for name, p in llama.named_parameters():
            moe.get_parameter(name.replace("mlp.", "moe.experts.0.")).copy_(p)
        for block in moe.moe_blocks():
            block.moe.router.weight.normal_()
    x = torch.randint(0, 263, (3, 23), generator=torch.Generator().manual_seed(5))
    logits, loss = llama(x, x)
    out = moe(x, x, train_moe.RoutingSettings(capacity_factor=0, aux_alpha=0, z_coef=0))
    check(torch.allclose(out.logits, logits, rtol=0, atol=1e-5) and math.isclose(out.ce_loss.item(), loss.item(),
                                                                                 rel_tol=1e-6),
          "llama MoE with one expert = Llama")


def np_llama_moe_forward(P, biases, x, y, cfg, micro_batches):
    """The llama MoE of doc/moe.md from the file's tensors P (float64) and biases, over the micro-batches of (x, y):
    (logits (B, T, V), the means over the micro-batches of CE, aux, z and the sequence-wise loss, their total, and
    per MoE layer the counts summed over the micro-batches). test_reference's numpy RMSNorm and RoPE; attention
    written out per head; the MoE layers by np_moe_layer."""
    C_, NH_, NKV, eps, E_, k = cfg["C"], cfg["NH"], cfg["NKV"], cfg["eps"], cfg["E"], cfg["k"]
    HS = C_ // NH_
    all_logits, sums, counts_total = [], np.zeros(4), [np.zeros(E_) for _ in range(cfg["L"])]
    prior = [None] * cfg["L"]
    for xm, ym in zip(np.split(x, micro_batches), np.split(y, micro_batches)):
        b, t = xm.shape
        cos, sin = test_reference.np_rope_table(t, HS, cfg["theta"])
        future = np.triu(np.ones((t, t), dtype=bool), k=1)
        h = P["wte"][xm]
        aux = z = seq = 0.0
        for l in range(cfg["L"]):
            qkv = test_reference.np_rmsnorm(h, P["ln1w"][l], eps) @ P["qkvw"][l].T
            heads = lambda start, n: qkv[..., start * HS : (start + n) * HS].reshape(b, t, n, HS).transpose(0, 2, 1, 3)
            q, kk, v = heads(0, NH_), heads(NH_, NKV), heads(NH_ + NKV, NKV)
            q, kk = test_reference.np_rope(q, cos, sin, "half"), test_reference.np_rope(kk, cos, sin, "half")
            out = np.empty_like(q)
            for head in range(NH_):
                j = head // (NH_ // NKV)
                scores = np.where(future, -np.inf, q[:, head] @ kk[:, j].transpose(0, 2, 1) / math.sqrt(HS))
                probs = np.exp(scores - scores.max(-1, keepdims=True))
                out[:, head] = probs / probs.sum(-1, keepdims=True) @ v[:, j]
            h = h + out.transpose(0, 2, 1, 3).reshape(b, t, C_) @ P["attprojw"][l].T
            xn = test_reference.np_rmsnorm(h, P["ln2w"][l], eps)
            experts = [(P["expert_fcw"][l, e], P["expert_fcprojw"][l, e]) for e in range(E_)]
            shared = [(P["shared_fcw"][l, i], P["shared_fcprojw"][l, i]) for i in range(cfg["S"])]
            ffn, _, _, _, counts, a, s = np_moe_layer(xn, P["routerw"][l], experts, shared, True, k, 0.0, ALPHA,
                                                      cfg["seq_alpha"], "sigmoid", biases[l], cfg["scale"],
                                                      cfg["groups"], cfg["limit"], prior[l])
            prior[l] = (counts if prior[l] is None else prior[l][0] + counts,
                        b * t * k + (0 if prior[l] is None else prior[l][1]))
            counts_total[l] += counts
            router_logits = xn.reshape(-1, C_) @ P["routerw"][l].T
            top = router_logits.max(axis=1)
            z += Z_COEF * float(((top + np.log(np.exp(router_logits - top[:, None]).sum(axis=1))) ** 2).mean())
            aux, seq = aux + a, seq + s
            h = h + ffn.reshape(b, t, C_)
        logits = test_reference.np_rmsnorm(h, P["lnfw"], eps) @ P["lm_head"][: cfg["V"]].T
        all_logits.append(logits)
        sums += [test_reference.np_cross_entropy(logits, ym), aux, z, seq]
    ce, aux, z, seq = sums / micro_batches
    return np.concatenate(all_logits), ce, aux, z, seq, ce + aux + z + seq, counts_total


def test_deepseek_forward_and_gradients(tmp):
    """The DeepSeek-shape reference (test_routing_options_files) against np_llama_moe_forward: logits within 1e-5 and
    the CE, aux, z and sequence-wise losses within 1e-5 relative (fp32 against float64, as the llama GPT test), the
    counts exactly, and the gradients (the mean over the micro-batches of the total loss) against float64 central
    differences at the largest and two random entries of each MoE tensor and qkvw (tolerance 1e-3 relative plus
    1e-4 of the tensor's largest gradient, check_gradients_against_numpy's; step 1e-5, no choice may flip)."""
    prefix = os.path.join(tmp, "ds")
    cfg = dict(C=32, NH=4, NKV=2, eps=float(np.float32(1e-5)), theta=10000.0, E=8, k=3, L=2, S=2, V=263, Vp=384,
               seq_alpha=0.001, scale=2.5, groups=4, limit=2)
    shapes = routing_options_file_tensors(dict(C=32, L=2, Lm=2, E=8, H=16, S=2, Hs=24, NH=4, NKV=2, Vp=384))
    data = open(prefix + "_model.bin", "rb").read()
    count = sum(int(np.prod(s)) for _, s in shapes)
    flat = np.frombuffer(data[HEADER_BYTES : HEADER_BYTES + 4 * count], dtype="<f4").astype(np.float64)
    biases = np.frombuffer(data[HEADER_BYTES + 4 * count :], dtype="<f4").reshape(2, 8).astype(np.float64)
    state = open(prefix + "_debug_state.bin", "rb").read()
    B_, T_ = 4, 9
    ints = np.frombuffer(state[HEADER_BYTES : HEADER_BYTES + 8 * B_ * T_], dtype="<i4")
    x, y = ints[: B_ * T_].reshape(B_, T_), ints[B_ * T_ :].reshape(B_, T_)
    f = np.frombuffer(state[HEADER_BYTES + 8 * B_ * T_ :], dtype="<f4")
    logits = f[: B_ * T_ * 263].reshape(B_, T_, 263)
    losses = f[B_ * T_ * 263 : B_ * T_ * 263 + 4]
    counts = np.frombuffer(state[HEADER_BYTES + 8 * B_ * T_ + 4 * (B_ * T_ * 263 + 4) :], dtype="<i4")[:18]
    grads = f[B_ * T_ * 263 + 4 + 18 : B_ * T_ * 263 + 4 + 18 + count]

    def forward(vector):
        P, _ = test_reference.split(vector, [(n, s) for n, s in shapes])
        return np_llama_moe_forward(P, biases, x, y, cfg, 2)

    ref = forward(flat)
    err = np.abs(ref[0] - logits).max()
    check(err < 1e-5, f"DeepSeek-shape logits match the numpy forward (max error {err:.2e}, tolerance 1e-5)")
    for name, mine, theirs in zip(("CE", "aux", "z", "seq"), ref[1:5], losses):
        check(math.isclose(mine, theirs, rel_tol=1e-5), f"DeepSeek-shape {name} loss {theirs} vs numpy {mine}")
    check(all(np.array_equal(counts.reshape(2, 9)[m, 1:], ref[6][m]) for m in range(2)), "DeepSeek-shape counts")
    _, ranges = test_reference.split(flat, [(n, s) for n, s in shapes])
    rng = np.random.default_rng(0)
    for name in ("qkvw", "routerw", "expert_fcw", "expert_fcprojw", "shared_fcw", "shared_fcprojw"):
        start, end = ranges[name]
        g = grads[start:end]
        for i in [int(np.abs(g).argmax())] + list(rng.integers(0, end - start, 2)):
            values = []
            for sign in (1, -1):
                moved = flat.copy()
                moved[start + i] += sign * 1e-5
                out = forward(moved)
                check(all(np.array_equal(a, b) for a, b in zip(out[6], ref[6])), f"{name}[{i}] keeps the counts")
                values.append(out[5])
            fd = (values[0] - values[1]) / 2e-5
            check(abs(fd - g[i]) <= 1e-3 * abs(fd) + 1e-4 * np.abs(g).max(),
                  f"DeepSeek-shape d{name}[{i}]: {g[i]} vs central difference {fd}")


def test_routing_options_bad_input(tmp):
    out = os.path.join(tmp, "bad15")
    base = ["--write-reference", out]
    fails_with(base + ["--bias-gamma", "0.001"], "sigmoid", "--bias-gamma with softmax")
    fails_with(base + ["--device-limit", "1"], "--ep-groups", "--device-limit without --ep-groups")
    fails_with(base + ["--device-limit", "1", "--ep-groups", "3"], "divide", "--ep-groups not dividing E")
    fails_with(base + ["--topk", "3", "--device-limit", "1", "--ep-groups", "2"], "fewer", "limit below top-k")
    fails_with(base + ["--micro-batches", "2"], "divide", "--micro-batches not dividing B")
    fails_with(base + ["--shared-hidden", "8"], "--shared-experts", "--shared-hidden alone")
    fails_with(base + ["--score", "sigmoid", "--noisy-topk", "1", "--topk", "2"], "noisy", "noisy with sigmoid")
    fails_with(base + ["--routed-scale", "0"], "routed scale", "--routed-scale 0")
    fails_with(base + ["--bias-gamma", "-1", "--score", "sigmoid"], "--bias-gamma", "negative gamma")
    source = open(os.path.join(tmp, "ds_model.bin"), "rb").read()
    for label, word, value, needle in (("revision 3", 24, 3, "revision"), ("score 2", 27, 2, "score"),
                                       ("expert groups in revision 1", 31, 2, "non-zero words"),
                                       ("bias word 2", 29, 2, "bias"), ("no bias: payload", 29, 0, "payload"),
                                       ("shared without hidden", 26, 0, "shared"), ("family 2", 16, 2, "family"),
                                       ("routed scale -1", 28, -1082130432, "routed scale")):
        bad = bytearray(source)
        bad[4 * word : 4 * word + 4] = value.to_bytes(4, "little", signed=True)
        path = os.path.join(tmp, "bad15_model.bin")
        open(path, "wb").write(bad)
        fails_with(base + ["--model-from-file", path], needle, f"routing options file: {label}")
    message, _ = run_main(train_moe, ["--write-reference", out, "--steps", "0"])
    plain = bytearray(open(out + "_model.bin", "rb").read())
    plain[4 * 25 : 4 * 26] = (1).to_bytes(4, "little")
    open(path, "wb").write(plain)
    fails_with(base + ["--model-from-file", path], "header[24] = 0", "word 25 set without the revision")


# ----------------------------------------------------------------------------------------------------------
# Fine-tuning (--ft, train_gpt.py's methods on the MoE model)


def test_fine_tuning(tmp):
    """--ft prompt: the debug state is the MoE one with word 40 = 3 (prompt) and the prompt's gradient (P, C) in place
    of the model's; the MoE layers route the P + T tokens of every sequence; the steps move the prompt only, every base
    parameter (routers and experts included) and the balancing biases staying bit for bit; a bias step and LoRA's fc
    on a model without a dense MLP are refused. LoRA on the experts: the adapter's tensors, and an adapted expert's
    output against its tensors."""
    P, steps = 3, 3
    prefix = os.path.join(tmp, "ft_prompt")
    message, _ = run_main(train_moe, reference_args(prefix, ["--ft", "prompt", "--ft-rank", str(P), "--steps",
                                                             str(steps)]))
    check(message is None, f"--ft prompt runs: {message}")
    data = open(prefix + "_debug_state.bin", "rb").read()
    expected = moe_state_header(2, 1.25, shape=(B, T, steps, V, VP))
    expected[40] = 3
    check(np.array_equal(read_header(data), expected), "--ft prompt debug state header: the MoE words and word 40 = 3")
    Lm = len(DEFAULT.moe_layers)
    check(len(data) == HEADER_BYTES + 4 * (2 * B * T + B * T * V + 3 + Lm * (1 + E) + P * C + steps),
          f"--ft prompt debug state size {len(data)}: the prompt's {P * C} gradients instead of the model's")
    s = read_debug_state(data, DEFAULT)
    check(all(int(c.sum()) == B * (P + T) for c in s["counts"]),
          f"the MoE layers route the P + T = {P + T} tokens of each sequence: counts {s['counts']}")
    floats = np.frombuffer(data, dtype="<f4", offset=HEADER_BYTES)
    step_losses = floats[len(floats) - steps :]
    check(step_losses[0] == np.float32(s["ce"]) and len(set(step_losses.tolist())) == steps,
          f"--ft prompt step losses start at the CE and change: {step_losses}")

    # the steps on a model with balancing biases (sigmoid scores), which route but must not move
    biased = train_moe.model_for_run(train_moe.parse_args(reference_args(prefix, ["--score", "sigmoid", "--topk", "2",
                                                                                  "--bias-gamma", "0.001"])))
    args = train_moe.parse_args(reference_args(prefix, ["--score", "sigmoid", "--topk", "2", "--ft", "prompt",
                                                        "--ft-rank", str(P), "--steps", str(steps)]))
    train_gpt.adapter_for_run(biased, args, train_gpt.REFERENCE_B_STD)
    base, biases, prompt = train_moe.flat_parameters(biased), biased.balance_biases(), biased.prompt.detach().clone()
    check(train_gpt.trainable_parameters(biased) == [biased.prompt], "--ft prompt: the prompt is all that trains")
    x, y = train_gpt.reference_batch(args, biased.config)
    moe_steps = train_moe.MoESteps(train_moe.routing_settings(args), 1, args.bias_gamma)
    train_gpt.reference_step_losses(biased, args, "cpu", x, y, moe_steps, moe_steps.after_step)
    check(np.array_equal(base, train_moe.flat_parameters(biased)),
          "--ft prompt: every base parameter, routers and experts included, unchanged after the steps")
    check(biases.any() and np.array_equal(biases, biased.balance_biases()),
          "--ft prompt: the balancing biases unchanged after the steps")
    check(not torch.equal(prompt, biased.prompt.detach()), "--ft prompt: the steps move the prompt")

    out = os.path.join(tmp, "ft_bad")
    fails_with(["--write-reference", out, "--score", "sigmoid", "--bias-gamma", "0.001", "--ft", "prompt"],
               "--bias-gamma", "--ft with a balancing-bias step")
    fails_with(["--write-reference", out, "--moe-every", "1", "--ft", "lora", "--ft-targets", "qkv,fc"], "no fc",
               "--ft-targets fc with every layer MoE")

    # LoRA on the experts (--ft-targets experts): every routed expert's two Linears get a pair, in adapter order every
    # expert of every MoE layer; an adapted expert's output against its tensors in numpy float64
    r, alpha = 8, 12.0
    lora = train_moe.model_for_run(train_moe.parse_args(reference_args(prefix)))
    args = train_moe.parse_args(reference_args(prefix, ["--ft", "lora", "--ft-rank", str(r), "--ft-alpha", str(alpha),
                                                        "--ft-targets", "proj,experts"]))
    train_gpt.adapter_for_run(lora, args, train_gpt.REFERENCE_B_STD)
    order = train_gpt.adapter_in_file_order(lora)
    shapes = [(name, len(ps), tuple(ps[0].shape)) for name, ps in order]
    expected = [("proj_A", L, (r, C)), ("proj_B", L, (C, r)), ("experts.fc_A", Lm * E, (r, C)),
                ("experts.fc_B", Lm * E, (H, r)), ("experts.fc_proj_A", Lm * E, (r, H)),
                ("experts.fc_proj_B", Lm * E, (C, r))]
    check(shapes == expected, f"--ft-targets proj,experts: the adapter's tensors {shapes}, expected {expected}")
    expert = lora.h[DEFAULT.moe_layers[-1]].moe.experts[E - 1]
    x = np.random.default_rng(5).standard_normal((5, C))
    with torch.no_grad():
        got = expert(torch.tensor(x, dtype=torch.float32)).double().numpy()
    t = {name: p.detach().double().numpy() for name, p in expert.named_parameters()}
    s = alpha / r
    hidden = np_gelu_tanh(x @ t["c_fc.weight"].T + t["c_fc.bias"] + s * (x @ t["c_fc.lora_A"].T) @ t["c_fc.lora_B"].T)
    want = (hidden @ t["c_proj.weight"].T + t["c_proj.bias"] +
            s * (hidden @ t["c_proj.lora_A"].T) @ t["c_proj.lora_B"].T)
    # fp32 products of width C = 48 and H = 96 against float64: 1e-5 of outputs of order 1
    check(np.abs(t["c_fc.lora_B"]).max() > 0 and np.allclose(got, want, rtol=1e-4, atol=1e-5),
          f"an expert with LoRA against float64: max difference {np.abs(got - want).max():.2e}")


def main():
    os.chdir(REPO)
    with tempfile.TemporaryDirectory(prefix="test_reference_moe_") as tmp:
        prefix, mixed = test_files(tmp)
        test_autograd_float64()
        test_routing()
        test_dense_equivalence(tmp)
        test_drops(tmp)
        test_training(prefix, mixed)
        test_bf16_and_model_from_file(prefix, tmp)
        test_train_mode(prefix, tmp)
        test_bad_input(prefix, tmp)
        test_noise_generator()
        test_noisy_routing()
        test_autograd_noise_float64()
        noisy_prefix = test_noise_files(tmp)
        test_train_mode_noisy(noisy_prefix, tmp)
        test_noise_bad_input(noisy_prefix, tmp)
        test_routing_options()
        test_bias_update()
        test_global_aux_micro_batches()
        test_llama_moe_is_llama()
        test_routing_options_files(tmp)
        test_deepseek_forward_and_gradients(tmp)
        test_routing_options_bad_input(tmp)
        test_fine_tuning(tmp)
    print(f"test_reference_moe: {test_reference.passed} passed, {test_reference.failed} failed")
    sys.exit(1 if test_reference.failed else 0)


if __name__ == "__main__":
    main()
