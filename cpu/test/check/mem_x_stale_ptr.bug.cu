// mem_x_stale_ptr (bug): a workspace struct keeps a device pointer; the host frees the buffer and allocates a
// bigger one but forgets to update the struct, so the second kernel writes through the stale (freed)
// pointer. expect memcheck.
// expect: memcheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

struct Workspace { float* buf; int n; };

__global__ void fill(Workspace ws, float v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < ws.n) ws.buf[i] = v * (float)i;
}

int main() {
    Workspace ws;
    ws.n = 64;
    CK(cudaMalloc(&ws.buf, ws.n * sizeof(float)));
    fill<<<1, 64>>>(ws, 1.0f);
    CK(cudaGetLastError());
    float* bigger;
    CK(cudaMalloc(&bigger, 128 * sizeof(float)));
    CK(cudaFree(ws.buf));
    // bug: ws.buf = bigger; is missing
    ws.n = 128;
    fill<<<2, 64>>>(ws, 2.0f);
    CK(cudaGetLastError());
    float r[128];
    CK(cudaMemcpy(r, bigger, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < 128; i++)
        if (r[i] != 2.0f * (float)i) { fprintf(stderr, "buf[%d] = %g\n", i, r[i]); return 1; }
    CK(cudaFree(bigger));
    printf("ok\n");
    return 0;
}
