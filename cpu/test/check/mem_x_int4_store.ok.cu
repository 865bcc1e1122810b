// mem_x_int4_store (ok): the header is padded to 16 bytes (records at out + 4 + 4 * i), so every int4 store is
// 16-byte aligned. Correct twin of mem_x_int4_store.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ int4* record_slot(int* out, int i) {
    char* base = (char*)out + 16;
    return (int4*)base + i;
}

__global__ void pack(const int* in, int* out, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) out[0] = n;
    if (i < n) {
        int4 v = make_int4(in[i], in[i] * 2, in[i] * 3, in[i] * 4);
        *record_slot(out, i) = v;
    }
}

int main() {
    const int n = 32, words = 4 + 4 * n;
    int h[n], r[words];
    for (int i = 0; i < n; i++) h[i] = i * 7 - 50;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(out, 0, sizeof r));
    pack<<<1, 32>>>(in, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    const int first = 4;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            if (r[first + 4 * i + k] != h[i] * (k + 1)) { fprintf(stderr, "record %d.%d wrong\n", i, k); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
