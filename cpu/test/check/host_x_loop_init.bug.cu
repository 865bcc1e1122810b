// host_x_loop_init (bug): a helper initialises a "buffer" it believes is host memory with a loop, but it is
// handed the cudaMalloc pointer (the names d_w and h_w got swapped at the call). expect hostcheck.
// expect: hostcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

static void init_weights(float* w, int n) {
    for (int i = 0; i < n; i++) w[i] = 0.01f * (float)(i % 17);
}

__global__ void scale(float* w, int n, float s) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) w[i] *= s;
}

int main() {
    const int n = 256;
    static float h_w[n], r[n];
    float* d_w;
    CK(cudaMalloc(&d_w, sizeof h_w));
    init_weights(d_w /* bug: should be h_w */, n);
    CK(cudaMemcpy(d_w, h_w, sizeof h_w, cudaMemcpyHostToDevice));
    scale<<<n / 64, 64>>>(d_w, n, 2.0f);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, d_w, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 2.0f * 0.01f * (float)(i % 17)) { fprintf(stderr, "w[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(d_w));
    printf("ok\n");
    return 0;
}
