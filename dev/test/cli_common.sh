# dev/test/cli_common.sh: what the command-line tests share (sourced, from the repository's root, by the
# dev/test/test_*.sh scripts that run the trainers and tools): the Python and mpirun they run, a work directory removed
# on exit, counting checks, running a command that must fail with a given message (an mpirun job's verdict taken later,
# expect_job_error), comparing step losses, and a pre-emption round trip.
PYTHON=/usr/bin/python3
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
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

# expect_job_error NAME EXPECTED-TEXT mpirun ...: expect_error for an mpirun job, its verdict counted by
# settle_job_errors (which the script calls before its summary). After a job's processes exit non-zero, mpirun takes 1
# to 2 s more (Open MPI's kill sequence sleeps before each of its signals, whether or not a process is left, and then
# exits non-zero): the script goes on once the job's processes have ended, so that only that idle wait overlaps what
# follows, never a process of the job.
job_errors=()
expect_job_error() {
    local name=$1 expected=$2 dir
    shift 2
    dir=$(mktemp -d)
    printf '%s' "$name" >"$dir/name"
    printf '%s' "$expected" >"$dir/expected"
    "$@" >"$dir/out" 2>&1 &
    local job=$! seen=0
    echo "$job" >"$dir/pid"
    job_errors+=("$dir")
    # until mpirun's processes (its children) have started and ended, or mpirun itself has ended
    while kill -0 "$job" 2>/dev/null; do
        if pgrep -P "$job" >/dev/null; then seen=1; elif [ $seen = 1 ]; then break; fi
        sleep 0.02
    done
}
settle_job_errors() {
    local dir rc name expected
    for dir in "${job_errors[@]}"; do
        wait "$(<"$dir/pid")"
        rc=$?
        name=$(<"$dir/name")
        expected=$(<"$dir/expected")
        if [ $rc -eq 0 ]; then fail "$name: accepted"
        elif grep -qF -- "$expected" "$dir/out"; then pass
        else fail "$name: output lacks '$expected': $(tail -2 "$dir/out")"; fi
        rm -rf "$dir"
    done
    job_errors=()
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
