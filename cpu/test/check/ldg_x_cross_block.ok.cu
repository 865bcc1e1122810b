// ldg_x_cross_block (ok): the table is written by a first kernel and read with __ldg by a second kernel on
// the same stream: read-only for the whole second kernel. Correct twin of ldg_x_cross_block.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void build_table(float* table) { table[threadIdx.x] = 1.0f / (float)(threadIdx.x + 1); }
__global__ void apply(const float* table, const int* idx, float* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __ldg(&table[__ldg(&idx[i])]);
}
__global__ void fused(float* table, const int* idx, float* out, int n) {
    if (blockIdx.x == 0) { table[threadIdx.x] = 1.0f / (float)(threadIdx.x + 1); return; }
    int i = (blockIdx.x - 1) * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __ldg(&table[__ldg(&idx[i])]);  // bug: table is written by block 0 of this kernel
}

int main() {
    const int n = 256;
    int hi[n];
    float r[n];
    for (int i = 0; i < n; i++) hi[i] = (i * 7) % 64;
    float *table, *out;
    int* idx;
    CK(cudaMalloc(&table, 64 * sizeof(float)));
    CK(cudaMalloc(&idx, sizeof hi));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(idx, hi, sizeof hi, cudaMemcpyHostToDevice));
    build_table<<<1, 64>>>(table);
    CK(cudaGetLastError());
    apply<<<n / 64, 64>>>(table, idx, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 1.0f / (float)(hi[i] + 1)) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(table)); CK(cudaFree(idx)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
