// hang_x_ticket_chain (ok): the chained scan takes its logical block index from an atomicAdd ticket, so a
// block only ever waits for a block that has already started (and runs to its publish without waiting on
// anything later). The prefix is read with volatile loads after the flag; __threadfence orders the publish.
// Correct on a GPU (the decoupled look-back idea); twin of hang_x_ticket_chain.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void chained_sum(const int* in, int* out, volatile int* prefix, volatile int* ready, unsigned* ticket, int nblocks) {
    __shared__ int s[64];
    __shared__ int blk;
    __shared__ int carry;
    int t = threadIdx.x;
    if (t == 0) blk = (int)atomicAdd(ticket, 1u);
    __syncthreads();
    int b = blk;
    s[t] = in[b * 64 + t];
    __syncthreads();
    for (int k = 1; k < 64; k <<= 1) {
        int v = t >= k ? s[t - k] : 0;
        __syncthreads();
        s[t] += v;
        __syncthreads();
    }
    if (t == 0) {
        int c = 0;
        if (b > 0) {
            while (ready[b - 1] == 0) {}
            __threadfence();  // acquire side: the prefix is read after the flag
            c = prefix[b - 1];
        }
        carry = c;
        prefix[b] = c + s[63];
        __threadfence();
        ready[b] = 1;
    }
    __syncthreads();
    out[b * 64 + t] = carry + s[t];
}

int main() {
    const int nblocks = 4, n = nblocks * 64;
    int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (i * 7) % 5;
    int *in, *out, *prefix, *ready;
    unsigned* ticket;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMalloc(&prefix, nblocks * sizeof(int)));
    CK(cudaMalloc(&ready, nblocks * sizeof(int)));
    CK(cudaMalloc(&ticket, sizeof(unsigned)));
    CK(cudaMemset(ready, 0, nblocks * sizeof(int)));
    CK(cudaMemset(ticket, 0, sizeof(unsigned)));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    chained_sum<<<nblocks, 64>>>(in, out, prefix, ready, ticket, nblocks);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    int acc = 0;
    for (int i = 0; i < n; i++) {
        acc += h[i];
        if (r[i] != acc) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], acc); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out)); CK(cudaFree(prefix)); CK(cudaFree(ready)); CK(cudaFree(ticket));
    printf("ok\n");
    return 0;
}
