"""
dev/test/test_reference.py: checks the PyTorch reference train_gpt.py against things it did not compute itself:
the file formats as doc/formats.md states them, an independent float64 numpy GPT-2 forward, central finite
differences, hand-worked bf16 roundings, and an AdamW written out from its formula.
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
    top = logits.max(-1, keepdims=True)
    logsumexp = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, y[..., None], -1)[..., 0]
    return logits, float((logsumexp - picked).mean())


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
    check(list(read_header(state_data)[:7]) == [20240327, 2, B, T, STEPS, V, VP], "debug state header")

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


def check_gradients_against_numpy(flat, x, y, grads):
    """(b) The debug state's fp32 gradients against float64 central differences of the numpy forward, at the
    largest-gradient entry and two random entries of every tensor. Tolerance: 1e-3 relative plus 1e-4 of the
    tensor's largest gradient (fp32 accumulation error; the differences themselves are exact to ~1e-9)."""
    _, ranges = split(flat)
    rng = np.random.default_rng(0)
    base = flat.astype(np.float64)
    step = 1e-5
    for name, (start, end) in ranges.items():
        g = grads[start:end]
        stop = start + V * C if name == "wte" else end  # padded wte rows have no gradient to check here
        entries = [start + int(np.abs(g[: stop - start]).argmax())] + list(rng.integers(start, stop, 2))
        for i in entries:
            plus, minus = base.copy(), base.copy()
            plus[i] += step
            minus[i] -= step
            fd = (np_forward(plus, x, y)[1] - np_forward(minus, x, y)[1]) / (2 * step)
            tolerance = 1e-3 * abs(fd) + 1e-4 * np.abs(g).max()
            check(abs(grads[i] - fd) <= tolerance,
                  f"debug-state gradient {name}[{i - start}] = {grads[i]:.6e}, finite difference {fd:.6e}")
    start, end = ranges["wte"]
    check(not grads[start + V * C : end].any(), "gradient of the padded wte rows is zero")


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
    config = train_gpt.GPTConfig(maxT=8, V=37, L=2, NH=2, C=16)
    model = train_gpt.GPT(config)
    train_gpt.init_weights(model, torch.Generator().manual_seed(7))
    model.double()
    generator = torch.Generator().manual_seed(8)
    x = torch.randint(0, config.V, (2, 6), generator=generator)
    y = torch.randint(0, config.V, (2, 6), generator=generator)
    _, loss = model(x, y)
    loss.backward()
    rng = np.random.default_rng(1)
    step = 1e-6
    with torch.no_grad():
        for name, p in model.named_parameters():
            rows = config.V if name == "wte.weight" else p.shape[0]  # padded rows: no token reaches them
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
                      f"float64 autograd {name}[{i}] = {flat_g[i].item():.9e}, finite difference {fd:.9e}")


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


def adamw_losses(flat, x, y, steps, grad_clip, lr=1e-3, wd=0.1, beta1=0.9, beta2=0.95, eps=1e-8):
    """Losses of `steps` steps of AdamW written from its formula (clip the global norm, decoupled weight decay
    on the 2-D tensors, bias-corrected moments), with the reference model for forward and backward (its
    gradients are checked above). Runs in float64 over the file payload."""
    config = train_gpt.GPTConfig(maxT=MAXT, V=V, L=L, NH=NH, C=C)
    model = train_gpt.GPT(config).double()
    _, ranges = split(flat)
    decay = np.zeros(len(flat))
    for name in DECAYED:
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
    clipped = read_debug_state(open(os.path.join(tmp, "clip_debug_state.bin"), "rb").read(), NPARAMS)[5]
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
    fails_with(["--write-tokenizer", os.path.join(tmp, "t.bin"), "--V", "300"], "257", "tokenizer V other than 257")
    fails_with(["--train"], "--input-bin", "--train without --input-bin")
    fails_with(["--train", "--input-bin", os.path.join(tmp, "nothing_*.bin")], "no data shard", "no shard matches")


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
    print(f"test_reference: {passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
