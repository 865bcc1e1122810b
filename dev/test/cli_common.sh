# dev/test/cli_common.sh: what the trainers' command-line tests share (sourced by dev/test/test_train_gpt.sh and
# dev/test/test_train_moe.sh): counting checks, and running a command that must fail with a given message.
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
