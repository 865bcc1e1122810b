// mem_x_half2_cast (bug): a dot product of __half vectors read in pairs through a C-style (const __half2*)
// cast of a + off with an odd off: a 4-byte __half2 load from a 2-byte aligned address. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cuda_fp16.h>

__global__ void dot_pairs(const __half* a, const __half* b, int off, float* out) {
    int i = threadIdx.x;
    const __half2* a2 = (const __half2*)(a + off);
    const __half2* b2 = (const __half2*)(b + off);
    __half2 p = __hmul2(a2[i], b2[i]);
    out[i] = __low2float(p) + __high2float(p);
}

int main() {
    const int n = 80, pairs = 32, off = 1 /* bug: odd */;
    __half ha[n], hb[n];
    float r[pairs];
    for (int i = 0; i < n; i++) { ha[i] = __float2half((float)(i % 4)); hb[i] = __float2half((float)(i % 3)); }
    __half *a, *b;
    float* out;
    CK(cudaMalloc(&a, sizeof ha));
    CK(cudaMalloc(&b, sizeof hb));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(a, ha, sizeof ha, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, hb, sizeof hb, cudaMemcpyHostToDevice));
    dot_pairs<<<1, pairs>>>(a, b, off, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < pairs; i++) {
        int j = off + 2 * i;
        float want = (float)(j % 4) * (float)(j % 3) + (float)((j + 1) % 4) * (float)((j + 1) % 3);
        if (r[i] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
