"""
dev/test/test_reference.py: checks the PyTorch reference train_gpt.py against things it did not compute itself:
the file formats as doc/formats.md states them, independent float64 numpy forwards of GPT-2 and of the
Llama-style model (--arch llama, from doc/kernels.md and doc/attention.md), central finite differences,
hand-worked bf16 roundings, and an AdamW written out from its formula.
Run from the repository root: /usr/bin/python3 dev/test/test_reference.py
Prints one line per failed check and ends with "test_reference: N passed, N failed" (exit 1 on a failure).
"""

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "2")  # as train_gpt.py sets them, before torch starts
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib
import io
import math
import re
import subprocess
import tempfile

import numpy as np
import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, REPO)
import train_gpt  # noqa: E402  (after the path and thread settings)

passed = 0
failed = 0


def check(condition, label):
    global passed, failed
    if condition:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {label}")


def run_main(module, argv):
    """Runs module.main (train_gpt's, or train_moe's for test_reference_moe.py) in this process; returns (exit
    message or None, stdout)."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            module.main(argv)
    except SystemExit as e:
        return str(e.code), out.getvalue()
    return None, out.getvalue()


def fails_with(argv, needle, label):
    """A bad input must end the run with one line naming the problem."""
    message, _ = run_main(train_gpt, argv)
    check(message is not None and "\n" not in message and needle in message, f"{label}: got {message!r}")


# ----------------------------------------------------------------------------------------------------------
# The formats, written out from doc/formats.md (not taken from train_gpt.py)

HEADER_BYTES = 1024
B, T, V, L, NH, C, MAXT, STEPS = 3, 23, 263, 2, 3, 48, 32, 10
VP = 384  # 263 rounded up to a multiple of 128


def model_shapes(maxT, Vp, L, C):
    return [
        ("wte", (Vp, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)), ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


SHAPES = model_shapes(MAXT, VP, L, C)
NPARAMS = sum(math.prod(s) for _, s in SHAPES)
DECAYED = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
# where each file tensor lives in the PyTorch model (per-layer ones under h.<l>.)
TORCH_NAME = {
    "wte": "wte.weight", "wpe": "wpe.weight", "ln1w": "ln_1.weight", "ln1b": "ln_1.bias",
    "qkvw": "attn.c_attn.weight", "qkvb": "attn.c_attn.bias", "attprojw": "attn.c_proj.weight",
    "attprojb": "attn.c_proj.bias", "ln2w": "ln_2.weight", "ln2b": "ln_2.bias", "fcw": "mlp.c_fc.weight",
    "fcb": "mlp.c_fc.bias", "fcprojw": "mlp.c_proj.weight", "fcprojb": "mlp.c_proj.bias",
    "lnfw": "ln_f.weight", "lnfb": "ln_f.bias",
}


def split(flat, shapes=SHAPES):
    """Flat payload -> {name: array view of the file's shape}, plus each name's (start, end) offsets."""
    tensors, ranges, offset = {}, {}, 0
    for name, shape in shapes:
        n = math.prod(shape)
        tensors[name] = flat[offset : offset + n].reshape(shape)
        ranges[name] = (offset, offset + n)
        offset += n
    return tensors, ranges


def read_header(data):
    return np.frombuffer(data[:HEADER_BYTES], dtype="<i4")


def debug_state_header(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, seed=1337,
                       words=(), shape=(B, T, STEPS, V, VP)):
    """The 256 header words doc/formats.md's table gives a debug state of these settings; words: (index, value)
    pairs of the MoE words; shape: B, T, the steps, V, Vp."""
    h = np.zeros(256, dtype="<i4")
    h[:7] = [20240327, 3, *shape]
    h[12:18] = [fp32_word(value) for value in (lr, beta1, beta2, eps, weight_decay, grad_clip)]
    h[18] = seed
    for index, value in words:
        h[index] = value
    return h


def read_debug_state(data, nparams):
    h = read_header(data)
    b, t, v = int(h[2]), int(h[3]), int(h[5])
    f = np.frombuffer(data[HEADER_BYTES:], dtype="<f4")  # x and y are int32: reinterpret them below
    ints = np.frombuffer(data[HEADER_BYTES : HEADER_BYTES + 8 * b * t], dtype="<i4")
    offset = 2 * b * t
    logits = f[offset : offset + b * t * v].reshape(b, t, v)
    offset += b * t * v
    loss = f[offset]
    grads = f[offset + 1 : offset + 1 + nparams]
    step_losses = f[offset + 1 + nparams :]
    return ints[: b * t].reshape(b, t), ints[b * t :].reshape(b, t), logits, loss, grads, step_losses


# ----------------------------------------------------------------------------------------------------------
# An independent GPT-2 forward in float64 numpy, straight from the definition


def np_layernorm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-5) * w + b


def np_gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def np_forward(flat, x, y, shapes=SHAPES, nh=NH, v=V):
    """(logits (B, T, V), mean cross-entropy) of the model whose file payload is flat."""
    P, _ = split(np.asarray(flat, dtype=np.float64), shapes)
    b, t = x.shape
    c = P["wte"].shape[1]
    hs = c // nh
    h = P["wte"][x] + P["wpe"][:t]
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    for l in range(P["ln1w"].shape[0]):
        qkv = np_layernorm(h, P["ln1w"][l], P["ln1b"][l]) @ P["qkvw"][l].T + P["qkvb"][l]
        q, k, vv = (qkv[..., i * c : (i + 1) * c].reshape(b, t, nh, hs).transpose(0, 2, 1, 3) for i in range(3))
        scores = np.where(future, -np.inf, q @ k.transpose(0, 1, 3, 2) / math.sqrt(hs))
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ vv).transpose(0, 2, 1, 3).reshape(b, t, c)
        h = h + attn @ P["attprojw"][l].T + P["attprojb"][l]
        hidden = np_gelu_tanh(np_layernorm(h, P["ln2w"][l], P["ln2b"][l]) @ P["fcw"][l].T + P["fcb"][l])
        h = h + hidden @ P["fcprojw"][l].T + P["fcprojb"][l]
    logits = np_layernorm(h, P["lnfw"], P["lnfb"]) @ P["wte"][:v].T
    return logits, np_cross_entropy(logits, y)


def np_cross_entropy(logits, y):
    """Mean over positions of logsumexp(logits) - logits[target]."""
    top = logits.max(-1, keepdims=True)
    logsumexp = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    return float((logsumexp - np.take_along_axis(logits, y[..., None], -1)[..., 0]).mean())


# ----------------------------------------------------------------------------------------------------------


def test_files(tmp):
    """(a) sizes, headers and contents of every file the reference writes."""
    prefix = os.path.join(tmp, "gpt")
    # the exact command line of the brief, as a real process
    cmd = [sys.executable, "train_gpt.py", "--write-reference", prefix, "--B", "3", "--T", "23", "--V", "263",
           "--L", "2", "--NH", "3", "--C", "48", "--maxT", "32", "--seed", "1337", "--dtype", "float32",
           "--steps", "10"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    check(proc.returncode == 0, f"--write-reference exits 0 (stderr: {proc.stderr.strip()})")
    message, _ = run_main(train_gpt, ["--write-reference", prefix + "_bf16", "--dtype", "bfloat16"])
    check(message is None, f"--write-reference --dtype bfloat16 runs: {message}")

    model_data = open(prefix + "_model.bin", "rb").read()
    check(len(model_data) == HEADER_BYTES + 4 * NPARAMS, f"fp32 model file size {len(model_data)}")
    check(list(read_header(model_data)[:8]) == [20240326, 3, MAXT, V, L, NH, C, VP], "fp32 model header")
    check(not read_header(model_data)[8:].any(), "fp32 model header: unused fields are zero")
    bf16_data = open(prefix + "_bf16_model.bin", "rb").read()
    check(len(bf16_data) == HEADER_BYTES + 2 * NPARAMS, f"bf16 model file size {len(bf16_data)}")
    check(list(read_header(bf16_data)[:8]) == [20240326, 5, MAXT, V, L, NH, C, VP], "bf16 model header")

    state_data = open(prefix + "_debug_state.bin", "rb").read()
    expected = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 1 + NPARAMS + STEPS)
    check(len(state_data) == expected, f"debug state size {len(state_data)}, expected {expected}")
    check(np.array_equal(read_header(state_data), debug_state_header()), "debug state header")

    # the file's tensors are the model's, in the documented order and (out, in) layout
    flat = np.frombuffer(model_data[HEADER_BYTES:], dtype="<f4")
    P, ranges = split(flat)
    args = train_gpt.parse_args(["--write-reference", prefix])
    model = train_gpt.model_for_run(args)
    params = dict(model.named_parameters())
    for name, shape in SHAPES:
        if name not in ("wte", "wpe", "lnfw", "lnfb"):  # per-layer: stacked (L, ...)
            layers = [params[f"h.{l}.{TORCH_NAME[name]}"].detach().numpy() for l in range(L)]
            same = all(np.array_equal(P[name][l], layers[l]) for l in range(L))
        else:
            same = np.array_equal(P[name], params[TORCH_NAME[name]].detach().numpy())
        check(same, f"model file tensor {name} equals the model's {TORCH_NAME[name]}")
    check(not P["wte"][V:].any(), "padded wte rows are zero")
    # GPT-2's init: std 0.02, the projections into the residual 0.02/sqrt(2L); 10% covers the sampling error
    for name, std in (("wte", 0.02), ("wpe", 0.02), ("qkvw", 0.02), ("fcw", 0.02),
                      ("attprojw", 0.02 / math.sqrt(2 * L)), ("fcprojw", 0.02 / math.sqrt(2 * L))):
        sample = P[name][:V] if name == "wte" else P[name]
        check(abs(sample.std() / std - 1) < 0.1 and abs(sample.mean()) < 0.1 * std,
              f"{name} init std {sample.std():.5f}, expected {std:.5f}")
    for name in ("ln1w", "ln1b", "qkvb", "attprojb", "ln2b", "fcb", "fcprojb", "lnfw", "lnfb"):
        base = 1.0 if name.endswith("w") else 0.0
        check(np.abs(P[name] - base).min() > 0 and np.abs(P[name] - base).max() > 0.01, f"{name} is perturbed")
    reloaded = train_gpt.read_model_file(prefix + "_model.bin")
    check(all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters()),
          "model file reads back to the same tensors")

    # the debug state: batch, logits and loss against the independent forward, gradients against finite differences
    x, y, logits, loss, grads, step_losses = read_debug_state(state_data, NPARAMS)
    check(x.min() >= 0 and x.max() < V and y.min() >= 0 and y.max() < V and len(np.unique(x)) > 10, "tokens in [0, V)")
    ref_logits, ref_loss = np_forward(flat, x, y)
    err = np.abs(ref_logits - logits).max()
    check(err < 1e-5, f"logits match the numpy forward (max error {err:.2e}, tolerance 1e-5)")
    check(abs(ref_loss - loss) < 1e-5, f"loss {loss} matches the numpy forward {ref_loss} (tolerance 1e-5)")
    check_gradients_against_numpy(flat, x, y, grads)

    # negative controls: the comparisons above see a [q|k|v] order change and a dropped bias (at this init the
    # attention is nearly uniform, so a q/k swap moves the logits by only ~5e-4: still 50x the tolerance)
    swapped = split(flat.copy())[0]
    q_rows = swapped["qkvw"][:, :C].copy()
    swapped["qkvw"][:, :C] = swapped["qkvw"][:, C : 2 * C]
    swapped["qkvw"][:, C : 2 * C] = q_rows
    swapped_flat = np.concatenate([swapped[n].reshape(-1) for n, _ in SHAPES])
    check(np.abs(np_forward(swapped_flat, x, y)[0] - logits).max() > 1e-4, "control: q/k swap changes the logits")
    no_bias = flat.copy()
    no_bias[slice(*ranges["attprojb"])] = 0
    check(np.abs(np_forward(no_bias, x, y)[0] - logits).max() > 1e-3, "control: dropping attprojb changes the logits")
    return prefix, flat, x, y, loss, step_losses


def check_gradients_against_numpy(flat, x, y, grads, shapes=SHAPES, forward=np_forward):
    """(b) The debug state's fp32 gradients against float64 central differences of the numpy forward (GPT-2's, or
    the llama one with its shapes), at the largest-gradient entry and two random entries of every tensor.
    Tolerance: 1e-3 relative plus 1e-4 of the tensor's largest gradient (fp32 accumulation error; the
    differences themselves are exact to ~1e-9)."""
    _, ranges = split(flat, shapes)
    rng = np.random.default_rng(0)
    base = flat.astype(np.float64)
    step = 1e-5
    padded = ("wte", "lm_head")  # Vp rows, of which the V real ones have a gradient to check here
    for name, (start, end) in ranges.items():
        g = grads[start:end]
        stop = start + V * (end - start) // VP if name in padded else end
        entries = [start + int(np.abs(g[: stop - start]).argmax())] + list(rng.integers(start, stop, 2))
        for i in entries:
            plus, minus = base.copy(), base.copy()
            plus[i] += step
            minus[i] -= step
            fd = (forward(plus, x, y)[1] - forward(minus, x, y)[1]) / (2 * step)
            tolerance = 1e-3 * abs(fd) + 1e-4 * np.abs(g).max()
            check(abs(grads[i] - fd) <= tolerance,
                  f"debug-state gradient {name}[{i - start}] = {grads[i]:.6e}, finite difference {fd:.6e}")
    for name in padded:
        if name in ranges:
            start, end = ranges[name]
            check(not grads[start + V * (end - start) // VP : end].any(), f"gradient of the padded {name} rows is zero")


def test_forward_float64():
    """The model's float64 forward against the numpy one on random parameters of std 0.5: at this scale the
    activations are O(1), so an activation variant (exact GELU instead of tanh: up to 5e-4), another LayerNorm
    eps or a layout slip shows far above the float64 tolerance of 1e-9."""
    config = train_gpt.GPTConfig(maxT=8, V=37, L=2, NH=2, C=16)
    shapes = model_shapes(config.maxT, config.Vp, config.L, config.C)
    flat = np.random.default_rng(2).normal(0.0, 0.5, sum(math.prod(s) for _, s in shapes))
    model = train_gpt.GPT(config).double()
    train_gpt.load_flat_parameters(model, flat)
    x = np.random.default_rng(3).integers(0, config.V, (2, 7))
    y = np.random.default_rng(4).integers(0, config.V, (2, 7))
    logits, loss = model(torch.from_numpy(x), torch.from_numpy(y))
    ref_logits, ref_loss = np_forward(flat, x, y, shapes, nh=config.NH, v=config.V)
    err = np.abs(logits.detach().numpy() - ref_logits).max()
    check(err < 1e-9 and abs(loss.item() - ref_loss) < 1e-9,
          f"float64 forward = numpy forward at std 0.5 (error {err:.2e})")


def test_autograd_float64():
    """(b) The model's autograd gradients in float64 against central finite differences of the same model,
    for three entries of every parameter of a tiny model. Tolerance: 1e-6 relative plus 1e-9 absolute
    (float64 differences with step 1e-6: error ~1e-10)."""
    model = train_gpt.GPT(train_gpt.GPTConfig(maxT=8, V=37, L=2, NH=2, C=16))
    train_gpt.init_weights(model, torch.Generator().manual_seed(7))
    autograd_check(model.double(), "GPT-2")


def autograd_check(model, label):
    """A float64 model's autograd gradients against central finite differences of its loss, at the
    largest-gradient entry and two random entries of every parameter (padded embedding rows left out)."""
    config = model.config
    generator = torch.Generator().manual_seed(8)
    x = torch.randint(0, config.V, (2, 6), generator=generator)
    y = torch.randint(0, config.V, (2, 6), generator=generator)
    _, loss = model(x, y)
    loss.backward()
    rng = np.random.default_rng(1)
    step = 1e-6
    with torch.no_grad():
        for name, p in model.named_parameters():
            rows = config.V if name in ("wte.weight", "lm_head.weight") else p.shape[0]  # no token reaches padding
            flat_p, flat_g = p.view(-1), p.grad.view(-1)
            used = rows * (p.numel() // p.shape[0])
            for i in [int(flat_g[:used].abs().argmax())] + list(rng.integers(0, used, 2)):
                saved = flat_p[i].item()
                flat_p[i] = saved + step
                plus = model(x, y)[1].item()
                flat_p[i] = saved - step
                minus = model(x, y)[1].item()
                flat_p[i] = saved
                fd = (plus - minus) / (2 * step)
                check(abs(flat_g[i].item() - fd) <= 1e-6 * abs(fd) + 1e-9,
                      f"{label} float64 autograd {name}[{i}] = {flat_g[i].item():.9e}, finite difference {fd:.9e}")


def test_bf16(prefix, flat):
    """(c) bf16 rounding is round-to-nearest-even, checked on hand-worked bit patterns and against torch's cast."""
    cases = [  # float32 bits -> bf16 bits
        (0x3F800000, 0x3F80),  # 1.0 exactly
        (0x3F808000, 0x3F80),  # 1 + 2^-8: a tie, the even neighbour is below
        (0x3F818000, 0x3F82),  # 1 + 3*2^-8: a tie, the even neighbour is above
        (0x3F808001, 0x3F81),  # just above the half: up
        (0x3F807FFF, 0x3F80),  # just below the half: down
        (0xBF808000, 0xBF80),  # negative tie to even
        (0xC0490FDB, 0xC049),  # -pi
        (0x00008000, 0x0000),  # subnormal tie to even (zero)
        (0x00018000, 0x0002),  # subnormal tie to even (up)
        (0x7F7FFFFF, 0x7F80),  # the largest float rounds to infinity
        (0x7F800000, 0x7F80),  # infinity stays infinity
    ]
    values = np.array([c[0] for c in cases], dtype="<u4").view("<f4")
    got = train_gpt.bf16_bits(values)
    for (source, want), result in zip(cases, got):
        check(int(result) == want, f"bf16 of 0x{source:08X}: 0x{int(result):04X}, expected 0x{want:04X}")
    nan = train_gpt.bf16_bits(np.array([0x7F800001], dtype="<u4").view("<f4"))  # NaN with only low bits set
    check(np.isnan(train_gpt.bf16_to_float(nan))[0], "a NaN whose payload is in the low bits stays NaN")

    bf16_payload = np.frombuffer(open(prefix + "_bf16_model.bin", "rb").read()[HEADER_BYTES:], dtype="<u2")
    torch_bits = torch.from_numpy(flat.copy()).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    check(np.array_equal(bf16_payload, torch_bits), "bf16 model file = torch's bf16 cast of the fp32 parameters")
    # the bf16 reference is computed in fp32 from the rounded parameters
    x, y, logits, loss, _, _ = read_debug_state(open(prefix + "_bf16_debug_state.bin", "rb").read(), NPARAMS)
    widened = (bf16_payload.astype("<u4") << 16).view("<f4")
    ref_logits, ref_loss = np_forward(widened, x, y)
    check(np.abs(ref_logits - logits).max() < 1e-5 and abs(ref_loss - loss) < 1e-5,
          "bf16 debug state = fp32 forward of the rounded parameters (tolerance 1e-5)")


