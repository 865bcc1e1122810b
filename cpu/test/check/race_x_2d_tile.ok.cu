// race_x_2d_tile (ok): a 32x8-thread transpose through a 32x33 shared tile with the barrier between the
// stores and the transposed loads. Correct twin of race_x_2d_tile.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

#define TILE 32
#define ROWS 8
__global__ void transpose(const float* in, float* out, int w, int h) {
    __shared__ float tile[TILE][TILE + 1];
    int x = blockIdx.x * TILE + threadIdx.x, y = blockIdx.y * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS)
        if (x < w && y + j < h) tile[threadIdx.y + j][threadIdx.x] = in[(y + j) * w + x];
    __syncthreads();
    x = blockIdx.y * TILE + threadIdx.x;
    y = blockIdx.x * TILE + threadIdx.y;
    for (int j = 0; j < TILE; j += ROWS)
        if (x < h && y + j < w) out[(y + j) * h + x] = tile[threadIdx.x][threadIdx.y + j];
}

int main() {
    const int w = 64, h = 64;
    static float hi[w * h], ho[w * h];
    for (int i = 0; i < w * h; i++) hi[i] = (float)(i % 97);
    float *in, *out;
    CK(cudaMalloc(&in, sizeof hi));
    CK(cudaMalloc(&out, sizeof ho));
    CK(cudaMemcpy(in, hi, sizeof hi, cudaMemcpyHostToDevice));
    transpose<<<dim3(w / TILE, h / TILE), dim3(TILE, ROWS)>>>(in, out, w, h);
    CK(cudaGetLastError());
    CK(cudaMemcpy(ho, out, sizeof ho, cudaMemcpyDeviceToHost));
    for (int r = 0; r < h; r++)
        for (int c = 0; c < w; c++)
            if (ho[c * h + r] != hi[r * w + c]) { fprintf(stderr, "mismatch at %d,%d\n", r, c); return 1; }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
