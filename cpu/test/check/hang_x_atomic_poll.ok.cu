// hang_x_atomic_poll (ok): the consumer is a second kernel on the same stream, so nothing polls. Correct twin
// of hang_x_atomic_poll.bug.cu.
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
        if (t == 0) while (atomicAdd(flag, 0) == 0) {}  // bug: waits for a block that may not be running
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
    produce<<<1, 32>>>(in, data);
    CK(cudaGetLastError());
    consume<<<1, 32>>>(data, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 32; i++)
        if (r[i] != 2 * h[(i + 1) % 32] + 1) { fprintf(stderr, "out[%d] = %d\n", i, r[i]); return 1; }
    CK(cudaFree(in)); CK(cudaFree(data)); CK(cudaFree(flag)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
