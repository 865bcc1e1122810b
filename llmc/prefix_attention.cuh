// llmc/prefix_attention.cuh: attention of every query to P key/value rows that all the sequences share and every query
// sees, beside causal self-attention: prefix tuning's learned keys and values (Li and Liang 2021) and LLaMA-Adapter's
// projected prompt (Zhang et al. 2023). Two ways to join them to the causal attention's output:
//   joint (prefix tuning): one softmax over the P shared keys and the causal ones. Flash attention
//     (llmc/flash_attention.cuh) runs unchanged over the causal keys; the forward kernel merges its output and
//     log-sum-exp with the shared keys' as two parts of one softmax (out = w_c out_c + w_p out_p, w_i = exp(lse_i -
//     lse), lse = log(exp(lse_c) + exp(lse_p))), so that out and stats are the joint attention's. Flash attention's
//     backward, given them, computes the joint softmax's gradients of q and of the causal keys and values
//     (p = exp(s - lse) and delta = dout . out are the joint ones); these kernels add the shared keys' parts.
//   gated (LLaMA-Adapter): a softmax of its own over the P shared keys, its output times a learned gate g added to
//     the causal attention's: joined = out + g softmax(q Kp^T scale) Vp, into a buffer of its own, since flash
//     attention's backward needs the causal output (its delta = dout . out is the causal softmax's). The gate starts
//     at 0, so the model starts unchanged.
// Layouts: q from the packed qkv (B, T, (NH + 2 NKV) HS) of doc/attention.md (roped, as flash attention reads it);
// out (B, T, NH HS); stats (B, NH, T), flash attention's; the shared keys and values, row p of key/value head j at
// keys + p * kv_stride + j * HS (prefix tuning: the adapter's (P, NKV HS) tensors; LLaMA-Adapter: the projected
// prompt's k and v columns of its (P, NH + 2 NKV) HS rows). Query head h reads key/value head h / (NH / NKV), as
// flash attention does. The shared keys carry no position (no RoPE): they are the same for every query.
// Every sum is fp32 in a fixed order: no atomics, the same bits every run. Builds with nvcc or cpu/cucc; the trainer
// calls it through llmc/model_adapter.h.
// Size rules: HS at most 128 (flash attention's head sizes), any P >= 1.
// Tests (dev/test/run_tests.sh NAME, patterns work): gpt-*-prefix*, llama-*-prefix*, gpt-*-lladapter*,
// llama-*-lladapter* (forward, gradients and 10 steps against train_gpt.py --ft prefix and --ft llama_adapter),
// fine-tuning-cli.
#pragma once
#include <math.h>
#include "common.cuh"

constexpr int PREFIX_LANE_VALUES = 4;  // head elements per lane: HS <= 32 * 4
constexpr int PREFIX_WARPS = 4;        // rows (b, t, h) per block of the row kernels, a warp each

struct PrefixShape {
    int B, T, NH, NKV, HS, P;
    int kv_stride;  // elements between consecutive rows of the shared keys (and values)
};

// The row kernels' row of this warp, r = (b T + t) NH + h (token = b T + t), its lane, and the key/value head of its
// shared keys; r = -1 past the last row
struct PrefixRow {
    int r, lane, h, kv_head, qkv_stride;
    size_t token;
};
__device__ inline PrefixRow prefix_this_row(const PrefixShape& s) {
    PrefixRow w;
    w.r = blockIdx.x * PREFIX_WARPS + threadIdx.x / 32, w.lane = threadIdx.x % 32;
    if (w.r >= s.B * s.T * s.NH) w.r = -1;
    w.token = (size_t)(w.r / s.NH), w.h = w.r % s.NH, w.kv_head = w.h / (s.NH / s.NKV);
    w.qkv_stride = (s.NH + 2 * s.NKV) * s.HS;
    return w;
}

// the lane's values of a head row (HS elements, lane + 32 i), zero past HS
__device__ inline void prefix_load_lane(float* out, const floatX* row, int HS, int lane) {
#pragma unroll
    for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
        int d = lane + 32 * i;
        out[i] = d < HS ? (float)row[d] : 0.0f;
    }
}
__device__ inline float prefix_lane_dot(const float* a, const floatX* row, int HS, int lane) {
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
        int d = lane + 32 * i;
        if (d < HS) sum += a[i] * (float)row[d];
    }
    return warp_reduce_sum(sum);
}

