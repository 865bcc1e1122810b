// llmc/quantize.cuh: weight-only quantisation for inference: the Linear layers' weights W (OC, C) (PyTorch layout, as
// the model stores them, floatX row-major) kept as int8 or NF4 codes, dequantised inside the matmul, activations
// staying floatX. Quantisation runs once at load (kernels on the device); the matmuls are GEMV-like kernels for
// decode, which read each weight once. Included by an inference program and by the lab dev/cuda/quantize.cu; builds
// with nvcc or cpu/cucc, nothing to link.
//
// Formats.
// int8, per output channel absmax: scale[o] = max_c |W[o, c]| / 127 (fp32, correctly rounded division), and
//   q[o, c] = round-to-nearest-even(W[o, c] / scale[o]) (fp32 division, correctly rounded) clamped to [-127, 127];
//   a zero row has scale 0 and codes 0. Dequantised: w = (float)q * scale[o], one fp32 multiply.
// NF4 (QLoRA, Dettmers et al. 2023): W's elements in row-major order, in blocks of 64 consecutive ones (C % 64 == 0,
//   so a block lies inside one row: block b is row b / (C/64), columns 64 (b % (C/64)) ..); block b's absmax a_b;
//   code = the index of the nearest of the 16 NormalFloat levels NF4_LEVELS to x = W / a_b (fp32, correctly
//   rounded; the boundaries are the fp32 midpoints fl(l_k + l_{k+1}) / 2, a value equal to one takes the lower level;
//   a zero block has x = 0, code 7, level 0.0). Two codes per byte, the even column in the low nibble: byte
//   b * 32 + j holds columns 2j and 2j + 1 of block b. Double quantisation of the absmax values: blocks in groups of
//   NF4_GROUP = 256 consecutive ones (the last group may be shorter: OC * C / 64 blocks in all); group g's mean
//   m_g = fl(sum of its a_b, in block order) / n_g, its scale s_g = max |fl(a_b - m_g)|, and the int8 code
//   k_b = round-to-nearest-even(fl(a_b - m_g) / fl(s_g / 127)) clamped to [-127, 127] (all 0 when s_g is 0).
//   The weights' codes come from the exact a_b; the dequantised absmax is a'_b = fmaf(k_b, fl(s_g / 127), m_g) (one
//   rounding), within s_g / 254 of a_b plus an ulp, and the dequantised weight w = NF4_LEVELS[code] * a'_b, one fp32
//   multiply (a zero block gives exact zeros whatever a'_b is: level 7 is 0.0).
//
// How the matmuls and the dequantize functions relate (for tolerances): matmul_forward_int8/_nf4 form exactly the
// fp32 values w above (the same __device__ functions), accumulate sum_c inp[n, c] * w[o, c] in fp32 (fmaf, lanes'
// partial sums combined by a butterfly), add the bias in fp32 and round once to floatX. dequantize_int8/_nf4 write
// (floatX)w, the floatX rounding of those same fp32 values (bit for bit the values themselves in an fp32 build). So
// matmul_forward(out, inp, dequantized, bias) through cuBLAS sees the weights rounded to floatX (half an ulp, 2^-9
// relative in bf16), where the quantised matmul uses them unrounded; both accumulate in fp32.
//
// Floors. Decode (N <= 64 rows of input) reads the quantised weights once: int8 OC C + 4 OC bytes; NF4 OC C / 2
// (codes) + OC C / 64 (absmax codes) + 8 ceil(OC C / 16384) (group scales and means) bytes; plus N C X inputs and
// N OC X outputs (and OC X of bias), X = sizeof(floatX). Flops: 2 N OC C (FMAs) + OC C (the dequantising
// multiplies). Llama-3 8B's MLP weight 4096 x 14336: int8 58.7 MB, ~12.2 us at H200's 4.8 TB/s; NF4 30.3 MB, ~6.3 us
// (bf16: 117 MB, 24 us).
// Memory-bound while the FMAs keep up: a byte of int8 weight is N FMAs, an NF4 byte 2 N, and H200's CUDA cores do
// ~33.5 T fp32 FMA/s against 4.8 TB/s (7 FMAs per byte): int8 is bandwidth-bound up to N ~ 7, NF4 up to N ~ 3; at
// N = 64 the CUDA cores cap the kernel near 1/9 (int8) and 1/18 (NF4) of the bandwidth floor. Prefill (N in the
// hundreds) is compute-bound: dequantize_* once into a floatX buffer and use matmul_forward (cuBLAS, tensor cores).
//
// The kernels (matmul_forward_int8/_nf4): a warp per output channel o and a tile of up to QUANTIZE_MAX_ROWS input rows;
// lane l reads 16-byte chunks l, l + 32, ... of row o's codes (int8: 16 weights, NF4: 32), coalesced, dequantises
// them once into registers and FMAs them with the tile's rows of inp (16-byte loads; the block's warps read the same
// input chunks, so all but the first find them in L1). The lanes' sums meet in a butterfly (fixed order:
// deterministic, no atomics). Tiles: N <= 8 one tile of 1, 2, 4 or 8 rows (a compiled kernel each); beyond, tiles of 8,
// the tiles of one warp-group's rows adjacent in the grid so that their weight reads after the first hit L2.
// Not done: tensor cores (mma on the dequantised tile) for N > 8, staging the input tile in shared memory.
//
// Constraints (quantize_support says why not, in one line): int8 C % 16 == 0, NF4 C % 64 == 0; C, OC >= 1; every
// pointer 16-byte aligned (cudaMalloc's are; nf4_allocate's are); N >= 0 (0: nothing); NF4 OC C < 2^31 (its block
// count is an int). Any N works; N > 8 runs in tiles of 8 rows, each re-reading the weights (from L2 when they fit).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-quantize_{bf16,fp32} and their lab-check- twins.
#pragma once
#include <stdint.h>
#include <math.h>
#include "common.cuh"

