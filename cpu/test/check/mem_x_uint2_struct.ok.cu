// mem_x_uint2_struct (ok): the key is read through a uint2 pointer at an 8-byte aligned offset (the record's
// tag is padded to 8 bytes). Correct twin of mem_x_uint2_struct.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#include <cstring>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define KEY_OFFSET 8
#define RECORD 16
__global__ void keys(const unsigned char* recs, unsigned* out, int n) {
    int i = threadIdx.x;
    if (i >= n) return;
    const uint2* k = reinterpret_cast<const uint2*>(recs + i * RECORD + KEY_OFFSET);
    uint2 v = *k;
    out[i] = v.x ^ v.y;
}

int main() {
    const int n = 8;
    unsigned char h[n * RECORD];
    unsigned r[n];
    for (int i = 0; i < n * RECORD; i++) h[i] = (unsigned char)(i * 11);
    unsigned char* recs;
    unsigned* out;
    CK(cudaMalloc(&recs, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(recs, h, sizeof h, cudaMemcpyHostToDevice));
    keys<<<1, 32>>>(recs, out, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        unsigned x, y;
        memcpy(&x, h + i * RECORD + KEY_OFFSET, 4);
        memcpy(&y, h + i * RECORD + KEY_OFFSET + 4, 4);
        if (r[i] != (x ^ y)) { fprintf(stderr, "out[%d] wrong\n", i); return 1; }
    }
    CK(cudaFree(recs)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
