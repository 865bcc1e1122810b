// llmc/gelu.cuh: GELU, tanh approximation, forward and backward (in place on the incoming gradient):
//   gelu(x) = 0.5 x (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)
// The project's one definition of GELU: every path that evaluates it outside a cuBLASLt epilogue uses
// gelu_value / gelu_derivative (the trainers' recompute, the unfused Linear layers of llmc/matmul.cuh, the
// dropless experts' bias-and-GELU pass of llmc/expert_matmul.cuh, the kernel lab's references), so that a
// recompute reproduces its forward bit for bit. A cuBLASLt GELU epilogue is the library's own evaluation: the trainers fuse the forward GELU into
// it only where nothing recomputes it (-ge with -r 0).
// Included by the trainers and by dev/cuda/gelu.cu (the kernel lab: `make build/lab/gelu_bf16 && build/lab/gelu_bf16 -s`).
// Any N (a size_t count): each thread moves 8 elements with 16-byte vectors, the last thread handles a tail of N % 8 one by
// one. Pointers must be 16-byte aligned (cudaMalloc'd buffers at offsets that are multiples of 8 elements).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-gelu_{bf16,fp32} and their lab-check- twins;
// production-sizes, gpt-* (-ge 0/1/2, -r 0/1/2).
#pragma once
#include "common.cuh"

#define GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
#define GELU_CUBIC 0.044715f

// 0.5 (1 + tanh u) is the logistic sigmoid of 2u, so gelu(x) = x * sigmoid(2u) with one exponential. This
// form keeps the relative error small where 1 + tanh(u) would cancel (x < -2), and avoids tanhf, which
// --use_fast_math maps to tanh.approx.f32 (relative error up to 2^-11, too coarse for fp32 training).
// Saturates cleanly: exp overflows to inf (sigmoid 0) or underflows to 0 (sigmoid 1).
__device__ inline float gelu_sigmoid_2u(float x) {
    const float u = GELU_SCALE * (x + GELU_CUBIC * x * x * x);
    return 1.0f / (1.0f + __expf(-2.0f * u));
}

__device__ inline float gelu_value(float x) {
    return x * gelu_sigmoid_2u(x);
}

// d gelu / dx = sigmoid(2u) + 2 x sigmoid(2u) (1 - sigmoid(2u)) du/dx,  du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// (the tanh form's 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) du/dx, rewritten with tanh u = 2 sigmoid(2u) - 1)
__device__ inline float gelu_derivative(float x) {
    const float sigmoid = gelu_sigmoid_2u(x);
    const float du_dx = GELU_SCALE * (1.0f + 3.0f * GELU_CUBIC * x * x);
    return sigmoid + 2.0f * x * sigmoid * (1.0f - sigmoid) * du_dx;
}

// Forward floor: read N, write N floatX: DRAM bytes = 2*N*sizeof(floatX); ~15 flops per element (one
// exponential, one division), ~4 flops per byte in bf16 against the ~20 flops per DRAM byte an H100's fp32
// units sustain: memory-bound.
__global__ void gelu_forward_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, size_t N) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i + x128::size <= N) {
        x128 x = load128cs(inp + i);
        x128 result;
        for (int k = 0; k < x128::size; k++) result[k] = (floatX)gelu_value((float)x[k]);
        store128(out + i, result);
    } else {
        for (size_t j = i; j < N; j++) out[j] = (floatX)gelu_value((float)inp[j]);
    }
}

// Backward floor: read the gradient and the input, write the gradient: DRAM bytes = 3*N*sizeof(floatX);
// ~30 flops per element: memory-bound.
__global__ void gelu_backward_inplace_kernel(floatX* d_in_out, const floatX* __restrict__ inp, size_t N) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i + x128::size <= N) {
        x128 d = load128cs(d_in_out + i);
        x128 x = load128cs(inp + i);
        x128 result;
        for (int k = 0; k < x128::size; k++) result[k] = (floatX)((float)d[k] * gelu_derivative((float)x[k]));
        store128(d_in_out + i, result);
    } else {
        for (size_t j = i; j < N; j++) d_in_out[j] = (floatX)((float)d_in_out[j] * gelu_derivative((float)inp[j]));
    }
}

// The grid is counted in size_t: N reaches 2^31 at production sizes (B*T*4C, the dropless experts' rows * H), and
// N / (block_size * 8) stays far below the 2^31 - 1 blocks a grid may have for any N that fits in a GPU's memory.
void gelu_forward_launch(floatX* out, const floatX* inp, size_t N, int block_size, cudaStream_t stream) {
    const unsigned int grid = (unsigned int)CEIL_DIV(N, (size_t)block_size * x128::size);
    gelu_forward_kernel<<<grid, block_size, 0, stream>>>(out, inp, N);
    cudaCheck(cudaGetLastError());
}

void gelu_backward_inplace_launch(floatX* d_in_out, const floatX* inp, size_t N, int block_size, cudaStream_t stream) {
    const unsigned int grid = (unsigned int)CEIL_DIV(N, (size_t)block_size * x128::size);
    gelu_backward_inplace_kernel<<<grid, block_size, 0, stream>>>(d_in_out, inp, N);
    cudaCheck(cudaGetLastError());
}

// out (N) = gelu(inp)
void gelu_forward(floatX* out, const floatX* inp, size_t N, cudaStream_t stream) {
    gelu_forward_launch(out, inp, N, 256, stream);
}

// d (N) *= gelu'(inp)
void gelu_backward_inplace(floatX* d_in_out, const floatX* inp, size_t N, cudaStream_t stream) {
    gelu_backward_inplace_launch(d_in_out, inp, N, 256, stream);
}
