// llmc/prompt.cuh: prompt tuning's learned input embeddings (Lester et al. 2021): P virtual tokens prepended to every
// sequence, whose embeddings are trained while the model stays frozen. The model runs on P + T positions; the encoder
// (llmc/encoder.cuh) embeds the real tokens, and these kernels put the prompt into the first P rows of every sequence
// and sum the gradient that reaches them. Builds with nvcc or cpu/cucc; the trainer (train_gpt.cu,
// llmc/model_adapter.h) calls them.
// Size rules: C a multiple of 8 (16-byte vectors of a row), buffers 16-byte aligned.
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-prompt*, llama-*-prompt* (forward, gradient and 10 steps
// against train_gpt.py --ft prompt), fine-tuning-cli.
#pragma once
#include "common.cuh"

// out (B, T, C): rows t < P of every sequence = prompt[t] (P, C), plus wpe[t] when the positions are learned (wpe
// NULL: RoPE). One thread per 16-byte pack of the (B, P, C) rows. Floor: B P C (2 or 3) sizeof(floatX) bytes.
__global__ void prompt_embed_forward_kernel(floatX* out, const floatX* prompt, const floatX* wpe, int B, int T, int P,
                                            int C) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= (size_t)B * P * C) return;
    const int b = (int)(i / ((size_t)P * C)), t = (int)(i / C % P), c = (int)(i % C);
    x128 p = load128(prompt + (size_t)t * C + c);
    if (wpe != nullptr) {
        x128 w = load128(wpe + (size_t)t * C + c);
        for (int k = 0; k < x128::size; k++) p[k] = (floatX)((float)p[k] + (float)w[k]);
    }
    store128(out + ((size_t)b * T + t) * C + c, p);
}

// dprompt (P, C) += the sum over the B sequences of dout (B, T, C)'s rows t < P, in sequence order (no atomics: the
// same bits every run). One thread per pack of (P, C). Floor: B P C sizeof(floatX) bytes read.
__global__ void prompt_embed_backward_kernel(floatX* dprompt, const floatX* dout, int B, int T, int P, int C) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= (size_t)P * C) return;
    const int t = (int)(i / C), c = (int)(i % C);
    float sum[x128::size];
    x128 old = load128(dprompt + i);
    for (int k = 0; k < x128::size; k++) sum[k] = (float)old[k];
    for (int b = 0; b < B; b++) {
        x128 d = load128(dout + ((size_t)b * T + t) * C + c);
        for (int k = 0; k < x128::size; k++) sum[k] += (float)d[k];
    }
    x128 out;
    for (int k = 0; k < x128::size; k++) out[k] = (floatX)sum[k];
    store128(dprompt + i, out);
}

static void prompt_require_sizes(const char* function, int C, const void* a, const void* b) {
    if (C % x128::size != 0 || ((uintptr_t)a | (uintptr_t)b) % 16 != 0) {
        fprintf(stderr, "%s: C=%d must be a multiple of %d and the buffers 16-byte aligned\n", function, C,
                (int)x128::size);
        exit(EXIT_FAILURE);
    }
}

void prompt_embed_forward(floatX* out, const floatX* prompt, const floatX* wpe, int B, int T, int P, int C,
                          cudaStream_t stream) {
    prompt_require_sizes("prompt_embed_forward", C, out, prompt);
    const int block_size = 256;
    const size_t packs = (size_t)B * P * C / x128::size;
    prompt_embed_forward_kernel<<<(unsigned)CEIL_DIV(packs, (size_t)block_size), block_size, 0, stream>>>(
        out, prompt, wpe, B, T, P, C);
    cudaCheck(cudaGetLastError());
}

void prompt_embed_backward(floatX* dprompt, const floatX* dout, int B, int T, int P, int C, cudaStream_t stream) {
    prompt_require_sizes("prompt_embed_backward", C, dprompt, dout);
    const int block_size = 256;
    const size_t packs = (size_t)P * C / x128::size;
    prompt_embed_backward_kernel<<<(unsigned)CEIL_DIV(packs, (size_t)block_size), block_size, 0, stream>>>(
        dprompt, dout, B, T, P, C);
    cudaCheck(cudaGetLastError());
}
