// dev/cuda/moe_reference.h: the MoE routing of doc/moe.md (softmax or sigmoid scores) and the gate path of its
// backward as plain double-precision loops, and the routing inputs, shared by the MoE labs (moe_router.cu,
// moe_router_backward.cu, moe_losses.cu, moe_slots.cu, moe_dispatch_combine.cu, moe_noise.cu): each lab's kernels
// start from what the previous stage hands over, so every lab must derive those inputs by the same definition.
#pragma once
#include <math.h>
#include <vector>
#include "common.h"

// the k largest of key[0..n) among the allowed ones (allowed nullptr: all), largest first, ties to the lower index:
// the order of every top-k of doc/moe.md (experts, and device-limited routing's groups)
static void moe_top_k(int* picks, const double* key, const char* allowed, int n, int k) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            bool taken = allowed != nullptr && !allowed[e];
            for (int m = 0; m < j; m++) taken = taken || picks[m] == e;
            if (!taken && (best < 0 || key[e] > key[best])) best = e;
        }
        picks[j] = best;
    }
}

// softmax p and logsumexp of one token's logits and, when picks is given, its top-k experts (prob descending,
// ties to the lower index: the probs order exactly as the fp32 logits do, and equal logits give equal probs).
// Real is float for the router's inputs, double for the finite differences of moe_router_backward.cu and
// moe_losses.cu.
template <class Real>
static void moe_route_row(double* p, double* lse, int* picks, const Real* row, int E, int k) {
    double row_max = -INFINITY, sum = 0.0;
    for (int e = 0; e < E; e++) row_max = fmax(row_max, (double)row[e]);
    for (int e = 0; e < E; e++) sum += exp((double)row[e] - row_max);
    for (int e = 0; e < E; e++) p[e] = exp((double)row[e] - row_max) / sum;
    *lse = row_max + log(sum);
    if (picks != nullptr) moe_top_k(picks, p, nullptr, E, k);
}

// sigmoid scores (doc/moe.md, "Routing options" 3): a token's affinities a[e] = sigmoid(row[e])
template <class Real>
static void moe_affinity_row(double* a, const Real* row, int E) {
    for (int e = 0; e < E; e++) a[e] = 1.0 / (1.0 + exp(-(double)row[e]));
}

// gate of pick j from the token's scores s (score MOE_SCORE_SOFTMAX: the probs; MOE_SCORE_SIGMOID: the affinities),
// times the routed scale rsf: softmax with k = 1 the raw prob, otherwise renormalised over the k picks (sigmoid
// with k = 1 too: its gate is then rsf)
static double moe_gate(const double* s, const int* picks, int j, int k, int score, double rsf) {
    if (k == 1 && score == MOE_SCORE_SOFTMAX) return rsf * s[picks[0]];
    double picked_sum = 0.0;
    for (int m = 0; m < k; m++) picked_sum += s[picks[m]];
    return rsf * s[picks[j]] / picked_sum;
}

// the gate path of the router backward for one token: ds[e] += dgate/ds_e summed over the k picks, given its
// scores s (as moe_gate), picks and d_gate (softmax k = 1: rsf * d_gate on the pick; otherwise through the
// renormalisation, with the gates recomputed from s). Adds rather than writes so that a caller can start ds from
// its other terms (the aux loss's in moe_router_backward.cu); the softmax or sigmoid step is the caller's. Real
// is float for the kernels' fp32 d_gates, double for moe_noise.cu's reference chain.
template <class Real>
static void moe_gate_backward_row(double* ds, const double* s, const int* picks, const Real* d_gate, int k, int score,
                                  double rsf) {
    if (k == 1 && score == MOE_SCORE_SOFTMAX) {
        ds[picks[0]] += rsf * d_gate[0];
        return;
    }
    double picked_sum = 0.0, gate_dot = 0.0;
    for (int j = 0; j < k; j++) picked_sum += s[picks[j]];
    for (int j = 0; j < k; j++) gate_dot += d_gate[j] * rsf * s[picks[j]] / picked_sum;
    for (int j = 0; j < k; j++) ds[picks[j]] += (rsf * d_gate[j] - gate_dot) / picked_sum;
}

