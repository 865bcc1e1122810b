// hang_spin (ok): the producer and the consumer are two launches on one stream, so the consumer needs no
// flag and cannot wait for a block that is not running. Correct twin of hang_spin.bug.cu; nothing may report it.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void produce(const float* in, float* data) {
    int t = threadIdx.x;
    data[t] = in[t] * in[t];
}
__global__ void consume(const float* data, float* out) {  // the fix: a second launch instead of a spin
    int t = threadIdx.x;
    out[t] = data[(t + 1) % 32] + 1.0f;
}

int main() {
    float h[32], r[32];
    for (int i = 0; i < 32; i++) h[i] = (float)(i % 6) - 2.0f;
    float *in, *data, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&data, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    produce<<<1, 32>>>(in, data);
    CK(cudaGetLastError());
    consume<<<1, 32>>>(data, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++) {
        float v = h[(i + 1) % 32];
        if (r[i] != v * v + 1.0f) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], v * v + 1.0f); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(data));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