def test_init_loss(loss):
    """(d) A near-uniform prediction at init: loss ~ ln V."""
    config = train_gpt.GPTConfig(maxT=MAXT, V=V, L=L, NH=NH, C=C)
    model = train_gpt.GPT(config)
    train_gpt.init_weights(model, torch.Generator().manual_seed(3))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(1e-3)  # weights of std 2e-5: the logits are all ~0
    generator = torch.Generator().manual_seed(4)
    x = torch.randint(0, V, (B, T), generator=generator)
    tiny_loss = model(x, torch.randint(0, V, (B, T), generator=generator))[1].item()
    check(abs(tiny_loss - math.log(V)) < 1e-4,
          f"tiny-std init loss {tiny_loss:.6f} = ln V {math.log(V):.6f} (tolerance 1e-4)")
    check(abs(loss - math.log(V)) < 0.25, f"std-0.02 init loss {loss:.4f} within 0.25 of ln V")


def adamw_losses(flat, x, y, steps, grad_clip, model=None, shapes=SHAPES, decayed=DECAYED, lr=1e-3, wd=0.1,
                 beta1=0.9, beta2=0.95, eps=1e-8):
    """Losses of `steps` steps of AdamW written from its formula (clip the global norm, decoupled weight decay
    on the tensors named in `decayed`, bias-corrected moments), with the reference model (float64; default the
    tiny GPT-2) for forward and backward (its gradients are checked above). Runs in float64 over the file
    payload."""
    if model is None:
        model = train_gpt.GPT(train_gpt.GPTConfig(maxT=MAXT, V=V, L=L, NH=NH, C=C)).double()
    _, ranges = split(flat, shapes)
    decay = np.zeros(len(flat))
    for name in decayed & ranges.keys():
        decay[slice(*ranges[name])] = 1.0
    params = flat.astype(np.float64)
    m = np.zeros_like(params)
    v = np.zeros_like(params)
    losses = []
    xt, yt = torch.from_numpy(x.astype(np.int64)), torch.from_numpy(y.astype(np.int64))
    for t in range(1, steps + 1):
        train_gpt.load_flat_parameters(model, params)
        model.zero_grad(set_to_none=True)
        loss = model(xt, yt)[1]
        loss.backward()
        losses.append(loss.item())
        g = np.concatenate([p.grad.reshape(-1).numpy() for _, ps in train_gpt.params_in_file_order(model) for p in ps])
        norm = np.sqrt((g**2).sum())
        if grad_clip > 0 and norm > grad_clip:
            g = g * grad_clip / norm
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g**2
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        params = params - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * decay * params)
    return np.array(losses)


