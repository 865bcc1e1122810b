// race_x_template_devfn (ok): a templated kernel calls a __device__ helper that stores each block's
// maximum in its own element out[blockIdx.x]. Correct twin of race_x_template_devfn.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

template <typename T>
__device__ void store_result(T* out, int slot, T v) { out[slot] = v; }

template <typename T, int BLOCK>
__global__ void block_max(const T* x, T* out) {
    __shared__ T s[BLOCK];
    int t = threadIdx.x;
    s[t] = x[blockIdx.x * BLOCK + t];
    __syncthreads();
    for (int k = BLOCK / 2; k > 0; k >>= 1) {
        if (t < k && s[t + k] > s[t]) s[t] = s[t + k];
        __syncthreads();
    }
    if (t == 0) store_result(out, blockIdx.x, s[0]);
}

int main() {
    const int blocks = 4, n = blocks * 64;
    int h[n], r[blocks];
    for (int i = 0; i < n; i++) h[i] = (i * 29) % 83;
    int *x, *out;
    CK(cudaMalloc(&x, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(x, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(out, 0, sizeof r));
    block_max<int, 64><<<blocks, 64>>>(x, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < blocks; b++) {
        int m = 0;
        for (int i = b * 64; i < b * 64 + 64; i++) m = h[i] > m ? h[i] : m;
        if (r[b] != m) { fprintf(stderr, "out[%d] = %d, want %d\n", b, r[b], m); return 1; }
    }
    CK(cudaFree(x)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
