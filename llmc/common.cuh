// llmc/common.cuh: what every kernel header of switch.cu shares: the training precision (floatX),
// error checks, the 16-byte packed vector used for all vectorised loads and stores, warp and block
// reductions, stochastic rounding and small helpers. Included by every llmc/*.cuh, the trainers and
// the kernel lab (dev/cuda/). Precision is chosen at build time: -DENABLE_FP32, -DENABLE_FP16, or
// neither (bf16, the default), as `make PRECISION=FP32|FP16|BF16` passes it.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ----------------------------------------------------------------------------------------------------
// Precision
enum PrecisionMode { PRECISION_FP32, PRECISION_FP16, PRECISION_BF16 };
#if defined(ENABLE_FP32)
typedef float floatX;
#define PRECISION_MODE PRECISION_FP32
#define PRECISION_NAME "fp32"
#elif defined(ENABLE_FP16)
typedef half floatX;
#define PRECISION_MODE PRECISION_FP16
#define PRECISION_NAME "fp16"
#else
typedef __nv_bfloat16 floatX;
#define PRECISION_MODE PRECISION_BF16
#define PRECISION_NAME "bf16"
#endif

// ----------------------------------------------------------------------------------------------------
// Error checks: one line naming the call's place and the error, then exit.
inline void cuda_check(cudaError_t error, const char* file, int line) {
    if (error != cudaSuccess) {
        fprintf(stderr, "[CUDA ERROR] at %s:%d: %s\n", file, line, cudaGetErrorString(error));
        exit(EXIT_FAILURE);
    }
}
#define cudaCheck(err) (cuda_check((err), __FILE__, __LINE__))

#define CEIL_DIV(M, N) (((M) + (N) - 1) / (N))

// ----------------------------------------------------------------------------------------------------
// Packed128: 16 bytes of elements (4 floats, 8 bf16/fp16), so that a thread moves memory with one
// 128-bit load or store, the widest the GPU issues.
template <class ElementType>
struct alignas(16) Packed128 {
    static constexpr const int size = sizeof(int4) / sizeof(ElementType);
    ElementType payload[size];

    Packed128() = default;
    __device__ __host__ explicit Packed128(int4 bits) { memcpy(&payload, &bits, sizeof(bits)); }
    __device__ __host__ static Packed128 constant(ElementType value) {
        Packed128 result;
        for (int k = 0; k < size; k++) result.payload[k] = value;
        return result;
    }
    __device__ __host__ static Packed128 zeros() { return constant((ElementType)0.0f); }
    __device__ __host__ ElementType& operator[](int index) { return payload[index]; }
    __device__ __host__ const ElementType& operator[](int index) const { return payload[index]; }
    __device__ __host__ int4 get_bits() const {
        int4 bits;
        memcpy(&bits, &payload, sizeof(bits));
        return bits;
    }
};
typedef Packed128<float> f128;
typedef Packed128<floatX> x128;

// loads and stores; "cs" = streaming (evict first): for data read or written once
template <class ElementType>
__device__ inline Packed128<ElementType> load128(const ElementType* address) {
    return Packed128<ElementType>{*reinterpret_cast<const int4*>(address)};
}
template <class ElementType>
__device__ inline Packed128<ElementType> load128cs(const ElementType* address) {
    return Packed128<ElementType>{__ldcs(reinterpret_cast<const int4*>(address))};
}
template <class ElementType>
__device__ inline void store128(ElementType* target, Packed128<ElementType> value) {
    *reinterpret_cast<int4*>(target) = value.get_bits();
}
template <class ElementType>
__device__ inline void store128cs(ElementType* target, Packed128<ElementType> value) {
    __stcs(reinterpret_cast<int4*>(target), value.get_bits());
}
template <class ElementType>
__device__ inline void store128cg(ElementType* target, Packed128<ElementType> value) {
    __stcg(reinterpret_cast<int4*>(target), value.get_bits());
}

// ----------------------------------------------------------------------------------------------------
// Reductions. Butterfly (xor) shuffles: every lane ends with the same value, in the same order on every
// lane, so results are deterministic.
__device__ inline float warp_reduce_sum(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffff, value, offset);
    return value;
}
__device__ inline float warp_reduce_max(float value) {
    for (int offset = 16; offset > 0; offset /= 2) value = fmaxf(value, __shfl_xor_sync(0xffffffff, value, offset));
    return value;
}

// Block-wide reduction for blockDim.x a multiple of 32 (up to 1024); every thread gets the result.
// final_sync = true when the caller reduces again right after (the shared slots are reused).
using reduction_func_t = float (*)(float);
template <reduction_func_t warp_reduction>
__device__ inline float block_reduce(float value, bool final_sync = false, float out_of_bounds = 0.0f) {
    __shared__ float shared_values[32];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int num_warps = blockDim.x / 32;
    float warp_value = warp_reduction(value);
    if (lane == 0) shared_values[warp] = warp_value;
    __syncthreads();
    warp_value = (lane < num_warps) ? shared_values[lane] : out_of_bounds;
    float block_value = warp_reduction(warp_value);
    if (final_sync) __syncthreads();
    return block_value;
}

