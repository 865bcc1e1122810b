// init_x_dyn_partial (ok): the kernel initialises both halves of its 2 * blockDim dynamic shared floats
// before reading them. Correct twin of init_x_dyn_partial.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void pairs(const float* in, float* out) {
    extern __shared__ float s[];
    int t = threadIdx.x, nb = blockDim.x, base = blockIdx.x * 2 * nb;
    s[t] = in[base + t];
    s[nb + t] = in[base + nb + t];
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
