// cpu/test/test_sanitize.cu: `cpu/cucc --sanitize` must catch out-of-bounds accesses inside kernels —
// in static shared memory, dynamic shared memory and global memory — with AddressSanitizer.
// CPU backend only. `make test` builds it with
//   cpu/cucc --sanitize -O1 -I dev/test cpu/test/test_sanitize.cu -o build/test_sanitize
// and runs ./build/test_sanitize, which re-runs itself once per planted bug and checks the report.
// (The clean half of the check, that sanitized kernels run without false reports, is test_runtime
// built with --sanitize, which `make test` also runs.)
#include <cuda_runtime.h>
#include "test_common.h"

// 33 threads write a 32-element static shared array: thread 32 writes one past the end.
__global__ void static_shared_overflow(float* out) {
    __shared__ float buf[32];
    buf[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = buf[threadIdx.x % 32];
}

// The same through a pointer, where the array type is gone: AddressSanitizer's redzone catches it.
__global__ void static_shared_pointer_overflow(float* out) {
    __shared__ float buf[32];
    float* p = buf;
    p[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = buf[threadIdx.x % 32];
}

__global__ void dynamic_shared_overflow(float* out, int n) {
    extern __shared__ float dyn[];
    dyn[threadIdx.x] = 1.0f;  // the launch gives n floats, blockDim.x = n + 1
    __syncthreads();
    out[threadIdx.x % n] = dyn[threadIdx.x % n];
}

__global__ void global_overflow(float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = 1.0f;  // no bounds check: the grid covers more than n
    (void)n;
}

int main(int argc, char** argv) {
    if (argc > 1) {
        float* d;
        cudaMalloc(&d, 100 * sizeof(float));
        if (!strcmp(argv[1], "static_shared")) static_shared_overflow<<<1, 33>>>(d);
        else if (!strcmp(argv[1], "static_shared_pointer")) static_shared_pointer_overflow<<<1, 33>>>(d);
        else if (!strcmp(argv[1], "dynamic_shared")) dynamic_shared_overflow<<<1, 65, 64 * sizeof(float)>>>(d, 64);
        else if (!strcmp(argv[1], "global")) global_overflow<<<2, 64>>>(d, 100);
        cudaDeviceSynchronize();
        return 0;  // reaching this is the failure the parent detects
    }
    // an index into the array itself is caught by UndefinedBehaviorSanitizer's bounds check
    const char* stat[] = {"test_sanitize.cu:14", "index 32 out of bounds for type 'float [32]'", nullptr};
    const char* stat_ptr[] = {"AddressSanitizer", "heap-buffer-overflow", "static_shared_pointer_overflow", nullptr};
    const char* dyn[] = {"AddressSanitizer", "heap-buffer-overflow", "dynamic_shared_overflow", nullptr};
    const char* glob[] = {"AddressSanitizer", "heap-buffer-overflow", "global_overflow", nullptr};
    expect_child_failure(argv[0], "static_shared", stat);
    expect_child_failure(argv[0], "static_shared_pointer", stat_ptr);
    expect_child_failure(argv[0], "dynamic_shared", dyn);
    expect_child_failure(argv[0], "global", glob);
    return test_summary("test_sanitize");
}
