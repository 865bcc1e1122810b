#!/usr/bin/env bash
# cpu/test/check/run_probes.sh: the probe suite of the checking build (cpu/cucc --check). Every NAME.bug.cu
# here is a deliberate GPU bug that one check must report (`// expect: <check>`: exit status 86 and a stderr
# line `cucc: <check>: ...`); every NAME.ok.cu is a correct program that must exit 0 with no `cucc: ` line.
# Header lines read: `// expect: CHECK`, `// ranks: N` (run under mpirun -np N).
#   cpu/test/check/run_probes.sh                  build (into build/check_probes/) and run every probe
#   cpu/test/check/run_probes.sh race_nosync 'mem_*' init_counter.bug   a subset: names, NAME.bug/.ok, globs
#   cpu/test/check/run_probes.sh --build          only the build, where out of date (make test's build phase)
# The probes are built together, as one program whose first argument picks the probe (unity.sh), linked with every
# library a probe may use (cuBLAS, cuBLASLt, NCCL, MPI); each runs in a process of its own. JOBS=N sets the runs in
# parallel (2). The program is rebuilt when a probe, or anything under cpu/ outside cpu/build/, is newer than it.
# Prints `PASS|FAIL probe: why` per probe and last `check_probes: N passed, N failed`; exits 1 on any failure (2 on a
# bad argument).
set -u
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
cd "$ROOT" || exit 2
BUILD=$ROOT/build/check_probes
JOBS=${JOBS:-2}
mkdir -p "$BUILD/logs"

