// cpu/test/test_faults.cu: the CPU backend's fault reports. Each case is a kernel that a GPU would hang
// on or execute with undefined results; the backend must abort and say what happened, naming the kernel,
// the block and the place. CPU backend only (on a GPU these kernels hang): `make test` builds it with
//   cpu/cucc -O2 -I dev/test cpu/test/test_faults.cu -o build/test_faults
// and runs ./build/test_faults, which re-runs itself once per case (`./build/test_faults <case>`) and
// checks that the child fails with the expected message.
#include <assert.h>
#include <cuda_runtime.h>
#include "test_common.h"

// Lane 0 of warp 0 waits at the block barrier (one place: wait_for_block) while lanes 1-31 wait for it
// at a shuffle.
__device__ void wait_for_block() { __syncthreads(); }

__global__ void deadlock_kernel(float* out) {
    float v = (float)threadIdx.x;
    if (threadIdx.x == 0) {
        wait_for_block();
    } else if (threadIdx.x < 32) {
        v = __shfl_sync(0xffffffff, v, 0);
    } else {
        wait_for_block();
    }
    out[threadIdx.x] = v;
}

__global__ void divergent_barrier_kernel(float* out) {
    if (threadIdx.x < 32) {
        out[threadIdx.x] = 1.0f;
        __syncthreads();
    } else {
        out[threadIdx.x] = 2.0f;
        __syncthreads();
    }
}

__global__ void exited_lane_kernel(float* out) {
    if (threadIdx.x >= 16) return;
    float v = __shfl_down_sync(0xffffffff, (float)threadIdx.x, 16);
    out[threadIdx.x] = v;
}

__global__ void mask_mismatch_kernel(float* out) {
    unsigned mask = threadIdx.x == 1 ? 0xfffffffeu : 0xffffffffu;
    out[threadIdx.x] = __shfl_xor_sync(mask, (float)threadIdx.x, 1);
}

__global__ void lane_not_in_mask_kernel(float* out) {
    out[threadIdx.x] = __shfl_sync(0x1u, (float)threadIdx.x, 0);
}

__global__ void trap_kernel(float* out) {
    if (threadIdx.x == 7) __trap();
    out[threadIdx.x] = 0.0f;
}

__global__ void assert_kernel(const float* in) {
    assert(in[threadIdx.x] < 0.0f);
}

static int run_case(const char* mode) {
    float* d;
    cudaMalloc(&d, 64 * sizeof(float));
    cudaMemset(d, 0, 64 * sizeof(float));
    if (!strcmp(mode, "deadlock")) deadlock_kernel<<<2, 64>>>(d);
    else if (!strcmp(mode, "divergent_barrier")) divergent_barrier_kernel<<<1, 64>>>(d);
    else if (!strcmp(mode, "exited_lane")) exited_lane_kernel<<<1, 32>>>(d);
    else if (!strcmp(mode, "mask_mismatch")) mask_mismatch_kernel<<<1, 32>>>(d);
    else if (!strcmp(mode, "lane_not_in_mask")) lane_not_in_mask_kernel<<<1, 32>>>(d);
    else if (!strcmp(mode, "trap")) trap_kernel<<<1, 32>>>(d);
    else if (!strcmp(mode, "assert")) assert_kernel<<<1, 32>>>(d);
    else {
        fprintf(stderr, "unknown case %s\n", mode);
        return 2;
    }
    cudaDeviceSynchronize();
    return 0;  // reaching this is the failure the parent detects
}

int main(int argc, char** argv) {
    if (argc > 1) return run_case(argv[1]);
    const char* deadlock[] = {"deadlock in kernel 'deadlock_kernel' block (", "__syncthreads (", "test_faults.cu:",
                              "__shfl_sync (", nullptr};
    const char* divergent[] = {"kernel 'divergent_barrier_kernel' block (0,0,0)", "at the same place", nullptr};
    const char* exited[] = {"kernel 'exited_lane_kernel'", "reads lane 16, which has exited", nullptr};
    const char* mismatch[] = {"kernel 'mask_mismatch_kernel'", "must agree on the mask", nullptr};
    const char* not_in_mask[] = {"kernel 'lane_not_in_mask_kernel'", "does not include the calling lane", nullptr};
    const char* trap[] = {"kernel 'trap_kernel' block (0,0,0) thread (7,0,0)", "__trap()", nullptr};
    const char* assertion[] = {"Assertion", "in[threadIdx.x] < 0.0f", nullptr};
    expect_child_failure(argv[0], "deadlock", deadlock);
    expect_child_failure(argv[0], "divergent_barrier", divergent);
    expect_child_failure(argv[0], "exited_lane", exited);
    expect_child_failure(argv[0], "mask_mismatch", mismatch);
    expect_child_failure(argv[0], "lane_not_in_mask", not_in_mask);
    expect_child_failure(argv[0], "trap", trap);
    expect_child_failure(argv[0], "assert", assertion);
    return test_summary("test_faults");
}
