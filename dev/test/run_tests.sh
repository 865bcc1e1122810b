#!/usr/bin/env bash
# dev/test/run_tests.sh: runs the tests of dev/test/tests.txt (`make test` builds what they use first, then calls
# this) and adds up their summary lines. Each test prints "name: N passed, N failed" last; a test that exits
# non-zero without a failed check, or prints no summary, counts as one failure; a lab (a row named lab-...) prints
# no summary and passes when it exits 0. Ends with "total: N passed, N failed", the ten slowest tests, and a
# non-zero exit status if anything failed. Each passing line ends with the test's wall time, "(N s)".
#   dev/test/run_tests.sh                 every test (what make test runs, after building everything)
#   dev/test/run_tests.sh NAME...         only the tests with these names (shell patterns: 'moe-fp32-*'); it first
#                                         builds, through make, what they use (make test T="NAME..." does the same)
#   dev/test/run_tests.sh --list          the names, one a line
# The machine's cores are shared out, never oversubscribed by the runner: a test takes as many cores as it runs
# processes (tests.txt's second column), every process of it runs one OpenMP thread (OMP_NUM_THREADS=1), and tests
# start in the table's order while the cores they take are free, except that a test waiting for more cores than are
# free lets later ones that fit go first (so that no core idles behind it); one that needs more cores than there are
# (an mpirun -np 4 on 2 cores) takes them all. mpirun binds no process to a core
# (OMPI_MCA_hwloc_base_binding_policy=none), since two runs at once would bind theirs to the same cores.
# TEST_CORES=N shares out N cores (default: nproc). Reports still come in the table's order, each once its test and
# every test before it have ended.
set -u
cd "$(dirname "$0")/../.."
TABLE=dev/test/tests.txt
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
export OMPI_MCA_hwloc_base_binding_policy=none
# the tests' ranks share one node: Open MPI's ob1 point-to-point layer (shared memory within a node) without first
# probing for UCX, which costs every mpirun 0.2 s
export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
total_passed=0
total_failed=0
list_only=0
patterns=()
for arg in "$@"; do
    if [ "$arg" = --list ]; then list_only=1; else patterns+=("$arg"); fi
done
declare -A matched=()

CORES=${TEST_CORES:-$(nproc)}
[[ $CORES =~ ^[1-9][0-9]*$ ]] || { echo "TEST_CORES=$CORES: expected a positive number of cores"; exit 2; }

