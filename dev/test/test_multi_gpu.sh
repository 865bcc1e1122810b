#!/usr/bin/env bash
# dev/test/test_multi_gpu.sh: the multi-process side of llmc/multi_gpu.cuh, through the command-line modes
# of the test_host_utils program: the NCCL id exchange of -pi tcp (3 processes over 127.0.0.1, the others
# started before rank 0) and -pi fs (3 processes, and nothing left behind in the shared directory), then
# whole process groups under mpirun: -pi mpi on 2 and 3 ranks, and -pi tcp / -pi fs on 2 ranks (on the CPU
# backend NCCL needs the processes in one MPI world, so tcp/fs run under mpirun there). Each group checks
# rank, size, the float sum over processes and the barrier.
# Usage, from the repository root after building the program (see dev/test/test_host_utils.cu):
#   dev/test/test_multi_gpu.sh [path/to/test_host_utils]     (default build/test_host_utils)
# Ends with "test_multi_gpu: N passed, N failed"; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BIN=${1:-build/test_host_utils}
MPIRUN="mpirun --allow-run-as-root --oversubscribe"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0

pass() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

if [ ! -x "$BIN" ]; then
    echo "test_multi_gpu: $BIN is not built (cpu/cucc -O2 -I dev/test -I llmc dev/test/test_host_utils.cu -o $BIN -lnccl -lmpi)"
    echo "test_multi_gpu: 0 passed, 1 failed"
    exit 1
fi

# expect_ok NAME OUTPUT-FILE COUNT: the file holds COUNT lines ending in ": ok" and no FAIL
expect_ok() {
    local name=$1 out=$2 want=$3 got
    got=$(grep -c ': ok' "$out")
    if [ "$got" -eq "$want" ] && ! grep -q FAIL "$out"; then
        pass
    else
        fail "$name: $got of $want processes ok"
        cat "$out"
    fi
}

# share_id METHOD ADDRESS|DIR PORT: 3 processes, ranks 2 and 1 first, exchange an id made from a seed
share_id() {
    local method=$1 where=$2 port=$3 seed=$RANDOM pids=() rc=0
    local out="$work/share_$method.txt"
    : >"$out"
    for rank in 2 1 0; do
        timeout 60 "$BIN" share-id "$method" "$rank" 3 "$where" "$port" 30 "$seed" >>"$out" 2>&1 &
        pids+=($!)
        [ "$rank" -eq 0 ] || sleep 0.3
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    [ "$rc" -eq 0 ] || echo "share-id $method: a process exited non-zero" >>"$out"
    expect_ok "share-id $method" "$out" 3
}

# a port from the ephemeral range that nothing listens on, so parallel runs do not collide
port=$((20000 + (RANDOM % 20000)))
share_id tcp 127.0.0.1 "$port"

mkdir -p "$work/shared"
share_id fs "$work/shared" 0
if [ -z "$(ls -A "$work/shared")" ]; then
    pass
else
    fail "share-id fs: files left behind in the shared directory: $(ls -A "$work/shared")"
fi

for np in 2 3; do
    out="$work/mpi_$np.txt"
    timeout 120 $MPIRUN -np "$np" "$BIN" mpi-sum >"$out" 2>&1 || echo "mpirun exited non-zero" >>"$out"
    expect_ok "-pi mpi on $np ranks" "$out" "$np"
done

out="$work/init_tcp.txt"
timeout 120 $MPIRUN -np 2 "$BIN" init tcp 127.0.0.1 >"$out" 2>&1 || echo "mpirun exited non-zero" >>"$out"
expect_ok "-pi tcp on 2 ranks under mpirun" "$out" 2

mkdir -p "$work/shared_init"
out="$work/init_fs.txt"
timeout 120 $MPIRUN -np 2 "$BIN" init fs "$work/shared_init" >"$out" 2>&1 || echo "mpirun exited non-zero" >>"$out"
expect_ok "-pi fs on 2 ranks under mpirun" "$out" 2

echo "test_multi_gpu: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
