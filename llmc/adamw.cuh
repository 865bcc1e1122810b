// llmc/adamw.cuh: the AdamW optimizer step (decoupled weight decay, Loshchilov & Hutter) over a flat array of
// parameters, with optional fp32 master weights and stochastic rounding into floatX. Included by the trainers;
// builds with nvcc or cpu/cucc, nothing to link. Lab file: dev/cuda/adamw.cu. Its host twin for ZeRO-Offload, bit for
// bit the same step: llmc/adamw_host.h.
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-adamw_{bf16,fp32} and their lab-check- twins; adamw-host-*
// (the host AdamW against this kernel), gpt-* and moe-* (10 AdamW steps against PyTorch).
#pragma once
#include "common.cuh"

// One parameter: updates m and v in place and returns the new fp32 value. Every operation is an IEEE one rounded to
// nearest (__fmul_rn, __fadd_rn, __fsqrt_rn, __fdiv_rn: never contracted into an fma by -fmad, never approximate under
// --use_fast_math's -prec-sqrt=false -prec-div=false), so that the host's AdamW for ZeRO-Offload (llmc/adamw_host.h)
// computes the same bits from the same inputs, on a GPU as on the CPU backend; only -ftz differs between builds
// (adamw_device_flushes_subnormals). The exact square root and division cost a few instructions more than the
// approximate ones, which the ~30 bytes per element this kernel moves hide.
__device__ inline float adamw_element(float param, float grad, float* m, float* v, float learning_rate, float beta1,
                                      float beta2, float beta1_correction_inverse, float beta2_correction_inverse,
                                      float eps, float weight_decay) {
    const float new_m = __fadd_rn(__fmul_rn(beta1, *m), __fmul_rn(1.0f - beta1, grad));
    const float new_v = __fadd_rn(__fmul_rn(beta2, *v), __fmul_rn(__fmul_rn(1.0f - beta2, grad), grad));
    *m = new_m;
    *v = new_v;
    // the bias corrections arrive as reciprocals: two divisions per element fewer (the GPU's division is a
    // multi-instruction sequence and the CPU backend's is ~10x a multiply)
    const float m_hat = __fmul_rn(new_m, beta1_correction_inverse);
    const float v_hat = __fmul_rn(new_v, beta2_correction_inverse);
    const float step = __fadd_rn(__fdiv_rn(m_hat, __fadd_rn(__fsqrt_rn(v_hat), eps)), __fmul_rn(weight_decay, param));
    return __fsub_rn(param, __fmul_rn(learning_rate, step));
}