def test_training(prefix, flat, x, y, loss, step_losses, tmp):
    """(e) the 10 step losses: they decrease, and match AdamW written out (with and without active clipping)."""
    check(len(step_losses) == STEPS, f"{len(step_losses)} step losses")
    check(step_losses[0] == loss, "step 0's loss is the first forward's loss")
    check(bool(np.all(np.diff(step_losses) < 0)), f"step losses decrease: {step_losses}")
    check(step_losses[-1] < step_losses[0] - 0.2, "10 steps lower the loss by more than 0.2")
    err = np.abs(adamw_losses(flat, x, y, STEPS, 1.0) - step_losses).max()
    check(err < 1e-5, f"losses match the written-out AdamW (max error {err:.2e}, tolerance 1e-5)")
    # the default clip (1.0) is above this model's gradient norm (~0.9): rerun where clipping is active
    message, _ = run_main(train_gpt, ["--write-reference", os.path.join(tmp, "clip"), "--grad-clip", "0.3"])
    clip_state = open(os.path.join(tmp, "clip_debug_state.bin"), "rb").read()
    check(np.array_equal(read_header(clip_state), debug_state_header(grad_clip=0.3)), "--grad-clip 0.3: header word 17")
    clipped = read_debug_state(clip_state, NPARAMS)[5]
    err = np.abs(adamw_losses(flat, x, y, STEPS, 0.3) - clipped).max()
    check(message is None and err < 1e-5, f"--grad-clip 0.3 losses match the written-out AdamW (max error {err:.2e})")
    unclipped_err = np.abs(adamw_losses(flat, x, y, STEPS, 0.0) - clipped).max()
    check(unclipped_err > 1e-4, f"control: clipping changes the losses ({unclipped_err:.2e})")


