// dev/cuda/attention_reference.h: the double-precision CPU references of causal multi-head attention that
// attention_forward.cu, attention_backward.cu and the flash_attention_*.cu labs validate against. They read and
// write the same two layouts and the same causal softmax, defined once here so that the forward and backward labs
// cannot disagree on them. Grouped-query attention (doc/attention.md): NKV key/value heads, NH a multiple of NKV,
// query head h attending with key/value head h / (NH / NKV); NKV = NH is multi-head attention.
#pragma once
#include <math.h>
#include <vector>

// The packed layout of inp and dinp, (B, T, (NH + 2 NKV) HS) = [q | k | v] per position, and the head layout of
// qkvr, q (B, NH, T, HS) then k and v (B, NKV, T, HS) each ((3, B, NH, T, HS) when NKV = NH): the index of element
// d of head h of part (0 q, 1 k, 2 v; h counts that part's heads) at position t of batch row b. C = NH HS.
struct AttentionLayout {
    int B, T, C, NH, NKV, HS;
    AttentionLayout(int B_, int T_, int C_, int NH_, int NKV_)
        : B(B_), T(T_), C(C_), NH(NH_), NKV(NKV_), HS(C_ / NH_) {}
    int part_heads(int part) const { return part == 0 ? NH : NKV; }
    int heads_before(int part) const { return part == 0 ? 0 : NH + (part - 1) * NKV; }
    size_t packed(int part, int b, int t, int h, int d) const {
        return ((size_t)b * T + t) * (NH + 2 * NKV) * HS + (size_t)(heads_before(part) + h) * HS + d;
    }
    size_t heads(int part, int b, int t, int h, int d) const {
        return (size_t)heads_before(part) * B * T * HS + (((size_t)b * part_heads(part) + h) * T + t) * HS + d;
    }
};

// scores[0..t] -> the causal softmax row (max subtracted, so any logits are safe)
static void attention_causal_softmax(double* scores, int t) {
    double max_score = -1e300;
    for (int s = 0; s <= t; s++) max_score = fmax(max_score, scores[s]);
    double sum = 0.0;
    for (int s = 0; s <= t; s++) {
        scores[s] = exp(scores[s] - max_score);
        sum += scores[s];
    }
    for (int s = 0; s <= t; s++) scores[s] /= sum;
}

// forward from packed inp: qkvr (the permuted q, k, v), att (B, NH, T, T) with zeros above the diagonal, out (B, T, C)
static void attention_forward_reference(std::vector<float>& qkvr, std::vector<float>& att, std::vector<float>& out,
                                        const std::vector<float>& inp, int B, int T, int C, int NH, int NKV) {
    const AttentionLayout L(B, T, C, NH, NKV);
    const double scale = 1.0 / sqrt((double)L.HS);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int part = 0; part < 3; part++)
                for (int h = 0; h < L.part_heads(part); h++)
                    for (int d = 0; d < L.HS; d++) qkvr[L.heads(part, b, t, h, d)] = inp[L.packed(part, b, t, h, d)];
    std::vector<double> scores(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const int kv = h / (NH / NKV);
                for (int s = 0; s <= t; s++) {
                    double dot = 0.0;
                    for (int d = 0; d < L.HS; d++) dot += (double)inp[L.packed(0, b, t, h, d)] * inp[L.packed(1, b, s, kv, d)];
                    scores[s] = dot * scale;
                }
                attention_causal_softmax(scores.data(), t);
                float* att_row = &att[(((size_t)b * NH + h) * T + t) * T];
                for (int s = 0; s < T; s++) att_row[s] = s <= t ? (float)scores[s] : 0.0f;
                for (int d = 0; d < L.HS; d++) {
                    double o = 0.0;
                    for (int s = 0; s <= t; s++) o += scores[s] * inp[L.packed(2, b, s, kv, d)];
                    out[((size_t)b * T + t) * C + h * L.HS + d] = (float)o;
                }
            }
}

// backward into packed dinp = [dq | dk | dv], from the given (rounded) att and qkvr, as the backward pass
// receives them; a key/value head's gradient sums over the query heads it serves
static void attention_backward_reference(std::vector<float>& dinp, const std::vector<float>& dout,
                                         const std::vector<float>& qkvr, const std::vector<float>& att, int B, int T,
                                         int C, int NH, int NKV) {
    const AttentionLayout L(B, T, C, NH, NKV);
    const int HS = L.HS;
    const double scale = 1.0 / sqrt((double)HS);
    std::vector<double> datt(T), dpre(T);
    std::vector<double> dqkv((size_t)B * T * (NH + 2 * NKV) * HS);  // head layout, as qkvr
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            const int kv = h / (NH / NKV);
            auto q = [&](int t, int d) { return (double)qkvr[L.heads(0, b, t, h, d)]; };
            auto k = [&](int t, int d) { return (double)qkvr[L.heads(1, b, t, kv, d)]; };
            auto v = [&](int t, int d) { return (double)qkvr[L.heads(2, b, t, kv, d)]; };
            auto g = [&](int t, int d) { return (double)dout[((size_t)b * T + t) * C + h * HS + d]; };
            for (int t = 0; t < T; t++) {
                const float* a = &att[(((size_t)b * NH + h) * T + t) * T];
                double dot = 0.0;
                for (int s = 0; s <= t; s++) {
                    datt[s] = 0.0;
                    for (int d = 0; d < HS; d++) datt[s] += g(t, d) * v(s, d);
                    dot += a[s] * datt[s];
                }
                for (int s = 0; s <= t; s++) {
                    dpre[s] = scale * a[s] * (datt[s] - dot);
                    for (int d = 0; d < HS; d++) {
                        dqkv[L.heads(2, b, s, kv, d)] += a[s] * g(t, d);
                        dqkv[L.heads(0, b, t, h, d)] += dpre[s] * k(s, d);
                        dqkv[L.heads(1, b, s, kv, d)] += dpre[s] * q(t, d);
                    }
                }
            }
        }
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int part = 0; part < 3; part++)
                for (int h = 0; h < L.part_heads(part); h++)
                    for (int d = 0; d < HS; d++) dinp[L.packed(part, b, t, h, d)] = (float)dqkv[L.heads(part, b, t, h, d)];
}

// the softmax statistics of the flash path and cuDNN (B, NH, T): stats = log(sum_{s <= t} exp(scale * q_t . k_s)),
// from packed inp; max-subtracted in double, so it is exact to double rounding for any logits
static void attention_stats_reference(std::vector<float>& stats, const std::vector<float>& inp, int B, int T, int C,
                                      int NH, int NKV) {
    const AttentionLayout L(B, T, C, NH, NKV);
    const double scale = 1.0 / sqrt((double)L.HS);
    std::vector<double> scores(T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const int kv = h / (NH / NKV);
                double max_score = -1e300;
                for (int s = 0; s <= t; s++) {
                    double dot = 0.0;
                    for (int d = 0; d < L.HS; d++) dot += (double)inp[L.packed(0, b, t, h, d)] * inp[L.packed(1, b, s, kv, d)];
                    scores[s] = dot * scale;
                    max_score = fmax(max_score, scores[s]);
                }
                double sum = 0.0;
                for (int s = 0; s <= t; s++) sum += exp(scores[s] - max_score);
                stats[((size_t)b * NH + h) * T + t] = (float)(max_score + log(sum));
            }
}
