// llmc/rope.cuh: rotary position embeddings (RoPE; Su et al., RoFormer; Llama's positions, `-arch llama`), applied in
// place to the query and key heads of the packed qkv activation, forward, and its transpose to their gradients in the
// backward pass. Included by the trainers; builds with nvcc or cpu/cucc, nothing to link. Lab file: dev/cuda/rope.cu.
// The convention is written down for reference code in doc/attention.md.
//
// Layout: qkv (B, T, (NH + 2 * NKV) * HS): per position NH query heads, then NKV key heads, then NKV value heads, each
// head HS contiguous elements. NKV = NH is multi-head attention ((B, T, 3C), C = NH * HS); NKV < NH is grouped-query
// attention. Query and key heads are contiguous (h * HS for h < NH + NKV), values are never touched.
//
// Pairing: Llama/Hugging Face "rotate_half": element i of a head pairs with element i + HS/2 (not the interleaved
// pairs (2i, 2i+1) of the paper and Meta's complex view; checkpoints in that order need their q, k weight rows
// permuted). For i < HS/2 at position t (0 .. T-1 within each sequence):
//   angle = t * theta^(-2i / HS)
//   out[i]        = x[i] * cos(angle) - x[i + HS/2] * sin(angle)
//   out[i + HS/2] = x[i + HS/2] * cos(angle) + x[i] * sin(angle)
// Backward: the transpose (the rotation by -angle), dx[i] = dy[i] cos + dy[i + HS/2] sin, dx[i + HS/2] =
// dy[i + HS/2] cos - dy[i] sin.
//
// Inference (rope_forward_at): rows of tokens each at its own position (a batch of sequences at different lengths),
// rotated by the same kernel and table, so a token at position p comes out bit for bit as rope_forward's row t = p.
//
// In place: the rotation is linear and its Jacobian depends on t only, so no backward pass needs the unrotated q and
// k (attention's backward needs the rotated ones, which is what the buffer then holds; the qkv matmul's backward needs
// its input, not its output). An out-of-place version would cost a second (B, T, (NH + 2 NKV) HS) activation and, to
// fill its v part, a copy.
//
// Angles: a (max_T, HS) fp32 table, row t = cos(angle_0 .. angle_{HS/2-1}) then sin(...), computed once on the host
// in double (angle exact to double, cos and sin rounded once to fp32: error <= 2^-24 at every t). Why a table and not
// sincosf in the kernel, counting bytes (X = sizeof(floatX)): the kernel moves 2 X bytes per element of q and k (read
// and write); the table adds 4 bytes per element from L1/L2 but only max_T * HS * 4 bytes from DRAM once (256 KiB at
// T = 1024, HS = 64; 4 MiB at T = 8192, HS = 128), shared by all B * (NH + NKV) heads, so the floor barely moves. In
// the kernel, each angle would be recomputed B * (NH + NKV) times, and with --use_fast_math sincosf becomes __sincosf,
// whose range reduction errs by about |angle| 2^-24 (5e-4 rad at t = 8191), on top of the fp32 rounding of t * inv_freq
// itself (up to another 5e-4) and __powf's error in inv_freq (relative up to ~4e-6, i.e. up to 0.03 rad at t = 8191).
// Measured (dev/cuda/rope.cu -s, fp32 CPU backend with the GPU's fast math, theta 1e4, HS 16, |x| <= 1): the output's
// max error at t = 8191 is 5.1e-4 with the angles in the kernel (variant 3), 6e-8 with the table (variant 2).
//
// Floor: 2 * B * T * (NH + NKV) * HS * X bytes (q and k read and written once) + T * HS * 4 (the table, once from
// DRAM); 6 flops per pair: memory-bound. GPT-2 124M, B = 8, T = 1024, bf16: 50.3 MB, ~10 us at 4.8 TB/s (H200).
// Tests (dev/test/run_tests.sh NAME, patterns work): lab-rope_{bf16,fp32} and their lab-check- twins; llama-* and
// moe-*llama*.
#pragma once
#include <math.h>
#include "common.cuh"

// Every launch checks the head size against the kernel's 16-byte vectors: each thread rotates x128::size pairs, so
// HS / 2 must be a multiple of x128::size (HS a multiple of 16 in bf16/fp16, of 8 in fp32).
static void rope_check_shape(const char* who, int T, int NH, int NKV, int HS) {
    if (T < 1 || NH < 1 || NKV < 1 || HS < 2 || HS % (2 * x128::size) != 0) {
        fprintf(stderr, "%s: need T, NH, NKV >= 1 and a head size that is a multiple of %d (got T=%d NH=%d NKV=%d "
                "HS=%d)\n", who, 2 * x128::size, T, NH, NKV, HS);
        exit(EXIT_FAILURE);
    }
}

