// dev/cuda/moe_noise.cu: kernel lab for the MoE router's training noise (llmc/moe_noise.cuh): router jitter
// (router_in = x * U(1-EPS, 1+EPS), and dx += d_router_in * the same multipliers), noisy top-k gating's logits
// H = clean + n * softplus(noise_logits), its importance and load losses (Shazeer 2017), and their backward
// (importance into d_gates; load, thr and H into d_clean and d_noise_logits). The definition is the router-noise
// spec (doc/moe.md, "Router noise"; "spec section n" below); the rest of the MoE layer is doc/moe.md.
// The double-precision reference below is written out from the spec; its backward is itself checked against
// central finite differences of its forward losses (the noise and the routing held fixed) before any kernel runs.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_noise_bf16   (build/lab/moe_noise_fp32: the fp32 build)
//   build/lab/moe_noise_bf16 -s          (the fp32 build: only the jitter is floatX)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_noise.cu -o moe_noise
//   ./moe_noise [variant] [-s]   (default: jitter N = 8*1024, C = 768; gating N = 8*1024, E = 8 and 64, k = 1, 2;
//                                 -s: jitter N = 69, C = 136; gating N = 69 with (E, k) = (5, 1), (5, 2), (3, 2),
//                                 (40, 2), (100, 1), (200, 3): 1, 2, 4 and 8 logits per lane, k = E - 1)
// Variants (each is the llmc/ function itself, the trainer's):
//   1  moe_jitter_forward: one thread per 16-byte vector
//   2  moe_jitter_backward: the same, dx += d_router_in * multiplier
//   3  moe_noisy_logits_forward: one thread per 4 logits (training; evaluation's copy is validated too)
//   4  moe_noisy_losses_forward: a grid of warp-per-token blocks writes per-block sums, one block adds them
//   5  moe_importance_backward: one thread per choice
//   6  moe_noisy_backward: one warp per token (validated out of place and in place, d_clean = d_H)
// Floors (see llmc/moe_noise.cuh; s = sizeof(floatX)): jitter forward 2*N*C*s, backward 3*N*C*s; noisy logits
// 12*N*E; losses 12*N*E + 8*N*k (+ the partials, 16*G*E); importance backward 12*N*k + 4*E; noisy backward
// 24*N*E + 4*N*k + 4*E bytes.
#include <algorithm>
#include "common.h"
#include "../../llmc/moe_noise.cuh"
#include "moe_reference.h"

struct Coefficients {
    float w_imp, w_load, loss_scale;
};

// ----------------------------------------------------------------------------------------------------
// the spec, in double

static unsigned int ref_seed(unsigned int rank, unsigned int pass, int moe_layer, int kind) {
    const unsigned int rank_base = squirrel_noise5(rank, 20261201u);
    return squirrel_noise5(pass * 512u + (unsigned int)(moe_layer * 2 + kind), rank_base);
}
static double ref_uniform(unsigned int seed, unsigned int i) {
    return (double)((squirrel_noise5(i, seed) >> 9) * 2u + 1u) * 0x1p-24;
}
static double ref_normal(unsigned int seed, unsigned int i) {
    return sqrt(-2.0 * log(ref_uniform(seed, 2u * i))) * cos(2.0 * M_PI * ref_uniform(seed, 2u * i + 1u));
}
static double ref_multiplier(unsigned int seed, unsigned int i, float eps) {
    return (1.0 - (double)eps) + 2.0 * (double)eps * ref_uniform(seed, i);
}
static double ref_softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }
static double ref_softplus_grad(double x) { return x > 20.0 ? 1.0 : 1.0 / (1.0 + exp(-x)); }
static double ref_Phi(double u) { return 0.5 * erfc(-u / sqrt(2.0)); }
static double ref_phi(double u) { return exp(-0.5 * u * u) / sqrt(2.0 * M_PI); }

static void ref_cv2(double* mean, double* cv2, const std::vector<double>& v) {
    const int E = (int)v.size();
    double m = 0.0, var = 0.0;
    for (double x : v) m += x / E;
    for (double x : v) var += (x - m) * (x - m) / E;
    *mean = m;
    *cv2 = var / (m * m);
}
// d CV2 / d v_e: CV2 = var / m^2, d var / d v_e = 2 (v_e - m) / E (the deviations sum to 0), d m / d v_e = 1 / E
static double ref_cv2_grad(double v_e, double mean, double cv2, int E) {
    return 2.0 / (E * mean * mean) * (v_e - mean - cv2 * mean);
}
// the size of dCV2/dv_e's terms, for tolerances: fp32 forms v_e - mean - cv2*mean from values each ~1 ulp off
static double ref_cv2_grad_bound(double v_e, double mean, double cv2, int E) {
    return 2.0 / (E * mean * mean) * (fabs(v_e) + fabs(mean) + fabs(cv2 * mean));
}

// a row's routing order: H descending, ties to the lower index
template <class Real>
static void ref_order(int* order, const Real* row, int E) {
    for (int e = 0; e < E; e++) order[e] = e;
    std::stable_sort(order, order + E, [&](int a, int b) { return row[a] > row[b]; });
}

