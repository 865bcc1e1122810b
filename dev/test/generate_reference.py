"""
dev/test/generate_reference.py: generate against the PyTorch reference's full forward pass (train_gpt.py's GPT or
Llama, train_moe.py's MoE GPT, dropless), for dev/test/test_generate.sh. Two modes:
  /usr/bin/python3 dev/test/generate_reference.py MODEL.bin PROMPTS.txt OUTPUT.txt LOGITS.bin
    generate's logits (its -lo file, doc/formats.md "Logits file") against the reference's over each sequence's
    prompt and generated tokens. PROMPTS.txt holds the token-id prompts generate read (-ids 1), OUTPUT.txt its stdout
    ('PROMPT SAMPLE: id ...'). Every record's logits must be the reference's at that position within FP32 rounding
    (below), and every generated token the record's own (greedy: the largest logit, ties to the lower id). For
    generate -wq, MODEL.bin is its -wm file: the quantised weights dequantised, what its kernels compute with.
  /usr/bin/python3 dev/test/generate_reference.py perplexity MODEL.bin SHARD.bin OUTPUT.txt
    generate -vp's loss (its 'perplexity P (loss L) ...' line in OUTPUT.txt) against the reference's mean
    cross-entropy over the same sequences: every whole row of maxT + 1 tokens of the shard, as llmc/dataloader.h cuts
    them, within 1e-5 relative (fp32 losses of a few hundred tokens summed in another order).
  /usr/bin/python3 dev/test/generate_reference.py trainer-sample MODEL.bin LOG SEED_TOKEN DRAWS_BEFORE
    a trainer's last sample in LOG (printed as token ids, -tf none) against the reference's softmax: the sequence
    from SEED_TOKEN, each token the one whose interval of the reference's cumulative probabilities (in double, token
    order, llmc/sampler.h's walk) holds that position's uniform draw from the trainer's generator (xorshift64* from
    its seed 1337, after DRAWS_BEFORE draws of earlier samples), within 1e-4 of probability (the fp32 logits of two
    computation orders move the boundaries by ~1e-6; a wrong token is off by the width of the intervals between, ~1/V).
Prints one line per sequence (or the loss) and exits 1 on any difference.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import train_gpt  # noqa: E402
import train_moe  # noqa: E402

# Tolerance: generate's decode reads keys and values through the cache and sums attention in another order than
# PyTorch's, all in fp32: ~1e-7 relative per operation over a few layers, a few 1e-7 of the logits' scale after them;
# 2e-5 of the scale allows those with a margin and still fails any wrong position, head or token (errors of 1e-2 and
# up).
RTOL_OF_SCALE = 2e-5


def read_logits(path):
    data = np.fromfile(path, dtype="<i4")
    if data.size < 256 or data[0] != 20261204 or data[1] != 1:
        raise SystemExit(f"{path}: not a logits file (magic {data[0] if data.size else None})")
    V, count = int(data[2]), int(data[3])
    body = data[256:]
    width = 4 + V
    if body.size != count * width:
        raise SystemExit(f"{path}: {body.size} words after the header, {count} records of {width} expected")
    records = body.reshape(count, width)
    return V, records[:, :4], records[:, 4:].view("<f4")


def main(model_path, prompts_path, output_path, logits_path):
    torch.manual_seed(0)
    with open(model_path, "rb") as f:
        magic = int.from_bytes(f.read(4), "little")
    moe = magic == train_moe.MOE_MODEL_MAGIC
    model = (train_moe if moe else train_gpt).read_model_file(model_path).eval()
    settings = train_moe.RoutingSettings(capacity_factor=0.0, aux_alpha=0.0, z_coef=0.0) if moe else None
    prompts = [[int(t) for t in line.split()] for line in open(prompts_path)]
    outputs = {}
    for line in open(output_path):
        head, ids = line.split(":")
        prompt, sample = (int(v) for v in head.split())
        outputs[(prompt, sample)] = [int(t) for t in ids.split()]
    V, keys, logits = read_logits(logits_path)
    failures = 0
    for (prompt, sample), generated in sorted(outputs.items()):
        tokens = prompts[prompt] + generated
        x = torch.tensor([tokens[:-1]])
        with torch.no_grad():
            if moe:
                ref = model(x, torch.zeros_like(x), settings).logits[0]
            else:
                ref = model(x, torch.zeros_like(x))[0][0]
        rows = np.nonzero((keys[:, 0] == prompt) & (keys[:, 1] == sample))[0]
        positions = keys[rows, 2]
        want = sorted(range(len(prompts[prompt]) - 1, len(tokens) - 1))
        if sorted(positions.tolist()) != want:
            print(f"FAIL prompt {prompt} sample {sample}: records at positions {sorted(positions.tolist())}, "
                  f"expected {want}")
            failures += 1
            continue
        got = torch.from_numpy(logits[rows].copy())
        expected = ref[torch.from_numpy(positions.astype(np.int64))]
        scale = expected.abs().max().item()
        err = (got - expected).abs().max().item()
        chosen = keys[rows, 3]
        next_tokens = np.array([tokens[p + 1] for p in positions])
        greedy = got.argmax(dim=1).numpy()
        ok = err <= RTOL_OF_SCALE * scale and (chosen == next_tokens).all() and (greedy == chosen).all()
        failures += not ok
        print(f"{'OK  ' if ok else 'FAIL'} prompt {prompt} sample {sample}: {len(rows)} positions, max err "
              f"{err:.3e} of scale {scale:.3e} (tol {RTOL_OF_SCALE:g} of it), tokens "
              f"{'the greedy ones' if (greedy == chosen).all() and (chosen == next_tokens).all() else 'DIFFER'}")
    sys.exit(1 if failures else 0)


def perplexity(model_path, shard_path, output_path):
    with open(model_path, "rb") as f:
        moe = int.from_bytes(f.read(4), "little") == train_moe.MOE_MODEL_MAGIC
    model = (train_moe if moe else train_gpt).read_model_file(model_path).eval()
    settings = train_moe.RoutingSettings(capacity_factor=0.0, aux_alpha=0.0, z_coef=0.0) if moe else None
    T = model.config.maxT
    tokens = torch.from_numpy(train_gpt.read_shard(shard_path))
    rows = (len(tokens) - 1) // T
    x = torch.stack([tokens[r * T : r * T + T] for r in range(rows)])
    y = torch.stack([tokens[r * T + 1 : r * T + T + 1] for r in range(rows)])
    with torch.no_grad():
        logits = model(x, y, settings).logits if moe else model(x, y)[0]
        losses = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                   reduction="none").view(rows, T).mean(dim=1)
    want = losses.double().mean().item()
    line = next(line for line in open(output_path) if line.startswith("perplexity "))
    got = float(line.split("(loss ")[1].split(")")[0])
    ok = abs(got - want) <= 1e-5 * abs(want)
    print(f"{'OK  ' if ok else 'FAIL'} -vp: loss {got:.6f}, the reference's {want:.6f} over {rows} sequences of {T}")
    sys.exit(0 if ok else 1)


class TrainerGenerator:
    """llmc/sampler.h's xorshift64* and its 24-bit uniform floats"""

    def __init__(self, state):
        self.state = state

    def uniform(self):
        mask = (1 << 64) - 1
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & mask
        s ^= s >> 27
        self.state = s
        return (((s * 0x2545F4914F6CDD1D) & mask) >> 32 >> 8) / 16777216.0


