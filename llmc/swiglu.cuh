// llmc/swiglu.cuh: SwiGLU, the Llama MLP's activation, forward and backward (doc/kernels.md, "SwiGLU"):
//   out = silu(gate) * up,  silu(x) = x * sigmoid(x).
// Layout (Megatron's and llm.c's): the MLP's first matmul is one fused Linear of 2H outputs, and each row of its
// output is [gate (H) | up (H)]: inp (N, 2H), out (N, H). The backward writes dinp (N, 2H) in the same layout,
// [dgate | dup], which the fused Linear's backward takes as its output gradient.
// Included by the kernel lab (dev/cuda/swiglu.cu: `make build/lab/swiglu_bf16 && build/lab/swiglu_bf16 -s`).
// Size constraint: H % 8 == 0 (each thread moves 8 elements of one row with 16-byte vectors, so a chunk never
// straddles gate and up); a trainer checks it at start-up through swiglu_support. Element counts are size_t: N*2H
// passes 2^31 at production sizes. Pointers must be 16-byte aligned (cudaMalloc'd buffers at offsets that are
// multiples of 8 elements).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-swiglu_{bf16,fp32} and their lab-check- twins; llama-* and
// moe-*llama*.
#pragma once
#include "common.cuh"

// silu(x) = x / (1 + exp(-x)); saturates cleanly: exp overflows to inf for x < -88 (silu -0) or underflows to 0
// (silu x). __expf, as llmc/gelu.cuh's sigmoid: ex2.approx on a GPU whatever the flags (a few ulp at |x| <= 10).
__device__ inline float swiglu_sigmoid(float x) {
    return 1.0f / (1.0f + __expf(-x));
}

// Forward floor: read N*2H, write N*H floatX: DRAM bytes = 3*N*H*sizeof(floatX); ~7 flops per output (one
// exponential, one division): memory-bound.
__global__ void swiglu_forward_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, int N, int H) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;  // flat index into out
    if (i >= (size_t)N * H) return;
    const size_t row = i / H;
    const floatX* gate = inp + row * 2 * H + (i - row * H);
    const x128 g = load128cs(gate);
    const x128 u = load128cs(gate + H);
    x128 result;
    for (int k = 0; k < x128::size; k++) {
        const float x = (float)g[k];
        result[k] = (floatX)(x * swiglu_sigmoid(x) * (float)u[k]);
    }
    store128(out + i, result);
}

// Backward: with s = sigmoid(gate),
//   dgate = dout * up * s * (1 + gate * (1 - s)),  dup = dout * silu(gate) = dout * gate * s.
// dinp may be inp itself (in place): each thread reads its gate and up elements before it writes the same ones.
// Floor: read dout (N*H) and inp (N*2H), write dinp (N*2H): DRAM bytes = 5*N*H*sizeof(floatX); ~12 flops per
// output element: memory-bound.
__global__ void swiglu_backward_kernel(floatX* dinp, const floatX* __restrict__ dout, const floatX* inp, int N,
                                       int H) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;  // flat index into dout
    if (i >= (size_t)N * H) return;
    const size_t row = i / H;
    const size_t gate_offset = row * 2 * H + (i - row * H);
    const x128 d = load128cs(dout + i);
    const x128 g = load128cs(inp + gate_offset);
    const x128 u = load128cs(inp + gate_offset + H);
    x128 dgate, dup;
    for (int k = 0; k < x128::size; k++) {
        const float x = (float)g[k];
        const float s = swiglu_sigmoid(x);
        const float dx = (float)d[k];
        dgate[k] = (floatX)(dx * (float)u[k] * s * (1.0f + x * (1.0f - s)));
        dup[k] = (floatX)(dx * x * s);
    }
    store128(dinp + gate_offset, dgate);
    store128(dinp + gate_offset + H, dup);
}

// The grid is counted in size_t: N*H / (block_size * 8) stays far below the 2^31 - 1 blocks a grid may have for
// any N*H that fits in a GPU's memory.
void swiglu_forward_launch(floatX* out, const floatX* inp, int N, int H, int block_size, cudaStream_t stream) {
    const unsigned int grid = (unsigned int)CEIL_DIV((size_t)N * H, (size_t)block_size * x128::size);
    swiglu_forward_kernel<<<grid, block_size, 0, stream>>>(out, inp, N, H);
    cudaCheck(cudaGetLastError());
}

void swiglu_backward_launch(floatX* dinp, const floatX* dout, const floatX* inp, int N, int H, int block_size,
                            cudaStream_t stream) {
    const unsigned int grid = (unsigned int)CEIL_DIV((size_t)N * H, (size_t)block_size * x128::size);
    swiglu_backward_kernel<<<grid, block_size, 0, stream>>>(dinp, dout, inp, N, H);
    cudaCheck(cudaGetLastError());
}

// out (N, H) = silu(inp[:, :H]) * inp[:, H:], inp (N, 2H)
void swiglu_forward(floatX* out, const floatX* inp, int N, int H, cudaStream_t stream) {
    swiglu_forward_launch(out, inp, N, H, 256, stream);
}

// dinp (N, 2H) = [dgate | dup] from dout (N, H) and the forward's inp (N, 2H); dinp may be inp (in place)
void swiglu_backward(floatX* dinp, const floatX* dout, const floatX* inp, int N, int H, cudaStream_t stream) {
    swiglu_backward_launch(dinp, dout, inp, N, H, 256, stream);
}

// ----------------------------------------------------------------------------------------------------
// The sizes the swiglu kernels support; false with a one-line reason otherwise. Called by a trainer at start-up.
bool swiglu_support(int H, char* why, size_t why_size) {
    if (H <= 0 || H % 8 != 0) {
        snprintf(why, why_size, "H = %d: the swiglu kernels need the MLP's hidden size H a positive multiple of 8 (16-byte vectors of 8 bf16)", H);
        return false;
    }
    return true;
}