// spec section 3: Importance, Load (thr from the order of H), the two losses
struct RefLosses {
    std::vector<double> importance, load;
    double l_imp, l_load;
};
template <class Real>
static RefLosses ref_noisy_losses(const Real* clean, const Real* noise_logits, const Real* H, const int* expert_index,
                                  const Real* gates, int N, int E, int k, Coefficients q) {
    RefLosses r;
    r.importance.assign(E, 0.0);
    r.load.assign(E, 0.0);
    std::vector<int> order(E), position(E);
    for (int t = 0; t < N; t++) {
        const Real* row = H + (size_t)t * E;
        ref_order(order.data(), row, E);
        for (int p = 0; p < E; p++) position[order[p]] = p;
        for (int j = 0; j < k; j++) {
            if (order[j] != expert_index[(size_t)t * k + j]) {
                printf("FAIL lab inputs: token %d's pick %d is %d, its order of H says %d\n", t, j,
                       expert_index[(size_t)t * k + j], order[j]);
                exit(EXIT_FAILURE);
            }
            r.importance[expert_index[(size_t)t * k + j]] += gates[(size_t)t * k + j];
        }
        for (int e = 0; e < E; e++) {
            const double thr = position[e] < k ? row[order[k]] : row[order[k - 1]];  // positions k + 1 and k
            const size_t i = (size_t)t * E + e;
            r.load[e] += ref_Phi(((double)clean[i] - thr) / ref_softplus(noise_logits[i]));
        }
    }
    double mean, cv2;
    ref_cv2(&mean, &cv2, r.importance);
    r.l_imp = q.w_imp * cv2;
    ref_cv2(&mean, &cv2, r.load);
    r.l_load = q.w_load * cv2;
    return r;
}

// d_gates (N, k) += loss_scale * w_imp * dCV2/dImportance_e; scale (optional): the magnitudes of its terms
static void ref_importance_backward(std::vector<double>* d_gates, std::vector<double>* scale,
                                    const std::vector<double>& importance, const int* expert_index, int N, int E,
                                    int k, Coefficients q) {
    double mean, cv2;
    ref_cv2(&mean, &cv2, importance);
    const double imp_scale = (double)q.loss_scale * q.w_imp;
    for (size_t c = 0; c < (size_t)N * k; c++) {
        const int e = expert_index[c];
        if (scale) {
            (*scale)[c] = fabs((*d_gates)[c]) + fabs(imp_scale) * ref_cv2_grad_bound(importance[e], mean, cv2, E);
        }
        (*d_gates)[c] += imp_scale * ref_cv2_grad(importance[e], mean, cv2, E);
    }
}

// d_H (N, E) through softmax and the gates (k = 1: the raw prob; k >= 2: renormalised), the gate path of
// moe_router_backward (moe_reference.h's moe_gate_backward_row, then the softmax), for the finite differences' chain
static void ref_gate_backward(std::vector<double>* d_H, const std::vector<double>& probs, const int* picks,
                              const std::vector<double>& d_gates, int N, int E, int k) {
    std::vector<double> dp(E);
    for (int t = 0; t < N; t++) {
        const double* p = probs.data() + (size_t)t * E;
        for (int e = 0; e < E; e++) dp[e] = 0.0;
        moe_gate_backward_row(dp.data(), p, picks + (size_t)t * k, d_gates.data() + (size_t)t * k, k, MOE_SCORE_SOFTMAX,
                              1.0);
        double dot = 0.0;
        for (int e = 0; e < E; e++) dot += p[e] * dp[e];
        for (int e = 0; e < E; e++) (*d_H)[(size_t)t * E + e] += p[e] * (dp[e] - dot);
    }
}

// The load loss's gradient plus d_H, through thr, clean, std = softplus(noise_logits) and H = clean + n*std
// (spec section 3, "Gradient"). With a_e = load_scale * dCV2/dLoad_e * phi(u_e) / std_e:
//   d clean_e += a_e,  d std_e += -a_e u_e,  d H[thr element of e] += -a_e;  then d clean += dH, d std += n dH.
// clean_scale, nl_scale (optional): the magnitudes of the terms, each load term times (1 + u^2) because fp32's
// relative error in phi(u) grows as u^2 times u's.
template <class Real>
static void ref_noisy_backward(std::vector<double>* d_clean, std::vector<double>* d_nl,
                               std::vector<double>* clean_scale, std::vector<double>* nl_scale,
                               const std::vector<double>& d_H, const Real* clean,
                               const Real* noise_logits, const Real* H, const std::vector<double>& load,
                               unsigned int seed, int N, int E, int k, Coefficients q) {
    double mean, cv2;
    ref_cv2(&mean, &cv2, load);
    const double load_scale = (double)q.loss_scale * q.w_load;
    std::vector<int> order(E), position(E);
    std::vector<double> a(E), au(E), u_abs(E), bound(E), extra(E), extra_bound(E);
    for (int t = 0; t < N; t++) {
        const size_t row = (size_t)t * E;
        ref_order(order.data(), H + row, E);
        for (int p = 0; p < E; p++) position[order[p]] = p;
        for (int e = 0; e < E; e++) extra[e] = extra_bound[e] = 0.0;
        for (int e = 0; e < E; e++) {
            const int thr_expert = position[e] < k ? order[k] : order[k - 1];
            const double std = ref_softplus(noise_logits[row + e]);
            const double u = ((double)clean[row + e] - (double)H[row + thr_expert]) / std;
            const double phi = ref_phi(u);
            a[e] = au[e] = bound[e] = 0.0;
            u_abs[e] = fabs(u);
            if (phi > 0.0) {  // else u is huge (std ~ 0) and the term is 0: u^2 could overflow
                a[e] = load_scale * ref_cv2_grad(load[e], mean, cv2, E) * phi / std;
                au[e] = a[e] * u;
                bound[e] = fabs(load_scale) * ref_cv2_grad_bound(load[e], mean, cv2, E) * phi / std * (1.0 + u * u);
            }
            extra[thr_expert] -= a[e];
            extra_bound[thr_expert] += bound[e];
        }
        for (int e = 0; e < E; e++) {
            const double dh = d_H[row + e] + extra[e];
            const double n = ref_normal(seed, (unsigned int)(row + e));
            const double sig = ref_softplus_grad(noise_logits[row + e]);
            (*d_clean)[row + e] = dh + a[e];
            (*d_nl)[row + e] = (n * dh - au[e]) * sig;
            if (clean_scale) {
                (*clean_scale)[row + e] = fabs(d_H[row + e]) + extra_bound[e] + bound[e];
                // n's fp32 error is absolute, the cosine's (~3e-6 here, up to ~8e-6 with a GPU's __cosf at the
                // largest radius): hence |n| + 2
                const double own = bound[e] > 0.0 ? bound[e] * u_abs[e] : 0.0;
                (*nl_scale)[row + e] = sig * ((fabs(n) + 2.0) * (fabs(d_H[row + e]) + extra_bound[e]) + own);
            }
        }
    }
}