#define QUANTIZE_WARPS 4         // warps per block of the matmul kernels (a warp per output channel)
#define QUANTIZE_MAX_ROWS 8      // input rows a warp takes at once (its accumulators per lane)
#define NF4_BLOCK 64             // weights per absmax block
#define NF4_GROUP 256            // absmax blocks per double-quantisation group (one quantize_nf4 thread block)

// the published NormalFloat-4 levels (bitsandbytes' table), ascending; index 7 is 0.0
#define NF4_LEVELS                                                                                                   \
    {-1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,                \
     -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,                 \
     0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f,    \
     1.0f}

typedef struct {
    uint8_t* codes;         // (OC * C / 2): block b's 64 codes in bytes b * 32 .. b * 32 + 31, low nibble first
    int8_t* absmax_codes;   // (OC * C / 64): k_b
    float* group_scale;     // (ceil(blocks / 256)): s_g = max |a_b - m_g| over the group
    float* group_mean;      // (ceil(blocks / 256)): m_g
} Nf4Weights;

// the sizes with a kernel: int8 (nf4 = false) C % 16, NF4 C % 64; false with a one-line reason otherwise
bool quantize_support(bool nf4, int C, int OC, char* why, size_t why_size) {
    const int multiple = nf4 ? NF4_BLOCK : 16;
    if (C < 1 || OC < 1 || C % multiple != 0) {
        snprintf(why, why_size, "%s weights: C=%d must be a positive multiple of %d (%s) and OC=%d positive",
                 nf4 ? "nf4" : "int8", C, multiple, nf4 ? "64-weight absmax blocks" : "16-byte code loads", OC);
        return false;
    }
    if (nf4 && (long long)OC * C >= (1ll << 31)) {
        snprintf(why, why_size, "nf4 weights: OC * C = %lld must be below 2^31", (long long)OC * C);
        return false;
    }
    return true;
}

static void quantize_check(const char* who, bool nf4, int N, int C, int OC) {
    char why[256];
    if (N < 0 || !quantize_support(nf4, C, OC, why, sizeof(why))) {
        fprintf(stderr, "%s: %s\n", who, N < 0 ? "negative row count" : why);
        exit(EXIT_FAILURE);
    }
}

static int nf4_blocks(int OC, int C) { return (int)((long long)OC * C / NF4_BLOCK); }
static int nf4_groups(int OC, int C) { return CEIL_DIV(nf4_blocks(OC, C), NF4_GROUP); }

size_t nf4_bytes(int OC, int C) {
    return (size_t)OC * C / 2 + (size_t)nf4_blocks(OC, C) + 2 * sizeof(float) * (size_t)nf4_groups(OC, C);
}

