// race_x_wmma_store (bug): a warp multiplies two 16x16 bf16 tiles with wmma, stores the product to shared memory
// with store_matrix_sync and each lane then reads a row of it with no __syncwarp between: which lane stored which
// element is unspecified, and store_matrix_sync orders nothing, so a lane may read before another has stored.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <mma.h>
using namespace nvcuda;
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)

__global__ void row_sums(const __nv_bfloat16* a, const __nv_bfloat16* b, float* out) {
    __shared__ __align__(32) float tile[16 * 16];
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
    // bug: __syncwarp() missing
    int r = threadIdx.x % 16;
    float s = 0.0f;
    for (int c = 0; c < 16; c++) s += tile[r * 16 + c];
    if (threadIdx.x < 16) out[r] = s;
}

int main() {
    __nv_bfloat16 h[256];
    for (int i = 0; i < 256; i++) h[i] = __float2bfloat16((float)(i % 7) - 3.0f);
    __nv_bfloat16 *a, *b;
    float* out;
    CK(cudaMalloc(&a, sizeof h));
    CK(cudaMalloc(&b, sizeof h));
    CK(cudaMalloc(&out, 16 * sizeof(float)));
    CK(cudaMemcpy(a, h, sizeof h, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, h, sizeof h, cudaMemcpyHostToDevice));
    row_sums<<<1, 32>>>(a, b, out);
    CK(cudaGetLastError());
    float r[16];
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    // out[m] = sum_n sum_k a[m][k] b[n][k] (b column-major: element (k, n) at n * 16 + k)
    for (int m = 0; m < 16; m++) {
        float want = 0.0f;
        for (int n = 0; n < 16; n++)
            for (int k = 0; k < 16; k++) want += __bfloat162float(h[m * 16 + k]) * __bfloat162float(h[n * 16 + k]);
        if (r[m] != want) { fprintf(stderr, "out[%d] = %g, want %g\n", m, r[m], want); return 1; }
    }
    CK(cudaFree(a)); CK(cudaFree(b)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
