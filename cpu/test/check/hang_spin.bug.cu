// hang_spin (bug): block 0 spins on a volatile flag that block 1 of the same launch sets after producing
// its data; nothing guarantees block 1 runs while block 0 spins (lower index waits). expect hangcheck.
// expect: hangcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void handoff(const float* in, float* data, int* flag, float* out) {
    int t = threadIdx.x;
    if (blockIdx.x == 1) {  // producer
        data[t] = in[t] * in[t];
        __threadfence();
        __syncthreads();
        if (t == 0) *(volatile int*)flag = 1;
    } else {  // bug: the consumer waits in the same launch for a block that may never be scheduled
        if (t == 0) while (*(volatile int*)flag == 0) {}
        __syncthreads();
        out[t] = ((volatile float*)data)[(t + 1) % 32] + 1.0f;
    }
}

int main() {
    float h[32], r[32];
    for (int i = 0; i < 32; i++) h[i] = (float)(i % 6) - 2.0f;
    float *in, *data, *out;
    int* flag;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&data, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMalloc(&flag, sizeof(int)));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(flag, 0, sizeof(int)));
    handoff<<<2, 32>>>(in, data, flag, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++) {
        float v = h[(i + 1) % 32];
        if (r[i] != v * v + 1.0f) { fprintf(stderr, "out[%d] = %g, want %g\n", i, r[i], v * v + 1.0f); return 1; }
    }
    CK(cudaFree(in));
    CK(cudaFree(data));
    CK(cudaFree(out));
    CK(cudaFree(flag));
    printf("ok\n");
    return 0;
}
