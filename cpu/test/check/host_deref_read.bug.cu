// host_deref_read (bug): host code reads a kernel's result by dereferencing the cudaMalloc pointer (a
// segfault on a GPU). expect hostcheck.
// expect: hostcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void dot(const float* a, const float* b, int n, float* out) {
    __shared__ float s[128];
    int t = threadIdx.x;
    s[t] = t < n ? a[t] * b[t] : 0.0f;
    __syncthreads();
    for (int half = 64; half > 0; half /= 2) {
        if (t < half) s[t] += s[t + half];
        __syncthreads();
    }
    if (t == 0) *out = s[0];
}

int main() {
    const int n = 100;
    float ha[n], hb[n], want = 0.0f, got;
    for (int i = 0; i < n; i++) { ha[i] = (float)(i % 7) - 3.0f; hb[i] = (float)(i % 5); want += ha[i] * hb[i]; }
    float *a, *b, *out;
    CK(cudaMalloc(&a, sizeof ha));
    CK(cudaMalloc(&b, sizeof hb));
    CK(cudaMalloc(&out, sizeof(float)));
    CK(cudaMemcpy(a, ha, sizeof ha, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb, sizeof hb, cudaMemcpyHostToDevice));
    dot<<<1, 128>>>(a, b, n, out);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    got = *out;  // bug: a device pointer dereferenced on the host; needs cudaMemcpy
    if (got != want) { fprintf(stderr, "dot = %g, want %g\n", got, want); return 1; }
    CK(cudaFree(a));
    CK(cudaFree(b));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