# selected NAME: whether the test runs (every test when no name is given); prints the name with --list
selected() {
    local name=$1 p hit=0
    if [ ${#patterns[@]} -eq 0 ]; then hit=1; fi
    for p in "${patterns[@]}"; do
        # shellcheck disable=SC2053
        if [[ $name == $p ]]; then hit=1; matched[$p]=1; fi
    done
    [ $hit -eq 1 ] || return 1
    if [ $list_only -eq 1 ]; then echo "$name"; return 1; fi
    return 0
}

# build_for PATH...: with chosen names, make what the test uses (make test has built everything otherwise). A
# reference is named by its prefix (build/ref/NAME): its debug state is what make builds.
build_for() {
    local a targets=()
    [ ${#patterns[@]} -gt 0 ] || return 0
    for a in "$@"; do
        case $a in
            build/ref/*_debug_state.bin | build/ref/*_model.bin) targets+=("$a") ;;
            build/ref/*) targets+=("${a}_debug_state.bin") ;;
            build/*) targets+=("$a") ;;
        esac
    done
    [ ${#targets[@]} -gt 0 ] || return 0
    local log
    log=$(make -s --no-print-directory "${targets[@]}" 2>&1) || { echo "$log"; return 1; }
}

results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
# the tests started and not yet reported, oldest first: each a folder under $results with the test's name, the
# cores it takes, its output, exit status and wall time (the last two written when it ends)
queue=()
launched=0
timings=()  # "seconds name" of every reported test

# report the oldest started test (it has ended): its summary line, its output when it failed, and the totals
report() {
    local dir=${queue[0]}
    queue=("${queue[@]:1}")
    local name out rc took
    name=$(<"$dir/name")
    out=$(<"$dir/out")
    rc=$(<"$dir/rc")
    took=$(<"$dir/took")
    timings+=("$took $name")
    if [[ $name == lab-* ]]; then
        if [ "$rc" -eq 0 ]; then
            total_passed=$((total_passed + 1))
            echo "[$name] validated ($took s)"
        else
            echo "$out" | tail -n 20
            echo "[$name] FAILED (exit status $rc)"
            total_failed=$((total_failed + 1))
        fi
        return
    fi
    local summary
    summary=$(grep -E '^[A-Za-z0-9_]+: [0-9]+ passed, [0-9]+ failed$' <<<"$out" | tail -n 1)
    if [ -z "$summary" ]; then
        echo "$out"
        echo "$name: no summary line (exit status $rc)"
        total_failed=$((total_failed + 1))
        return
    fi
    local p f
    p=$(sed -E 's/.*: ([0-9]+) passed.*/\1/' <<<"$summary")
    f=$(sed -E 's/.*, ([0-9]+) failed/\1/' <<<"$summary")
    if [ "$f" -gt 0 ] || [ "$rc" -ne 0 ]; then
        echo "$out"
        [ "$f" -eq 0 ] && f=1 && echo "$name: exit status $rc"
    fi
    echo "[$name] $summary (${took} s)"
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + f))
}

# report the oldest tests while they have ended; with `all`, start and wait for every queued test
report_ended() {
    while [ ${#queue[@]} -gt 0 ]; do
        if [ ! -e "${queue[0]}/rc" ]; then
            [ "${1:-}" = all ] || return 0
            start_waiting
            wait_for_one
            continue
        fi
        report
    done
}

# wait until a started test ends; one whose shell ended without its exit status (killed) counts as exit status 137
wait_for_one() {
    wait -n 2>/dev/null
    [ $? -eq 127 ] || return 0
    local dir
    for dir in "${queue[@]}"; do
        [ -e "$dir/started" ] && [ ! -e "$dir/rc" ] && { echo 0 >"$dir/took"; echo 137 >"$dir/rc"; }
    done
}

# the cores that the started tests still running take
cores_in_use() {
    local dir n=0
    for dir in "${queue[@]}"; do
        [ -e "$dir/started" ] && [ ! -e "$dir/rc" ] && n=$((n + $(<"$dir/cores")))
    done
    echo $n
}

# start the waiting tests that fit in the free cores, in the table's order: one that needs more cores than are free
# lets the tests after it that fit go first (it starts once enough cores are free at once; at the latest, when the
# tests after it have all started and ended)
start_waiting() {
    local dir free
    free=$((CORES - $(cores_in_use)))
    for dir in "${queue[@]}"; do
        [ "$free" -gt 0 ] || return 0
        [ -e "$dir/started" ] && continue
        [ "$(<"$dir/cores")" -le "$free" ] || continue
        touch "$dir/started"
        free=$((free - $(<"$dir/cores")))
        local cmd=()
        mapfile -d '' -t cmd <"$dir/cmd"
        # a simple command, so that the forked shell execs at once: a subshell of this script's shell that outlived
        # the script's next lines would, as it exits, seek the script file (shared with this shell) back to where it
        # forked
        bash -c 'OMP_NUM_THREADS=1 timeout 900 "${@:2}" >"$1/out" 2>&1; rc=$?; echo $SECONDS >"$1/took"; echo $rc >"$1/rc"' \
            test "$dir" "${cmd[@]}" &
    done
}

# queue_one NAME CORES COMMAND...: the test waits for CORES free cores; tests are reported in the order queued
queue_one() {
    local name=$1 cores=$2
    shift 2
    launched=$((launched + 1))
    local dir=$results/$launched
    mkdir "$dir"
    echo "$name" >"$dir/name"
    echo "$cores" >"$dir/cores"
    printf '%s\0' "$@" >"$dir/cmd"
    queue+=("$dir")
    start_waiting
    # while the tests started so far take every core, wait for one to end and report what has ended
    while [ "$(cores_in_use)" -ge "$CORES" ]; do
        wait_for_one
        report_ended
        start_waiting
    done
}

# queue_test NAME PROCS NEEDS COMMAND...: a row of the table, selected by NAME, built (with chosen names) and started.
# PROCS: 1 (one process), npN (N ranks under mpirun), or N (a script that runs up to N processes at once itself)
queue_test() {
    local name=$1 procs=$2 needs=$3
    shift 3
    selected "$name" || return 0
    # shellcheck disable=SC2086  # needs is a list of paths
    if ! build_for "$@" $needs; then
        report_ended all
        echo "[$name] FAILED: cannot build what it runs"
        total_failed=$((total_failed + 1))
        return
    fi
    local cores cmd=("$@")
    case $procs in
        np[1-9]*) cores=${procs#np}; cmd=($MPIRUN -np "$cores" "$@") ;;
        [1-9]*) cores=$procs ;;
        *) echo "$TABLE: test $name: processes '$procs': expected 1, npN or N"; exit 2 ;;
    esac
    [ "$cores" -le "$CORES" ] || cores=$CORES
    queue_one "$name" "$cores" "${cmd[@]}"
}

# the table: NAME PROCS COMMAND..., an indented "needs PATH..." line after a row naming what its command uses beyond
# the build/ paths on it; {lab} in a row stands for every lab of dev/cuda/ and {p} for bf16 and fp32
[ -r "$TABLE" ] || { echo "$TABLE: cannot read the test table"; exit 2; }
labs=()
for src in dev/cuda/*.cu; do labs+=("$(basename "$src" .cu)"); done
rows=()
while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}
    read -r -a words <<<"$line"
    [ ${#words[@]} -gt 0 ] || continue
    if [ "${words[0]}" = needs ]; then
        [ ${#rows[@]} -gt 0 ] || { echo "$TABLE: a needs line before any test"; exit 2; }
        rows[-1]="${rows[-1]}"$'\t'"${words[*]:1}"
        continue
    fi
    [ ${#words[@]} -ge 3 ] || { echo "$TABLE: '$line': expected NAME PROCS COMMAND..."; exit 2; }
    rows+=("${words[*]}"$'\t')
done <"$TABLE"
declare -A seen=()
for row in "${rows[@]}"; do
    IFS=$'\t' read -r test needs <<<"$row"
    expansions=("$test")
    if [[ $test == *"{lab}"* ]]; then
        expansions=()
        for lab in "${labs[@]}"; do for p in bf16 fp32; do
            t=${test//\{lab\}/$lab}
            expansions+=("${t//\{p\}/$p}")
        done; done
    fi
    for t in "${expansions[@]}"; do
        read -r -a words <<<"$t"
        [ -z "${seen[${words[0]}]:-}" ] || { echo "$TABLE: test ${words[0]} is defined twice"; exit 2; }
        seen[${words[0]}]=1
        queue_test "${words[0]}" "${words[1]}" "$needs" "${words[@]:2}"
    done
done

[ $list_only -eq 0 ] || exit 0
report_ended all
for p in "${patterns[@]}"; do
    if [ -z "${matched[$p]:-}" ]; then
        echo "no test is named '$p' (dev/test/run_tests.sh --list prints the names)"
        total_failed=$((total_failed + 1))
    fi
done
echo "total: $total_passed passed, $total_failed failed"
if [ ${#timings[@]} -gt 0 ]; then
    echo "the slowest tests (wall seconds):"
    printf '%s\n' "${timings[@]}" | sort -rn | head -n 10 | awk '{ printf "  %5d s  %s\n", $1, $2 }'
fi
[ "$total_failed" -eq 0 ]
