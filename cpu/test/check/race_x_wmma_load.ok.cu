// race_x_wmma_load (ok): the lanes of a warp stage a 16x16 bf16 tile in shared memory, __syncwarp(), then the warp
// loads it with load_matrix_sync. Correct twin of race_x_wmma_load.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <mma.h>
using namespace nvcuda;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void square(const __nv_bfloat16* a, float* out) {
    __shared__ __align__(32) __nv_bfloat16 tile[16 * 16];
    for (int i = threadIdx.x; i < 256; i += 32) tile[i] = a[i];
    __syncwarp();
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, tile, 16);
    wmma::load_matrix_sync(fb, tile, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}

int main() {
    __nv_bfloat16 h[256];
    for (int i = 0; i < 256; i++) h[i] = __float2bfloat16((float)(i % 5) - 2.0f);
    __nv_bfloat16* a;
    float* out;
    CK(cudaMalloc(&a, sizeof h));
    CK(cudaMalloc(&out, 256 * sizeof(float)));
    CK(cudaMemcpy(a, h, sizeof h, cudaMemcpyHostToDevice));
    square<<<1, 32>>>(a, out);
    CK(cudaGetLastError());
    float r[256];
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float want = 0.0f;
            for (int k = 0; k < 16; k++) want += __bfloat162float(h[m * 16 + k]) * __bfloat162float(h[k * 16 + n]);
            if (r[m * 16 + n] != want) { fprintf(stderr, "out[%d][%d] = %g, want %g\n", m, n, r[m * 16 + n], want); return 1; }
        }
    CK(cudaFree(a)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
