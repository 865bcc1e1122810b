// ldg_x_later_writer (bug): a persistent-style kernel: every block reads coefficients with __ldg, and the
// last block also refreshes those coefficients for the next step in the same launch. The read-only path
// may serve stale or torn values (and the blocks are unordered). expect ldgcheck.
// expect: ldgcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void step(const float* coef, float* coef_w, const float* x, float* y, int n, int refresh) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __ldg(&coef[threadIdx.x]) * x[i];
    if (refresh && blockIdx.x == gridDim.x - 1) coef_w[threadIdx.x] = coef_w[threadIdx.x] * 0.5f;
}
__global__ void refresh_coef(float* coef) { coef[threadIdx.x] *= 0.5f; }

int main() {
    const int n = 256;
    float hc[64], hx[n], r[n];
    for (int i = 0; i < 64; i++) hc[i] = (float)(i % 4 + 1);
    for (int i = 0; i < n; i++) hx[i] = (float)(i % 3);
    float *coef, *x, *y;
    CK(cudaMalloc(&coef, sizeof hc));
    CK(cudaMalloc(&x, sizeof hx));
    CK(cudaMalloc(&y, sizeof r));
    CK(cudaMemcpy(coef, hc, sizeof hc, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    step<<<n / 64, 64>>>(coef, coef, x, y, n, 1);  // bug: refreshes coef while other blocks __ldg it
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, y, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n - 64; i++)
        if (r[i] != hc[i % 64] * hx[i]) { fprintf(stderr, "y[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(coef)); CK(cudaFree(x)); CK(cudaFree(y));
    printf("ok\n");
    return 0;
}
