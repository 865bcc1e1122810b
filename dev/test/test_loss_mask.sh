#!/usr/bin/env bash
# dev/test/test_loss_mask.sh: the trainers' loss masks (doc/formats.md, "Loss mask") on the CPU backend, on the
# instruction shards data/instructions.py makes of the shipped sample (bytes; about half the targets masked: the
# prompts), with the tiny reference model:
#   - the first step's loss and gradient norm on one batch (-a 1, unshuffled) against PyTorch's: the mean
#     cross-entropy over the targets that count and its gradient's norm (train_gpt.py's model, FP32: rel 1e-5, the
#     printed 6 decimals and fp32 sums), on 1 process with 2 micro-steps of the same batch and on 2 processes; and
#     the reference's own shard loader (train_gpt.py --train) reads that batch with the same masked targets;
#   - the validation loss (unshuffled, over 2 batches) against PyTorch's mean over the same rows' targets that count;
#   - 4 shuffled steps the same under 4 layouts of one global batch of 8 x 32 tokens: 1 process with 2 micro-steps
#     or one, 2 processes with 2 micro-steps or one: the step's targets that count split differently between them,
#     and the losses and norms agree to fp32 summation order (rel 1e-5);
#   - the MoE trainer (dropless, no balance losses: routing that the split cannot change) on 2 processes against 1;
#     test_moe's mask rows hold its balance losses, which keep their per-token weight, to the reference.
# Needs build/train_gpt_fp32, build/train_moe_fp32 and build/ref/tiny_fp32_model.bin. Run from anywhere:
#   dev/test/test_loss_mask.sh
set -u
cd "$(dirname "$0")/../.."
. dev/test/cli_common.sh
MODEL=build/ref/tiny_fp32_model.bin

$PYTHON data/instructions.py data/instructions_sample.jsonl --out-dir "$work/data" --tokenizer bytes >/dev/null ||
    { echo "cannot write the instruction shards"; exit 1; }
DATA=(-i "$work/data/train.bin" -j "$work/data/val.bin" -t 32 -v 100 -m 2 -s 0 -l 1e-3)
COMMON=(-e "$MODEL" "${DATA[@]}")

# step lines -> "loss norm" per step
steps() { grep -E '^step [0-9]+/' "$1" | sed -E 's/.*\| loss ([0-9.]+).*\| norm ([0-9.]+).*/\1 \2/'; }

# --- one batch (-a 1): step 1 and the validation loss against PyTorch
build/train_gpt_fp32 "${COMMON[@]}" -b 2 -d 128 -a 1 -x 1 >"$work/one.log" 2>&1 || fail "-a 1: $(tail -2 "$work/one.log")"
$MPIRUN -np 2 build/train_gpt_fp32 "${COMMON[@]}" -b 2 -d 128 -a 1 -x 1 >"$work/two.log" 2>&1 ||
    fail "-a 1 on 2 processes: $(tail -2 "$work/two.log")"
# each log with its rows: one process reads its first batch of 2 rows in both micro-steps, two processes 4 rows in one;
# validation -m 2 batches of 2 or 4 rows
$PYTHON - "$MODEL" "$work/data" "$work/one.log:2:4" "$work/two.log:4:8" <<'PY' && pass || fail "against PyTorch"
import re, sys
import numpy as np
import torch
sys.path.insert(0, ".")
import train_gpt
model_path, data, logs = sys.argv[1], sys.argv[2], sys.argv[3:]
model = train_gpt.read_model_file(model_path)
T = 32

def rows(shard, n):  # the first n rows of T + 1 tokens (row k from token k*T), targets masked as the shard's mask says
    tokens = train_gpt.read_shard(shard)
    mask = train_gpt.read_mask(shard, len(tokens))
    x = torch.tensor(np.stack([tokens[k * T : k * T + T] for k in range(n)]))
    y = torch.tensor(np.stack([np.where(mask[k * T + 1 : k * T + T + 1], tokens[k * T + 1 : k * T + T + 1],
                                        train_gpt.MASKED) for k in range(n)]))
    return x, y

