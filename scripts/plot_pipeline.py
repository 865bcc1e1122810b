#!/usr/bin/python3
"""scripts/plot_pipeline.py: draws a pipeline trace (the trainers' -ppt FILE, doc/parallelism.md) as a PNG timeline:
one row per process, each forward (F), backward (B) and weight-gradient (W, ZB) pass a bar from its begin to its end, labelled with its
micro-batch (and with interleaving its chunk, micro.chunk); the gaps in a row are that stage's bubbles. The title gives each stage's idle time over its busy time.

    /usr/bin/python3 scripts/plot_pipeline.py [-o pipeline.png] [--step N] TRACE

The trace's lines (after its header) are "step rank stage pass micro chunk begin_ms end_ms", times from each process's start
of the step's passes; --step picks a step (default: the last one in the file). Needs matplotlib (apt-get install
python3-matplotlib).
"""
import argparse
import sys

PROG = "plot_pipeline.py"
COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#c44e52"}


def read_trace(path):
    """The trace's rows as (step, rank, stage, pass, micro, chunk, begin, end); exits with one line on a malformed one."""
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        sys.exit(f"{PROG}: {path}: {e.strerror}")
    if not lines or lines[0].split() != ["step", "rank", "stage", "pass", "micro", "chunk", "begin_ms", "end_ms"]:
        sys.exit(f"{PROG}: {path}: not a pipeline trace (expected the header of -ppt's file)")
    rows = []
    for n, line in enumerate(lines[1:], start=2):
        f = line.split()
        try:
            if len(f) != 8 or f[3] not in COLOURS:
                raise ValueError
            rows.append((int(f[0]), int(f[1]), int(f[2]), f[3], int(f[4]), int(f[5]), float(f[6]), float(f[7])))
        except ValueError:
            sys.exit(f"{PROG}: {path}:{n}: expected 'step rank stage F|B|W micro chunk begin_ms end_ms', got '{line}'")
    if not rows:
        sys.exit(f"{PROG}: {path}: no passes")
    return rows


def idle_fractions(rows):
    """Each stage's idle time over its busy time (its first process's): the gaps before its last pass ends."""
    out = {}
    for stage in sorted({r[2] for r in rows}):
        rank = min(r[1] for r in rows if r[2] == stage)
        mine = [r for r in rows if r[1] == rank]
        busy = sum(r[7] - r[6] for r in mine)
        span = max(r[7] for r in mine)
        out[stage] = (span - busy) / busy if busy > 0 else 0.0
    return out


def main():
    ap = argparse.ArgumentParser(description="draw a pipeline trace (-ppt) as a timeline")
    ap.add_argument("trace")
    ap.add_argument("-o", "--output", default="pipeline.png")
    ap.add_argument("--step", type=int, default=None)
    args = ap.parse_args()
    rows = read_trace(args.trace)
    step = args.step if args.step is not None else max(r[0] for r in rows)
    rows = [r for r in rows if r[0] == step]
    if not rows:
        sys.exit(f"{PROG}: {args.trace}: no step {step}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ranks = sorted({r[1] for r in rows})
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(ranks) + 1.5))
    chunks = max(r[5] for r in rows) + 1
    for _, rank, stage, kind, micro, chunk, begin, end in rows:
        y = ranks.index(rank)
        ax.barh(y, end - begin, left=begin, height=0.8, color=COLOURS[kind], edgecolor="black", linewidth=0.5,
                alpha=1.0 - 0.35 * chunk / max(chunks - 1, 1))
        label = f"{kind}{micro}" + (f".{chunk}" if chunks > 1 else "")
        ax.text((begin + end) / 2, y, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r} (stage {next(x[2] for x in rows if x[1] == r)})" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the step's start")
    idle = idle_fractions(rows)
    ax.set_title(f"{args.trace}, step {step}: idle over busy " +
                 ", ".join(f"stage {s} {f:.2f}" for s, f in idle.items()))
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    ax.legend(handles, ["forward", "backward (input gradients with W)", "weight gradients (W)"], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}: step {step}, {len(ranks)} processes, {len(rows)} passes")


if __name__ == "__main__":
    main()
