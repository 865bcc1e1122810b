// init_x_dyn_partial (bug): a kernel with dynamic shared memory sized for 2 * blockDim floats initialises
// only the first blockDim of them, then reads s[t + blockDim.x] as well. expect initcheck.
// expect: initcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void pairs(const float* in, float* out) {
    extern __shared__ float s[];
    int t = threadIdx.x, nb = blockDim.x, base = blockIdx.x * 2 * nb;
    s[t] = in[base + t];
    // bug: the upper half s[nb + t] is never loaded
    __syncthreads();
    out[blockIdx.x * nb + t] = s[2 * t] + s[2 * t + 1];
}

int main() {
    const int nb = 64, blocks = 2, n = blocks * 2 * nb;
    float h[n], r[blocks * nb];
    for (int i = 0; i < n; i++) h[i] = (float)(i % 6);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    pairs<<<blocks, nb, 2 * nb * sizeof(float)>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < nb; t++) {
            float want = h[b * 2 * nb + 2 * t] + h[b * 2 * nb + 2 * t + 1];
            if (r[b * nb + t] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", b * nb + t, r[b * nb + t], want); return 1; }
        }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
