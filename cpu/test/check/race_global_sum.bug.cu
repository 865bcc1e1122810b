// race_global_sum (bug): threads of several blocks count into one global int with a plain `*count += 1`
// (load, add, store) instead of an atomic. expect racecheck.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void count_positive(const float* x, int n, int* count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n && x[i] > 0.0f) *count += 1;  // bug: needs atomicAdd(count, 1)
}

int main() {
    const int n = 1000;
    static float h[n];
    int want = 0, got = -1;
    for (int i = 0; i < n; i++) { h[i] = (float)((i * 37) % 19) - 9.0f; want += h[i] > 0.0f; }
    float* x;
    int* count;
    CK(cudaMalloc(&x, n * sizeof(float)));
    CK(cudaMalloc(&count, sizeof(int)));
    CK(cudaMemcpy(x, h, n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemset(count, 0, sizeof(int)));
    count_positive<<<(n + 255) / 256, 256>>>(x, n, count);
    CK(cudaGetLastError());
    CK(cudaMemcpy(&got, count, sizeof(int), cudaMemcpyDeviceToHost));
    if (got != want) { fprintf(stderr, "count = %d, want %d\n", got, want); return 1; }
    CK(cudaFree(x));
    CK(cudaFree(count));
    printf("ok\n");
    return 0;
}
