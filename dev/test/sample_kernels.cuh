// dev/test/sample_kernels.cuh: two realistic kernels that exercise the CPU backend the way the
// trainers' kernels will: a warp-per-row layernorm with warp-shuffle reductions (the llm.c pattern) and a
// block-per-row softmax with block-wide max and sum through shared memory. Used by the backend test
// (cpu/test/test_runtime.cu, against host references) and the backend benchmark (cpu/bench.cu).
#pragma once
#include <cuda_runtime.h>
#include <math.h>

__device__ inline float warp_sum(float v) {
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffff, v, off);
    return v;
}

__global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                  const float* bias, int N, int C) {
    int warps = blockDim.x / 32;
    int row = blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const float* x = inp + (size_t)row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += x[i];
    float m = warp_sum(s) / C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) v += (x[i] - m) * (x[i] - m);
    float r = rsqrtf(warp_sum(v) / C + 1e-5f);
    for (int i = lane; i < C; i += 32) out[(size_t)row * C + i] = (x[i] - m) * r * weight[i] + bias[i];
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

__global__ void softmax_forward(float* out, const float* inp, int C) {
    extern __shared__ float shared[];  // one float per warp
    int row = blockIdx.x, t = threadIdx.x, lane = t % 32, warp = t / 32, warps = blockDim.x / 32;
    const float* x = inp + (size_t)row * C;
    float mx = -INFINITY;
    for (int i = t; i < C; i += blockDim.x) mx = fmaxf(mx, x[i]);
    for (int off = 16; off > 0; off /= 2) mx = fmaxf(mx, __shfl_down_sync(0xffffffff, mx, off));
    if (lane == 0) shared[warp] = mx;
    __syncthreads();
    if (t == 0) {
        float m = shared[0];
        for (int w = 1; w < warps; w++) m = fmaxf(m, shared[w]);
        shared[0] = m;
    }
    __syncthreads();
    float row_max = shared[0];
    __syncthreads();
    float s = 0.0f;
    for (int i = t; i < C; i += blockDim.x) {
        float e = expf(x[i] - row_max);
        out[(size_t)row * C + i] = e;
        s += e;
    }
    s = warp_sum(s);
    if (lane == 0) shared[warp] = s;
    __syncthreads();
    if (t == 0) {
        float total = 0.0f;
        for (int w = 0; w < warps; w++) total += shared[w];
        shared[0] = total;
    }
    __syncthreads();
    float inv = 1.0f / shared[0];
    for (int i = t; i < C; i += blockDim.x) out[(size_t)row * C + i] *= inv;
}
