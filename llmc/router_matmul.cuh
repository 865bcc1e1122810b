// llmc/router_matmul.cuh: the MoE router's GEMMs: logits in fp32 (the router runs in fp32 from its logits on),
// inputs in floatX (matmul_forward_fp32_output / matmul_backward_fp32_dout), through llmc/matmul.cuh's strided
// cuBLASLt call. Included by the trainers; needs cublas_setup() first and links with -lcublas -lcublasLt (nvcc or
// cpu/cucc). Lab: dev/cuda/expert_matmul.cu.
// C must be a multiple of 8 (the operands' leading dimension); OC (the expert count) may be any size >= 1.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-expert_matmul_{bf16,fp32} and their lab-check- twins; moe-*.
#pragma once
#include "common.cuh"
#include "cublas_common.cuh"
#include "matmul.cuh"

// dst (n) = src (n) rounded to floatX: the router's fp32 logit gradient made a GEMM operand. In the FP32 build
// it is a plain copy. Floor: n * (4 + sizeof(floatX)) bytes, one pass.
__global__ void matmul_cast_to_floatX_kernel(floatX* dst, const float* src, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (floatX)src[i];
}

// out (N, OC) fp32 = inp (N, C) @ weight^T (OC, C), fp32 accumulation rounded once to fp32, no bias
void matmul_forward_fp32_output(float* out, const floatX* inp, const floatX* weight, int N, int C, int OC,
                                cudaStream_t stream) {
    matmul_require_multiple_of_8("matmul_forward_fp32_output", "C", C);
    matmul_cublaslt_strided(out, CUDA_R_32F, weight, inp, nullptr, OC, N, C, stream, true, false, false, nullptr,
                            false, 1, 0, 0, 0, 0);
}

// dinp (N, C) += dout @ weight (accumulates: the router's input also receives the experts' gradient; NULL: not
// wanted); dweight (OC, C) += dout^T @ inp (NULL: not computed). dout (N, OC) is fp32, but a GEMM's A and B share
// one type, so it is first rounded to floatX into dout_scratch (N * OC elements); the GEMMs then accumulate in fp32 as
// everywhere.
void matmul_backward_fp32_dout(floatX* dinp, floatX* dweight, const float* dout, const floatX* inp,
                               const floatX* weight, floatX* dout_scratch, int N, int C, int OC, cudaStream_t stream) {
    matmul_require_multiple_of_8("matmul_backward_fp32_dout", "C", C);
    const size_t count = (size_t)N * OC;
    const int block_size = 256;
    matmul_cast_to_floatX_kernel<<<CEIL_DIV(count, (size_t)block_size), block_size, 0, stream>>>(dout_scratch, dout,
                                                                                                  count);
    cudaCheck(cudaGetLastError());
    if (dinp != nullptr)
        matmul_cublaslt_strided(dinp, CUBLAS_LOWP, weight, dout_scratch, nullptr, C, N, OC, stream, false, false, true,
                                nullptr, false, 1, 0, 0, 0, 0);
    if (dweight != nullptr)  // NULL: a frozen router (fine-tuning)
        matmul_cublaslt_strided(dweight, CUBLAS_LOWP, inp, dout_scratch, nullptr, C, OC, N, stream, false, true, true,
                                nullptr, false, 1, 0, 0, 0, 0);
}
