// host_wrong_kind (bug): results are copied back by cudaMemcpy(host, device, ..., cudaMemcpyHostToDevice):
// the destination is a host buffer, so the kind is wrong (must be DeviceToHost). expect hostcheck.
// expect: hostcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void clamp_relu(const float* x, float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = fminf(fmaxf(x[i], 0.0f), 4.0f);
}

int main() {
    const int n = 150;
    float h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 7) % 15) - 5.0f;
    float *x, *y;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&y, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    clamp_relu<<<(n + 63) / 64, 64>>>(x, y, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, y, sizeof r, cudaMemcpyHostToDevice));  // bug: the kind must be cudaMemcpyDeviceToHost
    for (int i = 0; i < n; i++) {
        float want = h[i] < 0.0f ? 0.0f : (h[i] > 4.0f ? 4.0f : h[i]);
        if (r[i] != want) { fprintf(stderr, "y[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(x));
    CK(cudaFree(y));
    printf("ok\n");
    return 0;
}
