// llmc/bottleneck.cuh: the bottleneck adapter (Houlsby et al. 2019) that fine-tuning puts after a block's output,
// h -> h + up(gelu(down(h))): down (r, C) with its bias, the tanh GELU, up (C, r) with its bias, r the bottleneck
// width. Its up projection starts at zero, so that the adapted block starts as the frozen one. The GEMMs are
// llmc/matmul.cuh's cuBLASLt call (the up projection accumulates into h with its bias in the epilogue), the GELU
// llmc/gelu.cuh's. The trainer (train_gpt.cu, llmc/model_adapter.h) calls these at each adapted block's output.
// Needs cublas_setup() first; builds with nvcc or cpu/cucc.
// Size rules: those of llmc/matmul.cuh (C and r multiples of 8, buffers 16-byte aligned).
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-adapter*, llama-*-adapter* (forward, gradients and 10
// steps against train_gpt.py --ft adapter), fine-tuning-cli.
#pragma once
#include "common.cuh"
#include "gelu.cuh"
#include "matmul.cuh"

// h (N, C) += gelu(h Wd^T + bd) Wu^T + bu, in place. z and g: (N, r) scratch (the pre-activation and the GELU's
// output). Floor: 4 N C r flops and N C reads and writes of h: the adapter costs r / C of a C x C projection.
static void bottleneck_forward(floatX* h, const floatX* Wd, const floatX* bd, const floatX* Wu, const floatX* bu,
                               floatX* z, floatX* g, int N, int C, int r, cudaStream_t stream) {
    matmul_check_sizes("bottleneck_forward", C, r);
    matmul_cublaslt(z, Wd, h, bd, r, N, C, stream, true, false, false, nullptr, false);
    gelu_forward(g, z, (size_t)N * r, stream);
    matmul_cublaslt(h, Wu, g, bu, C, N, r, stream, true, false, true, nullptr, false);
}

// Its transpose from the block's input h (N, C) as the forward pass saw it (z and g recomputed from it, bit for bit
// the forward's): with dout (N, C) the gradient of the adapted output,
//   dWu (C, r) += dout^T g,  dbu += sum over rows of dout,  dz = (dout Wu) * gelu'(z),
//   dWd (r, C) += dz^T h,    dbd += sum over rows of dz,    dh (N, C) = dout + dz Wd.
// z, g, dz: (N, r) scratch; bias_scratch: matmul_dbias_buffer_floats(C) floats.
static void bottleneck_backward(floatX* dh, floatX* dWd, floatX* dbd, floatX* dWu, floatX* dbu, const floatX* dout,
                                const floatX* h, const floatX* Wd, const floatX* bd, const floatX* Wu, floatX* z,
                                floatX* g, floatX* dz, float* bias_scratch, int N, int C, int r, cudaStream_t stream) {
    matmul_check_sizes("bottleneck_backward", C, r);
    matmul_cublaslt(z, Wd, h, bd, r, N, C, stream, true, false, false, nullptr, false);
    gelu_forward(g, z, (size_t)N * r, stream);
    matmul_cublaslt(dWu, g, dout, nullptr, r, C, N, stream, false, true, true, nullptr, false);
    matmul_backward_bias(dbu, dout, bias_scratch, N, C, stream);
    matmul_cublaslt(dz, Wu, dout, nullptr, r, N, C, stream, false, false, false, nullptr, false);
    gelu_backward_inplace(dz, z, (size_t)N * r, stream);
    matmul_cublaslt(dWd, h, dz, nullptr, C, r, N, stream, false, true, true, nullptr, false);
    matmul_backward_bias(dbd, dz, bias_scratch, N, r, stream);
    cudaCheck(cudaMemcpyAsync(dh, dout, (size_t)N * C * sizeof(floatX), cudaMemcpyDeviceToDevice, stream));
    matmul_cublaslt(dh, Wd, dz, nullptr, C, N, r, stream, false, false, true, nullptr, false);
}