// ----------------------------------------------------------------------------------------------------
// Deterministic parameter gradients without float atomics (the norms' backward passes): each block of the
// main kernel writes its own fp32 partial sums, a (blocks, C) or (blocks, 2C) matrix, and this kernel adds
// them in block order: first[c] += sum_b partials[b][c] and, when second is not nullptr, second[c] +=
// sum_b partials[b][C + c]. A block of (32 columns x 16 slices) threads owns 32 columns of one 16-byte
// vector each, each slice summing rows slice, slice+16, ... before the 16 slice sums are added in slice
// order. C % 8 == 0.
#define PARTIALS_ACCUMULATE_COLUMNS 32  // vector columns of the partials per block
#define PARTIALS_ACCUMULATE_SLICES 16   // threads splitting the partial rows of one column

__global__ void block_partials_accumulate_kernel(floatX* __restrict__ first, floatX* __restrict__ second,
                                                 const float* __restrict__ partials, int blocks, int C) {
    __shared__ float slice_sums[PARTIALS_ACCUMULATE_SLICES * PARTIALS_ACCUMULATE_COLUMNS * x128::size];
    const int width = second != nullptr ? 2 * C : C;
    const int column = blockIdx.x * PARTIALS_ACCUMULATE_COLUMNS + threadIdx.x;  // x128::size floats of width
    const int slice = threadIdx.y;
    const int columns = width / x128::size;
    float sum[x128::size];
    for (int k = 0; k < x128::size; k++) sum[k] = 0.0f;
    if (column < columns) {
        for (int b = slice; b < blocks; b += PARTIALS_ACCUMULATE_SLICES) {
            const float* partial = partials + (size_t)b * width + column * x128::size;
            for (int k = 0; k < x128::size; k += f128::size) {
                f128 p = load128cs(partial + k);
                for (int j = 0; j < f128::size; j++) sum[k + j] += p[j];
            }
        }
    }
    float* mine = slice_sums + (slice * PARTIALS_ACCUMULATE_COLUMNS + threadIdx.x) * x128::size;
    for (int k = 0; k < x128::size; k++) mine[k] = sum[k];
    __syncthreads();
    if (slice != 0 || column >= columns) return;
    for (int s = 1; s < PARTIALS_ACCUMULATE_SLICES; s++) {
        const float* theirs = slice_sums + (s * PARTIALS_ACCUMULATE_COLUMNS + threadIdx.x) * x128::size;
        for (int k = 0; k < x128::size; k++) sum[k] += theirs[k];
    }
    const int chunks = C / x128::size;
    floatX* target = column < chunks ? first + column * x128::size : second + (column - chunks) * x128::size;
    x128 old_value = load128(target);
    x128 new_value;
    for (int k = 0; k < x128::size; k++) new_value[k] = (floatX)((float)old_value[k] + sum[k]);
    store128(target, new_value);
}

// first (C) += the column sums of partials (blocks, C); with second (C), partials are (blocks, 2C) and their
// last C columns go to second
void block_partials_accumulate(floatX* first, floatX* second, const float* partials, int blocks, int C,
                               cudaStream_t stream) {
    const int width = second != nullptr ? 2 * C : C;
    dim3 block(PARTIALS_ACCUMULATE_COLUMNS, PARTIALS_ACCUMULATE_SLICES);
    const int grid = CEIL_DIV(width / x128::size, PARTIALS_ACCUMULATE_COLUMNS);
    block_partials_accumulate_kernel<<<grid, block, 0, stream>>>(first, second, partials, blocks, C);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// Random numbers for stochastic rounding: a counter-based hash (Squirrel noise 5), so a value depends
// only on (seed, index) and not on the order threads run in.
__device__ __host__ inline unsigned int squirrel_noise5(unsigned int position, unsigned int seed) {
    const unsigned int SQ5_BIT_NOISE1 = 0xd2a80a3f;
    const unsigned int SQ5_BIT_NOISE2 = 0xa884f197;
    const unsigned int SQ5_BIT_NOISE3 = 0x6C736F4B;
    const unsigned int SQ5_BIT_NOISE4 = 0xB79F3ABB;
    const unsigned int SQ5_BIT_NOISE5 = 0x1b56c4f5;
    unsigned int mangled = position;
    mangled *= SQ5_BIT_NOISE1;
    mangled += seed;
    mangled ^= (mangled >> 9);
    mangled += SQ5_BIT_NOISE2;
    mangled ^= (mangled >> 11);
    mangled *= SQ5_BIT_NOISE3;
    mangled ^= (mangled >> 13);
    mangled += SQ5_BIT_NOISE4;
    mangled ^= (mangled >> 15);
    mangled *= SQ5_BIT_NOISE5;
    mangled ^= (mangled >> 17);
    return mangled;
}
__device__ __host__ inline unsigned int random_u32(unsigned int seed, unsigned int index) {
    return squirrel_noise5(index, seed);
}

// Round a float to bf16 up or down with probability given by the distance: unbiased in expectation,
// which keeps small AdamW updates from vanishing in bf16 weights.
__device__ inline void stochastic_rounding(float in, __nv_bfloat16* out, unsigned int random) {
    unsigned int threshold = random & 0xFFFF;
    unsigned int float_bits = __float_as_uint(in);
    unsigned int rounded_bits = float_bits & 0x0000FFFF;
    float_bits = (rounded_bits > threshold) ? (float_bits | 0xFFFF) : (float_bits & ~0xFFFF);
    *out = __float2bfloat16_rn(__uint_as_float(float_bits));  // all-ones low bits round up, all-zero are exact
}
__device__ inline void stochastic_rounding(float in, half* out, unsigned int random) {
    *out = (half)in;  // fp16 has 10 mantissa bits: round to nearest is what the FP16 path wants
    (void)random;
}
__device__ inline void stochastic_rounding(float in, float* out, unsigned int random) {
    *out = in;
    (void)random;
}