// Forward, a warp per row (b, t, h): the shared keys' attention out_p = softmax(scale q Kp^T) Vp with its
// log-sum-exp lse_p (online over the P keys), then joined: gate NULL, merged with out and stats (joint; joined may be
// out); else joined = out + g out_p (gated), stats untouched. Each joined element is rounded once.
// Floor: 4 B T NH P HS flops; bytes B T NH HS (q, out read, joined written) 3 sizeof(floatX) + 8 B NH T (stats),
// Kp and Vp (2 P NKV HS) from L2.
__global__ void prefix_attention_forward_kernel(floatX* joined, float* stats, const floatX* out, const floatX* qkv,
                                                const floatX* keys, const floatX* values, const floatX* gate,
                                                PrefixShape s, float scale) {
    const PrefixRow w = prefix_this_row(s);
    if (w.r < 0) return;
    const int lane = w.lane, h = w.h, kv_head = w.kv_head, row_stride = w.qkv_stride;
    const size_t token = w.token;
    float q[PREFIX_LANE_VALUES], acc[PREFIX_LANE_VALUES] = {0.0f, 0.0f, 0.0f, 0.0f};
    prefix_load_lane(q, qkv + token * row_stride + h * s.HS, s.HS, lane);
    float m = -INFINITY, l = 0.0f;
    for (int p = 0; p < s.P; p++) {
        const floatX* k = keys + (size_t)p * s.kv_stride + kv_head * s.HS;
        const floatX* v = values + (size_t)p * s.kv_stride + kv_head * s.HS;
        const float score = scale * prefix_lane_dot(q, k, s.HS, lane);
        const float m_new = fmaxf(m, score), correction = expf(m - m_new), e = expf(score - m_new);
        l = l * correction + e;
#pragma unroll
        for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
            int d = lane + 32 * i;
            acc[i] = acc[i] * correction + (d < s.HS ? e * (float)v[d] : 0.0f);
        }
        m = m_new;
    }
    const floatX* o = out + token * s.NH * s.HS + h * s.HS;
    floatX* j = joined + token * s.NH * s.HS + h * s.HS;
    float w_causal = 1.0f, w_shared = gate ? (float)gate[0] : 0.0f;
    if (!gate) {  // the joint softmax: the two parts weighted by their shares of its normaliser
        float* stat = stats + ((size_t)(token / s.T) * s.NH + h) * s.T + token % s.T;
        const float lse_causal = *stat, lse_shared = m + logf(l);
        const float top = fmaxf(lse_causal, lse_shared);
        const float lse = top + logf(expf(lse_causal - top) + expf(lse_shared - top));
        w_causal = expf(lse_causal - lse);
        w_shared = expf(lse_shared - lse);
        __syncwarp();  // every lane has read the causal statistic
        if (lane == 0) *stat = lse;
    }
    const float inverse_l = 1.0f / l;
#pragma unroll
    for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
        int d = lane + 32 * i;
        if (d < s.HS) j[d] = (floatX)(w_causal * (float)o[d] + w_shared * acc[i] * inverse_l);
    }
}

