// race_x_3d (ok): a 3D block (8,4,4) loads a brick into shared memory, __syncthreads(), then each thread
// adds the value of the thread one layer up in z (wrapping). 3D grid of 2x2x1 blocks. Correct twin of
// race_x_3d.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void zsum(const int* in, int* out) {
    __shared__ int brick[4][4][8];
    int x = threadIdx.x, y = threadIdx.y, z = threadIdx.z;
    int b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    int i = b * 128 + (z * 4 + y) * 8 + x;
    brick[z][y][x] = in[i];
    __syncthreads();
    out[i] = brick[z][y][x] + brick[(z + 1) % 4][y][x];
}

int main() {
    const int n = 4 * 128;
    static int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (i * 3) % 17;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    zsum<<<dim3(2, 2, 1), dim3(8, 4, 4)>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int b = i / 128, l = i % 128, z = l / 32;
        int want = h[i] + h[b * 128 + ((z + 1) % 4) * 32 + l % 32];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
