// race_x_cg_tile_upper (ok): the upper tile of 16 reads the lower tile's stores after a full-warp
// __syncwarp() (both tiles take part), not after tile.sync(). Correct twin of race_x_cg_tile_upper.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

__global__ void diff(const int* in, int* out) {
    __shared__ int s[32];
    cg::thread_block_tile<16> tile = cg::tiled_partition<16>(cg::this_thread_block());
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 32 + t] * 2;
    __syncwarp();  // the whole warp: orders the lower tile's stores before the upper tile's loads
    int v = tile.meta_group_rank() == 1 ? s[t] - s[t - 16] : s[t];
    out[blockIdx.x * 32 + t] = v;
}

int main() {
    const int blocks = 2, n = blocks * 32;
    int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (i * 5) % 13;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    diff<<<blocks, 32>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int want = i % 32 >= 16 ? 2 * h[i] - 2 * h[i - 16] : 2 * h[i];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