def test_model_from_file(prefix, tmp):
    """(f) --model-from-file: a written model reads back and reproduces the same files, both versions."""
    for suffix, dtype in (("", "float32"), ("_bf16", "bfloat16")):
        again = os.path.join(tmp, "again" + suffix)
        message, _ = run_main(train_gpt, ["--write-reference", again, "--model-from-file", prefix + suffix + "_model.bin",
                               "--dtype", dtype, "--V", "999", "--L", "5"])  # the file's shape wins over flags
        check(message is None, f"--model-from-file {dtype}: {message}")
        for part in ("_model.bin", "_debug_state.bin"):
            same = open(prefix + suffix + part, "rb").read() == open(again + part, "rb").read()
            check(same, f"--model-from-file {dtype} reproduces {part} byte for byte")
    # a bf16 file written back as fp32 holds the exactly widened bf16 values
    widened = os.path.join(tmp, "widened")
    run_main(train_gpt, ["--write-reference", widened, "--model-from-file", prefix + "_bf16_model.bin", "--steps", "0"])
    bf16_payload = np.frombuffer(open(prefix + "_bf16_model.bin", "rb").read()[HEADER_BYTES:], dtype="<u2")
    fp32_payload = np.frombuffer(open(widened + "_model.bin", "rb").read()[HEADER_BYTES:], dtype="<f4")
    check(np.array_equal((bf16_payload.astype("<u4") << 16).view("<f4"), fp32_payload), "bf16 file widens exactly")