// Backward over rows, a warp per row (b, t, h), after flash attention's backward wrote dqkv from dout, the gradient
// of joined (joint: the joined out and stats; gated: the causal out): with p the shared keys'
// probabilities and dp = dout' . Vp (dout' = dout joint, g dout gated),
//   joint: p = exp(s - lse) (lse: the joint statistic), delta = dout . out (the joint output);
//   gated: p = softmax(s) over the P keys, delta = sum p dp;
// ds = p (dp - delta); dq += scale ds Kp (rounded once into dqkv's q). Writes ds and p (B T NH, P) for the key/value
// kernel, and gated, each row's share of the gate's gradient, dout . out_p = sum p (dout . Vp), into gate_rows.
// Floor: 8 B T NH P HS flops; bytes B T NH HS (q, dout, out read, dq read and written) 5 sizeof(floatX) + 8 B T NH P.
__global__ void prefix_attention_backward_rows_kernel(floatX* dqkv, float* ds_rows, float* p_rows, float* gate_rows,
                                                      const floatX* dout, const floatX* qkv, const floatX* out,
                                                      const float* stats, const floatX* keys, const floatX* values,
                                                      const floatX* gate, PrefixShape s, float scale) {
    const PrefixRow w = prefix_this_row(s);
    if (w.r < 0) return;
    const int r = w.r, lane = w.lane, h = w.h, kv_head = w.kv_head, row_stride = w.qkv_stride;
    const size_t token = w.token;
    float q[PREFIX_LANE_VALUES], d_out[PREFIX_LANE_VALUES];
    prefix_load_lane(q, qkv + token * row_stride + h * s.HS, s.HS, lane);
    prefix_load_lane(d_out, dout + token * s.NH * s.HS + h * s.HS, s.HS, lane);
    const float g = gate ? (float)gate[0] : 1.0f;
    float* ds_row = ds_rows + (size_t)r * s.P;
    float* p_row = p_rows + (size_t)r * s.P;
    float lse, delta;
    if (!gate) {
        lse = stats[((size_t)(token / s.T) * s.NH + h) * s.T + token % s.T];
        delta = prefix_lane_dot(d_out, out + token * s.NH * s.HS + h * s.HS, s.HS, lane);
    } else {  // the shared keys' own softmax: its log-sum-exp, then delta = g sum p (dout . v)
        float m = -INFINITY, l = 0.0f;
        for (int p = 0; p < s.P; p++) {
            const float score = scale * prefix_lane_dot(q, keys + (size_t)p * s.kv_stride + kv_head * s.HS, s.HS, lane);
            const float m_new = fmaxf(m, score);
            l = l * expf(m - m_new) + expf(score - m_new);
            m = m_new;
        }
        lse = m + logf(l);
        float weighted = 0.0f;
        for (int p = 0; p < s.P; p++) {
            const float score = scale * prefix_lane_dot(q, keys + (size_t)p * s.kv_stride + kv_head * s.HS, s.HS, lane);
            weighted += expf(score - lse) *
                        prefix_lane_dot(d_out, values + (size_t)p * s.kv_stride + kv_head * s.HS, s.HS, lane);
        }
        delta = g * weighted;
        if (lane == 0) gate_rows[r] = weighted;
    }
    float dq[PREFIX_LANE_VALUES] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int p = 0; p < s.P; p++) {
        const floatX* k = keys + (size_t)p * s.kv_stride + kv_head * s.HS;
        const float score = scale * prefix_lane_dot(q, k, s.HS, lane);
        const float prob = expf(score - lse);
        const float dp = g * prefix_lane_dot(d_out, values + (size_t)p * s.kv_stride + kv_head * s.HS, s.HS, lane);
        const float ds = prob * (dp - delta);
#pragma unroll
        for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
            int d = lane + 32 * i;
            if (d < s.HS) dq[i] += ds * (float)k[d];
        }
        if (lane == 0) ds_row[p] = ds, p_row[p] = prob;
    }
    floatX* dq_row = dqkv + token * row_stride + h * s.HS;
#pragma unroll
    for (int i = 0; i < PREFIX_LANE_VALUES; i++) {
        int d = lane + 32 * i;
        if (d < s.HS) dq_row[d] = (floatX)((float)dq_row[d] + scale * dq[i]);
    }
}

// Backward of the shared keys and values: block (p, key/value head j), a thread per head element d; over the rows in
// order (b, t, then the NH / NKV query heads of j), dKp[p] = scale sum ds q, dVp[p] = g sum p dout; written (+= when
// accumulate, the trainable tensors' gradients; = otherwise) at the keys' layout in dkeys and dvalues.
// Floor: 4 B T NH P HS flops; bytes B T NH HS (q, dout) 2 sizeof(floatX) per shared key, re-read P times from L2,
// + 8 B T NH P.
__global__ void prefix_attention_backward_keys_kernel(floatX* dkeys, floatX* dvalues, const float* ds_rows,
                                                      const float* p_rows, const floatX* dout, const floatX* qkv,
                                                      const floatX* gate, PrefixShape s, float scale, int accumulate) {
    const int p = blockIdx.x, kv_head = blockIdx.y, d = threadIdx.x;
    const int group = s.NH / s.NKV, row_stride = (s.NH + 2 * s.NKV) * s.HS;
    float dk = 0.0f, dv = 0.0f;
    for (size_t token = 0; token < (size_t)s.B * s.T; token++) {
        for (int h = kv_head * group; h < (kv_head + 1) * group; h++) {
            const size_t r = token * s.NH + h;
            dk += ds_rows[r * s.P + p] * (float)qkv[token * row_stride + h * s.HS + d];
            dv += p_rows[r * s.P + p] * (float)dout[token * s.NH * s.HS + h * s.HS + d];
        }
    }
    dk *= scale;
    dv *= gate ? (float)gate[0] : 1.0f;
    const size_t at = (size_t)p * s.kv_stride + kv_head * s.HS + d;
    dkeys[at] = (floatX)((accumulate ? (float)dkeys[at] : 0.0f) + dk);
    dvalues[at] = (floatX)((accumulate ? (float)dvalues[at] : 0.0f) + dv);
}

