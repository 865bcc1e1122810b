// sync_x_converge_loop (ok): an iterative relaxation in shared memory whose loop condition is block-uniform:
// __syncthreads_or(changed) tells every thread whether any thread still changed a value, so all threads run
// the same number of iterations (and barriers). __syncthreads_count checks the result. Correct twin of
// sync_x_converge_loop.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

// labels[t] becomes the minimum label of its connected run (edges between t and t+1 where link[t] != 0)
__global__ void propagate(const int* link, int* labels, int* rounds, int* ones) {
    __shared__ int lab[128];
    int t = threadIdx.x;
    lab[t] = t;
    __syncthreads();
    int iter = 0;
    bool more = true;
    while (more) {
        int mine = lab[t];
        int best = mine;
        if (t > 0 && link[t - 1]) best = min(best, lab[t - 1]);
        if (t < 127 && link[t]) best = min(best, lab[t + 1]);
        __syncthreads();
        bool changed = best != mine;
        lab[t] = best;
        more = __syncthreads_or(changed);
        iter++;
    }
    labels[t] = lab[t];
    int n0 = __syncthreads_count(lab[t] == 0);
    if (t == 0) { *rounds = iter; *ones = n0; }
}

int main() {
    int hl[128], r[128], rounds, zeros;
    for (int i = 0; i < 128; i++) hl[i] = (i % 16) != 15;  // runs of 16
    int *link, *labels, *d_rounds, *d_zeros;
    CK(cudaMalloc(&link, sizeof hl));
    CK(cudaMalloc(&labels, sizeof r));
    CK(cudaMalloc(&d_rounds, sizeof(int)));
    CK(cudaMalloc(&d_zeros, sizeof(int)));
    CK(cudaMemcpy(link, hl, sizeof hl, cudaMemcpyHostToDevice));
    propagate<<<1, 128>>>(link, labels, d_rounds, d_zeros);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, labels, sizeof r, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&rounds, d_rounds, sizeof(int), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&zeros, d_zeros, sizeof(int), cudaMemcpyDeviceToHost));
    for (int i = 0; i < 128; i++)
        if (r[i] != i / 16 * 16) { fprintf(stderr, "labels[%d] = %d, want %d\n", i, r[i], i / 16 * 16); return 1; }
    if (zeros != 16) { fprintf(stderr, "zeros = %d\n", zeros); return 1; }
    CK(cudaFree(link)); CK(cudaFree(labels)); CK(cudaFree(d_rounds)); CK(cudaFree(d_zeros));
    printf("ok (%d rounds)\n", rounds);
    return 0;
}
