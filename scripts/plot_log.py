#!/usr/bin/python3
"""scripts/plot_log.py: plots training logs (the trainers' -o DIR/main.log) as a PNG: train and val loss
against steps, one colour per log, and for MoE runs also the router's auxiliary (load-balancing) and z
losses, the fraction of tokens dropped at capacity, and the expert load (min, max, coefficient of variation);
when the log has train_moe's per-layer telemetry, also the dead experts (summed over the MoE layers), the
balancing bias (its spread over the experts, max - min, averaged over the layers) and the histogram of the
experts' loads in the training steps before the last validation (every layer's experts, their load over the mean).

    /usr/bin/python3 scripts/plot_log.py [-o loss.png] [--ymax Y] [--title T] LOG_OR_DIR [LOG_OR_DIR ...]

A directory stands for DIR/main.log. Lines read (llmc/logger.h writes them):
    s:STEP trl:LOSS norm:N lr:LR ms:MS [mfu:PCT] tok/s:R                      a training step
    s:STEP tel:LOSS                                                           a validation loss
    s:STEP aux:A z:Z drop:D load_min:L load_max:L load_cv:C                   MoE router statistics
    s:STEP layer:M ... layer_dead:D [layer_steps:S layer_choices:N layer_loads:L0,..] [layer_bias:B0,..]
                                                                              one MoE layer at a validation
Other lines (free text) are skipped. A resumed run appends to the log and may repeat steps after its
checkpoint: the last value logged for a step wins. Needs matplotlib (apt-get install python3-matplotlib).
"""
import argparse
import os
import sys

PROG = "plot_log.py"
# which key marks which kind of line, and the keys each kind must have
KINDS = {
    "trl": ("train", ["trl"]),
    "tel": ("val", ["tel"]),
    "aux": ("moe", ["aux", "z", "drop", "load_min", "load_max", "load_cv"]),
    "layer": ("layer", ["layer_dead"]),
}


def fail(message):
    sys.exit("%s: %s" % (PROG, message))


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a bad option gets one line (not the usage block)."""

    def error(self, message):
        sys.exit("%s: %s (see --help)" % (PROG, message))


def parse_line(path, number, line):
    """(kind, step, {key: value}) for a log line, None for a free-text or unknown line; exits on a malformed one.
    A value is a number, or a comma-separated list of numbers (a list)."""
    if not line.startswith("s:"):
        return None
    values = {}
    for field in line.split():
        key, sep, text = field.partition(":")
        try:
            if not sep:
                raise ValueError
            values[key] = [float(v) for v in text.split(",")] if "," in text else float(text)
        except ValueError:
            fail("%s:%d: cannot parse %r in %r (expected KEY:NUMBER fields)" % (path, number, field, line[:120]))
    step = values.pop("s")
    if isinstance(step, list) or step != int(step) or step < 0:
        fail("%s:%d: step %r is not a whole number >= 0" % (path, number, step))
    for marker, (kind, needed) in KINDS.items():
        if marker in values:
            missing = [key for key in needed if key not in values]
            if missing:
                fail("%s:%d: a %s line without %s: %r" % (path, number, kind, ", ".join(missing), line[:120]))
            return kind, int(step), values
    return None  # a kind of s: line this script does not know: later trainers may add some


def read_log(path):
    """{kind: {step: values}} of one log."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError as e:
        fail("%s: %s" % (path, e.strerror))
    if not any(line.strip() for line in lines):
        fail("%s is empty: no step has been logged yet" % path)
    records = {"train": {}, "val": {}, "moe": {}, "layer": {}}
    for number, line in enumerate(lines, 1):
        parsed = parse_line(path, number, line.strip())
        if not parsed:
            continue
        kind, step, values = parsed
        if kind == "layer":  # {step: {layer: values}}; one expert's list is a single number
            for key in ("layer_loads", "layer_bias"):
                if key in values and not isinstance(values[key], list):
                    values[key] = [values[key]]
            records["layer"].setdefault(step, {})[int(values["layer"])] = values
        else:
            records[kind][step] = values
    if not records["train"] and not records["val"]:
        fail("%s: no training or validation lines (expected 's:STEP trl:LOSS ...' or 's:STEP tel:LOSS')" % path)
    return records


def series(records, kind, key):
    steps = sorted(records[kind])
    return steps, [records[kind][s][key] for s in steps]


def plot_layers(layers, label, color, dead_ax, bias_ax, hist_ax):
    """One run's per-layer telemetry: dead experts and the bias spread against the validation steps, and the
    histogram of the last validation's expert loads that has them."""
    steps = sorted(layers)
    dead_ax.plot(steps, [sum(v["layer_dead"] for v in layers[s].values()) for s in steps], color=color,
                 marker="o", markersize=3, linewidth=0.9, label=label)
    biased = [s for s in steps if all("layer_bias" in v for v in layers[s].values())]
    if biased:
        spread = [sum(max(v["layer_bias"]) - min(v["layer_bias"]) for v in layers[s].values()) / len(layers[s])
                  for s in biased]
        bias_ax.plot(biased, spread, color=color, marker="o", markersize=3, linewidth=0.9, label=label)
    loaded = [s for s in steps if all("layer_loads" in v for v in layers[s].values())]
    if loaded:
        # loads of 4 and more in the last bin, so that every run shares the bins
        loads = [min(x, 3.99) for v in layers[loaded[-1]].values() for x in v["layer_loads"]]
        hist_ax.hist(loads, bins=32, range=(0.0, 4.0), color=color, alpha=0.5,
                     label="%s (step %d)" % (label, loaded[-1]))


