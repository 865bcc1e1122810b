// race_x_cg_tile (bug): one warp split into two cooperative_groups tiles of 16: tile.sync() only orders the
// threads of one tile, but each thread reads the value stored by a thread of the other tile. expect racecheck.
// expect: racecheck
#include <cstdio>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); return 1; } } while (0)
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

__global__ void mirror(const int* in, int* out) {
    __shared__ int s[32];
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<16> tile = cg::tiled_partition<16>(block);
    int t = block.thread_rank();
    s[t] = in[blockIdx.x * 32 + t];
    tile.sync();  // bug: orders this tile's 16 threads only; the other tile's stores are unordered
    int other = (tile.meta_group_rank() ^ 1) * 16 + (15 - (int)tile.thread_rank());
    out[blockIdx.x * 32 + t] = s[other];
}

int main() {
    const int blocks = 2, n = blocks * 32;
    int h[n], r[n];
    for (int i = 0; i < n; i++) h[i] = (i * 5) % 13;
    int *in, *out;
    CK(cudaMalloc(&in, sizeof h));
    CK(cudaMalloc(&out, sizeof r));
    CK(cudaMemcpy(in, h, sizeof h, cudaMemcpyHostToDevice));
    mirror<<<blocks, 32>>>(in, out);
    CK(cudaGetLastError());
    CK(cudaMemcpy(r, out, sizeof r, cudaMemcpyDeviceToHost));
    for (int i = 0; i < n; i++) {
        int l = i % 32, want = h[(i / 32) * 32 + ((l / 16) ^ 1) * 16 + 15 - l % 16];
        if (r[i] != want) { fprintf(stderr, "out[%d] = %d, want %d\n", i, r[i], want); return 1; }
    }
    CK(cudaFree(in)); CK(cudaFree(out));
    printf("ok\n");
    return 0;
}
