// hang_x_cas_poll (bug): block 0 waits for block 1's result by polling with atomicCAS(flag, 1, 1) (a compare-and-swap
// read-modify-write used as a load); nothing guarantees block 1 runs while block 0 spins (the waiting block
// has the lower index). expect hangcheck.
// expect: hangcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void produce_consume(const int* in, int* data, int* flag, int* out) {
    int t = threadIdx.x;
    if (blockIdx.x == 1) {
        data[t] = in[t] * 2;
        __threadfence();
        __syncthreads();
        if (t == 0) atomicExch(flag, 1);
    } else {
        if (t == 0) while (atomicCAS(flag, 1, 1) != 1) {}  // bug: waits for a block that may not be running
        __syncthreads();
        out[t] = atomicAdd(&data[(t + 1) % 32], 0) + 1;
    }
}
__global__ void produce(const int* in, int* data) { data[threadIdx.x] = in[threadIdx.x] * 2; }
__global__ void consume(const int* data, int* out) { out[threadIdx.x] = data[(threadIdx.x + 1) % 32] + 1; }

int main() {
    int h[32], r[32];
    for (int i = 0; i < 32; i++) h[i] = i * 3 - 7;
    int *in, *data, *flag, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&data, sizeof h));
    CK(cudaMalloc(&flag, sizeof(int)));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemset(flag, 0, sizeof(int)));
    produce_consume<<<2, 32>>>(in, data, flag, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++)
        if (r[i] != 2 * h[(i + 1) % 32] + 1) { fprintf(stderr, "out[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(data)); CK(cudaFree(flag)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