def test_data_files(prefix, tmp):
    """(a) shard and tokenizer files, and (3) the training mode's step lines on such a shard."""
    shard = os.path.join(tmp, "shard_000.bin")
    message, _ = run_main(train_gpt, ["--write-shard", shard, "--shard-tokens", "1000", "--V", "263", "--seed", "5"])
    data = open(shard, "rb").read()
    check(message is None and len(data) == HEADER_BYTES + 2 * 1000, f"shard size {len(data)}")
    check(list(read_header(data)[:3]) == [20240520, 1, 1000] and not read_header(data)[3:].any(), "shard header")
    tokens = np.frombuffer(data[HEADER_BYTES:], dtype="<u2")
    check(tokens.max() < 263 and len(np.unique(tokens)) > 200, "shard tokens are spread over [0, V)")
    run_main(train_gpt, ["--write-shard", shard + ".same", "--shard-tokens", "1000", "--V", "263", "--seed", "5"])
    check(open(shard + ".same", "rb").read() == data, "the same seed writes the same shard")

    tokenizer = os.path.join(tmp, "tokenizer.bin")
    message, _ = run_main(train_gpt, ["--write-tokenizer", tokenizer, "--V", "257"])
    data = open(tokenizer, "rb").read()
    check(message is None and len(data) == HEADER_BYTES + 256 * 2 + 1 + 13, f"tokenizer size {len(data)}")
    check(list(read_header(data)[:4]) == [20240328, 2, 257, 256], "tokenizer header")
    body = data[HEADER_BYTES:]
    check(all(body[2 * i] == 1 and body[2 * i + 1] == i for i in range(256)), "tokens 0..255 are the bytes")
    check(body[512] == 13 and body[513:] == b"<|endoftext|>", "token 256 is <|endoftext|>")

    message, out = run_main(train_gpt, ["--train", "--input-bin", os.path.join(tmp, "shard_*.bin"), "--B", "2", "--T", "16",
                             "--steps", "3", "--lr", "1e-3", "--model-from-file", prefix + "_model.bin"])
    lines = out.strip().splitlines()
    line = re.compile(r"^step \d+/3 \| loss \d+\.\d{6} \| norm \d+\.\d{6} \| lr 1\.000000e-03 \| "
                      r"\d+\.\d\d ms \| \d+ tok/s$")
    check(message is None and len(lines) == 3 and all(line.match(s) for s in lines), f"--train step lines: {lines}")


def test_bad_input(prefix, tmp):
    """Bad input: one clear line and a non-zero exit."""
    cmd = [sys.executable, "train_gpt.py", "--write-reference", os.path.join(tmp, "x"),
           "--model-from-file", os.path.join(tmp, "missing.bin")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    check(proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1 and "missing.bin" in proc.stderr,
          f"missing model file: rc {proc.returncode}, stderr {proc.stderr!r}")
    wrong_magic = os.path.join(tmp, "wrong_magic.bin")
    data = bytearray(open(prefix + "_model.bin", "rb").read())
    data[0:4] = (20240327).to_bytes(4, "little")
    open(wrong_magic, "wb").write(data)
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--model-from-file", wrong_magic], "magic", "wrong magic")
    truncated = os.path.join(tmp, "truncated.bin")
    open(truncated, "wb").write(open(prefix + "_model.bin", "rb").read()[:-4])
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--model-from-file", truncated], "payload",
               "truncated file")
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--bogus"], "--bogus", "unknown flag")
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--C", "50"], "--NH", "C not a multiple of NH")
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--T", "40"], "maxT", "T over maxT")
    fails_with(["--write-reference", os.path.join(tmp, "x"), "--seed", "-1"], "--seed", "a seed no int32 word holds")
    fails_with(["--write-tokenizer", os.path.join(tmp, "t.bin"), "--V", "300"], "257", "tokenizer V other than 257")
    fails_with(["--train"], "--input-bin", "--train without --input-bin")
    fails_with(["--train", "--input-bin", os.path.join(tmp, "nothing_*.bin")], "no data shard", "no shard matches")


# ----------------------------------------------------------------------------------------------------------
# The Llama-style model (--arch llama): its file written out from doc/formats.md, its forward from doc/kernels.md
# ("The Llama-style model", RMSNorm, SwiGLU) and doc/attention.md (packed qkv, grouped-query sharing, RoPE), in
# float64 numpy (not taken from train_gpt.py)

LLAMA_NH, LLAMA_C, LLAMA_NKV = 4, 64, 2
LLAMA_H = 192  # the default: floor(8 * 64 / 3) = 170, rounded up to a multiple of 64
LLAMA_ARGS = ["--B", "3", "--T", "23", "--V", "263", "--L", "2", "--NH", "4", "--C", "64", "--maxT", "32",
              "--seed", "1337", "--steps", "10", "--arch", "llama", "--kv-heads", "2"]
# the other configuration: one key/value head for the four query heads, tied, every llama flag off its default
LLAMA_TIED_ARGS = LLAMA_ARGS[:-1] + ["1", "--tie-embeddings", "1", "--rope-theta", "500000", "--norm-eps", "1e-6",
                                     "--ffn-hidden", "96"]
LLAMA_DECAYED = {"wte", "qkvw", "attprojw", "fcw", "fcprojw", "lm_head"}  # the matrices
LLAMA_TORCH_NAME = {
    "wte": "wte.weight", "ln1w": "ln_1.weight", "qkvw": "attn.c_attn.weight", "attprojw": "attn.c_proj.weight",
    "ln2w": "ln_2.weight", "fcw": "mlp.c_fc.weight", "fcprojw": "mlp.c_proj.weight", "lnfw": "ln_f.weight",
    "lm_head": "lm_head.weight",
}


def fp32_word(value):
    return int(np.array([value], dtype="<f4").view("<i4")[0])


def llama_config(h):
    """The model of a llama file's header (doc/formats.md) as a dict."""
    w = [int(v) for v in h[:22]]
    bits = np.array([w[18], w[20]], dtype="<i4").view("<f4")
    return dict(maxT=w[2], V=w[3], L=w[4], NH=w[5], C=w[6], Vp=w[7], NKV=w[17], theta=float(bits[0]), H=w[19],
                eps=float(bits[1]), tied=w[21] == 1)


def llama_shapes(cfg):
    C, HS, H, L, Vp = cfg["C"], cfg["C"] // cfg["NH"], cfg["H"], cfg["L"], cfg["Vp"]
    shapes = [("wte", (Vp, C)), ("ln1w", (L, C)), ("qkvw", (L, (cfg["NH"] + 2 * cfg["NKV"]) * HS, C)),
              ("attprojw", (L, C, C)), ("ln2w", (L, C)), ("fcw", (L, 2 * H, C)), ("fcprojw", (L, C, H)),
              ("lnfw", (C,))]
    return shapes if cfg["tied"] else shapes + [("lm_head", (Vp, C))]


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def np_rope_table(t, hs, theta):
    """doc/attention.md: angle t * theta^(-2i/HS) in float64; cos and sin rounded once to fp32. (t, hs/2)"""
    angle = np.arange(t, dtype=np.float64)[:, None] * theta ** (-np.arange(0, hs, 2, dtype=np.float64) / hs)
    return np.cos(angle).astype(np.float32).astype(np.float64), np.sin(angle).astype(np.float32).astype(np.float64)


