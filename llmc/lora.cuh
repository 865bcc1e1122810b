// llmc/lora.cuh: LoRA, a Linear layer y = x W^T + b with a trainable low-rank update beside its frozen weight:
//   y = x W^T + b + s (x A^T) B^T,   A (r, C) Gaussian-initialised, B (OC, r) zero-initialised, s = alpha / r
// (Hu et al. 2021). The GEMMs are llmc/matmul.cuh's cuBLASLt call; the one kernel of its own scales the rank-r
// intermediate by s. The trainer (train_gpt.cu, llmc/model_adapter.h) calls these after the frozen layer's own matmul
// forward and backward. Needs cublas_setup() first; builds with nvcc or cpu/cucc.
// Size rules: those of llmc/matmul.cuh (C, OC and the rank r multiples of 8, buffers 16-byte aligned).
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-lora*, llama-*-lora* (forward, gradients and 10 steps
// against train_gpt.py --ft lora), fine-tuning-cli.
#pragma once
#include "common.cuh"
#include "matmul.cuh"

// x (n) *= s, rounded once to floatX. Floor: 2 n sizeof(floatX) bytes, n flops; n = N r is 1/C of the layer's
// activations, so this is noise beside the GEMMs.
__global__ void lora_scale_kernel(floatX* x, float s, size_t n) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 packed = load128(x + i);
    for (int k = 0; k < x128::size; k++) packed[k] = (floatX)(s * (float)packed[k]);
    store128(x + i, packed);
}

static void lora_scale(floatX* x, float s, size_t n, cudaStream_t stream) {
    const int block_size = 256;
    const size_t packs = CEIL_DIV(n, (size_t)x128::size);  // n = N r with r a multiple of 8: whole packs
    lora_scale_kernel<<<(unsigned)CEIL_DIV(packs, (size_t)block_size), block_size, 0, stream>>>(x, s, n);
    cudaCheck(cudaGetLastError());
}

// u (N, r) = s (inp (N, C) A^T), the rank-r intermediate of both passes (the backward pass recomputes it: N r values
// per layer are cheaper to recompute than to keep)
static void lora_intermediate(floatX* u, const floatX* inp, const floatX* A, float s, int N, int C, int r,
                              cudaStream_t stream) {
    matmul_cublaslt(u, A, inp, nullptr, r, N, C, stream, true, false, false, nullptr, false);
    lora_scale(u, s, (size_t)N * r, stream);
}

// out (N, OC) += s (inp (N, C) A^T) B^T, after the frozen layer's matmul_forward wrote out. u: (N, r) scratch.
static void lora_forward(floatX* out, const floatX* inp, const floatX* A, const floatX* B, float s, floatX* u, int N,
                         int C, int OC, int r, cudaStream_t stream) {
    matmul_check_sizes("lora_forward", C, OC);
    matmul_require_multiple_of_8("lora_forward", "rank", r);
    lora_intermediate(u, inp, A, s, N, C, r, stream);
    matmul_cublaslt(out, B, u, nullptr, OC, N, r, stream, true, false, true, nullptr, false);
}

// The transpose, after the frozen layer's matmul_backward wrote dinp = dout W: with u = s inp A^T and g = s dout B,
//   dB (OC, r) += dout^T u,   dA (r, C) += g^T inp,   dinp (N, C) += g A.
// u and g: (N, r) scratch each.
static void lora_backward(floatX* dinp, floatX* dA, floatX* dB, const floatX* dout, const floatX* inp,
                          const floatX* A, const floatX* B, float s, floatX* u, floatX* g, int N, int C, int OC, int r,
                          cudaStream_t stream) {
    matmul_check_sizes("lora_backward", C, OC);
    matmul_require_multiple_of_8("lora_backward", "rank", r);
    lora_intermediate(u, inp, A, s, N, C, r, stream);
    matmul_cublaslt(dB, u, dout, nullptr, r, OC, N, stream, false, true, true, nullptr, false);
    matmul_cublaslt(g, B, dout, nullptr, r, N, OC, stream, false, false, false, nullptr, false);
    lora_scale(g, s, (size_t)N * r, stream);
    matmul_cublaslt(dA, inp, g, nullptr, C, r, N, stream, false, true, true, nullptr, false);
    matmul_cublaslt(dinp, A, g, nullptr, C, N, r, stream, false, false, true, nullptr, false);
}