def label_of(path):
    """A run is known by its directory (every log is called main.log)."""
    if os.path.basename(path) == "main.log":
        return os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return path


def main():
    parser = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", metavar="LOG_OR_DIR")
    parser.add_argument("-o", "--out", default="loss.png", help="the PNG to write (default loss.png)")
    parser.add_argument("--ymax", type=float, help="upper limit of the loss axis (the first steps' loss of ~11 "
                                                   "flattens the rest of the curve)")
    parser.add_argument("--title", default="", help="title above the plot")
    args = parser.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")  # no display: write files only
        import matplotlib.pyplot as plt
    except ImportError as e:
        fail("%s in %s: run with Debian's /usr/bin/python3 after apt-get install python3-matplotlib"
             % (e, sys.executable))

    paths = [os.path.join(p, "main.log") if os.path.isdir(p) else p for p in args.logs]
    logs = [(label_of(p), read_log(p)) for p in paths]
    has_moe = any(records["moe"] for _, records in logs)
    has_layers = any(records["layer"] for _, records in logs)
    if has_moe and has_layers:
        fig, axes = plt.subplots(3, 3, figsize=(18, 13.5))
        loss_ax, aux_ax, z_ax, drop_ax, load_ax, cv_ax, dead_ax, bias_ax, hist_ax = axes.flat
    elif has_moe:
        fig, axes = plt.subplots(2, 3, figsize=(18, 9))
        loss_ax, aux_ax, z_ax, drop_ax, load_ax, cv_ax = axes.flat
    else:
        fig, loss_ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    for i, (label, records) in enumerate(logs):
        color = colors[i % len(colors)]
        if records["train"]:
            loss_ax.plot(*series(records, "train", "trl"), color=color, alpha=0.45, linewidth=0.8,
                         label="%s train" % label)
        if records["val"]:
            loss_ax.plot(*series(records, "val", "tel"), color=color, marker="o", markersize=3, linewidth=1.6,
                         label="%s val" % label)
        if not records["moe"]:
            continue
        aux_ax.plot(*series(records, "moe", "aux"), color=color, linewidth=0.9, label=label)
        z_ax.plot(*series(records, "moe", "z"), color=color, linewidth=0.9, label=label)
        drop_ax.plot(*series(records, "moe", "drop"), color=color, linewidth=0.9, label=label)
        load_ax.plot(*series(records, "moe", "load_max"), color=color, linewidth=0.9, label="%s max" % label)
        load_ax.plot(*series(records, "moe", "load_min"), color=color, linewidth=0.9, linestyle="--",
                     label="%s min" % label)
        cv_ax.plot(*series(records, "moe", "load_cv"), color=color, linewidth=0.9, label=label)
        if has_layers and records["layer"]:
            plot_layers(records["layer"], label, color, dead_ax, bias_ax, hist_ax)

    loss_ax.set_title("loss")
    loss_ax.set_ylabel("cross-entropy (nats/token)")
    if args.ymax is not None:
        loss_ax.set_ylim(top=args.ymax)
    panels = [loss_ax]
    if has_moe:
        for ax, title in ((aux_ax, "load-balancing (aux) loss"), (z_ax, "router z-loss"),
                          (drop_ax, "fraction of tokens dropped"), (load_ax, "expert load (max, min)"),
                          (cv_ax, "expert load coefficient of variation")):
            ax.set_title(title)
        panels += [aux_ax, z_ax, drop_ax, load_ax, cv_ax]
    if has_moe and has_layers:
        dead_ax.set_title("dead experts (no token in 100 steps)")
        bias_ax.set_title("balancing bias spread (max - min)")
        hist_ax.set_title("expert loads before the last validation")
        hist_ax.set_xlabel("load / mean")
        hist_ax.set_ylabel("experts")
        hist_ax.grid(alpha=0.3)
        if hist_ax.patches:
            hist_ax.legend(fontsize=8)
        panels += [dead_ax, bias_ax]
    for ax in panels:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    try:
        fig.savefig(args.out, dpi=100)
    except OSError as e:
        fail("cannot write %s: %s" % (args.out, e.strerror))
    summary = []
    for label, records in logs:
        last = ""
        if records["val"]:
            step = max(records["val"])
            last = ", val %.4f at step %d" % (records["val"][step]["tel"], step)
        summary.append("%s: %d steps%s" % (label, len(records["train"]), last))
    print("%s: wrote %s (%s)" % (PROG, args.out, "; ".join(summary)))


if __name__ == "__main__":
    main()