// With a balancing bias (sigmoid only, doc/moe.md "Routing options" 4): top-k on the keys
// fp32(a) + bias[e] in fp32 (one rounding of the sum, as the kernel), ties to the lower index. The fp32 affinity is
// the double one rounded, which a GPU's expf can miss by an ulp: a pick could then differ only where two keys are
// within ~1e-7, which the random inputs of the labs do not produce (validated exactly).
static void moe_pick_by_keys(int* picks, const double* a, const float* bias, int E, int k) {
    std::vector<double> key(E);  // the fp32 sums, exact in double
    for (int e = 0; e < E; e++) key[e] = (float)a[e] + bias[e];
    moe_top_k(picks, key.data(), nullptr, E, k);
}

// the router forward over N tokens with either score and the routed scale rsf, rounded to the fp32 values
// moe_router_forward writes (sigmoid: probs are the affinities over their sum); bias (E) or nullptr
static void moe_router_reference(std::vector<float>* probs, std::vector<int>* expert_index, std::vector<float>* gates,
                                 std::vector<float>* logsumexp, const std::vector<float>& logits, const float* bias,
                                 int N, int E, int k, int score, float rsf) {
    std::vector<double> p(E), a(E);
    for (int t = 0; t < N; t++) {
        int* picks = expert_index->data() + (size_t)t * k;
        double lse;
        moe_route_row(p.data(), &lse, picks, logits.data() + (size_t)t * E, E, k);
        const double* s = p.data();
        if (score == MOE_SCORE_SIGMOID) {
            moe_affinity_row(a.data(), logits.data() + (size_t)t * E, E);
            double affinity_sum = 0.0;
            for (int e = 0; e < E; e++) affinity_sum += a[e];
            for (int e = 0; e < E; e++) p[e] = a[e] / affinity_sum;
            s = a.data();
            if (bias != nullptr) moe_pick_by_keys(picks, a.data(), bias, E, k);
        }
        for (int e = 0; e < E; e++) (*probs)[(size_t)t * E + e] = (float)p[e];
        for (int j = 0; j < k; j++) (*gates)[(size_t)t * k + j] = (float)moe_gate(s, picks, j, k, score, rsf);
        (*logsumexp)[t] = (float)lse;
    }
}

// random logits in [-4, 4] with exact ties planted, so that the tie rule is exercised: every third row has its
// maximum copied to another expert, every fifth row a tie between two other experts, and rows 7 and 11 (when
// present) are all equal
static std::vector<float> moe_router_logits(int N, int E) {
    std::vector<float> logits = lab_random((size_t)N * E, -4.0f, 4.0f);
    for (int t = 0; t < N; t++) {
        float* row = logits.data() + (size_t)t * E;
        if (E >= 2 && t % 3 == 0) {
            int top = 0;
            for (int e = 1; e < E; e++) top = row[e] > row[top] ? e : top;
            row[(top + 1 + lab_random_ints(1, E - 1)[0]) % E] = row[top];
        }
        if (E >= 3 && t % 5 == 0) {
            const int a = lab_random_ints(1, E)[0];
            row[(a + 1) % E] = row[a];
        }
        if (t == 7 || t == 11) {
            for (int e = 0; e < E; e++) row[e] = 0.25f;
        }
    }
    return logits;
}

