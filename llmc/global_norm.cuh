// llmc/global_norm.cuh: the squared global norm of the gradients (for clipping and the printed `norm`),
// deterministic: partial sums over segments fixed by the element count alone (not by the GPU), then added in
// a fixed order. Per tensor: global_norm_squared, then global_norm_aggregate (accumulating after the first). Included by the trainers; builds with nvcc or cpu/cucc.
// Lab file: dev/cuda/global_norm.cu.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-global_norm_{bf16,fp32} and their lab-check- twins; gpt-*
// and moe-* (clipping at 0.5 against PyTorch).
#pragma once
#include "common.cuh"

// Up to 128 blocks of 256 threads, one per tile when there are fewer tiles (a block with no tile would add only a
// zero partial, and the sum is the same without it); block p owns a contiguous segment of the 16-byte chunks and
// walks it in tiles of 256 x 8 chunks, thread j reading the 8 consecutive chunks j*8 .. j*8+7 of each tile (128 bytes). On a
// GPU a warp's 8 loads then cover its 4 KiB of the tile, half of each 32-byte sector per load and the other
// half from L1 on the next; on the CPU backend, where the threads of a block run one after another, the
// tile is read front to back, which the hardware prefetcher streams. (A grid-stride loop, the usual GPU
// form, makes each CPU thread walk memory with a 512 KiB stride: DRAM latency instead of bandwidth.) The
// partials (one per block) and the order of every sum depend only on the element count.
#define GLOBAL_NORM_PARTIALS 128
#define GLOBAL_NORM_BLOCK_SIZE 256
#define GLOBAL_NORM_CHUNKS_PER_THREAD 8

size_t global_norm_num_partials(size_t count) {
    const size_t tiles = CEIL_DIV(count / x128::size, (size_t)GLOBAL_NORM_BLOCK_SIZE * GLOBAL_NORM_CHUNKS_PER_THREAD);
    return tiles < 1 ? 1 : tiles < GLOBAL_NORM_PARTIALS ? tiles : GLOBAL_NORM_PARTIALS;
}

// partials[p] = sum of squares of segment p; the count % x128::size elements past the last whole chunk go
// to block 0. Floor: count * sizeof(T) bytes read once, 2 flops per element.
// T = floatX (the gradient buffer) or float (ZeRO-2's fp32 gradient shard). A chunk is x128::size elements for
// both (one 16-byte load of floatX, x128::size / f128::size loads of float), so equal values give the same
// partials, summed in the same order, whatever their type.
template <typename T>
__global__ void global_norm_squared_kernel(float* partials, const T* values, size_t count) {
    constexpr int loads = x128::size / Packed128<T>::size;  // 16-byte loads per chunk
    const size_t chunks = count / x128::size;
    const size_t tile_chunks = (size_t)GLOBAL_NORM_BLOCK_SIZE * GLOBAL_NORM_CHUNKS_PER_THREAD;
    const size_t tiles = CEIL_DIV(chunks, tile_chunks);
    const size_t tiles_per_block = CEIL_DIV(tiles, (size_t)gridDim.x);
    float sum = 0.0f;
    for (size_t t = blockIdx.x * tiles_per_block; t < (blockIdx.x + 1) * tiles_per_block && t < tiles; t++) {
        Packed128<T> packed[GLOBAL_NORM_CHUNKS_PER_THREAD][loads];
        for (int k = 0; k < GLOBAL_NORM_CHUNKS_PER_THREAD; k++) {
            size_t c = t * tile_chunks + (size_t)threadIdx.x * GLOBAL_NORM_CHUNKS_PER_THREAD + k;
            for (int j = 0; j < loads; j++)
                packed[k][j] = c < chunks ? load128(values + c * x128::size + j * Packed128<T>::size)
                                          : Packed128<T>::zeros();
        }
        for (int k = 0; k < GLOBAL_NORM_CHUNKS_PER_THREAD; k++)
            for (int j = 0; j < loads; j++)
                for (int e = 0; e < Packed128<T>::size; e++) sum += (float)packed[k][j][e] * (float)packed[k][j][e];
    }
    if (blockIdx.x == 0 && threadIdx.x < count % x128::size) {
        const float value = (float)values[chunks * x128::size + threadIdx.x];
        sum += value * value;
    }
    const float block_sum = block_reduce<warp_reduce_sum>(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = block_sum;
}

// one block: thread j adds partials j, j + 1024, ... in order, then block_reduce in its fixed order
__global__ void global_norm_aggregate_kernel(float* out, const float* partials, size_t num_partials, bool accumulate) {
    float sum = 0.0f;
    for (size_t i = threadIdx.x; i < num_partials; i += blockDim.x) sum += partials[i];
    const float total = block_reduce<warp_reduce_sum>(sum);
    if (threadIdx.x == 0) out[0] = accumulate ? out[0] + total : total;
}

// partials: global_norm_num_partials(count) floats
template <typename T>
void global_norm_squared(float* partials, const T* values, size_t count, cudaStream_t stream) {
    if ((uintptr_t)values % 16 != 0) {
        fprintf(stderr, "global_norm_squared: values must be 16-byte aligned\n");
        exit(EXIT_FAILURE);
    }
    global_norm_squared_kernel<T><<<(unsigned)global_norm_num_partials(count), GLOBAL_NORM_BLOCK_SIZE, 0, stream>>>(
        partials, values, count);
    cudaCheck(cudaGetLastError());
}

// out[0] = (accumulate ? out[0] : 0) + the sum of the partials of one global_norm_squared call
void global_norm_aggregate(float* out, const float* partials, size_t num_partials, bool accumulate,
                           cudaStream_t stream) {
    global_norm_aggregate_kernel<<<1, 1024, 0, stream>>>(out, partials, num_partials, accumulate);
    cudaCheck(cudaGetLastError());
}
