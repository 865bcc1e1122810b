// init_max_seed (ok): the running row maximum's seed is set to -inf before the first batch. Correct twin
// of init_max_seed.bug.cu; no check may report it.
#include <cmath>
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void fill(float* p, int n, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
}

__global__ void running_row_max(const float* x, int rows, int cols, float* m) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    float best = m[r];
    for (int c = 0; c < cols; c++) best = fmaxf(best, x[r * cols + c]);
    m[r] = best;
}

int main() {
    const int rows = 8, cols = 16, batches = 2;
    float h[batches][rows * cols], r[rows];
    for (int b = 0; b < batches; b++)
        for (int i = 0; i < rows * cols; i++) h[b][i] = (float)((i * 31 + b * 7) % 53) - 40.0f;
    float *x, *m;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&m, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    fill<<<1, rows>>>(m, rows, -INFINITY);  // the fix
    for (int b = 0; b < batches; b++) running_row_max<<<1, rows>>>(x + b * rows * cols, rows, cols, m);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, m, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < rows; i++) {
        float want = -INFINITY;
        for (int b = 0; b < batches; b++)
            for (int c = 0; c < cols; c++) want = fmaxf(want, h[b][i * cols + c]);
        if (r[i] != want) { fprintf(stderr, "max[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(m));
    printf("ok\n");
    return 0;
}
