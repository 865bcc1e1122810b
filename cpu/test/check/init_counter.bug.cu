// init_counter (bug): a histogram's counters are incremented with atomicAdd but the buffer from cudaMalloc
// was never cudaMemset to zero. expect initcheck.
// expect: initcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void histogram(const int* x, int n, int* bins) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&bins[x[i] % 8], 1);
}

int main() {
    const int n = 500, nbins = 8;
    static int h[n];
    int want[nbins] = {0}, got[nbins];
    for (int i = 0; i < n; i++) { h[i] = (i * i + 3 * i) % 97; want[h[i] % 8]++; }
    int *x, *bins;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&bins, sizeof got));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    // bug: CK(cudaMemset(bins, 0, sizeof got)) is missing
    histogram<<<(n + 127) / 128, 128>>>(x, n, bins);
    CK(cudaGetLastError());
    CK(cudaMemcpy(got, bins, sizeof got, cudaMemcpyDeviceToHost));
    for (int b = 0; b < nbins; b++)
        if (got[b] != want[b]) { fprintf(stderr, "bin %d = %d, want %d\n", b, got[b], want[b]); return 1; }
    CK(cudaFree(x));
    CK(cudaFree(bins));
    printf("ok\n");
    return 0;
}