def np_rope(x, cos, sin, pairing):
    """x (b, nh, t, hs). "half": element i pairs with i + hs/2 (the definition); "interleaved": with its
    neighbour (2i, 2i+1), RoFormer's convention, which the negative controls use."""
    out = np.empty_like(x)
    half = x.shape[-1] // 2
    lo_index = np.arange(half) if pairing == "half" else np.arange(0, 2 * half, 2)
    hi_index = lo_index + half if pairing == "half" else lo_index + 1
    lo, hi = x[..., lo_index], x[..., hi_index]
    out[..., lo_index] = lo * cos - hi * sin
    out[..., hi_index] = hi * cos + lo * sin
    return out


def np_cross_entropy(logits, y):
    top = logits.max(-1, keepdims=True)
    logsumexp = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    return float((logsumexp - np.take_along_axis(logits, y[..., None], -1)[..., 0]).mean())


def np_llama_forward(flat, x, y, cfg, pairing="half", kv_of_head=None):
    """(logits (B, T, V), mean cross-entropy) of the llama model whose file payload is flat. kv_of_head(h, NH, NKV)
    overrides grouped-query sharing's h // (NH / NKV) (for the negative controls)."""
    P, _ = split(np.asarray(flat, dtype=np.float64), llama_shapes(cfg))
    b, t = x.shape
    C, NH, NKV, H, eps = cfg["C"], cfg["NH"], cfg["NKV"], cfg["H"], cfg["eps"]
    HS = C // NH
    cos, sin = np_rope_table(t, HS, cfg["theta"])
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    h = P["wte"][x]
    for l in range(cfg["L"]):
        qkv = np_rmsnorm(h, P["ln1w"][l], eps) @ P["qkvw"][l].T  # (b, t, (NH + 2 NKV) HS)
        heads = lambda start, n: qkv[..., start * HS : (start + n) * HS].reshape(b, t, n, HS).transpose(0, 2, 1, 3)
        q, k, v = heads(0, NH), heads(NH, NKV), heads(NH + NKV, NKV)
        q, k = np_rope(q, cos, sin, pairing), np_rope(k, cos, sin, pairing)
        out = np.empty_like(q)
        for head in range(NH):
            j = kv_of_head(head, NH, NKV) if kv_of_head else head // (NH // NKV)
            scores = np.where(future, -np.inf, q[:, head] @ k[:, j].transpose(0, 2, 1) / math.sqrt(HS))
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = probs / probs.sum(-1, keepdims=True) @ v[:, j]
        h = h + out.transpose(0, 2, 1, 3).reshape(b, t, C) @ P["attprojw"][l].T
        fc = np_rmsnorm(h, P["ln2w"][l], eps) @ P["fcw"][l].T  # (b, t, 2H): [gate | up]
        gate, up = fc[..., :H], fc[..., H:]
        h = h + (gate / (1.0 + np.exp(-gate)) * up) @ P["fcprojw"][l].T
    out_embedding = P["wte"] if cfg["tied"] else P["lm_head"]
    logits = np_rmsnorm(h, P["lnfw"], eps) @ out_embedding[: cfg["V"]].T
    return logits, np_cross_entropy(logits, y)


def swap_gate_up(flat, cfg):
    """The payload with fc's gate and up rows exchanged (a negative control)."""
    P, _ = split(flat.copy(), llama_shapes(cfg))
    H = cfg["H"]
    P["fcw"][:] = np.concatenate([P["fcw"][:, H:], P["fcw"][:, :H]], axis=1)
    return np.concatenate([P[n].reshape(-1) for n, _ in llama_shapes(cfg)])