# ---- the probes to run ----------------------------------------------------------------------------------
all=()
for f in "$HERE"/*.bug.cu "$HERE"/*.ok.cu; do
    [ -e "$f" ] && all+=("$(basename "$f" .cu)")
done
mapfile -t all < <(printf '%s\n' "${all[@]}" | sort)
probes=()
build_only=0
if [ "${1:-}" = --build ]; then
    build_only=1
elif [ $# -eq 0 ]; then
    probes=("${all[@]}")
else
    for arg in "$@"; do
        arg=${arg%.cu}
        found=0
        for p in "${all[@]}"; do
            # shellcheck disable=SC2053  # the argument is a glob on purpose
            if [[ $p == $arg || ${p%.*} == $arg ]]; then
                found=1
                [[ " ${probes[*]-} " == *" $p "* ]] || probes+=("$p")
            fi
        done
        [ $found = 1 ] || { echo "run_probes.sh: no probe matches '$arg'" >&2; exit 2; }
    done
fi

header() {  # header FILE KEY: the value of the first `// KEY: value` line
    sed -n "s|^// $2:[[:space:]]*||p" "$1" | head -n 1 | sed 's/[[:space:]]*$//'
}

# ---- build: every probe in one program (unity.sh), rebuilt when out of date --------------------------------
# One g++ call parses the CUDA headers and the backend's once for all of them (about 8 s, where one build per probe
# took a minute of CPU). A probe that does not compile fails them all, with the compiler's first error.
PROGRAM=$BUILD/probes
build_log=$BUILD/logs/build
if [ ! -x "$PROGRAM" ] || [ -n "$(find cpu -path cpu/build -prune -o -type f -newer "$PROGRAM" -print -quit)" ]; then
    echo "run_probes.sh: building the ${#all[@]} probes as one program with cpu/cucc --check" >&2
    (cd "$HERE" && ./unity.sh "${all[@]/%/.cu}") >"$BUILD/probes.cu"
    if ! cpu/cucc --check -O1 -I "$HERE" "$BUILD/probes.cu" -o "$PROGRAM" -lcublas -lcublasLt -lnccl -lmpi \
        >"$build_log" 2>&1; then
        rm -f "$PROGRAM"
    fi
fi
if [ $build_only = 1 ]; then
    [ -x "$PROGRAM" ] || { echo "run_probes.sh: the probes do not build: $(grep -m 1 -E 'error' "$build_log")" >&2; exit 1; }
    exit 0
fi

export -f header
export HERE BUILD PROGRAM build_log

# ---- run and judge, in parallel; results are printed in name order --------------------------------------
run_one() {  # run_one PROBE: writes $BUILD/logs/PROBE.result (one line: PASS|FAIL probe: why)
    local p=$1 src="$HERE/$1.cu" expect ranks rc first line
    local res=$BUILD/logs/$p.result out=$BUILD/logs/$p.out errf=$BUILD/logs/$p.err
    expect=$(header "$src" expect)
    ranks=$(header "$src" ranks)
    if [ ! -x "$PROGRAM" ]; then
        first=$(grep -m 1 -E 'error|cucc:' "$build_log" || head -n 1 "$build_log")
        echo "FAIL $p: build failed: ${first:0:300}" >"$res"
        return
    fi
    if [[ $p == *.bug && -z $expect ]]; then
        echo "FAIL $p: no '// expect: <check>' line" >"$res"
        return
    fi
    # (in a command substitution whose stderr is discarded, so that bash's own "Aborted" notes stay out). Under mpirun
    # a bug probe's reporting process exits first, having printed its report: the job's other processes are killed at
    # once, not after Open MPI's second of grace before each of its signals.
    if [ -n "$ranks" ]; then
        rc=$({ OMPI_MCA_odls_base_sigkill_timeout=0 timeout 120 mpirun --allow-run-as-root --oversubscribe -np "$ranks" "$PROGRAM" "$p" >"$out" 2>"$errf"
            echo $?; } 2>/dev/null)
    else
        rc=$({ timeout 120 "$PROGRAM" "$p" >"$out" 2>"$errf"; echo $?; } 2>/dev/null)
    fi
    # a report is a line `cucc: <check>: `; under mpirun a rank prefix may come before it
    local anchor='^'
    [ -n "$ranks" ] && anchor='(^|[]>:)[:space:]])'
    line=$(grep -m 1 -E "${anchor}cucc: [a-z]+check: " "$errf")
    first=${line:-$(grep -m 1 -E "${anchor}cucc: " "$errf")}
    first=${first:-$(grep -m 1 -v '^[[:space:]]*$' "$errf")}
    first=${first:0:300}
    local why_rc="exit $rc"
    [ "$rc" = 124 ] && why_rc="exit 124 (timed out after 120 s)"
    if [[ $p == *.bug ]]; then
        if [ "$rc" = 86 ] && grep -q -E "${anchor}cucc: ${expect}: " "$errf"; then
            line=$(grep -m 1 -E "${anchor}cucc: ${expect}: " "$errf")
            echo "PASS $p: ${line:0:200}" >"$res"
        elif [ "$rc" = 86 ] && [ -n "$line" ]; then
            echo "FAIL $p: expected $expect, other check reported: $first" >"$res"
        elif grep -q -E "${anchor}cucc: ${expect}: " "$errf"; then
            echo "FAIL $p: $expect reported but $why_rc (want 86): $first" >"$res"
        else
            echo "FAIL $p: $expect not reported, $why_rc${first:+: $first}" >"$res"
        fi
    else
        if [ "$rc" = 0 ] && ! grep -q -E "${anchor}cucc: " "$errf"; then
            echo "PASS $p: exit 0, no report" >"$res"
        elif [ "$rc" = 0 ]; then
            echo "FAIL $p: correct program reported: $first" >"$res"
        else
            echo "FAIL $p: correct program, $why_rc${first:+: $first}" >"$res"
        fi
    fi
}
export -f run_one

for p in "${probes[@]}"; do rm -f "$BUILD/logs/$p.result"; done
# shellcheck disable=SC2016  # $1 is the inner bash's
printf '%s\n' "${probes[@]}" | xargs -P "$JOBS" -I{} bash -c 'run_one "$1"' _ {}

passed=0
failed=0
for p in "${probes[@]}"; do
    if [ -s "$BUILD/logs/$p.result" ]; then
        cat "$BUILD/logs/$p.result"
    else
        echo "FAIL $p: the runner produced no result" >"$BUILD/logs/$p.result"
        cat "$BUILD/logs/$p.result"
    fi
    if grep -q '^PASS ' "$BUILD/logs/$p.result"; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
done
echo "check_probes: $passed passed, $failed failed"
[ $failed = 0 ]