void nf4_allocate(Nf4Weights* w, int OC, int C) {
    quantize_check("nf4_allocate", true, 0, C, OC);
    cudaCheck(cudaMalloc(&w->codes, (size_t)OC * C / 2));
    cudaCheck(cudaMalloc(&w->absmax_codes, (size_t)nf4_blocks(OC, C)));
    cudaCheck(cudaMalloc(&w->group_scale, sizeof(float) * nf4_groups(OC, C)));
    cudaCheck(cudaMalloc(&w->group_mean, sizeof(float) * nf4_groups(OC, C)));
}

void nf4_free(Nf4Weights* w) {
    cudaCheck(cudaFree(w->codes));
    cudaCheck(cudaFree(w->absmax_codes));
    cudaCheck(cudaFree(w->group_scale));
    cudaCheck(cudaFree(w->group_mean));
    w->codes = NULL;
    w->absmax_codes = NULL;
    w->group_scale = w->group_mean = NULL;
}

// ----------------------------------------------------------------------------------------------------
// Dequantisation, shared by the matmuls and dequantize_*: the fp32 weight values of the format comments above.
// __fdiv_rn and __fmaf_rn keep them correctly rounded under --use_fast_math and free of the compiler's contraction.
__device__ inline float int8_weight(int8_t code, float scale) { return (float)code * scale; }
__device__ inline float nf4_block_absmax(const Nf4Weights& q, int block) {
    const int group = block / NF4_GROUP;
    return __fmaf_rn((float)q.absmax_codes[block], __fdiv_rn(q.group_scale[group], 127.0f), q.group_mean[group]);
}

// the NF4 levels in a block's shared memory (dynamic indexing of a local array would go through local memory)
__device__ inline void nf4_levels_to_shared(float* levels) {
    if (threadIdx.x < 16) {
        const float table[16] = NF4_LEVELS;
        levels[threadIdx.x] = table[threadIdx.x];
    }
    __syncthreads();
}

// ----------------------------------------------------------------------------------------------------
// quantize_int8: a warp per row o: the absmax (exact: a max of floatX values), then the codes.
__global__ void quantize_int8_kernel(int8_t* q, float* scale, const floatX* w, int OC, int C) {
    const int o = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (o >= OC) return;
    const floatX* row = w + (size_t)o * C;
    float absmax = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 v = load128(row + c);
        for (int k = 0; k < x128::size; k++) absmax = fmaxf(absmax, fabsf((float)v[k]));
    }
    absmax = warp_reduce_max(absmax);
    const float s = __fdiv_rn(absmax, 127.0f);
    if (lane == 0) scale[o] = s;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        const x128 v = load128(row + c);
        for (int k = 0; k < x128::size; k++) {
            // s == 0: a zero row (or one so small that its scale flushes to zero): codes 0
            const int code = s > 0.0f ? __float2int_rn(__fdiv_rn((float)v[k], s)) : 0;
            q[(size_t)o * C + c + k] = (int8_t)max(-127, min(127, code));
        }
    }
}

void quantize_int8(int8_t* q, float* scale, const floatX* w, int OC, int C, cudaStream_t stream) {
    quantize_check("quantize_int8", false, 0, C, OC);
    const int rows_per_block = 4;
    quantize_int8_kernel<<<CEIL_DIV(OC, rows_per_block), rows_per_block * 32, 0, stream>>>(q, scale, w, OC, C);
    cudaCheck(cudaGetLastError());
}