def test_llama_files(tmp):
    """(a) the llama files: headers and sizes, tensors in the documented order, the init, and the debug state's
    logits, loss and gradients against the numpy forward, in two configurations (GQA untied; one key/value head,
    tied, every llama flag off its default)."""
    prefix = os.path.join(tmp, "llama")
    cmd = [sys.executable, "train_gpt.py", "--write-reference", prefix] + LLAMA_ARGS + ["--dtype", "float32"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    check(proc.returncode == 0, f"--arch llama --write-reference exits 0 (stderr: {proc.stderr.strip()})")
    message, _ = run_main(train_gpt, ["--write-reference", prefix + "_tied"] + LLAMA_TIED_ARGS)
    check(message is None, f"--arch llama --tie-embeddings 1 runs: {message}")

    results = {}
    for label, args, nkv, theta, H, eps, tied in (("", LLAMA_ARGS, 2, 10000.0, LLAMA_H, 1e-5, 0),
                                                  ("_tied", LLAMA_TIED_ARGS, 1, 500000.0, 96, 1e-6, 1)):
        what = f"llama{label}"
        model_data = open(prefix + label + "_model.bin", "rb").read()
        h = read_header(model_data)
        want = [20240326, 3, MAXT, V, L, LLAMA_NH, LLAMA_C, VP] + [0] * 8 + [1, nkv, fp32_word(theta), H,
                                                                           fp32_word(eps), tied]
        check(list(h[:22]) == want and not h[22:].any(), f"{what} model header {list(h[:22])}, expected {want}")
        cfg = llama_config(h)
        shapes = llama_shapes(cfg)
        nparams = sum(math.prod(s) for _, s in shapes)
        check(len(model_data) == HEADER_BYTES + 4 * nparams, f"{what} model file size {len(model_data)}")
        state_data = open(prefix + label + "_debug_state.bin", "rb").read()
        expected = HEADER_BYTES + 4 * (2 * B * T + B * T * V + 1 + nparams + STEPS)
        check(len(state_data) == expected, f"{what} debug state size {len(state_data)}, expected {expected}")
        check(np.array_equal(read_header(state_data), debug_state_header()), f"{what} debug state header")

        # the file's tensors are a fresh model's of the same flags, in the documented order and (out, in) layout
        flat = np.frombuffer(model_data[HEADER_BYTES:], dtype="<f4")
        P, _ = split(flat, shapes)
        model = train_gpt.model_for_run(train_gpt.parse_args(["--write-reference", prefix] + args))
        params = dict(model.named_parameters())
        check(len(params) == 3 + 6 * L - tied, f"{what}: the model has the file's {3 + 6 * L - tied} parameters")
        for name, _ in shapes:
            if name in ("wte", "lnfw", "lm_head"):
                same = np.array_equal(P[name], params[LLAMA_TORCH_NAME[name]].detach().numpy())
            else:
                same = all(np.array_equal(P[name][l], params[f"h.{l}.{LLAMA_TORCH_NAME[name]}"].detach().numpy())
                           for l in range(L))
            check(same, f"{what} model file tensor {name} equals the model's {LLAMA_TORCH_NAME[name]}")
        # GPT-2's init (doc/kernels.md): 10% covers the sampling error of the smallest tensor (12288 values)
        residual = 0.02 / math.sqrt(2 * L)
        for name, std in (("wte", 0.02), ("qkvw", 0.02), ("fcw", 0.02), ("lm_head", 0.02),
                          ("attprojw", residual), ("fcprojw", residual)):
            if name in P:
                sample = P[name][:V] if name in ("wte", "lm_head") else P[name]
                check(abs(sample.std() / std - 1) < 0.1 and abs(sample.mean()) < 0.1 * std,
                      f"{what} {name} init std {sample.std():.5f}, expected {std:.5f}")
        for name in ("ln1w", "ln2w", "lnfw"):  # 1, perturbed with std 0.1
            check(np.abs(P[name] - 1).min() > 0 and 0.05 < np.abs(P[name] - 1).max() < 0.6, f"{what} {name} perturbed")
        for name in ("wte", "lm_head"):
            if name in P:
                check(not P[name][V:].any(), f"{what} padded {name} rows are zero")
        reloaded = train_gpt.read_model_file(prefix + label + "_model.bin")
        check(all(torch.equal(p, params[n]) for n, p in reloaded.named_parameters()),
              f"{what} model file reads back to the same tensors")

        x, y, logits, loss, grads, step_losses = read_debug_state(state_data, nparams)
        ref_logits, ref_loss = np_llama_forward(flat, x, y, cfg)
        err = np.abs(ref_logits - logits).max()
        check(err < 1e-5, f"{what} logits match the numpy forward (max error {err:.2e}, tolerance 1e-5)")
        check(abs(ref_loss - loss) < 1e-5, f"{what} loss {loss} matches the numpy forward {ref_loss} (tolerance 1e-5)")
        check(abs(loss - math.log(V)) < 0.25, f"{what} std-0.02 init loss {loss:.4f} within 0.25 of ln V")
        check_gradients_against_numpy(flat, x, y, grads, shapes, lambda f, a, b: np_llama_forward(f, a, b, cfg))
        # negative controls: gate and up exchanged, and key/value head h mod NKV instead of h / (NH/NKV)
        control = np.abs(np_llama_forward(swap_gate_up(flat, cfg), x, y, cfg)[0] - logits).max()
        check(control > 1e-4, f"control: {what} gate/up exchanged changes the logits by {control:.2e}")
        if nkv > 1:
            tiled = np_llama_forward(flat, x, y, cfg, kv_of_head=lambda h, nh, nkv: h % nkv)[0]
            check(np.abs(tiled - logits).max() > 1e-4, f"control: {what} kv head h mod NKV changes the logits")
        results[label] = (flat, x, y, loss, step_losses, cfg, shapes)
    return prefix, results


def test_llama_bf16_and_reload(prefix, results, tmp):
    """(c, f) the llama bf16 file is torch's bf16 cast of the fp32 one, its debug state the fp32 forward of the
    rounded parameters; --model-from-file reproduces every llama file byte for byte."""
    message, _ = run_main(train_gpt, ["--write-reference", prefix + "_bf16"] + LLAMA_ARGS + ["--dtype", "bfloat16"])
    check(message is None, f"--arch llama --dtype bfloat16 runs: {message}")
    flat, _, _, _, _, cfg, shapes = results[""]
    data = open(prefix + "_bf16_model.bin", "rb").read()
    check(list(read_header(data)[:2]) == [20240326, 5] and list(read_header(data)[16:22]) ==
          [1, 2, fp32_word(10000.0), LLAMA_H, fp32_word(1e-5), 0], "llama bf16 model header")
    bf16_payload = np.frombuffer(data[HEADER_BYTES:], dtype="<u2")
    torch_bits = torch.from_numpy(flat.copy()).to(torch.bfloat16).view(torch.int16).numpy().view("<u2")
    check(np.array_equal(bf16_payload, torch_bits), "llama bf16 model file = torch's bf16 cast of the fp32 parameters")
    nparams = sum(math.prod(s) for _, s in shapes)
    x, y, logits, loss, _, _ = read_debug_state(open(prefix + "_bf16_debug_state.bin", "rb").read(), nparams)
    ref_logits, ref_loss = np_llama_forward((bf16_payload.astype("<u4") << 16).view("<f4"), x, y, cfg)
    check(np.abs(ref_logits - logits).max() < 1e-5 and abs(ref_loss - loss) < 1e-5,
          "llama bf16 debug state = fp32 forward of the rounded parameters (tolerance 1e-5)")

    for suffix, dtype in (("", "float32"), ("_bf16", "bfloat16"), ("_tied", "float32")):
        again = os.path.join(tmp, "llama_again" + suffix)
        # no --arch: the file says llama
        message, _ = run_main(train_gpt, ["--write-reference", again, "--model-from-file",
                                          prefix + suffix + "_model.bin", "--dtype", dtype, "--seed", "1337"])
        check(message is None, f"llama --model-from-file {suffix or dtype}: {message}")
        for part in ("_model.bin", "_debug_state.bin"):
            same = open(prefix + suffix + part, "rb").read() == open(again + part, "rb").read()
            check(same, f"llama --model-from-file {suffix or dtype} reproduces {part} byte for byte")


def test_llama_training(prefix, results):
    """(e) the llama step losses decrease and match AdamW written out (weight decay on the matrices only)."""
    for label, (flat, x, y, loss, step_losses, cfg, shapes) in results.items():
        check(len(step_losses) == STEPS and step_losses[0] == loss, f"llama{label}: step 0's loss is the first loss")
        check(bool(np.all(np.diff(step_losses) < 0)) and step_losses[-1] < step_losses[0] - 0.2,
              f"llama{label} step losses decrease by more than 0.2: {step_losses}")
        model = train_gpt.read_model_file(prefix + label + "_model.bin").double()
        err = np.abs(adamw_losses(flat, x, y, STEPS, 1.0, model, shapes, LLAMA_DECAYED) - step_losses).max()
        check(err < 1e-5, f"llama{label} losses match the written-out AdamW (max error {err:.2e}, tolerance 1e-5)")


def tiny_llama(tied, theta=100.0):
    return train_gpt.Llama(train_gpt.LlamaConfig(maxT=8, V=37, L=2, NH=4, C=16, NKV=2, rope_theta=theta, H=24,
                                                 norm_eps=1e-5, tied=tied))


def test_llama_forward_float64():
    """The llama model's float64 forward against the numpy one on random parameters of std 0.5 (activations
    O(1)), tolerance 1e-9, untied and tied. theta 100 turns the second frequency by 0.1 rad per position (at
    10000 and HS = 4 it would be 0.01), so that a RoPE slip shows. Negative controls: RoFormer's interleaved
    pairs, key/value head h mod NKV, gate and up exchanged, and eps 1e-3 each move the logits far above 1e-9."""
    for tied in (False, True):
        model = tiny_llama(tied).double()
        c = model.config
        cfg = dict(maxT=c.maxT, V=c.V, L=c.L, NH=c.NH, C=c.C, Vp=c.Vp, NKV=c.NKV, theta=c.rope_theta, H=c.H,
                   eps=c.norm_eps, tied=tied)
        shapes = llama_shapes(cfg)
        flat = np.random.default_rng(2).normal(0.0, 0.5, sum(math.prod(s) for _, s in shapes))
        train_gpt.load_flat_parameters(model, flat)
        x = np.random.default_rng(3).integers(0, c.V, (2, 7))
        y = np.random.default_rng(4).integers(0, c.V, (2, 7))
        logits, loss = model(torch.from_numpy(x), torch.from_numpy(y))
        logits = logits.detach().numpy()
        ref_logits, ref_loss = np_llama_forward(flat, x, y, cfg)
        err = np.abs(logits - ref_logits).max()
        check(err < 1e-9 and abs(loss.item() - ref_loss) < 1e-9,
              f"llama (tied {tied}) float64 forward = numpy forward at std 0.5 (error {err:.2e})")
        controls = {
            "interleaved RoPE pairs": np_llama_forward(flat, x, y, cfg, pairing="interleaved")[0],
            "kv head h mod NKV": np_llama_forward(flat, x, y, cfg, kv_of_head=lambda h, nh, nkv: h % nkv)[0],
            "gate/up exchanged": np_llama_forward(swap_gate_up(flat, cfg), x, y, cfg)[0],
            "eps 1e-3": np_llama_forward(flat, x, y, dict(cfg, eps=1e-3))[0],
        }
        for name, other in controls.items():
            moved = np.abs(other - logits).max()
            check(moved > 1e-4, f"control: llama (tied {tied}) {name} moves the logits by {moved:.2e}")


def test_llama_autograd_float64():
    """(b) The llama model's autograd gradients in float64 against central finite differences of the same
    model, untied and tied (as test_autograd_float64)."""
    for tied in (False, True):
        model = tiny_llama(tied)
        train_gpt.init_weights(model, torch.Generator().manual_seed(7))
        autograd_check(model.double(), f"llama (tied {tied})")


def test_llama_bad_input(prefix, tmp):
    """Bad llama flags and files: one line naming the problem."""
    out = os.path.join(tmp, "x")
    base = ["--write-reference", out, "--NH", "4", "--C", "64"]
    fails_with(base + ["--arch", "llama", "--kv-heads", "3"], "do not divide", "kv-heads not dividing NH")
    fails_with(base + ["--arch", "llama", "--kv-heads", "0"], "do not divide", "kv-heads 0")
    fails_with(["--write-reference", out, "--arch", "llama", "--NH", "4", "--C", "36"], "even head size", "odd HS")
    fails_with(base + ["--arch", "llama", "--norm-eps", "0"], "eps", "eps 0")
    fails_with(base + ["--arch", "llama", "--norm-eps", "1e-50"], "eps", "eps that is 0 as an fp32")
    fails_with(base + ["--arch", "llama", "--rope-theta", "1e39"], "theta", "theta beyond fp32")
    fails_with(base + ["--arch", "llama", "--rope-theta", "-1"], "theta", "negative theta")
    fails_with(base + ["--arch", "llama", "--ffn-hidden", "0"], "hidden size", "ffn-hidden 0")
    fails_with(base + ["--arch", "llama", "--tie-embeddings", "2"], "--tie-embeddings", "tie-embeddings 2")
    fails_with(base + ["--arch", "mamba"], "--arch", "unknown arch")
    for flag, value in (("--kv-heads", "4"), ("--rope-theta", "10000"), ("--ffn-hidden", "192"),
                        ("--norm-eps", "1e-5"), ("--tie-embeddings", "0")):
        fails_with(base + [flag, value], flag, f"{flag} with --arch gpt2")

    good = open(prefix + "_model.bin", "rb").read()
    gpt2 = open(os.path.join(tmp, "gpt_model.bin"), "rb").read()

    def edited(name, data, word, value):
        path = os.path.join(tmp, name)
        data = bytearray(data)
        data[4 * word : 4 * word + 4] = int(value).to_bytes(4, "little", signed=True)
        open(path, "wb").write(data)
        return ["--write-reference", out, "--model-from-file", path]

    fails_with(edited("family2.bin", good, 16, 2), "family", "family 2")
    fails_with(edited("gpt2_word18.bin", gpt2, 18, fp32_word(10000.0)), "non-zero Llama", "gpt2 file with a theta")
    fails_with(edited("nkv3.bin", good, 17, 3), "do not divide", "llama file with NKV 3 of NH 4")
    fails_with(edited("eps0.bin", good, 20, 0), "eps", "llama file with eps 0")
    fails_with(edited("theta_nan.bin", good, 18, 0x7FC00000), "theta", "llama file with theta NaN")
    fails_with(edited("tied2.bin", good, 21, 2), "tied", "llama file with word 21 = 2")
    fails_with(edited("tied1.bin", good, 21, 1), "payload", "untied llama payload under a tied header")
    fails_with(edited("h_wrong.bin", good, 19, 128), "payload", "llama payload of another H")
    truncated = os.path.join(tmp, "llama_truncated.bin")
    open(truncated, "wb").write(good[:-2])
    fails_with(["--write-reference", out, "--model-from-file", truncated], "payload", "truncated llama file")


def main():
    os.chdir(REPO)
    with tempfile.TemporaryDirectory(prefix="test_reference_") as tmp:
        prefix, flat, x, y, loss, step_losses = test_files(tmp)
        test_forward_float64()
        test_autograd_float64()
        test_bf16(prefix, flat)
        test_init_loss(loss)
        test_training(prefix, flat, x, y, loss, step_losses, tmp)
        test_model_from_file(prefix, tmp)
        test_data_files(prefix, tmp)
        test_bad_input(prefix, tmp)
        llama_prefix, llama_results = test_llama_files(tmp)
        test_llama_forward_float64()
        test_llama_autograd_float64()
        test_llama_bf16_and_reload(llama_prefix, llama_results, tmp)
        test_llama_training(llama_prefix, llama_results)
        test_llama_bad_input(llama_prefix, tmp)
    print(f"test_reference: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
