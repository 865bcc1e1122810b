// limit_x_block_threads (ok): a 2D block of 32 x 32 = 1024 threads, the maximum. Correct twin of
// limit_x_block_threads.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void grid_fill(int* out, int w) {
    int x = blockIdx.x * blockDim.x + threadIdx.x, y = blockIdx.y * blockDim.y + threadIdx.y;
    out[y * w + x] = x + 1000 * y;
}

int main() {
    const int w = 64, h = 64;
    static int r[w * h];
    int* out;
    CK(cudaMalloc(&out, sizeof r));
    dim3 block(32, 32);
    dim3 grid(w / block.x, h / block.y);
    grid_fill<<<grid, block>>>(out, w);
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            if (r[y * w + x] != x + 1000 * y) { fprintf(stderr, "out[%d][%d] = %d\n", y, x, r[y * w + x]); return 1; }
    CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