// quantize_nf4: a thread block per group of NF4_GROUP absmax blocks, thread t owning block g * 256 + t: its absmax,
// then (thread 0, in block order: deterministic) the group's mean and scale, then every thread its absmax code and its
// 64 weights' codes. Runs once at load: thread 0's serial loops and the uncoalesced row reads do not matter.
__global__ void quantize_nf4_kernel(Nf4Weights q, const floatX* w, int blocks) {
    __shared__ float absmax_shared[NF4_GROUP];
    __shared__ float group_shared[2];  // mean, scale
    const int group = blockIdx.x, first = group * NF4_GROUP, n = min(NF4_GROUP, blocks - first);
    const int block = first + threadIdx.x;
    const bool mine = threadIdx.x < n;
    const floatX* weights = w + (size_t)block * NF4_BLOCK;
    float absmax = 0.0f;
    if (mine) {
        for (int c = 0; c < NF4_BLOCK; c += x128::size) {
            const x128 v = load128(weights + c);
            for (int k = 0; k < x128::size; k++) absmax = fmaxf(absmax, fabsf((float)v[k]));
        }
        absmax_shared[threadIdx.x] = absmax;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float sum = 0.0f;
        for (int b = 0; b < n; b++) sum += absmax_shared[b];
        const float mean = __fdiv_rn(sum, (float)n);
        float deviation = 0.0f;
        for (int b = 0; b < n; b++) deviation = fmaxf(deviation, fabsf(absmax_shared[b] - mean));
        group_shared[0] = mean;
        group_shared[1] = deviation;
        q.group_mean[group] = mean;
        q.group_scale[group] = deviation;
    }
    __syncthreads();
    if (!mine) return;
    const float mean = group_shared[0], step = __fdiv_rn(group_shared[1], 127.0f);
    const int code = step > 0.0f ? __float2int_rn(__fdiv_rn(absmax - mean, step)) : 0;
    q.absmax_codes[block] = (int8_t)max(-127, min(127, code));

    const float levels[16] = NF4_LEVELS;
    for (int half = 0; half < 2; half++) {  // 32 weights, 16 bytes of codes, at a time
        Packed128<uint8_t> packed;
        for (int j = 0; j < 16; j++) {
            int nibble[2];
            for (int e = 0; e < 2; e++) {
                const float x = absmax > 0.0f ? __fdiv_rn((float)weights[half * 32 + 2 * j + e], absmax) : 0.0f;
                int k = 0;  // the levels whose lower midpoint x exceeds: the nearest level
#pragma unroll
                for (int m = 0; m < 15; m++) k += x > 0.5f * (levels[m] + levels[m + 1]) ? 1 : 0;
                nibble[e] = k;
            }
            packed[j] = (uint8_t)(nibble[0] | (nibble[1] << 4));
        }
        store128(q.codes + (size_t)block * (NF4_BLOCK / 2) + half * 16, packed);
    }
}

void quantize_nf4(Nf4Weights* q, const floatX* w, int OC, int C, cudaStream_t stream) {
    quantize_check("quantize_nf4", true, 0, C, OC);
    const int blocks = nf4_blocks(OC, C);
    quantize_nf4_kernel<<<nf4_groups(OC, C), NF4_GROUP, 0, stream>>>(*q, w, blocks);
    cudaCheck(cudaGetLastError());
}

// ----------------------------------------------------------------------------------------------------
// The matmuls. Block: QUANTIZE_WARPS warps (blockDim.x / 32), warp w on output channel
// o = (blockIdx.x / tiles) * warps + w and input rows n0 = (blockIdx.x % tiles) * NT .. n0 + NT - 1 (those below N).
// out (N, OC), inp (N, C).
template <int NT>
__device__ inline void quantize_matmul_store(floatX* out, const float (&acc)[NT], const floatX* bias, int n0, int N,
                                             int o, int OC) {
    float sums[NT];
    for (int n = 0; n < NT; n++) sums[n] = warp_reduce_sum(acc[n]);
    if (threadIdx.x % 32 != 0) return;
    const float b = bias != NULL ? (float)bias[o] : 0.0f;
    for (int n = 0; n < NT && n0 + n < N; n++) out[(size_t)(n0 + n) * OC + o] = (floatX)(sums[n] + b);
}

// acc[n] += sum_k inp[n0 + n, c + k] * w[k], k < W (W a multiple of x128::size), for the tile's rows below N
template <int NT, int W>
__device__ inline void quantize_matmul_fma(float (&acc)[NT], const float (&w)[W], const floatX* inp, int n0, int N,
                                           int C, int c) {
    for (int n = 0; n < NT; n++) {
        if (n0 + n >= N) break;
        const floatX* x = inp + (size_t)(n0 + n) * C + c;
        for (int j = 0; j < W; j += x128::size) {
            const x128 v = load128(x + j);
            for (int k = 0; k < x128::size; k++) acc[n] = fmaf((float)v[k], w[j + k], acc[n]);
        }
    }
}

