// mem_x_smem_dyn_oob (bug): a kernel keeps two arrays of blockDim floats in dynamic shared memory (values and
// weights) but is launched with blockDim * sizeof(float) bytes, enough for one: the weights lie past the end.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void weighted(const float* x, const float* w, float* out) {
    extern __shared__ float smem[];
    float* vals = smem;
    float* wts = smem + blockDim.x;
    int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
    vals[t] = x[i];
    wts[t] = w[i];
    __syncthreads();
    int j = (t + 1) % blockDim.x;
    out[i] = vals[j] * wts[j];
}

int main() {
    const int nb = 128, blocks = 2, n = nb * blocks;
    float hx[n], hw[n], r[n];
    for (int i = 0; i < n; i++) { hx[i] = (float)(i % 5); hw[i] = (float)(i % 3) - 1.0f; }
    float *x, *w, *out;
    CK(cudaMalloc(&x, sizeof hx));
    CK(cudaMalloc(&w, sizeof hw));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(x, hx, sizeof hx, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(w, hw, sizeof hw, cudaMemcpyHostToDevice));
    weighted<<<blocks, nb, nb * sizeof(float) /* bug: two arrays need twice that */>>>(x, w, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int j = (i / nb) * nb + (i % nb + 1) % nb;
        if (r[i] != hx[j] * hw[j]) { fprintf(stderr, "out[%d] = %g\n", i, r[i]); return 1; }
    }
    CK(cudaFree(x)); CK(cudaFree(w)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