// One thread per 16-byte chunk of params (x128::size elements): one x128 load/store of params and grads, and
// x128::size / 4 f128 loads/stores of each fp32 array. The last chunk, when n is not a multiple of the chunk,
// goes element by element. The rounding noise of element i is random_u32(seed, first_index + i), whatever the launch
// shape (a caller updating a piece of a tensor passes the piece's offset in it, so that ZeRO shards round as one
// update of the whole tensor would).
// Floor: per element, with master weights: reads grad (X) + m, v, master (12), writes param (X) + m, v,
// master (12): 2X + 24 bytes; without: reads grad, param (2X) + m, v (8), writes param (X) + m, v (8): 3X + 16
// bytes (X = sizeof(floatX)). ~15 flops per element: memory-bound.
// GradT: floatX (the gradient buffer) or float (ZeRO-2's fp32 gradient shard, read as x128::size / f128::size loads).
template <typename GradT>
__global__ void adamw_kernel(floatX* params, float* master_params, const GradT* grads, float* m, float* v, size_t n,
                             float learning_rate, float beta1, float beta2, float beta1_correction_inverse,
                             float beta2_correction_inverse, float eps, float weight_decay, float grad_scale,
                             unsigned int seed, unsigned int first_index) {
    const size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    if (i + x128::size <= n) {
        float old_params[x128::size], new_params[x128::size], first[x128::size], second[x128::size];
        float chunk_grads[x128::size];
        for (int k = 0; k < x128::size; k += Packed128<GradT>::size) {
            Packed128<GradT> packed_grads = load128cs(grads + i + k);
            for (int j = 0; j < Packed128<GradT>::size; j++) chunk_grads[k + j] = (float)packed_grads[j];
        }
        x128 packed_params = master_params == nullptr ? load128(params + i) : x128::zeros();
        for (int k = 0; k < x128::size; k += f128::size) {
            f128 packed_m = load128cs(m + i + k);
            f128 packed_v = load128cs(v + i + k);
            f128 packed_master = master_params != nullptr ? load128cs(master_params + i + k) : f128::zeros();
            for (int j = 0; j < f128::size; j++) {
                first[k + j] = packed_m[j];
                second[k + j] = packed_v[j];
                old_params[k + j] = master_params != nullptr ? packed_master[j] : (float)packed_params[k + j];
            }
        }
        for (int k = 0; k < x128::size; k++)
            new_params[k] = adamw_element(old_params[k], __fmul_rn(grad_scale, chunk_grads[k]), &first[k],
                                          &second[k], learning_rate, beta1, beta2, beta1_correction_inverse,
                                          beta2_correction_inverse, eps, weight_decay);
        x128 rounded;
        for (int k = 0; k < x128::size; k++)
            stochastic_rounding(new_params[k], &rounded[k], random_u32(seed, first_index + (unsigned int)(i + k)));
        store128(params + i, rounded);
        for (int k = 0; k < x128::size; k += f128::size) {
            f128 packed_m, packed_v, packed_master;
            for (int j = 0; j < f128::size; j++) {
                packed_m[j] = first[k + j];
                packed_v[j] = second[k + j];
                packed_master[j] = new_params[k + j];
            }
            store128cs(m + i + k, packed_m);
            store128cs(v + i + k, packed_v);
            if (master_params != nullptr) store128cs(master_params + i + k, packed_master);
        }
    } else {
        for (size_t e = i; e < n; e++) {
            const float old_param = master_params != nullptr ? master_params[e] : (float)params[e];
            const float new_param = adamw_element(old_param, __fmul_rn(grad_scale, (float)grads[e]), &m[e], &v[e],
                                                  learning_rate, beta1, beta2, beta1_correction_inverse,
                                                  beta2_correction_inverse, eps, weight_decay);
            stochastic_rounding(new_param, &params[e], random_u32(seed, first_index + (unsigned int)e));
            if (master_params != nullptr) master_params[e] = new_param;
        }
    }
}

// beta1_correction = 1 - beta1^t and beta2_correction = 1 - beta2^t; the kernel multiplies by their reciprocals.
template <typename GradT>
void adamw_update(floatX* params, float* master_params, const GradT* grads, float* m, float* v, size_t num_parameters,
                  float learning_rate, float beta1, float beta2, float beta1_correction, float beta2_correction,
                  float eps, float weight_decay, float grad_scale, unsigned int seed, cudaStream_t stream,
                  unsigned int first_index = 0) {
    if ((uintptr_t)params % 16 || (uintptr_t)master_params % 16 || (uintptr_t)grads % 16 || (uintptr_t)m % 16 ||
        (uintptr_t)v % 16) {
        fprintf(stderr, "adamw_update: params, master_params, grads, m and v must be 16-byte aligned\n");
        exit(EXIT_FAILURE);
    }
    if (num_parameters == 0) return;
    const int block_size = 512;
    const size_t chunks = CEIL_DIV(num_parameters, (size_t)x128::size);
    adamw_kernel<GradT><<<(unsigned int)CEIL_DIV(chunks, (size_t)block_size), block_size, 0, stream>>>(
        params, master_params, grads, m, v, num_parameters, learning_rate, beta1, beta2, 1.0f / beta1_correction,
        1.0f / beta2_correction, eps, weight_decay, grad_scale, seed, first_index);
    cudaCheck(cudaGetLastError());
}

// Whether this build's kernels flush subnormal fp32 inputs and results to zero (nvcc -ftz=true, which --use_fast_math
// implies; cpu/cucc emulates it): the one numerics setting that adamw_element's IEEE operations still follow, and so
// what the host's AdamW (llmc/adamw_host.h) must be told to match it bit for bit. 2^-100 * 2^-30 is subnormal.
__global__ void adamw_flush_probe_kernel(float* out, float a, float b) { *out = __fmul_rn(a, b); }
int adamw_device_flushes_subnormals(void) {
    float* d_product;
    float product;
    cudaCheck(cudaMalloc(&d_product, sizeof(float)));
    adamw_flush_probe_kernel<<<1, 1>>>(d_product, 0x1p-100f, 0x1p-30f);
    cudaCheck(cudaGetLastError());
    cudaCheck(cudaMemcpy(&product, d_product, sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_product));
    return product == 0.0f;
}
