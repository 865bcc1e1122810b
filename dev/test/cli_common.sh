# dev/test/cli_common.sh: what the command-line tests share (sourced, from the repository's root, by the
# dev/test/test_*.sh scripts that run the trainers and tools): the Python and mpirun they run, a work directory removed
# on exit, counting checks, running a command that must fail with a given message, comparing step losses, and a
# pre-emption round trip.
PYTHON=/usr/bin/python3
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0
pass() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_error NAME EXPECTED-TEXT COMMAND...: the command must exit non-zero and print EXPECTED-TEXT. An mpirun job
# whose process exits non-zero ends at once: Open MPI's kill sequence would otherwise sleep a second before each of its
# signals to the job's other processes (odls_base_sigkill_timeout), whether or not one is left. A refusal prints its
# line on every process before it exits, so the first one to exit has printed it.
expect_error() {
    local name=$1 expected=$2
    shift 2
    local out
    if out=$(OMPI_MCA_odls_base_sigkill_timeout=0 "$@" 2>&1); then fail "$name: accepted"; return; fi
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

# Pre-emption (llmc/preemption.h): the last process of a job stopped before step 4 (TRAIN_TEST_STOP_AT_STEP) gets
# SIGTERM (REPEAT "again": again and again until it exits) and goes on; the job must write a checkpoint of step 4 and
# exit 143, and resumed print the uninterrupted run's last two steps bit for bit. Needs $MPIRUN, $work, pass, fail.
stopped_child() {  # MPIRUN-PID: the pid of its stopped child, once there is one
    for _ in $(seq 600); do
        for child in $(pgrep -P "$1"); do
            [ "$(ps -o stat= -p "$child" 2>/dev/null | cut -c1)" = T ] && { echo "$child"; return 0; }
        done
        sleep 0.1
    done
    return 1
}
preempted() {  # NAME NP REPEAT TRAINER FLAGS...: a run of 6 steps stopped before step 4 and signalled, then resumed
    local name=$1 np=$2 repeat=$3
    shift 3
    $MPIRUN -np "$np" "$@" -o "$work/${name}_full" >"$work/${name}_full.log" 2>&1 ||
        fail "$name: the uninterrupted run: $(tail -3 "$work/${name}_full.log")"
    TRAIN_TEST_STOP_AT_STEP=4 TRAIN_TEST_STOP_RANK=$((np - 1)) $MPIRUN -np "$np" -x TRAIN_TEST_STOP_AT_STEP \
        -x TRAIN_TEST_STOP_RANK "$@" -o "$work/$name" >"$work/$name.log" 2>&1 &
    local job=$! child
    child=$(stopped_child $job) || { fail "$name: no process stopped before step 4"; wait $job; return; }
    kill -TERM "$child"
    kill -CONT "$child"
    while [ "$repeat" = again ] && kill -TERM "$child" 2>/dev/null; do sleep 0.01; done
    wait $job
    local rc=$?
    if [ $rc -eq 143 ] && grep -q "^step 4: SIGTERM received: checkpoint written; exiting with status 143" "$work/$name.log" &&
        [ -e "$work/$name/DONE_00000004" ] && [ ! -e "$work/$name/DONE_00000006" ]; then pass; else
        fail "$name: no checkpoint of step 4 and exit 143 at the signal (exit $rc): $(grep -v '^[|+]' "$work/$name.log" | tail -3)"; fi
    $MPIRUN -np "$np" "$@" -o "$work/$name" -y 1 >"$work/${name}_resumed.log" 2>&1 ||
        fail "$name: resumed: $(tail -3 "$work/${name}_resumed.log")"
    want=$(step_fields "$work/${name}_full.log" | tail -n 2)
    if [ -n "$want" ] && [ "$(step_fields "$work/${name}_resumed.log")" = "$want" ]; then pass; else
        fail "$name: the resumed run differs from the uninterrupted one"; fi
}