// ----------------------------------------------------------------------------------------------------
// validation: |got - want| <= rtol*|want| + tol*scale + atol for every element, scale being the sum of the
// magnitudes of the terms the value is made of, so that a value that cancels to ~0 is held to its terms' precision.
// Prints the worst error as a fraction of its bound; exits non-zero on failure.
template <class T>
static void check_close(const char* name, const T* device, const std::vector<double>& want,
                        const std::vector<double>& scale, double rtol, double tol, double atol) {
    const size_t n = want.size();
    std::vector<T> got(n);
    cudaCheck(cudaMemcpy(got.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
    size_t bad = 0;
    double worst = 0.0, worst_abs = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double g = (double)(float)got[i];
        const double err = fabs(g - want[i]);
        const double bound = rtol * fabs(want[i]) + tol * scale[i] + atol;
        if (!(err <= bound)) {
            if (bad < 5) printf("  %s[%zu]: got %.9g, want %.9g (bound %.3g)\n", name, i, g, want[i], bound);
            bad++;
        }
        if (bound > 0.0) worst = fmax(worst, err / bound);
        worst_abs = fmax(worst_abs, err);
    }
    if (bad) {
        printf("FAIL %s: %zu of %zu elements outside rtol %.2g + %.2g * scale + %.2g\n", name, bad, n, rtol, tol, atol);
        exit(EXIT_FAILURE);
    }
    printf("  %-28s ok (worst %.3f of its bound, max abs err %.3g, %zu elements)\n", name, worst, worst_abs, n);
}

static std::vector<double> as_doubles(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// ----------------------------------------------------------------------------------------------------
// inputs

// rows where plant_ties copies one logit of H onto another
static bool tie_row(int t) { return t % 3 == 0 || t % 5 == 0 || t == 7; }

// noise logits in [-3, 1.5] (std 0.05 .. 1.7), with planted cases: above 20 (softplus = x, derivative 1), exactly 20
// (the log1p branch), -20 (std 2e-9: u saturates) and -90 (softplus underflows: 0 on a GPU's flush-to-zero). The
// last two stay out of the tie rows: there H = clean to the bit, a planted tie can make thr equal that clean, and
// u = 0 / ~0 is a step whose gradient, ~1e36, is right but useless as a test.
static std::vector<float> noise_logits_input(int N, int E) {
    const size_t n = (size_t)N * E;
    std::vector<float> z = lab_random(n, -3.0f, 1.5f);
    for (size_t i = 0; i < n; i++) {
        if (i % 23 == 5) z[i] = 20.5f + 5.0f * lab_rand_uniform(0.0f, 1.0f);
        else if (i % 29 == 7) z[i] = 20.0f;
        else if (i % 31 == 3 && !tie_row((int)(i / E))) z[i] = -20.0f;
        else if (i % 37 == 11 && !tie_row((int)(i / E))) z[i] = -90.0f;
    }
    return z;
}

// exact ties in H where thr looks: rows t % 3 == 0 tie positions k and k+1 (which expert is picked, and which one
// thr's gradient reaches, is the tie rule's), rows t % 5 == 0 tie positions k+1 and k+2, row 7 is all equal
static void plant_ties(std::vector<float>* H, int N, int E, int k) {
    std::vector<int> order(E);
    for (int t = 0; t < N; t++) {
        float* row = H->data() + (size_t)t * E;
        ref_order(order.data(), row, E);
        if (t % 3 == 0) row[order[k]] = row[order[k - 1]];
        else if (t % 5 == 0 && E > k + 1) row[order[k + 1]] = row[order[k]];
        if (t == 7) for (int e = 0; e < E; e++) row[e] = 0.5f;
    }
}

// ----------------------------------------------------------------------------------------------------
// finite differences of the reference's forward against the reference's backward

// The routing the finite differences evaluate at a point (the base point or a perturbed one), the noise fixed:
// H = clean + n * softplus(noise_logits), each row's first k+1 positions of the order of H (the picks and the
// expert thr reads) in order (N, k+1), and probs = softmax(H) with the gates on picks (N, k). The picks are
// fixed_order's first k when given (the base point's, which the analytic gradient assumes), else this point's own.
struct FdRouting {
    std::vector<double> H, probs, gates;
    std::vector<int> order, picks;
};
static FdRouting fd_route(const std::vector<double>& clean, const std::vector<double>& noise_logits,
                          const std::vector<int>* fixed_order, unsigned int seed, int N, int E, int k) {
    const size_t n = (size_t)N * E;
    FdRouting r;
    r.H.resize(n);
    r.probs.resize(n);
    r.gates.resize((size_t)N * k);
    r.order.resize((size_t)N * (k + 1));
    r.picks.resize((size_t)N * k);
    for (size_t i = 0; i < n; i++) r.H[i] = clean[i] + ref_normal(seed, (unsigned int)i) * ref_softplus(noise_logits[i]);
    const std::vector<int>& pick_order = fixed_order ? *fixed_order : r.order;
    std::vector<int> row_order(E);
    for (int t = 0; t < N; t++) {
        ref_order(row_order.data(), r.H.data() + (size_t)t * E, E);
        for (int p = 0; p <= k; p++) r.order[(size_t)t * (k + 1) + p] = row_order[p];
        for (int j = 0; j < k; j++) r.picks[(size_t)t * k + j] = pick_order[(size_t)t * (k + 1) + j];
        double lse;
        moe_route_row(r.probs.data() + (size_t)t * E, &lse, (int*)nullptr, r.H.data() + (size_t)t * E, E, k);
        for (int j = 0; j < k; j++) {
            r.gates[(size_t)t * k + j] = moe_gate(r.probs.data() + (size_t)t * E, r.picks.data() + (size_t)t * k, j, k,
                                                  MOE_SCORE_SOFTMAX, 1.0);
        }
    }
    return r;
}

// J = sum G*H + loss_scale * (L_imp + L_load), the gates from softmax(H) on the fixed picks, the noise fixed.
// same_order is cleared if any row's first k+1 positions differ from base_order (the routing the gradient assumes).
static double fd_objective(const std::vector<double>& clean, const std::vector<double>& noise_logits,
                           const std::vector<double>& G, const std::vector<int>& base_order, unsigned int seed, int N,
                           int E, int k, Coefficients q, bool* same_order) {
    const FdRouting r = fd_route(clean, noise_logits, &base_order, seed, N, E, k);
    *same_order = *same_order && r.order == base_order;
    double linear = 0.0;
    for (size_t i = 0; i < r.H.size(); i++) linear += G[i] * r.H[i];
    const RefLosses L = ref_noisy_losses(clean.data(), noise_logits.data(), r.H.data(), r.picks.data(), r.gates.data(),
                                         N, E, k, q);
    return linear + q.loss_scale * (L.l_imp + L.l_load);
}

static void check_reference_by_finite_differences(int N, int E, int k, bool upstream, Coefficients q) {
    const size_t n = (size_t)N * E;
    const unsigned int seed = moe_noise_seed(1, 5, 2, MOE_NOISE_GATING);
    std::vector<double> clean = as_doubles(lab_random(n, -2.0f, 2.0f));
    std::vector<double> noise_logits = as_doubles(lab_random(n, -2.0f, 1.5f));
    noise_logits[3] = 22.5;   // softplus = x: derivative 1
    noise_logits[n / 2] = 25.0;
    noise_logits[11] = -30.0;  // std 1e-13: Phi saturated, no gradient
    noise_logits[n - 2] = -90.0;
    std::vector<double> G = upstream ? as_doubles(lab_random(n, -0.2f, 0.2f)) : std::vector<double>(n, 0.0);

    // the routing at the base point, and the analytic gradient there
    const FdRouting base = fd_route(clean, noise_logits, nullptr, seed, N, E, k);
    const RefLosses L = ref_noisy_losses(clean.data(), noise_logits.data(), base.H.data(), base.picks.data(),
                                         base.gates.data(), N, E, k, q);
    std::vector<double> d_gates((size_t)N * k, 0.0), d_H = G, d_clean(n), d_nl(n);
    ref_importance_backward(&d_gates, nullptr, L.importance, base.picks.data(), N, E, k, q);
    ref_gate_backward(&d_H, base.probs, base.picks.data(), d_gates, N, E, k);
    ref_noisy_backward(&d_clean, &d_nl, nullptr, nullptr, d_H, clean.data(), noise_logits.data(), base.H.data(),
                       L.load, seed, N, E, k, q);

    // h: H moves by at most h * (1 + |n|) ~ 5e-6, far below the gaps of the routing order (checked for every
    // perturbation); truncation ~h^2 |J'''| ~ 1e-12, cancellation ~1e-16 |J| / h ~ 1e-9
    const double h = 1e-6;
    double worst = 0.0;
    bool same_order = true;
    for (int which = 0; which < 2; which++) {
        std::vector<double>& x = which == 0 ? clean : noise_logits;
        const std::vector<double>& analytic = which == 0 ? d_clean : d_nl;
        for (size_t i = 0; i < n; i++) {
            const double saved = x[i];
            x[i] = saved + h;
            const double up = fd_objective(clean, noise_logits, G, base.order, seed, N, E, k, q, &same_order);
            x[i] = saved - h;
            const double down = fd_objective(clean, noise_logits, G, base.order, seed, N, E, k, q, &same_order);
            x[i] = saved;
            if (!same_order) {
                printf("FAIL finite differences: perturbing %s[%zu] by %g changed the routing order\n",
                       which == 0 ? "clean" : "noise_logits", i, h);
                exit(EXIT_FAILURE);
            }
            const double fd = (up - down) / (2.0 * h);
            const double err = fabs(fd - analytic[i]);
            if (!(err <= 1e-7 + 1e-6 * fabs(analytic[i]))) {
                printf("FAIL reference d_%s[%zu] = %.10g, finite difference %.10g\n",
                       which == 0 ? "clean" : "noise_logits", i, analytic[i], fd);
                exit(EXIT_FAILURE);
            }
            worst = fmax(worst, err);
        }
    }
    double largest = 0.0;
    for (size_t i = 0; i < n; i++) largest = fmax(largest, fmax(fabs(d_clean[i]), fabs(d_nl[i])));
    printf("  N=%d E=%d k=%d %-16s ok (max abs err %.3g, gradients up to %.3g, L_imp %.4g L_load %.4g; order "
           "unchanged by all %zu perturbations)\n", N, E, k, upstream ? "with upstream dH" : "losses alone", worst,
           largest, L.l_imp, L.l_load, 4 * n);
}

// ----------------------------------------------------------------------------------------------------

static void print_generator_values(void) {
    // reference values for the PyTorch side's own test of the generator
    const unsigned int s = moe_noise_seed(3, 7, 1, MOE_NOISE_GATING);
    printf("generator: seed(rank 0, pass 0, layer 0, jitter) = %u, (0, 0, 0, gating) = %u, (3, 7, 1, gating) = %u\n",
           moe_noise_seed(0, 0, 0, MOE_NOISE_JITTER), moe_noise_seed(0, 0, 0, MOE_NOISE_GATING), s);
    printf("  with the last: uniform(0..2) = %.9g %.9g %.9g, normal(0..2) = %.9g %.9g %.9g\n", moe_uniform(s, 0),
           moe_uniform(s, 1), moe_uniform(s, 2), moe_normal(s, 0), moe_normal(s, 1), moe_normal(s, 2));
    // the seed formula, the uniform (exact) and the host normal against the spec in double; the normal's moments
    for (unsigned int r = 0; r < 4; r++) {
        for (unsigned int pass = 0; pass < 50; pass++) {
            for (int m = 0; m < 6; m++) {
                for (int kind = 0; kind < 2; kind++) {
                    if (moe_noise_seed(r, pass, m, kind) != ref_seed(r, pass, m, kind)) {
                        printf("FAIL moe_noise_seed(%u, %u, %d, %d)\n", r, pass, m, kind);
                        exit(EXIT_FAILURE);
                    }
                }
            }
        }
    }
    const int samples = 1 << 20;
    double sum = 0.0, squares = 0.0, worst = 0.0;
    for (int i = 0; i < samples; i++) {
        if ((double)moe_uniform(s, i) != ref_uniform(s, i)) {
            printf("FAIL moe_uniform(%u, %d) = %.9g, want %.17g\n", s, i, moe_uniform(s, i), ref_uniform(s, i));
            exit(EXIT_FAILURE);
        }
        const double want = ref_normal(s, i), got = moe_normal(s, i);
        worst = fmax(worst, fabs(got - want));
        sum += want;
        squares += want * want;
    }
    const double mean = sum / samples, var = squares / samples - mean * mean;
    // fp32: log1pf and sqrtf within an ulp or two; cosf's argument 6.283185307f*u is 2pi*u to ~5e-7 absolute, times
    // the radius (<= 5.8): 4e-6. Moments: standard errors 1e-3 (mean) and 1.4e-3 (variance), bounds 5 sigma.
    if (!(worst <= 4e-6) || !(fabs(mean) < 5e-3) || !(fabs(var - 1.0) < 7e-3)) {
        printf("FAIL moe_normal: max abs err %.3g against the double spec, mean %.5f, variance %.5f over %d draws\n",
               worst, mean, var, samples);
        exit(EXIT_FAILURE);
    }
    printf("  seeds ok, moe_uniform exact, moe_normal (host) max abs err %.3g, mean %.5f variance %.5f over %d draws\n",
           worst, mean, var, samples);
}

// ----------------------------------------------------------------------------------------------------

static void run_jitter(const LabArgs& args, int N, int C, int repeats) {
    const size_t n = (size_t)N * C;
    const float eps = 0.3f;  // large, so that a wrong multiplier is far outside bf16's tolerance
    const unsigned int seed = moe_noise_seed(2, 11, 3, MOE_NOISE_JITTER);
    const std::vector<float> x = lab_random_rounded(n, -2.0f, 2.0f);
    const std::vector<float> dx_in = lab_random_rounded(n, -1.0f, 1.0f);
    const std::vector<float> d_router_in = lab_random_rounded(n, -1.0f, 1.0f);
    std::vector<double> fwd(n), fwd_scale(n), bwd(n), bwd_scale(n);
    for (size_t i = 0; i < n; i++) {
        const double m = ref_multiplier(seed, (unsigned int)i, eps);
        fwd[i] = x[i] * m;
        fwd_scale[i] = fabs(fwd[i]);
        bwd[i] = dx_in[i] + d_router_in[i] * m;
        bwd_scale[i] = fabs(dx_in[i]) + fabs(d_router_in[i] * m);
    }
    floatX* d_x = lab_to_device<floatX>(x);
    floatX* d_dx = lab_to_device<floatX>(dx_in);
    floatX* d_d = lab_to_device<floatX>(d_router_in);
    floatX* d_out = lab_poisoned<floatX>(n);
    // fp32: the multiplier is 2 roundings off the exact (1-eps) + 2 eps u, the product or fma 1 more: < 4 * 2^-24 of
    // the terms, tol 1e-6. bf16/fp16: then one rounding to floatX, at most 2^-8 (2^-11) of the result when the fp32
    // value lands across a rounding midpoint from the exact one; fp16 also has subnormals below 2^-14, spaced 2^-24:
    // atol 2^-24.
    const double rtol = PRECISION_MODE == PRECISION_BF16 ? 0x1p-8 : PRECISION_MODE == PRECISION_FP16 ? 0x1p-11 : 0.0;
    const double atol = PRECISION_MODE == PRECISION_FP16 ? 0x1p-24 : 0.0;
    printf("jitter N=%d C=%d eps=%g (%s)\n", N, C, eps, PRECISION_NAME);
    if (args.variant == 0 || args.variant == 1) {
        printf("variant 1\n");
        moe_jitter_forward(d_out, d_x, N, C, eps, seed, 0);
        cudaCheck(cudaDeviceSynchronize());
        check_close("router_in", d_out, fwd, fwd_scale, rtol, 1e-6, atol);
    }
    if (args.variant == 0 || args.variant == 2) {
        printf("variant 2\n");
        moe_jitter_backward(d_dx, d_d, N, C, eps, seed, 0);
        cudaCheck(cudaDeviceSynchronize());
        check_close("dx", d_dx, bwd, bwd_scale, rtol, 1e-6, atol);
    }
    char sizes[64];
    snprintf(sizes, sizeof(sizes), "N=%d C=%d", N, C);
    lab_print_header("moe_jitter", sizes);
    const int block_sizes[] = {64, 128, 256, 512};
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            const float ms = lab_time_ms(repeats, [&]() {
                if (variant == 1) moe_jitter_forward_launch(d_out, d_x, N, C, eps, seed, block_size, 0);
                else moe_jitter_backward_launch(d_dx, d_d, N, C, eps, seed, block_size, 0);
            });
            lab_print_row(variant, block_size, ms, (variant == 1 ? 2.0 : 3.0) * n * sizeof(floatX), 0.0);
        }
    }
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_dx));
    cudaCheck(cudaFree(d_d));
    cudaCheck(cudaFree(d_out));
}

