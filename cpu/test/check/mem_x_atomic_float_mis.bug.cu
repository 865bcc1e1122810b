// mem_x_atomic_float_mis (bug): per-bucket float sums live in 6-byte {short id; float sum;} records packed
// back to back in a byte buffer, so atomicAdd((float*)(rec + 2), v) targets addresses that are only 2-byte
// aligned for odd records. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#include <cstring>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define REC 6
#define SUM_AT 2
__global__ void accumulate(const int* bucket, const float* v, unsigned char* recs, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd((float*)(recs + bucket[i] * REC + SUM_AT), v[i]);
}

int main() {
    const int n = 256, buckets = 4;
    int hb[n];
    float hv[n], want[buckets] = {0};
    for (int i = 0; i < n; i++) { hb[i] = (i * 5) % buckets; hv[i] = (float)(i % 4); want[hb[i]] += hv[i]; }
    unsigned char hr[buckets * REC];
    int* bucket;
    float* v;
    unsigned char* recs;
    CK(cudaMalloc(&bucket, sizeof hb));
    CK(cudaMalloc(&v, sizeof hv));
    CK(cudaMalloc(&recs, sizeof hr));
    CK(cudaMemcpy(bucket, hb, sizeof hb, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(v, hv, sizeof hv, cudaMemcpyHostToDevice));
    CK(cudaMemset(recs, 0, sizeof hr));
    accumulate<<<n / 64, 64>>>(bucket, v, recs, n);
    CK(cudaGetLastError());
    CK(cudaMemcpy(hr, recs, sizeof hr, cudaMemcpyDeviceToHost));
    for (int b = 0; b < buckets; b++) {
        float s;
        memcpy(&s, hr + b * REC + SUM_AT, 4);
        if (s != want[b]) { fprintf(stderr, "bucket %d = %g, want %g\n", b, s, want[b]); return 1; }
    }
    CK(cudaFree(bucket)); CK(cudaFree(v)); CK(cudaFree(recs));
    printf("ok\n");
    return 0;
}
