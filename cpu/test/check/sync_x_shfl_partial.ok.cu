// sync_x_shfl_partial (ok): the half-warp reduction inside "if (lane < 16)" names exactly the lanes that
// execute it (0x0000ffff), with width 16 so that no lane reads outside the mask. Correct twin of sync_x_shfl_partial.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void half_sum(const int* in, int* out) {
    int lane = threadIdx.x;
    int v = in[blockIdx.x * 32 + lane];
    if (lane < 16) {
        for (int off = 8; off > 0; off >>= 1) v += __shfl_down_sync(0x0000ffffu, v, off, 16);
        if (lane == 0) out[blockIdx.x] = v;
    } else {
        out[2 + blockIdx.x * 16 + lane - 16] = v;
    }
}

int main() {
    int h[64], r[2 + 32];
    for (int i = 0; i < 64; i++) h[i] = (i * 7) % 10;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    half_sum<<<2, 32>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int b = 0; b < 2; b++) {
        int want = 0;
        for (int l = 0; l < 16; l++) want += h[b * 32 + l];
        if (r[b] != want) { fprintf(stderr, "sum[%d] = %d, want %d\n", b, r[b], want); return 1; }
        for (int l = 16; l < 32; l++)
            if (r[2 + b * 16 + l - 16] != h[b * 32 + l]) { fprintf(stderr, "copy %d,%d wrong\n", b, l); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