template <int NT>
__global__ void matmul_int8_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp,
                                   const int8_t* __restrict__ q, const float* __restrict__ scale,
                                   const floatX* __restrict__ bias, int N, int C, int OC) {
    const int tiles = CEIL_DIV(N, NT), warps = blockDim.x / 32;
    const int o = (blockIdx.x / tiles) * warps + threadIdx.x / 32, n0 = (blockIdx.x % tiles) * NT;
    if (o >= OC) return;  // whole warps: nothing below waits on another warp
    const float s = scale[o];
    const int8_t* row = q + (size_t)o * C;
    float acc[NT];
    for (int n = 0; n < NT; n++) acc[n] = 0.0f;
    for (int c = (threadIdx.x % 32) * 16; c < C; c += 32 * 16) {
        const Packed128<int8_t> codes = load128(row + c);  // 16 weights
        float w[16];
        for (int k = 0; k < 16; k++) w[k] = int8_weight(codes[k], s);
        quantize_matmul_fma<NT, 16>(acc, w, inp, n0, N, C, c);
    }
    quantize_matmul_store<NT>(out, acc, bias, n0, N, o, OC);
}

template <int NT>
__global__ void matmul_nf4_kernel(floatX* __restrict__ out, const floatX* __restrict__ inp, Nf4Weights q,
                                  const floatX* __restrict__ bias, int N, int C, int OC) {
    __shared__ float levels[16];
    nf4_levels_to_shared(levels);
    const int tiles = CEIL_DIV(N, NT), warps = blockDim.x / 32;
    const int o = (blockIdx.x / tiles) * warps + threadIdx.x / 32, n0 = (blockIdx.x % tiles) * NT;
    if (o >= OC) return;
    const uint8_t* row = q.codes + (size_t)o * C / 2;
    float acc[NT];
    for (int n = 0; n < NT; n++) acc[n] = 0.0f;
    for (int c = (threadIdx.x % 32) * 32; c < C; c += 32 * 32) {  // c: the chunk's first column
        const Packed128<uint8_t> codes = load128(row + c / 2);      // 32 weights, all of one absmax block
        const float absmax = nf4_block_absmax(q, (int)(((size_t)o * C + c) / NF4_BLOCK));
        float w[32];
        for (int k = 0; k < 16; k++) {
            w[2 * k] = levels[codes[k] & 15] * absmax;
            w[2 * k + 1] = levels[codes[k] >> 4] * absmax;
        }
        quantize_matmul_fma<NT, 32>(acc, w, inp, n0, N, C, c);
    }
    quantize_matmul_store<NT>(out, acc, bias, n0, N, o, OC);
}

// the input rows per tile: the smallest of 1, 2, 4, 8 that holds N, else 8
static int quantize_tile_rows(int N) {
    int rows = 1;
    while (rows < N && rows < QUANTIZE_MAX_ROWS) rows *= 2;
    return rows;
}

// warps_per_block: 1 .. 32, the output channels of a block
void matmul_forward_int8_launch(floatX* out, const floatX* inp, const int8_t* q, const float* scale,
                                const floatX* bias, int N, int C, int OC, int warps_per_block, cudaStream_t stream) {
    quantize_check("matmul_forward_int8", false, N, C, OC);
    if (N == 0) return;  // a grid of 0 blocks is a launch error
    const int NT = quantize_tile_rows(N);
    const unsigned int grid = (unsigned int)CEIL_DIV(OC, warps_per_block) * CEIL_DIV(N, NT);
    const int threads = warps_per_block * 32;
    switch (NT) {
        case 1: matmul_int8_kernel<1><<<grid, threads, 0, stream>>>(out, inp, q, scale, bias, N, C, OC); break;
        case 2: matmul_int8_kernel<2><<<grid, threads, 0, stream>>>(out, inp, q, scale, bias, N, C, OC); break;
        case 4: matmul_int8_kernel<4><<<grid, threads, 0, stream>>>(out, inp, q, scale, bias, N, C, OC); break;
        default: matmul_int8_kernel<8><<<grid, threads, 0, stream>>>(out, inp, q, scale, bias, N, C, OC); break;
    }
    cudaCheck(cudaGetLastError());
}

