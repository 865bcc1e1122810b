// stream_x_pitched (ok): pitched copies and memsets, a stream-ordered allocation, a host function on a stream and
// mapped pinned memory, each used correctly: a pitched D2H copy into pinned memory is read after the stream is
// synchronised. Twin of stream_x_pitched.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void scale_rows(float* m, size_t pitch, int rows, int cols) {
    int r = blockIdx.x, c = threadIdx.x;
    if (r < rows && c < cols) {
        float* row = (float*)((char*)m + r * pitch);
        row[c] = row[c] * 2.0f + (float)r;
    }
}

static void note_done(void* flag) { *(int*)flag = 1; }

int main() {
    const int rows = 8, cols = 24;
    float h[rows][cols];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) h[r][c] = (float)(r * cols + c) * 0.5f;
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    float* d;
    const size_t pitch = 128;
    CK(cudaMallocAsync((void**)&d, pitch * rows, s));
    CK(cudaMemset2DAsync(d, pitch, 0, pitch, rows, s));
    CK(cudaMemcpy2DAsync(d, pitch, h, cols * sizeof(float), cols * sizeof(float), rows, cudaMemcpyHostToDevice, s));
    scale_rows<<<rows, 32, 0, s>>>(d, pitch, rows, cols);
    CK(cudaGetLastError());
    float* pinned;
    CK(cudaMallocHost((void**)&pinned, rows * cols * sizeof(float)));
    CK(cudaMemcpy2DAsync(pinned, cols * sizeof(float), d, pitch, cols * sizeof(float), rows, cudaMemcpyDeviceToHost, s));
    int done = 0;
    CK(cudaLaunchHostFunc(s, note_done, &done));
    CK(cudaStreamSynchronize(s));
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++)
            if (pinned[r * cols + c] != h[r][c] * 2.0f + (float)r) {
                fprintf(stderr, "[%d][%d] = %g\n", r, c, pinned[r * cols + c]);
                return 1;
            }
    if (!done) { fprintf(stderr, "the host function did not run\n"); return 1; }
    CK(cudaFreeAsync(d, s));
    CK(cudaStreamDestroy(s));
    CK(cudaFreeHost(pinned));
    printf("ok\n");
    return 0;
}
