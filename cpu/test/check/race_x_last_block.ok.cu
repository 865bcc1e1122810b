// race_x_last_block (ok): the "last block" single-pass reduction of the CUDA threadFenceReduction sample and
// the programming guide: each block stores its partial sum, __threadfence(), takes a ticket with atomicInc;
// the block that draws the last ticket reads every partial (plain loads) and writes the total. The fence
// before the ticket and the ticket's atomic make the other blocks' partials visible. Correct; twin of
// race_x_last_block.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ unsigned int retired = 0;

__global__ void sum_single_pass(const float* x, float* partial, float* total, int n) {
    __shared__ float s[128];
    __shared__ bool am_last;
    int t = threadIdx.x, i = blockIdx.x * 128 + t;
    s[t] = i < n ? x[i] : 0.0f;
    __syncthreads();
    for (int k = 64; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) {
        partial[blockIdx.x] = s[0];
        __threadfence();
        unsigned int ticket = atomicInc(&retired, gridDim.x);
        am_last = ticket == gridDim.x - 1;
    }
    __syncthreads();
    if (am_last && t == 0) {
        float acc = 0.0f;
        for (unsigned b = 0; b < gridDim.x; b++) acc += partial[b];
        *total = acc;
        retired = 0;
    }
}

int main() {
    const int n = 1000, blocks = (n + 127) / 128;
    static float h[n];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 8) * 0.25f;
    float *x, *partial, *total, r;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&partial, blocks * sizeof(float)));
    CK(cudaMalloc(&total, sizeof(float)));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    sum_single_pass<<<blocks, 128>>>(x, partial, total, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(&r, total, sizeof r, cudaMemcpyDeviceToHost));
    float want = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float p = 0.0f;
        for (int i = b * 128; i < n && i < b * 128 + 128; i++) p += h[i];
        want += p;
    }
    if (r != want) { fprintf(stderr, "total = %g, want %g\n", r, want); return 1; }
    CK(cudaFree(x)); CK(cudaFree(partial)); CK(cudaFree(total));
    printf("ok\n");
    return 0;
}