// dgate += the sum of the n rows' shares, in a fixed order: thread i sums rows i, i + 256, ..., then a tree
// Floor: 4 n bytes.
__global__ void prefix_attention_gate_kernel(floatX* dgate, const float* gate_rows, int n) {
    __shared__ float partial[256];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += 256) sum += gate_rows[i];
    partial[threadIdx.x] = sum;
    for (int width = 128; width > 0; width /= 2) {
        __syncthreads();
        if (threadIdx.x < width) partial[threadIdx.x] += partial[threadIdx.x + width];
    }
    if (threadIdx.x == 0) dgate[0] = (floatX)((float)dgate[0] + partial[0]);
}

static void prefix_attention_require(const char* function, const PrefixShape& s) {
    if (s.HS < 1 || s.HS > 32 * PREFIX_LANE_VALUES || s.P < 1 || s.NKV < 1 || s.NH % s.NKV != 0) {
        fprintf(stderr, "%s: head size %d (at most %d), %d shared keys (at least 1), %d heads over %d key/value heads\n",
                function, s.HS, 32 * PREFIX_LANE_VALUES, s.P, s.NH, s.NKV);
        exit(EXIT_FAILURE);
    }
}

// After flash attention's forward wrote out (B, T, NH HS) and stats (B, NH, T) from qkv: joined (B, T, NH HS) = the
// attention with the shared keys (gate NULL: joint, stats become the joint attention's, joined may be out; else gated
// by gate[0], joined a buffer of its own)
void prefix_attention_forward(floatX* joined, float* stats, const floatX* out, const floatX* qkv, const floatX* keys,
                              const floatX* values, const floatX* gate, PrefixShape s, cudaStream_t stream) {
    prefix_attention_require("prefix_attention_forward", s);
    const int rows = s.B * s.T * s.NH;
    prefix_attention_forward_kernel<<<CEIL_DIV(rows, PREFIX_WARPS), 32 * PREFIX_WARPS, 0, stream>>>(
        joined, stats, out, qkv, keys, values, gate, s, 1.0f / sqrtf((float)s.HS));
    cudaCheck(cudaGetLastError());
}

// After flash attention's backward wrote dqkv from dout and the forward's out and stats (joint: the joined ones; gated:
// the causal ones, which the gated kernels do not read): dq += the shared keys'
// part, dkeys and dvalues (at the keys' layout) += (accumulate) or = their gradients, and gated, dgate[0] += the
// gate's. Scratch: ds_rows and p_rows of B T NH P floats, gate_rows of B T NH (gated only).
void prefix_attention_backward(floatX* dqkv, floatX* dkeys, floatX* dvalues, floatX* dgate, float* ds_rows,
                               float* p_rows, float* gate_rows, const floatX* dout, const floatX* qkv,
                               const floatX* out, const float* stats, const floatX* keys, const floatX* values,
                               const floatX* gate, PrefixShape s, int accumulate, cudaStream_t stream) {
    prefix_attention_require("prefix_attention_backward", s);
    const int rows = s.B * s.T * s.NH;
    const float scale = 1.0f / sqrtf((float)s.HS);
    prefix_attention_backward_rows_kernel<<<CEIL_DIV(rows, PREFIX_WARPS), 32 * PREFIX_WARPS, 0, stream>>>(
        dqkv, ds_rows, p_rows, gate_rows, dout, qkv, out, stats, keys, values, gate, s, scale);
    cudaCheck(cudaGetLastError());
    prefix_attention_backward_keys_kernel<<<dim3(s.P, s.NKV), s.HS, 0, stream>>>(dkeys, dvalues, ds_rows, p_rows, dout,
                                                                              qkv, gate, s, scale, accumulate);
    cudaCheck(cudaGetLastError());
    if (gate) {
        prefix_attention_gate_kernel<<<1, 256, 0, stream>>>(dgate, gate_rows, rows);
        cudaCheck(cudaGetLastError());
    }
}