def trainer_sample(model_path, log_path, seed_token, draws_before):
    with open(model_path, "rb") as f:
        moe = int.from_bytes(f.read(4), "little") == train_moe.MOE_MODEL_MAGIC
    model = (train_moe if moe else train_gpt).read_model_file(model_path).eval()
    settings = train_moe.RoutingSettings(capacity_factor=0.0, aux_alpha=0.0, z_coef=0.0) if moe else None
    lines = open(log_path).read().split("\n")
    starts = [i for i, line in enumerate(lines) if line == "generating:"]
    if not starts:
        raise SystemExit(f"{log_path}: no sample")
    sample = [int(t) for t in lines[starts[-1] + 2].strip("<>").split("><")]
    tokens = [int(seed_token)] + sample
    x = torch.tensor([tokens[:-1]])
    with torch.no_grad():
        logits = (model(x, torch.zeros_like(x), settings).logits if moe else model(x, torch.zeros_like(x))[0])[0]
    V = model.config.V
    probabilities = torch.softmax(logits[:, :V].double(), dim=-1)
    rng = TrainerGenerator(1337)
    for _ in range(int(draws_before)):
        rng.uniform()
    worst = 1.0
    for t, token in enumerate(sample):
        coin = rng.uniform()
        cdf = torch.cumsum(probabilities[t], dim=0)
        low = 0.0 if token == 0 else cdf[token - 1].item()
        high = cdf[token].item()
        worst = min(worst, min(coin - low, high - coin) + 1e-4)
    ok = worst >= 0.0
    print(f"{'OK  ' if ok else 'FAIL'} the trainer's sample of {len(sample)} tokens: each draw inside its token's "
          f"interval of the reference's probabilities (tightest margin {worst - 1e-4:+.2e}, tol 1e-4)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "perplexity":
        perplexity(*sys.argv[2:])
    elif len(sys.argv) == 6 and sys.argv[1] == "trainer-sample":
        trainer_sample(*sys.argv[2:])
    elif len(sys.argv) == 5:
        main(*sys.argv[1:])
    else:
        raise SystemExit("usage: generate_reference.py MODEL.bin PROMPTS.txt OUTPUT.txt LOGITS.bin | "
                         "perplexity MODEL.bin SHARD.bin OUTPUT.txt | trainer-sample MODEL.bin LOG SEED_TOKEN DRAWS_BEFORE")