void matmul_forward_nf4_launch(floatX* out, const floatX* inp, const Nf4Weights* q, const floatX* bias, int N, int C,
                               int OC, int warps_per_block, cudaStream_t stream) {
    quantize_check("matmul_forward_nf4", true, N, C, OC);
    if (N == 0) return;
    const int NT = quantize_tile_rows(N);
    const unsigned int grid = (unsigned int)CEIL_DIV(OC, warps_per_block) * CEIL_DIV(N, NT);
    const int threads = warps_per_block * 32;
    switch (NT) {
        case 1: matmul_nf4_kernel<1><<<grid, threads, 0, stream>>>(out, inp, *q, bias, N, C, OC); break;
        case 2: matmul_nf4_kernel<2><<<grid, threads, 0, stream>>>(out, inp, *q, bias, N, C, OC); break;
        case 4: matmul_nf4_kernel<4><<<grid, threads, 0, stream>>>(out, inp, *q, bias, N, C, OC); break;
        default: matmul_nf4_kernel<8><<<grid, threads, 0, stream>>>(out, inp, *q, bias, N, C, OC); break;
    }
    cudaCheck(cudaGetLastError());
}

// out (N, OC) = inp (N, C) . dequant(q)^T + bias (bias (OC) may be NULL); q (OC, C), scale (OC) from quantize_int8
void matmul_forward_int8(floatX* out, const floatX* inp, const int8_t* q, const float* scale, const floatX* bias,
                         int N, int C, int OC, cudaStream_t stream) {
    matmul_forward_int8_launch(out, inp, q, scale, bias, N, C, OC, QUANTIZE_WARPS, stream);
}

// out (N, OC) = inp (N, C) . dequant(q)^T + bias (bias (OC) may be NULL); q from quantize_nf4 of an (OC, C) weight
void matmul_forward_nf4(floatX* out, const floatX* inp, const Nf4Weights* q, const floatX* bias, int N, int C, int OC,
                        cudaStream_t stream) {
    matmul_forward_nf4_launch(out, inp, q, bias, N, C, OC, QUANTIZE_WARPS, stream);
}

// ----------------------------------------------------------------------------------------------------
// dequantize_*: w (OC, C) floatX, (floatX) of the matmuls' fp32 weights; a thread per 16 (int8) or 32 (NF4) weights.
__global__ void dequantize_int8_kernel(floatX* w, const int8_t* q, const float* scale, int C, size_t chunks) {
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const size_t at = chunk * 16;  // C % 16 == 0: a chunk lies in one row
    const Packed128<int8_t> codes = load128(q + at);
    const float s = scale[at / C];
    for (int j = 0; j < 16; j += x128::size) {
        x128 v;
        for (int k = 0; k < x128::size; k++) v[k] = (floatX)int8_weight(codes[j + k], s);
        store128(w + at + j, v);
    }
}

__global__ void dequantize_nf4_kernel(floatX* w, Nf4Weights q, size_t chunks) {
    __shared__ float levels[16];
    nf4_levels_to_shared(levels);
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const size_t at = chunk * 32;
    const Packed128<uint8_t> codes = load128(q.codes + at / 2);
    const float absmax = nf4_block_absmax(q, (int)(at / NF4_BLOCK));
    for (int j = 0; j < 32; j += x128::size) {
        x128 v;
        for (int k = 0; k < x128::size; k++) {
            const uint8_t byte = codes[(j + k) / 2];
            v[k] = (floatX)(levels[(j + k) % 2 == 0 ? byte & 15 : byte >> 4] * absmax);
        }
        store128(w + at + j, v);
    }
}

void dequantize_int8(floatX* w, const int8_t* q, const float* scale, int OC, int C, cudaStream_t stream) {
    quantize_check("dequantize_int8", false, 0, C, OC);
    const size_t chunks = (size_t)OC * C / 16;
    dequantize_int8_kernel<<<(unsigned int)CEIL_DIV(chunks, (size_t)256), 256, 0, stream>>>(w, q, scale, C, chunks);
    cudaCheck(cudaGetLastError());
}

void dequantize_nf4(floatX* w, const Nf4Weights* q, int OC, int C, cudaStream_t stream) {
    quantize_check("dequantize_nf4", true, 0, C, OC);
    const size_t chunks = (size_t)OC * C / 32;
    dequantize_nf4_kernel<<<(unsigned int)CEIL_DIV(chunks, (size_t)256), 256, 0, stream>>>(w, *q, chunks);
    cudaCheck(cudaGetLastError());
}