# the reference's own loader (train_gpt.py --train) reads the same first batch: inputs whole, targets masked
lx, ly = train_gpt.ShardLoader(f"{data}/train.bin", 2, T, model.config.V).next_batch()
x2, y2 = rows(f"{data}/train.bin", 2)
ok = bool(torch.equal(lx, x2) and torch.equal(ly, y2))
print(f"  train_gpt.py's ShardLoader: its first batch {'is' if ok else 'is not'} the rows read here")
for entry in logs:
    log, train_rows, val_rows = entry.split(":")
    x, y = rows(f"{data}/train.bin", int(train_rows))
    model.zero_grad()
    _, loss = model(x, y)
    loss.backward()
    norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters())).item()
    with torch.no_grad():
        _, val = model(*rows(f"{data}/val.bin", int(val_rows)))
    text = open(log).read()
    step = re.search(r"step 1/\d+ \| loss ([0-9.]+).*\| norm ([0-9.]+)", text)
    got_val = float(re.search(r"val loss ([0-9.]+)", text).group(1))
    got_loss, got_norm = float(step.group(1)), float(step.group(2))
    errors = (abs(got_loss - loss.item()) / loss.item(), abs(got_norm - norm) / norm, abs(got_val - val.item()) / val.item())
    print(f"  {log.split('/')[-1]}: loss {got_loss:.6f} (PyTorch {loss.item():.6f}), norm {got_norm:.6f} ({norm:.6f}), "
          f"val {got_val:.6f} ({val.item():.6f}); max rel err {max(errors):.1e} (tol 1e-5); "
          f"{int((y >= 0).sum())} of {y.numel()} targets count")
    ok = ok and max(errors) < 1e-5
sys.exit(0 if ok else 1)
PY

# --- 4 shuffled steps under 4 layouts of a global batch of 8 x 32 tokens
build/train_gpt_fp32 "${COMMON[@]}" -b 4 -d 256 -x 4 >"$work/b4.log" 2>&1 || fail "-b 4: $(tail -2 "$work/b4.log")"
build/train_gpt_fp32 "${COMMON[@]}" -b 8 -d 256 -x 4 >"$work/b8.log" 2>&1 || fail "-b 8: $(tail -2 "$work/b8.log")"
$MPIRUN -np 2 build/train_gpt_fp32 "${COMMON[@]}" -b 2 -d 256 -x 4 >"$work/np2_b2.log" 2>&1 ||
    fail "-np 2 -b 2: $(tail -2 "$work/np2_b2.log")"
$MPIRUN -np 2 build/train_gpt_fp32 "${COMMON[@]}" -b 4 -d 256 -x 4 >"$work/np2_b4.log" 2>&1 ||
    fail "-np 2 -b 4: $(tail -2 "$work/np2_b4.log")"
# the MoE trainer, dropless with no balance or z-loss (each token routed alone, as its micro-batch's split cannot
# change): 2 processes (expert parallel) against 1
MOE=(-e d2 -ev 263 -et 32 "${DATA[@]}" -ne 4 -tk 1 -me 2 -cf 0 -ra 0 -rz 0 -d 128 -x 4)
build/train_moe_fp32 "${MOE[@]}" -b 2 >"$work/moe1.log" 2>&1 || fail "MoE: $(tail -2 "$work/moe1.log")"
$MPIRUN -np 2 build/train_moe_fp32 "${MOE[@]}" -b 1 -ep 2 >"$work/moe2.log" 2>&1 ||
    fail "MoE -ep 2: $(tail -2 "$work/moe2.log")"
for log in b4 b8 np2_b2 np2_b4 moe1 moe2; do steps "$work/$log.log" >"$work/$log.steps"; done
if $PYTHON - "$work" <<'PY'; then pass; else fail "the layouts differ"; fi
import sys
work = sys.argv[1]
read = lambda name: [tuple(map(float, line.split())) for line in open(f"{work}/{name}.steps")]
ok = True
for base, others in (("b4", ("b8", "np2_b2", "np2_b4")), ("moe1", ("moe2",))):
    want = read(base)
    for other in others:
        got = read(other)
        err = max(abs(g - w) / w for a, b in zip(got, want) for g, w in zip(a, b)) if len(got) == len(want) == 4 else 1
        print(f"  {other} against {base}: 4 steps' losses and norms, max rel err {err:.1e} (tol 1e-5)")
        ok = ok and err < 1e-5
sys.exit(0 if ok else 1)
PY

echo "test_loss_mask: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
