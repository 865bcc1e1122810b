// mem_float4_misaligned (bug): float4 loads from p + 1, an address that is only 4-byte aligned (a float4
// access needs 16). expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

// p[0] is a header; groups of four payload floats follow it
__global__ void group_sums(const float* p, float* out, int groups) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= groups) return;
    float4 v = reinterpret_cast<const float4*>(p + 1)[i];  // bug: misaligned vector load
    out[i] = v.x + v.y + v.z + v.w;
}

int main() {
    const int groups = 16, n = 1 + 4 * groups;
    float h[n], r[groups];
    for (int i = 0; i < n; i++) h[i] = (float)((i * 5) % 9) - 2.0f;
    float *p, *out;
    CK(cudaMalloc(&p, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(p, h, sizeof h, cudaMemcpyHostToDevice));
    group_sums<<<1, 32>>>(p, out, groups);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < groups; i++) {
        const float* q = h + 1 + 4 * i;
        if (r[i] != q[0] + q[1] + q[2] + q[3]) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], q[0] + q[1] + q[2] + q[3]); return 1; }
    }
    CK(cudaFree(p));
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
