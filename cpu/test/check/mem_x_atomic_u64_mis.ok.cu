// mem_x_atomic_u64_mis (ok): the header takes 8 bytes (two ints), so the 64-bit counters at buf + 2 are
// 8-byte aligned. Correct twin of mem_x_atomic_u64_mis.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#include <cstring>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define HDR_INTS 2
__global__ void count_events(const int* ev, int n, int* buf) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) buf[0] = n;
    unsigned long long* counters = (unsigned long long*)(buf + HDR_INTS);
    if (i < n) atomicAdd(&counters[ev[i] & 3], (unsigned long long)(ev[i] + 1));
}

int main() {
    const int n = 128;
    int h[n];
    unsigned long long want[4] = {0};
    for (int i = 0; i < n; i++) { h[i] = (i * 3) % 10; want[h[i] & 3] += (unsigned long long)(h[i] + 1); }
    int *ev, *buf;
    int hr[2 + 8];
    CK(cudaMalloc(&ev, sizeof h));
    CK(cudaMalloc(&buf, sizeof hr));
    CK(cudaMemcpy(ev, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(buf, 0, sizeof hr));
    count_events<<<n / 64, 64>>>(ev, n, buf);
    CK(cudaGetLastError());
    CK(cudaMemcpy(hr, buf, sizeof hr, cudaMemcpyDeviceToHost));
    for (int k = 0; k < 4; k++) {
        unsigned long long c;
        memcpy(&c, hr + HDR_INTS + 2 * k, 8);
        if (c != want[k]) { fprintf(stderr, "counter %d = %llu, want %llu\n", k, c, want[k]); return 1; }
    }
    CK(cudaFree(ev)); CK(cudaFree(buf));
    printf("ok\n");
    return 0;
}
