// hang_x_grid_barrier (bug): a hand-rolled grid-wide barrier (atomicAdd on a counter, then spin with a
// volatile load until it reaches gridDim.x) between two phases of one launch; without a cooperative launch
// the blocks are not guaranteed to be resident together, so early blocks can wait forever. expect hangcheck.
// expect: hangcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ void grid_sync(unsigned* count) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(count, 1u);
        while (*(volatile unsigned*)count < gridDim.x) {}
    }
    __syncthreads();
}

__global__ void phase1(const float* in, float* mid, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) mid[i] = in[i] * in[i];
}
__global__ void phase2(const float* mid, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = mid[(i + 64) % n] - mid[i];
}
__global__ void both(const float* in, float* mid, float* out, int n, unsigned* count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) mid[i] = in[i] * in[i];
    grid_sync(count);  // bug: not a valid grid barrier without a cooperative launch
    if (i < n) out[i] = ((volatile float*)mid)[(i + 64) % n] - ((volatile float*)mid)[i];
}

int main() {
    const int n = 256;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 7);
    float *in, *mid, *out;
    unsigned* count;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&mid, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMalloc(&count, sizeof(unsigned)));
    CK(cudaMemset(count, 0, sizeof(unsigned)));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    both<<<n / 64, 64>>>(in, mid, out, n, count);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        float a = h[(i + 64) % n], b = h[i];
        if (r[i] != a * a - b * b) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(mid)); CK(cudaFree(out)); CK(cudaFree(count));
    printf("ok\n");
    return 0;
}
