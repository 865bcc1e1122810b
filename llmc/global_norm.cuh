// llmc/global_norm.cuh: the squared global norm of the gradients (for clipping and the printed `norm`),
// deterministic: a fixed number of partial sums, each over a share of the values fixed by the element count
// alone (not by the GPU), then added in a fixed order. Call global_norm_squared once per tensor (reset on the
// first), then global_norm_aggregate. Included by the trainers; builds with nvcc or cpu/cucc.
// Lab file: dev/cuda/global_norm.cu.
#pragma once
#include "common.cuh"

// 128 blocks of 256 threads, each thread with 4 independent 16-byte loads in flight per step: 2 MB in
// flight, about what an H100/H200 needs to cover DRAM latency, from few enough threads that the CPU backend
// (~12 ns per thread per shuffle or barrier) runs a call in a few ms. The partials stay few enough for one
// block to add them.
#define GLOBAL_NORM_PARTIALS 128
#define GLOBAL_NORM_BLOCK_SIZE 256
#define GLOBAL_NORM_LOADS_IN_FLIGHT 4

int global_norm_num_partials(void) { return GLOBAL_NORM_PARTIALS; }

// Block p's thread j sums the squares of chunks (16 bytes each) p*256 + j + i*stride, stride = 128*256
// chunks, taking 4 of them per step; the count % x128::size elements past the last whole chunk go to block
// 0. fp32 sums in a fixed order, then block_reduce in its fixed order.
// Floor: count * sizeof(floatX) bytes read once, 2 flops per element.
__global__ void global_norm_squared_kernel(float* partials, const floatX* values, size_t count, bool reset) {
    const size_t chunks = count / x128::size;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    float sum = 0.0f;
    for (; c + (GLOBAL_NORM_LOADS_IN_FLIGHT - 1) * stride < chunks; c += GLOBAL_NORM_LOADS_IN_FLIGHT * stride) {
        x128 packed[GLOBAL_NORM_LOADS_IN_FLIGHT];
        for (int l = 0; l < GLOBAL_NORM_LOADS_IN_FLIGHT; l++) packed[l] = load128cs(values + (c + l * stride) * x128::size);
        for (int l = 0; l < GLOBAL_NORM_LOADS_IN_FLIGHT; l++)
            for (int k = 0; k < x128::size; k++) sum += (float)packed[l][k] * (float)packed[l][k];
    }
    for (; c < chunks; c += stride) {
        x128 packed = load128cs(values + c * x128::size);
        for (int k = 0; k < x128::size; k++) sum += (float)packed[k] * (float)packed[k];
    }
    if (blockIdx.x == 0 && threadIdx.x < count % x128::size) {
        const float value = (float)values[chunks * x128::size + threadIdx.x];
        sum += value * value;
    }
    const float block_sum = block_reduce<warp_reduce_sum>(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = reset ? block_sum : partials[blockIdx.x] + block_sum;
}

// one thread per partial, one block: the order of the sum is block_reduce's, fixed
__global__ void global_norm_aggregate_kernel(float* out, const float* partials) {
    const float total = block_reduce<warp_reduce_sum>(partials[threadIdx.x]);
    if (threadIdx.x == 0) out[0] = total;
}

void global_norm_squared(float* partials, const floatX* values, size_t count, bool reset, cudaStream_t stream) {
    if ((uintptr_t)values % 16 != 0) {
        fprintf(stderr, "global_norm_squared: values must be 16-byte aligned\n");
        exit(EXIT_FAILURE);
    }
    global_norm_squared_kernel<<<GLOBAL_NORM_PARTIALS, GLOBAL_NORM_BLOCK_SIZE, 0, stream>>>(partials, values, count,
                                                                                           reset);
    cudaCheck(cudaGetLastError());
}

void global_norm_aggregate(float* out, const float* partials, cudaStream_t stream) {
    global_norm_aggregate_kernel<<<1, GLOBAL_NORM_PARTIALS, 0, stream>>>(out, partials);
    cudaCheck(cudaGetLastError());
}