// Fills the device table (max_T, HS): row t = cos(t * theta^(-2i/HS)) for i < HS/2, then the sines. A start-up step
// (synchronous copy); positions 0 .. max_T-1 serve any sequence length T <= max_T.
void rope_table_init(float* table, int max_T, int HS, float theta) {
    rope_check_shape("rope_table_init", max_T, 1, 1, HS);
    if (!(theta > 1.0f)) {
        fprintf(stderr, "rope_table_init: theta must be greater than 1 (got %g)\n", theta);
        exit(EXIT_FAILURE);
    }
    const int half = HS / 2;
    float* host = (float*)malloc((size_t)max_T * HS * sizeof(float));
    if (host == NULL) {
        fprintf(stderr, "rope_table_init: cannot allocate %zu bytes\n", (size_t)max_T * HS * sizeof(float));
        exit(EXIT_FAILURE);
    }
    for (int i = 0; i < half; i++) {
        const double inv_freq = pow((double)theta, -2.0 * i / HS);
        for (int t = 0; t < max_T; t++) {
            const double angle = (double)t * inv_freq;
            host[(size_t)t * HS + i] = (float)cos(angle);
            host[(size_t)t * HS + half + i] = (float)sin(angle);
        }
    }
    cudaCheck(cudaMemcpy(table, host, (size_t)max_T * HS * sizeof(float), cudaMemcpyHostToDevice));
    free(host);
}

// One thread per x128::size consecutive pairs (i .. i + size - 1, with partners at + HS/2) of one query or key head at
// one position: two 16-byte loads and stores of qkv, and 16-byte loads of the table's cos and sin for those pairs.
// Consecutive threads take consecutive chunks of a head, then the next head, then the next position.
// A row's position t is row % T (rows (B, T): every sequence from 0), or positions[row] when positions is given (rows
// (N) of tokens at positions of their own, for inference): one code path, so that a token rotated at position p is
// bit for bit rope_forward's row at t = p.
template <bool backward>
__global__ void rope_kernel(floatX* qkv, const float* table, const int* positions, int T, int NH, int NKV, int HS,
                            size_t chunks) {
    const size_t chunk = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (chunk >= chunks) return;
    const int half = HS / 2;
    const int chunks_per_head = half / x128::size;
    const int i = (int)(chunk % chunks_per_head) * x128::size;
    const size_t head = chunk / chunks_per_head;  // (b * T + t) * (NH + NKV) + h
    const int h = (int)(head % (NH + NKV));
    const size_t position = head / (NH + NKV);  // the row: b * T + t, or the token
    const int t = positions != nullptr ? positions[position] : (int)(position % T);
    floatX* x = qkv + position * (size_t)(NH + 2 * NKV) * HS + (size_t)h * HS + i;
    const float* cos_row = table + (size_t)t * HS + i;
    const float* sin_row = cos_row + half;
    const x128 low = load128(x);
    const x128 high = load128(x + half);
    x128 out_low, out_high;
    for (int k = 0; k < x128::size; k += f128::size) {
        const f128 c = load128(cos_row + k);
        const f128 s = load128(sin_row + k);
        for (int j = 0; j < f128::size; j++) {
            const float a = (float)low[k + j], b = (float)high[k + j];
            const float sine = backward ? -s[j] : s[j];
            out_low[k + j] = (floatX)(a * c[j] - b * sine);
            out_high[k + j] = (floatX)(b * c[j] + a * sine);
        }
    }
    store128(x, out_low);
    store128(x + half, out_high);
}

// positions: NULL for rows (B, T) at t = row % T, or the (B * T) positions of the rows (rope_forward_at: B = 1, T = N)
static void rope_launch(bool backward, floatX* qkv, const float* table, const int* positions, int B, int T, int NH,
                        int NKV, int HS, int block_size, cudaStream_t stream) {
    const char* who = backward ? "rope_backward" : (positions != nullptr ? "rope_forward_at" : "rope_forward");
    rope_check_shape(who, T, NH, NKV, HS);
    if (B < 1) {
        fprintf(stderr, "%s: need B >= 1 (got %d)\n", who, B);
        exit(EXIT_FAILURE);
    }
    const size_t chunks = (size_t)B * T * (NH + NKV) * (HS / 2 / x128::size);
    const unsigned int grid = (unsigned int)CEIL_DIV(chunks, (size_t)block_size);
    if (backward) rope_kernel<true><<<grid, block_size, 0, stream>>>(qkv, table, positions, T, NH, NKV, HS, chunks);
    else rope_kernel<false><<<grid, block_size, 0, stream>>>(qkv, table, positions, T, NH, NKV, HS, chunks);
    cudaCheck(cudaGetLastError());
}

// qkv (B, T, (NH + 2 NKV) HS) in place: queries and keys rotated by their position; table from rope_table_init with
// max_T >= T.
void rope_forward(floatX* qkv, const float* table, int B, int T, int NH, int NKV, int HS, cudaStream_t stream) {
    rope_launch(false, qkv, table, nullptr, B, T, NH, NKV, HS, 256, stream);
}

// dqkv (B, T, (NH + 2 NKV) HS) in place: the query and key gradients rotated back (dv untouched).
void rope_backward(floatX* dqkv, const float* table, int B, int T, int NH, int NKV, int HS, cudaStream_t stream) {
    rope_launch(true, dqkv, table, nullptr, B, T, NH, NKV, HS, 256, stream);
}

// qkv (N, (NH + 2 NKV) HS) in place, one row per token (inference: a batch of sequences each at its own position):
// token i's queries and keys rotated by positions[i] (device, (N)), each 0 <= positions[i] < the table's max_T.
// Bit-identical to rope_forward's row at t = positions[i].
void rope_forward_at(floatX* qkv, const float* table, const int* positions, int N, int NH, int NKV, int HS,
                     cudaStream_t stream) {
    rope_launch(false, qkv, table, positions, 1, N, NH, NKV, HS, 256, stream);
}
