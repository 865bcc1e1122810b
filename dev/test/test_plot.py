#!/usr/bin/python3
"""dev/test/test_plot.py: tests scripts/plot_log.py on logs it writes in the trainers' format (llmc/logger.h):
a GPT log with a resumed run's repeated steps and free-text lines, an MoE log with router statistics, and one
with train_moe's per-layer telemetry (dead experts, expert loads, balancing biases); checks that a PNG comes out
with the expected size (one panel, six with MoE, nine with the telemetry), that repeated steps count once with
the last value winning, and that a missing, empty or malformed log gets one line and a non-zero exit.

    /usr/bin/python3 dev/test/test_plot.py [--keep DIR]     (--keep: leave the PNGs in DIR to look at)

Needs python3-matplotlib. Ends with "test_plot: N passed, N failed"; exits 1 if anything failed.
"""
import math
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PLOT = os.path.join(ROOT, "scripts", "plot_log.py")

passed = 0
failed = 0


def check(condition, what):
    global passed, failed
    if condition:
        passed += 1
    else:
        failed += 1
        print("FAIL: %s" % what)


def png_size(path):
    """(width, height) from the PNG signature and IHDR chunk, or None if the file is not a PNG."""
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR":
        return None
    return struct.unpack(">II", head[16:24])


def train_line(step, loss, mfu=True):
    lr = 6e-4 * min(1.0, step / 10)
    return "s:%d trl:%.4f norm:%.4f lr:%.6e ms:%.2f%s tok/s:%.0f" % (
        step, loss, 1.0 + 0.5 / step, lr, 310.5, " mfu:%.2f" % 41.3 if mfu else "", 1.7e6)


def gpt_log(path):
    """200 steps with val every 25; the run 'crashes' after step 120 and resumes from its step-100 checkpoint,
    logging steps 101..120 again with different values (the second ones count). Val at 200 is 3.5."""
    lines = ["s:0 tel:10.9800"]
    for step in range(1, 121):
        lines.append(train_line(step, 3.5 + 7.0 * math.exp(-step / 15) + 0.1 * math.sin(step)))
        if step % 25 == 0:
            lines.append("s:%d tel:%.4f" % (step, 3.6 + 7.0 * math.exp(-step / 15)))
    lines.append("resumed from step 100 of log_gpt2")  # free text: skipped
    for step in range(101, 201):
        lines.append(train_line(step, 3.4 + 7.0 * math.exp(-step / 15) + 0.05 * math.sin(step), mfu=step % 2 == 0))
        if step % 25 == 0:
            lines.append("s:%d tel:%.4f" % (step, 3.5 if step == 200 else 3.55 + 7.0 * math.exp(-step / 15)))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def moe_log(path):
    lines = []
    for step in range(1, 151):
        lines.append(train_line(step, 3.3 + 7.0 * math.exp(-step / 12)))
        lines.append("s:%d aux:%f z:%f drop:%f load_min:%f load_max:%f load_cv:%f" % (
            step, 0.01 * (1.0 + 0.5 * math.exp(-step / 30)), 0.002 * math.exp(-step / 50), 0.2 * math.exp(-step / 20),
            0.125 * (1 - 0.6 * math.exp(-step / 25)), 0.125 * (1 + 1.5 * math.exp(-step / 25)),
            0.8 * math.exp(-step / 25)))
        if step % 30 == 0:
            lines.append("s:%d tel:%.4f" % (step, 3.4 + 7.0 * math.exp(-step / 12)))
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def moe_layer_log(path):
    """moe_log's lines, and at each validation two MoE layers' telemetry as train_moe writes it: 8 experts' loads
    over the mean and their balancing biases (comma-separated), the dead experts."""
    moe_log(path)
    lines = []
    for step in range(30, 151, 30):
        for layer in range(2):
            loads = [1.0 + 0.6 * math.exp(-step / 40) * math.sin(e + layer) for e in range(8)]
            bias = [0.001 * round(10 * math.sin(e * step)) for e in range(8)]
            lines.append("s:%d layer:%d layer_aux:0.010 layer_z:0.001 layer_drop:0.0 layer_load_min:0.5 "
                         "layer_load_max:1.5 layer_load_cv:0.3 layer_dead:%d layer_steps:30 layer_loads:%s "
                         "layer_bias:%s" % (step, layer, 1 if step < 90 else 0, ",".join("%.3f" % x for x in loads),
                                            ",".join("%.6g" % b for b in bias)))
    with open(path, "a") as f:
        f.write("\n".join(lines) + "\n")


