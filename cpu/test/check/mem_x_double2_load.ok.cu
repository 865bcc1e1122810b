// mem_x_double2_load (ok): the double2 loads start at z + 2 * i, 16-byte aligned. Correct twin of
// mem_x_double2_load.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void mags(const double* z, double* out, int n) {
    int i = threadIdx.x;
    if (i >= n) return;
    const double2* zz = reinterpret_cast<const double2*>(z);
    double2 c = zz[i];
    out[i] = c.x * c.x + c.y * c.y;
}

int main() {
    const int n = 16;
    double h[2 * n + 2], r[n];
    for (int i = 0; i < 2 * n + 2; i++) h[i] = (double)(i % 5);
    double *z, *out;
    CK(cudaMalloc(&z, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(z, h, sizeof h, cudaMemcpyHostToDevice));
    mags<<<1, 32>>>(z, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    int s = 0;
    for (int i = 0; i < n; i++) {
        double want = h[2 * i + s] * h[2 * i + s] + h[2 * i + 1 + s] * h[2 * i + 1 + s];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(z)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
