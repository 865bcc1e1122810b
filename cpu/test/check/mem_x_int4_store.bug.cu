// mem_x_int4_store (bug): a packing kernel writes 16-byte int4 records after a 4-byte header
// (out + 1 + 4 * i, via a plain int4* pointer, no cast at the store): every int4 store is only 4-byte aligned.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__device__ int4* record_slot(int* out, int i) {
    char* base = (char*)out + 4 /* bug: records follow a 4-byte header */;
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
    const int first = 1;
    for (int i = 0; i < n; i++)
        for (int k = 0; k < 4; k++)
            if (r[first + 4 * i + k] != h[i] * (k + 1)) { fprintf(stderr, "record %d.%d wrong\n", i, k); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
