# dev/test/cli_common.sh: what the trainers' command-line tests share (sourced by dev/test/test_train_gpt.sh and
# dev/test/test_train_moe.sh): counting checks, running a command that must fail with a given message, and comparing step losses.
passed=0
failed=0
pass() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_error NAME EXPECTED-TEXT COMMAND...: the command must exit non-zero and print EXPECTED-TEXT
expect_error() {
    local name=$1 expected=$2
    shift 2
    local out
    if out=$("$@" 2>&1); then fail "$name: accepted"; return; fi
    if grep -qF -- "$expected" <<<"$out"; then pass; else fail "$name: output lacks '$expected': $(tail -2 <<<"$out")"; fi
}

# the step lines of a log without their timing fields (everything from "| lr" on)
step_fields() { grep -E '^step [0-9]+/[0-9]+ \| loss' "$1" | sed -E 's/ \| lr .*//'; }

# close_losses A B STEPS: the step lines of logs A and B have STEPS steps each whose losses agree within 1e-5
# and gradient norms within 1e-4 (relative): fp32 runs that sum the same terms in another order (ranks
# splitting a batch, experts batching an MLP). Prints both.
close_losses() {
    /usr/bin/python3 - "$1" "$2" "$3" <<'PY'
import re, sys
def steps(path):
    return [(float(m.group(1)), float(m.group(2))) for m in
            re.finditer(r"^step \d+/\d+ \| loss ([-\d.e+]+) .*?\| norm ([-\d.e+]+)", open(path).read(), re.M)]
a, b, n = steps(sys.argv[1]), steps(sys.argv[2]), int(sys.argv[3])
print("  %s: %s\n  %s: %s" % (sys.argv[1].split("/")[-1], a, sys.argv[2].split("/")[-1], b))
sys.exit(0 if len(a) == n and len(b) == n and all(abs(x[0] - y[0]) <= 1e-5 * abs(x[0]) and
                                                  abs(x[1] - y[1]) <= 1e-4 * abs(x[1]) for x, y in zip(a, b)) else 1)
PY
}
