// mem_x_smem_static_oob (bug): a shared-memory shift s[t + 1] = ... for all 64 threads of a block whose static
// tile holds 64 floats: thread 63 stores s[64], one past the end. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void shift_right(const float* in, float* out) {
    __shared__ float s[64 /* bug: 65 needed */];
    __shared__ float other[64];
    int t = threadIdx.x;
    other[t] = 1.0f;
    if (t == 0) s[0] = 0.0f;
    s[t + 1] = in[blockIdx.x * 64 + t];
    __syncthreads();
    out[blockIdx.x * 64 + t] = s[t] + other[t];
}

int main() {
    float h[128], r[128];
    for (int i = 0; i < 128; i++) h[i] = (float)(i % 7);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    shift_right<<<2, 64>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 128; i++) {
        float want = (i % 64 == 0 ? 0.0f : h[i - 1]) + 1.0f;
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