struct GatingBuffers {
    float *clean, *noise_logits, *H, *H_out, *gates, *importance, *load, *losses, *partials;
    float *d_gates, *d_H, *d_clean, *d_noise_logits, *in_place;
    int* expert_index;
};

static void run_gating(const LabArgs& args, int N, int E, int k, Coefficients q, int repeats) {
    const size_t n = (size_t)N * E, num_choices = (size_t)N * k;
    const unsigned int seed = moe_noise_seed(3, 7, 1, MOE_NOISE_GATING);
    const std::vector<float> clean = lab_random(n, -2.0f, 2.0f);
    const std::vector<float> noise_logits = noise_logits_input(N, E);

    // H in double, handed over in fp32; then ties planted and the router's picks and gates taken from that H (the
    // losses and the backward must see the routing their H implies)
    std::vector<double> H_ref(n), H_scale(n);
    std::vector<float> H(n);
    for (size_t i = 0; i < n; i++) {
        const double noise = ref_normal(seed, (unsigned int)i), std = ref_softplus(noise_logits[i]);
        H_ref[i] = clean[i] + noise * std;
        H_scale[i] = fabs(clean[i]) + std * (1.0 + fabs(noise));
        H[i] = (float)H_ref[i];
    }
    plant_ties(&H, N, E, k);
    std::vector<float> probs(n), gates(num_choices), logsumexp(N);
    std::vector<int> expert_index(num_choices);
    moe_router_reference(&probs, &expert_index, &gates, &logsumexp, H, nullptr, N, E, k, MOE_SCORE_SOFTMAX, 1.0f);

    const RefLosses L = ref_noisy_losses(clean.data(), noise_logits.data(), H.data(), expert_index.data(), gates.data(),
                                         N, E, k, q);
    // the kernels' inputs downstream of the losses: what moe_noisy_losses_forward hands over, in fp32
    const std::vector<float> importance_f(L.importance.begin(), L.importance.end());
    const std::vector<float> load_f(L.load.begin(), L.load.end());
    // upstream gradients ~1/N, like the mean losses' (and like the load and importance terms), so that neither hides
    // the other in the tolerance
    const std::vector<float> d_gates_in = lab_random(num_choices, -1.0f / N, 1.0f / N);
    const std::vector<float> d_H_in = lab_random(n, -1.0f / N, 1.0f / N);
    std::vector<double> d_gates_ref = as_doubles(d_gates_in), d_gates_scale(num_choices);
    ref_importance_backward(&d_gates_ref, &d_gates_scale, as_doubles(importance_f), expert_index.data(), N, E, k, q);
    std::vector<double> d_clean_ref(n), d_nl_ref(n), d_clean_scale(n), d_nl_scale(n);
    ref_noisy_backward(&d_clean_ref, &d_nl_ref, &d_clean_scale, &d_nl_scale, as_doubles(d_H_in), clean.data(),
                       noise_logits.data(), H.data(), as_doubles(load_f), seed, N, E, k, q);

    GatingBuffers d;
    d.clean = lab_to_device<float>(clean);
    d.noise_logits = lab_to_device<float>(noise_logits);
    d.H = lab_to_device<float>(H);
    d.H_out = lab_poisoned<float>(n);
    d.gates = lab_to_device<float>(gates);
    d.expert_index = lab_ints_to_device(expert_index);
    d.importance = lab_poisoned<float>(E);
    d.load = lab_poisoned<float>(E);
    d.losses = lab_poisoned<float>(2);
    d.partials = lab_poisoned<float>(moe_noisy_losses_partials_size(E));
    d.d_gates = lab_to_device<float>(d_gates_in);
    d.d_H = lab_to_device<float>(d_H_in);
    d.d_clean = lab_poisoned<float>(n);
    d.d_noise_logits = lab_poisoned<float>(n);
    d.in_place = lab_to_device<float>(d_H_in);
    float* d_importance_in = lab_to_device<float>(importance_f);
    float* d_load_in = lab_to_device<float>(load_f);

    printf("gating N=%d E=%d k=%d (w_imp %g, w_load %g, loss_scale %g)\n", N, E, k, q.w_imp, q.w_load, q.loss_scale);
    if (args.variant == 0 || args.variant == 3) {
        printf("variant 3\n");
        moe_noisy_logits_forward(d.H_out, d.clean, d.noise_logits, N, E, seed, true, 0);
        cudaCheck(cudaDeviceSynchronize());
        // n: log1pf, sqrtf ~1 ulp, cosf(6.283185307f*u) ~4e-6 absolute at the largest radius (on a GPU __cosf adds
        // ~2^-21 * 5.8); std: expf (__expf: 2 + 1.2|x| ulp) and log1pf, ~2e-6 relative: 2e-5 of
        // |clean| + std*(1 + |n|)
        check_close("H (training)", d.H_out, H_ref, H_scale, 0.0, 2e-5, 0.0);
        cudaCheck(cudaMemset(d.H_out, 0xff, n * sizeof(float)));
        moe_noisy_logits_forward(d.H_out, d.clean, d.noise_logits, N, E, seed, false, 0);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("H (evaluation) = clean", d.H_out, clean.data(), n, 0.0f, 0.0f);
    }
    if (args.variant == 0 || args.variant == 4) {
        printf("variant 4\n");
        moe_noisy_losses_forward(d.importance, d.load, d.losses, d.partials, d.clean, d.noise_logits, d.H,
                                 d.expert_index, d.gates, N, E, k, q.w_imp, q.w_load, 0);
        cudaCheck(cudaDeviceSynchronize());
        // sums of positive fp32 terms: a warp's tokens, then the block's warps, then up to 256 blocks in order, so
        // at most ~300 additions deep: 300 * 2^-24 = 1.8e-5 of the sum, tol 3e-5. Each P is also off by up to
        // ~2.4e-7 (u's relative error ~1e-6 times max phi(u)|u| = 0.24), hence + 1e-2 N in load's scale.
        std::vector<double> imp_scale = L.importance, load_scale(E);
        for (int e = 0; e < E; e++) load_scale[e] = L.load[e] + 1e-2 * N;
        check_close("importance", d.importance, L.importance, imp_scale, 0.0, 3e-5, 0.0);
        check_close("load", d.load, L.load, load_scale, 0.0, 3e-5, 0.0);
        // the losses inherit the vectors' errors through |dL/dv_e|, plus fp32 mean, variance and division: 3e-5 of L
        double imp_mean, imp_cv2, load_mean, load_cv2;
        ref_cv2(&imp_mean, &imp_cv2, L.importance);
        ref_cv2(&load_mean, &load_cv2, L.load);
        std::vector<double> loss_bound = {3e-5 * L.l_imp, 3e-5 * L.l_load};
        for (int e = 0; e < E; e++) {
            loss_bound[0] += q.w_imp * fabs(ref_cv2_grad(L.importance[e], imp_mean, imp_cv2, E)) * 3e-5 * imp_scale[e];
            loss_bound[1] += q.w_load * fabs(ref_cv2_grad(L.load[e], load_mean, load_cv2, E)) * 3e-5 * load_scale[e];
        }
        check_close("L_imp, L_load", d.losses, std::vector<double>{L.l_imp, L.l_load}, loss_bound, 0.0, 1.0, 0.0);
    }
    if (args.variant == 0 || args.variant == 5) {
        printf("variant 5\n");
        moe_importance_backward(d.d_gates, d_importance_in, d.expert_index, N, E, k, q.w_imp, q.loss_scale, 0);
        cudaCheck(cudaDeviceSynchronize());
        // fp32 mean and CV2 of E values (~(E/32 + 10) roundings) and the few operations of the gradient: 1e-5 of
        // the terms' magnitudes
        check_close("d_gates", d.d_gates, d_gates_ref, d_gates_scale, 0.0, 1e-5, 0.0);
    }
    if (args.variant == 0 || args.variant == 6) {
        printf("variant 6\n");
        // relative errors: 1/std and u ~1.5e-6 (expf, log1pf, the division), phi ~1.6e-6 u^2 (in the scales' 1 + u^2),
        // the CV2 gradient ~1e-6 of its terms, n <= 8e-6 absolute (the |n| + 2): 1e-5 of the scales. atol 1e-30:
        // sigmoid(-90) ~ 1e-39 is a denormal, flushed to 0 on a GPU
        moe_noisy_backward(d.d_clean, d.d_noise_logits, d.d_H, d.clean, d.noise_logits, d.H, d.expert_index, d_load_in,
                           N, E, k, q.w_load, q.loss_scale, seed, 0);
        cudaCheck(cudaDeviceSynchronize());
        check_close("d_clean", d.d_clean, d_clean_ref, d_clean_scale, 0.0, 1e-5, 1e-30);
        check_close("d_noise_logits", d.d_noise_logits, d_nl_ref, d_nl_scale, 0.0, 1e-5, 1e-30);
        cudaCheck(cudaMemset(d.d_noise_logits, 0xff, n * sizeof(float)));
        moe_noisy_backward(d.in_place, d.d_noise_logits, d.in_place, d.clean, d.noise_logits, d.H, d.expert_index,
                           d_load_in, N, E, k, q.w_load, q.loss_scale, seed, 0);
        cudaCheck(cudaDeviceSynchronize());
        check_close("d_clean (in place of d_H)", d.in_place, d_clean_ref, d_clean_scale, 0.0, 1e-5, 1e-30);
        check_close("d_noise_logits (in place)", d.d_noise_logits, d_nl_ref, d_nl_scale, 0.0, 1e-5, 1e-30);
    }

    char sizes[64];
    snprintf(sizes, sizeof(sizes), "N=%d E=%d k=%d", N, E, k);
    lab_print_header("moe_noise", sizes);
    const int block_sizes[] = {64, 128, 256, 512};
    for (int variant = 3; variant <= 6; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int block_size : block_sizes) {
            const float ms = lab_time_ms(repeats, [&]() {
                if (variant == 3) {
                    moe_noisy_logits_forward_launch(d.H_out, d.clean, d.noise_logits, N, E, seed, true, block_size, 0);
                } else if (variant == 4) {
                    moe_noisy_losses_forward_launch(d.importance, d.load, d.losses, d.partials, d.clean, d.noise_logits,
                                                    d.H, d.expert_index, d.gates, N, E, k, q.w_imp, q.w_load,
                                                    block_size, 0);
                } else if (variant == 5) {
                    moe_importance_backward_launch(d.d_gates, d_importance_in, d.expert_index, N, E, k, q.w_imp,
                                                   q.loss_scale, block_size, 0);
                } else {
                    moe_noisy_backward_launch(d.d_clean, d.d_noise_logits, d.d_H, d.clean, d.noise_logits, d.H,
                                              d.expert_index, d_load_in, N, E, k, q.w_load, q.loss_scale, seed,
                                              block_size, 0);
                }
            });
            const double bytes = variant == 3 ? 12.0 * n
                               : variant == 4 ? 12.0 * n + 8.0 * num_choices
                               : variant == 5 ? 12.0 * num_choices + 4.0 * E
                                              : 24.0 * n + 4.0 * num_choices + 4.0 * E;
            lab_print_row(variant, block_size, ms, bytes, 0.0);
        }
    }
    float* buffers[] = {d.clean, d.noise_logits, d.H, d.H_out, d.gates, d.importance, d.load, d.losses, d.partials,
                        d.d_gates, d.d_H, d.d_clean, d.d_noise_logits, d.in_place, d_importance_in, d_load_in};
    for (float* b : buffers) cudaCheck(cudaFree(b));
    cudaCheck(cudaFree(d.expert_index));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    // coefficients far from each other and loss_scale != 1, so that a swapped or missing factor shows
    const Coefficients q = {0.3f, 0.7f, 1.5f};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative
    printf("moe_noise (%s build; everything but the jitter is fp32)\n", PRECISION_NAME);
    print_generator_values();

    printf("reference backward vs central finite differences of the reference losses (double)\n");
    struct FdCase { int N, E, k; };
    const FdCase fd_cases[] = {{20, 5, 1}, {20, 5, 2}, {12, 3, 2}, {16, 9, 3}};
    for (const FdCase& c : fd_cases) {
        check_reference_by_finite_differences(c.N, c.E, c.k, false, q);
        check_reference_by_finite_differences(c.N, c.E, c.k, true, q);
    }

    if (args.variant == 0 || args.variant <= 2) {
        if (args.small) run_jitter(args, 69, 136, repeats);
        else run_jitter(args, 8 * 1024, 768, repeats);
    }
    struct Case { int N, E, k; };
    const Case full_cases[] = {{8 * 1024, 8, 1}, {8 * 1024, 8, 2}, {8 * 1024, 64, 1}, {8 * 1024, 64, 2}};
    const Case small_cases[] = {{69, 5, 1}, {69, 5, 2}, {69, 3, 2}, {69, 40, 2}, {69, 100, 1}, {69, 200, 3}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? 6 : 4;
    if (args.variant == 0 || args.variant >= 3) {
        for (int c = 0; c < num_cases; c++) run_gating(args, cases[c].N, cases[c].E, cases[c].k, q, repeats);
    }
    return 0;
}