// The slot rule as a plain loop over the priority order (every first choice in token order, then every second
// choice, ...): each choice's position s in its expert's queue, kept iff s < capacity; choice_row (N, k), its row
// in the expert buffer (the expert's first row + s), -1 when the expert is full; row_choice (the buffer's rows),
// the choice in each row, -1 for padding; expert_count, choices routed to e before dropping; kept_count, rows
// used. Padded layout: expert e's rows start at e * capacity, E * capacity rows; packed (dropless, capacity = N):
// at the number of choices routed to experts below e, N * k rows.
struct MoeSlots {
    std::vector<int> choice_row, row_choice, expert_count, kept_count;
};
static MoeSlots moe_slots_reference(const std::vector<int>& expert_index, int N, int E, int k, int capacity,
                                    bool packed) {
    MoeSlots r;
    std::vector<int> position((size_t)N * k);
    r.expert_count.assign(E, 0);
    r.kept_count.assign(E, 0);
    for (int j = 0; j < k; j++) {
        for (int t = 0; t < N; t++) {
            const int choice = t * k + j;
            position[choice] = r.expert_count[expert_index[choice]]++;
        }
    }
    std::vector<int> first_row(E);
    for (int e = 0, below = 0; e < E; below += r.expert_count[e], e++) first_row[e] = packed ? below : e * capacity;
    for (int e = 0; e < E; e++) r.kept_count[e] = r.expert_count[e] < capacity ? r.expert_count[e] : capacity;
    r.choice_row.assign((size_t)N * k, -1);
    r.row_choice.assign(packed ? (size_t)N * k : (size_t)E * capacity, -1);
    for (int choice = 0; choice < N * k; choice++) {
        if (position[choice] >= capacity) continue;
        const int row = first_row[expert_index[choice]] + position[choice];
        r.choice_row[choice] = row;
        r.row_choice[row] = choice;
    }
    return r;
}

// k distinct experts per token, expert e drawn with weight 1/(e+1) so that the low experts overflow
static std::vector<int> moe_skewed_routing(int N, int E, int k) {
    std::vector<int> expert_index((size_t)N * k);
    std::vector<double> weight(E);
    for (int t = 0; t < N; t++) {
        for (int e = 0; e < E; e++) weight[e] = 1.0 / (e + 1);
        for (int j = 0; j < k; j++) {
            double total = 0.0;
            for (int e = 0; e < E; e++) total += weight[e];
            double u = lab_rand_uniform(0.0f, 1.0f) * total;
            int pick = -1;
            for (int e = 0; e < E; e++) {
                if (weight[e] == 0.0) continue;
                pick = e;  // the last free expert if rounding runs u past the end
                if (u < weight[e]) break;
                u -= weight[e];
            }
            expert_index[(size_t)t * k + j] = pick;
            weight[pick] = 0.0;
        }
    }
    return expert_index;
}

// A reference gradient `analytic` of a scalar loss of the logits against central differences at every logit (h =
// 1e-5: truncation ~h^2 |L'''| and cancellation ~1e-16 |L| / h, both near 1e-10 for these losses); fails the run where
// they differ by more than `tolerance`. loss(x, context) is the lab's double-precision loss.
static void moe_check_finite_differences(const char* what, const std::vector<double>& analytic,
                                         const std::vector<float>& logits,
                                         double (*loss)(const std::vector<double>& x, const void* context),
                                         const void* context, double tolerance) {
    std::vector<double> x(logits.begin(), logits.end());
    const double h = 1e-5;
    double worst = 0.0;
    for (size_t i = 0; i < x.size(); i++) {
        const double saved = x[i];
        x[i] = saved + h;
        const double up = loss(x, context);
        x[i] = saved - h;
        const double down = loss(x, context);
        x[i] = saved;
        const double err = fabs((up - down) / (2.0 * h) - analytic[i]);
        if (err > tolerance) {
            printf("FAIL %s: reference d_logits[%zu] = %.10g, finite difference %.10g\n", what, i, analytic[i],
                   (up - down) / (2.0 * h));
            exit(EXIT_FAILURE);
        }
        worst = fmax(worst, err);
    }
    printf("  %-28s ok (max abs err %.3g over %zu logits)\n", what, worst, x.size());
}
