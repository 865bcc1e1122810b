// init_shared_dynamic (ok): each thread zeroes its slot of the dynamic (extern __shared__) accumulator
// first. Correct twin of init_shared_dynamic.bug.cu; no check may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void column_sums(const float* x, int rows, float* out) {
    extern __shared__ float acc[];  // 64 floats, sized at the launch
    int t = threadIdx.x;
    acc[t] = 0.0f;  // the fix
    for (int r = 0; r < rows; r++) acc[t] += x[(blockIdx.x * rows + r) * 64 + t];
    __syncthreads();
    out[blockIdx.x * 64 + t] = acc[t] - acc[63 - t];
}

int main() {
    const int blocks = 6, rows = 4, n = blocks * rows * 64;
    static float h[n];
    float r[blocks * 64], col[64];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 19) % 29) - 14.0f;
    float *x, *out;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    column_sums<<<blocks, 64, 64 * sizeof(float)>>>(x, rows, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        for (int t = 0; t < 64; t++) {
            col[t] = 0.0f;
            for (int k = 0; k < rows; k++) col[t] += h[(b * rows + k) * 64 + t];
        }
        for (int t = 0; t < 64; t++)
            if (r[b * 64 + t] != col[t] - col[63 - t]) { fprintf(stderr, "out[%d] = %g, want %g\n", b * 64 + t, r[b * 64 + t], col[t] - col[63 - t]); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
