// race_x_intrawarp (ok): inside one warp, lane t stores s[t], __syncwarp(), then reads its butterfly
// partner s[t ^ 1]. Correct twin of race_x_intrawarp.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void pair_swap(const int* in, int* out) {
    __shared__ int s[32];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 32 + t] * 3;
    __syncwarp();
    out[blockIdx.x * 32 + t] = s[t ^ 1] - s[t];
}

int main() {
    const int blocks = 2, n = blocks * 32;
    int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (i * 7) % 11;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    pair_swap<<<blocks, 32>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++)
        if (r[i] != 3 * h[i ^ 1] - 3 * h[i]) { fprintf(stderr, "out[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
