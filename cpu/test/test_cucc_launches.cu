// cpu/test/test_cucc_launches.cu: launch and declaration forms that cpu/cucc must rewrite as nvcc
// reads them: template kernels with deduced and explicit arguments, namespaced kernels, launches
// spread over lines and inside macros, a kernel called through a function pointer, struct arguments
// by value, default-argument launch configurations, <<< inside comments and strings (left alone),
// aligned and volatile shared declarations, a __shared__ array sized by a template parameter.
// Built and run by cpu/test/test_cucc.sh (and compiles with nvcc for a GPU).
#include <cuda_runtime.h>
#include "test_common.h"

struct Params {
    float scale;
    int offset;
};

template <typename T>
__global__ void fill_deduced(T* out, T value, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value + (T)i;
}

template <int BLOCK, typename T>
__global__ void scaled_copy(T* out, const T* in, Params p, int n) {
    __shared__ __align__(16) T stage[BLOCK];
    __shared__ volatile int flag;
    int i = blockIdx.x * BLOCK + threadIdx.x;
    if (threadIdx.x == 0) flag = 7;
    stage[threadIdx.x] = i < n ? in[i] : (T)0;
    __syncthreads();
    if (i < n) out[i] = stage[threadIdx.x] * (T)p.scale + (T)p.offset + (T)(flag - 7);
}

namespace kernels {
__global__ void add_one(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1;
}
}  // namespace kernels

__global__ void times_two(int* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= 2;
}

#define LAUNCH_ADD_ONE(ptr, n) kernels::add_one<<<((n) + 31) / 32, 32>>>(ptr, n)

int main(void) {
    const int n = 100;
    float* f;
    int* x;
    cudaMalloc(&f, n * sizeof(float));
    cudaMalloc(&x, n * sizeof(int));
    const char* not_a_launch = "kernel<<<1, 1>>>(x)";  // a string, left alone
    // a comment, left alone: times_two<<<1, 1>>>(x, n);
    check(strlen(not_a_launch) == 19, "string literal with <<< untouched");

    fill_deduced<<<(n + 63) / 64, 64>>>(f, 1.5f, n);  // T deduced as float
    float hf[n];
    cudaMemcpy(hf, f, sizeof(hf), cudaMemcpyDeviceToHost);
    int bad = 0;
    for (int i = 0; i < n; i++) bad += hf[i] != 1.5f + (float)i;
    check(bad == 0, "template kernel with deduced arguments");

    float* g;
    cudaMalloc(&g, n * sizeof(float));
    Params p = {2.0f, 3};
    scaled_copy<64, float>
        <<<(n + 63) / 64,
           64,
           0,
           0>>>(g, f, p, n);
    cudaMemcpy(hf, g, sizeof(hf), cudaMemcpyDeviceToHost);
    bad = 0;
    for (int i = 0; i < n; i++) bad += hf[i] != (1.5f + (float)i) * 2.0f + 3.0f;
    check(bad == 0, "explicit template arguments, multi-line launch, struct by value, aligned/volatile shared");
    check(__LINE__ == 75, "line numbers are preserved through the rewrite (line %d)", __LINE__);

    cudaMemset(x, 0, n * sizeof(int));
    LAUNCH_ADD_ONE(x, n);
    void (*kernel_pointer)(int*, int) = times_two;
    kernel_pointer<<<dim3((n + 31) / 32), dim3(32)>>>(x, n);
    int hx[n];
    cudaMemcpy(hx, x, sizeof(hx), cudaMemcpyDeviceToHost);
    bad = 0;
    for (int i = 0; i < n; i++) bad += hx[i] != 2;
    check(bad == 0, "namespaced kernel in a macro, kernel through a function pointer");
    check(cudaGetLastError() == cudaSuccess, "no launch error");
    cudaFree(f);
    cudaFree(g);
    cudaFree(x);
    return test_summary("test_cucc_launches");
}