def run(args):
    result = subprocess.run([sys.executable, PLOT] + args, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


def main():
    keep = sys.argv[2] if len(sys.argv) == 3 and sys.argv[1] == "--keep" else None
    with tempfile.TemporaryDirectory(prefix="test_plot_") as tmp:
        out_dir = keep or tmp
        os.makedirs(out_dir, exist_ok=True)
        gpt_dir = os.path.join(tmp, "log_gpt2")
        moe_dir = os.path.join(tmp, "log_moe")
        os.makedirs(gpt_dir)
        os.makedirs(moe_dir)
        gpt_log(os.path.join(gpt_dir, "main.log"))
        moe_log(os.path.join(moe_dir, "main.log"))
        layer_dir = os.path.join(tmp, "log_moe_layers")
        os.makedirs(layer_dir)
        moe_layer_log(os.path.join(layer_dir, "main.log"))

        png = os.path.join(out_dir, "gpt.png")
        rc, out, err = run(["-o", png, "--ymax", "8", gpt_dir])
        check(rc == 0, "plot of a GPT log (rc %d: %s)" % (rc, err.strip()[-300:]))
        check(os.path.exists(png) and png_size(png) == (900, 550), "a one-panel PNG, 900x550 (%r)"
              % (png_size(png) if os.path.exists(png) else None,))
        check("log_gpt2: 200 steps, val 3.5000 at step 200" in out,
              "repeated steps after a resume count once and the last value wins (%r)" % out.strip())

        png = os.path.join(out_dir, "moe.png")
        rc, out, err = run(["-o", png, "--title", "GPT-2 vs Switch 8x", os.path.join(gpt_dir, "main.log"), moe_dir])
        check(rc == 0, "plot of a GPT and an MoE log together (rc %d: %s)" % (rc, err.strip()[-300:]))
        check(os.path.exists(png) and png_size(png) == (1800, 900), "with MoE lines: six panels, 1800x900 (%r)"
              % (png_size(png) if os.path.exists(png) else None,))
        check("log_moe: 150 steps" in out, "the MoE log's steps are counted (%r)" % out.strip())

        png = os.path.join(out_dir, "moe_layers.png")
        rc, out, err = run(["-o", png, moe_dir, layer_dir])
        check(rc == 0, "plot of MoE logs with and without per-layer telemetry (rc %d: %s)" % (rc, err.strip()[-300:]))
        check(os.path.exists(png) and png_size(png) == (1800, 1350), "with the telemetry: nine panels, 1800x1350 (%r)"
              % (png_size(png) if os.path.exists(png) else None,))

        bad = os.path.join(tmp, "bad")
        os.makedirs(bad)
        cases = [("missing.log", None, "No such file"), ("empty.log", "", "empty"),
                 ("text_only.log", "starting\nno steps here\n", "no training or validation lines"),
                 ("garbled.log", "s:1 trl:3.2 norm:1.0\ns:2 trl:three norm:1.0\n", "garbled.log:2"),
                 ("moe_short.log", "s:1 trl:3.2\ns:1 aux:0.01 z:0.001\n", "without drop"),
                 ("layer_list.log", "s:1 trl:3.2\ns:1 layer:0 layer_dead:0 layer_loads:1.0,x,1.0\n", "layer_list.log:2"),
                 ("layer_short.log", "s:1 trl:3.2\ns:1 layer:0 layer_loads:1.0,1.0\n", "without layer_dead")]
        for name, text, phrase in cases:
            path = os.path.join(bad, name)
            if text is not None:
                with open(path, "w") as f:
                    f.write(text)
            png = os.path.join(bad, name + ".png")
            rc, out, err = run(["-o", png, path])
            lines = err.strip().splitlines()
            check(rc != 0 and len(lines) == 1 and phrase in lines[0] and not os.path.exists(png),
                  "%s: one line saying %r, non-zero exit, no PNG (rc %d: %r)" % (name, phrase, rc, err.strip()[-200:]))
        rc, out, err = run(["-o", os.path.join(bad, "no_such_dir", "x.png"), gpt_dir])
        check(rc != 0 and len(err.strip().splitlines()) == 1 and "cannot write" in err,
              "an unwritable output: one line, non-zero exit (rc %d: %r)" % (rc, err.strip()[-200:]))
    print("test_plot: %d passed, %d failed" % (passed, failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
