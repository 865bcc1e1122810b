// race_x_cg_tile (ok): cooperative_groups tiles of 16: each thread stores its value in shared memory,
// tile.sync(), then reads the value of the mirror thread of its own tile; the tile sum comes from cg::reduce.
// Correct twin of race_x_cg_tile.bug.cu.
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
namespace cg = cooperative_groups;

__global__ void mirror(const int* in, int* out, int* sums) {
    __shared__ int s[64];
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<16> tile = cg::tiled_partition<16>(block);
    int t = block.thread_rank();
    int v = in[blockIdx.x * 64 + t];
    s[t] = v;
    tile.sync();
    int base = tile.meta_group_rank() * 16;
    int partner = base + (15 - (int)tile.thread_rank());
    out[blockIdx.x * 64 + t] = s[partner];
    int sum = cg::reduce(tile, v, cg::plus<int>());
    if (tile.thread_rank() == 0) sums[blockIdx.x * 4 + tile.meta_group_rank()] = sum;
}

int main() {
    const int blocks = 2, n = blocks * 64;
    int h[n], r[n], rs[blocks * 4];
    for (int i = 0; i < n; i++) h[i] = (i * 5) % 13;
    int *in, *out, *sums;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMalloc(&sums, sizeof rs));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    mirror<<<blocks, 64>>>(in, out, sums);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(rs, sums, sizeof rs, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int want = h[(i / 16) * 16 + 15 - i % 16];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], want); return 1; }
    }
    for (int g = 0; g < blocks * 4; g++) {
        int want = 0;
        for (int j = 0; j < 16; j++) want += h[g * 16 + j];
        if (rs[g] != want) { fprintf(stderr, "sums[%d] = %d, want %d\n", g, rs[g], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out)); CK(cudaFree(sums));
    printf("ok\n");
    return 0;
}
