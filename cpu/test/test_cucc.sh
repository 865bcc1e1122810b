#!/usr/bin/env bash
# cpu/test/test_cucc.sh: tests of the cpu/cucc driver itself. It builds and runs
# cpu/test/test_cucc_launches.cu (launch forms that must be rewritten as nvcc reads them), and checks
# that what the CPU backend cannot build is refused with one clear line: -lcudnn, an unknown option,
# namespace-scope __shared__, a launch with no closing >>>, several __shared__ variables in one
# declaration. Run from the repository root: cpu/test/test_cucc.sh (make test does).
set -u
cd "$(dirname "$0")/../.."
CUCC=cpu/cucc
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
passed=0
failed=0

pass() { passed=$((passed + 1)); }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }

# expect_refusal NAME EXPECTED-TEXT CUCC-ARGS...: cucc must exit non-zero and say EXPECTED-TEXT
expect_refusal() {
    local name=$1 expected=$2
    shift 2
    local out
    if out=$("$CUCC" "$@" -o "$work/out" 2>&1); then
        fail "$name: cucc accepted it"
    elif ! grep -qF -- "$expected" <<<"$out"; then
        fail "$name: message lacks '$expected': $out"
    else
        pass
    fi
}

if "$CUCC" -O2 -I dev/test cpu/test/test_cucc_launches.cu -o "$work/launches" && "$work/launches"; then
    pass
else
    fail "test_cucc_launches built with cucc"
fi

cat >"$work/ok.cu" <<'CU'
__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }
int main() { return 0; }
CU
expect_refusal "-lcudnn" "cuDNN is GPU-only" "$work/ok.cu" -lcudnn
expect_refusal "unknown option" "unknown option --frobnicate" --frobnicate "$work/ok.cu"
expect_refusal "missing source" "no such file" "$work/missing.cu"
# -arch/-gencode are accepted and ignored
if "$CUCC" -arch=sm_90 -gencode arch=compute_80,code=sm_80 "$work/ok.cu" -o "$work/ok" 2>"$work/err"; then pass; else
    fail "-arch/-gencode should be accepted: $(cat "$work/err")"; fi

cat >"$work/ns_shared.cu" <<'CU'
__shared__ float everywhere[32];
__global__ void k(float* x) { x[threadIdx.x] = everywhere[threadIdx.x]; }
int main() { return 0; }
CU
expect_refusal "namespace-scope __shared__" "ns_shared.cu:1: __shared__ at namespace scope" "$work/ns_shared.cu"

cat >"$work/unclosed.cu" <<'CU'
__global__ void k(float* x) { x[threadIdx.x] = 1.0f; }
int main() { float* x = 0; k<<<1, 32(x); return 0; }
CU
expect_refusal "unclosed launch" "unclosed.cu:2: no >>> closes this kernel launch" "$work/unclosed.cu"

cat >"$work/two_shared.cu" <<'CU'
__global__ void k(float* x) {
    __shared__ float a[32], b[32];
    a[threadIdx.x] = b[threadIdx.x] = 1.0f;
    x[threadIdx.x] = a[threadIdx.x];
}
int main() { return 0; }
CU
expect_refusal "two __shared__ in one declaration" "two_shared.cu:2: declare one __shared__ variable per statement" "$work/two_shared.cu"

# a header included by the .cu is rewritten too (its launch would otherwise reach g++)
mkdir -p "$work/inc/sub"
cat >"$work/inc/sub/launcher.cuh" <<'CU'
__global__ void set_seven(int* x) { __shared__ int s; s = 7; __syncthreads(); x[threadIdx.x] = s; }
inline void launch_set_seven(int* x) { set_seven<<<1, 4>>>(x); }
CU
cat >"$work/inc/main.cu" <<'CU'
#include <cuda_runtime.h>
#include "sub/launcher.cuh"
int main() {
    int* x; cudaMalloc(&x, 4 * sizeof(int)); launch_set_seven(x);
    int h[4]; cudaMemcpy(h, x, sizeof(h), cudaMemcpyDeviceToHost);
    return h[0] == 7 && h[3] == 7 ? 0 : 1;
}
CU
if "$CUCC" "$work/inc/main.cu" -o "$work/inc/main" && "$work/inc/main"; then pass; else fail "launch in an included header"; fi
# ... also when included by absolute path, or through -I with angle brackets
sed "s#\"sub/launcher.cuh\"#\"$work/inc/sub/launcher.cuh\"#" "$work/inc/main.cu" >"$work/inc/main_abs.cu"
if "$CUCC" "$work/inc/main_abs.cu" -o "$work/inc/main_abs" && "$work/inc/main_abs"; then pass; else fail "header included by absolute path"; fi
sed 's#"sub/launcher.cuh"#<launcher.cuh>#' "$work/inc/main.cu" >"$work/main_angle.cu"
if "$CUCC" -I "$work/inc/sub" "$work/main_angle.cu" -o "$work/main_angle" && "$work/main_angle"; then pass; else fail "header included through -I"; fi

# device printf reaches stdout, one line per thread
cat >"$work/hello.cu" <<'CU'
#include <cstdio>
__global__ void hello(int tag) { printf("hello %d from block %d thread %d\n", tag, blockIdx.x, threadIdx.x); }
int main() { hello<<<2, 3>>>(42); return 0; }
CU
if "$CUCC" "$work/hello.cu" -o "$work/hello" && [ "$("$work/hello" | grep -c '^hello 42 from block [01] thread [012]$')" = 6 ]; then
    pass
else
    fail "device printf"
fi

echo "test_cucc: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
