// cpu/include/cooperative_groups.h: the CPU backend's cooperative_groups subset, found before the
// toolkit's (device-only) header because cpu/cucc puts cpu/include first on the include path.
// Covered: this_thread_block(), tiled_partition<N>() of a block (N a power of two up to 32) with
// thread_rank, meta_group_rank, meta_group_size, size/num_threads, sync and the shuffles and votes;
// cg::reduce with plus/less/greater lives in cooperative_groups/reduce.h. Everything is built on the
// same warp and block rendezvous as the CUDA intrinsics (cpu/include/cucc.h).
#pragma once
#include "cucc.h"

namespace cooperative_groups {

struct thread_block {
    void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const { __syncthreads(file, line); }
    unsigned long long thread_rank() const { return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z); }
    unsigned long long size() const { return (unsigned long long)blockDim.x * blockDim.y * blockDim.z; }
    unsigned long long num_threads() const { return size(); }
    dim3 group_index() const { return dim3(blockIdx.x, blockIdx.y, blockIdx.z); }
    dim3 thread_index() const { return dim3(threadIdx.x, threadIdx.y, threadIdx.z); }
    dim3 group_dim() const { return blockDim; }
    dim3 dim_threads() const { return blockDim; }
};

inline thread_block this_thread_block() { return thread_block(); }

template <unsigned int N>
struct thread_block_tile {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "tiled_partition<N>: N must be a power of two up to 32");
    // lanes of the warp that belong to the caller's tile
    unsigned mask() const {
        unsigned lane = __cucc_lane_id();
        unsigned tile_bits = N == 32 ? 0xffffffffu : ((1u << N) - 1);
        return tile_bits << (lane & ~(N - 1));
    }
    unsigned long long thread_rank() const { return __cucc_lane_id() & (N - 1); }
    unsigned long long meta_group_rank() const { return this_thread_block().thread_rank() / N; }
    unsigned long long meta_group_size() const { return (this_thread_block().size() + N - 1) / N; }
    static constexpr unsigned long long size() { return N; }
    static constexpr unsigned long long num_threads() { return N; }
    void sync(const char* file = __builtin_FILE(), int line = __builtin_LINE()) const { __syncwarp(mask(), file, line); }
    template <typename T>
    T shfl(T v, int src, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __shfl_sync(mask(), v, src, N, file, line);
    }
    template <typename T>
    T shfl_down(T v, unsigned delta, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __shfl_down_sync(mask(), v, delta, N, file, line);
    }
    template <typename T>
    T shfl_up(T v, unsigned delta, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __shfl_up_sync(mask(), v, delta, N, file, line);
    }
    template <typename T>
    T shfl_xor(T v, unsigned lane_mask, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __shfl_xor_sync(mask(), v, lane_mask, N, file, line);
    }
    int any(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __any_sync(mask(), pred, file, line);
    }
    int all(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        return __all_sync(mask(), pred, file, line);
    }
    unsigned ballot(int pred, const char* file = __builtin_FILE(), int line = __builtin_LINE()) const {
        // as in CUDA, bit i is the tile's thread i
        return __ballot_sync(mask(), pred, file, line) >> (__cucc_lane_id() & ~(N - 1));
    }
};

template <unsigned int N, typename ParentT>
inline thread_block_tile<N> tiled_partition(const ParentT&) {
    return thread_block_tile<N>();
}

}  // namespace cooperative_groups
