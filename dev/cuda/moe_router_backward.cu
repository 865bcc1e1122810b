// dev/cuda/moe_router_backward.cu: kernel lab for the MoE router's backward pass: d_logits (N, E) of the gates'
// gradient d_gates (k = 1: the raw prob; k >= 2: through the renormalisation over the k picks) and of the
// load-balancing loss aux = alpha*E*sum_e f_e P_e and the z-loss c_z*mean_t lse_t^2 (these two times loss_scale),
// through the softmax; with sigmoid scores through the affinities a = sigmoid(logits) (gates: the picked affinities
// renormalised, k = 1 too; P: the affinities over their sum; the z-loss still on the logits); either way the gates
// times the routed scale rsf. doc/moe.md. The losses' values, and the sequence-wise loss with its gradient, are
// dev/cuda/moe_losses.cu's.
// The double-precision reference gradient is itself checked against central finite differences of the
// double-precision loss (picks and f_e held fixed, as the definition does) at small sizes.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_router_backward_bf16   (build/lab/moe_router_backward_fp32: the fp32 build)
//   build/lab/moe_router_backward_bf16 -s          (the fp32 build is the same: the router is fp32)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_router_backward.cu -o moe_router_backward
//   ./moe_router_backward [variant] [-s]  (default: production sizes N = 65536 tokens, E = 8 and 64 with k = 1, 2
//                                          and 8; -s: N = 69, E = 4 with k = 1 and 2, E = 40 with k = 2, and E = 4
//                                          k = 2 with d_gates = 0 (the loss terms alone); N = 999, E = 5 (125 blocks,
//                                          the last with 7 of its 8 warps); sigmoid scores with rsf 2.5
//                                          at E = 4 k = 1, E = 40 k = 2, E = 200 k = 3, softmax with rsf 2.5 at E = 4
//                                          k = 2; the default sizes add E = 64 k = 6 sigmoid)
// Variants:
//   1  router backward, one thread per token: serial loops over the row
//   2  llmc/moe_router.cuh moe_router_backward: one warp per token, lanes own experts, one warp reduction. The
//      trainer's.
// Floor (see llmc/moe_router.cuh): N*E*8 + N*k*12 + N*4 + E*4 bytes (sigmoid: N*E*4 more, the logits).
#include "common.h"
#include "../../llmc/moe_router.cuh"
#include "moe_reference.h"

__global__ void router_backward_thread_per_token_kernel(float* d_logits, const float* probs, const float* logits,
                                                        const int* expert_index, const float* gates,
                                                        const float* d_gates, const float* logsumexp,
                                                        const int* expert_count, int N, int E, int k, int score,
                                                        float routed_scale, float aux_alpha, float z_coef,
                                                        float loss_scale) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= N) return;
    const bool sigmoid = score == MOE_SCORE_SIGMOID;
    const float* p = probs + (size_t)token * E;
    const float* row = logits + (size_t)token * E;
    const int* picks = expert_index + (size_t)token * k;
    const float* d_gate = d_gates + (size_t)token * k;
    const float aux_per_count = loss_scale * aux_alpha * (float)E / ((float)N * (float)k * (float)N);
    float picked_sum = 0.0f, gate_dot = 0.0f;
    for (int j = 0; j < k; j++) {
        picked_sum += sigmoid ? moe_sigmoid(row[picks[j]]) : p[picks[j]];
        gate_dot += d_gate[j] * gates[(size_t)token * k + j];
    }
    const float z_scale = loss_scale * z_coef * 2.0f * logsumexp[token] / (float)N;
    if (sigmoid) {  // the aux gradient through q = a / A, then the gates' on the picks, then the sigmoid
        float affinity_sum = 0.0f, dot = 0.0f;
        for (int e = 0; e < E; e++) {
            affinity_sum += moe_sigmoid(row[e]);
            dot += p[e] * aux_per_count * (float)expert_count[e];
        }
        for (int e = 0; e < E; e++) {
            const float a = moe_sigmoid(row[e]);
            float da = (aux_per_count * (float)expert_count[e] - dot) / affinity_sum;
            for (int j = 0; j < k; j++) {
                if (picks[j] == e) da += (routed_scale * d_gate[j] - gate_dot) / picked_sum;
            }
            d_logits[(size_t)token * E + e] = da * a * (1.0f - a) + z_scale * expf(row[e] - logsumexp[token]);
        }
        return;
    }
    // dP_e is needed twice (the softmax dot, then the output): recomputed rather than stored, E is small
    float dot = 0.0f;
    for (int pass = 0; pass < 2; pass++) {
        for (int e = 0; e < E; e++) {
            float dp = aux_per_count * (float)expert_count[e];
            for (int j = 0; j < k; j++) {
                if (picks[j] == e)
                    dp += k == 1 ? routed_scale * d_gate[0] : (routed_scale * d_gate[j] - gate_dot) / picked_sum;
            }
            if (pass == 0) dot += p[e] * dp;
            else d_logits[(size_t)token * E + e] = p[e] * (dp - dot) + z_scale * p[e];
        }
    }
}

struct RouterBackwardBuffers {
    float* logits;
    float* probs;
    int* expert_index;
    float* gates;
    float* d_gates;
    float* logsumexp;
    int* expert_count;
    float* d_logits;
};

struct LossCoefficients {
    float aux_alpha, z_coef, loss_scale;
};
// the router's score function and the gates' routed scale
struct Scoring {
    int score;
    float rsf;
};

static void run_variant(int variant, const RouterBackwardBuffers* d, int N, int E, int k, LossCoefficients q,
                        Scoring sc, int block_size) {
    if (variant == 1) {
        router_backward_thread_per_token_kernel<<<CEIL_DIV(N, block_size), block_size>>>(
            d->d_logits, d->probs, d->logits, d->expert_index, d->gates, d->d_gates, d->logsumexp, d->expert_count, N,
            E, k, sc.score, sc.rsf, q.aux_alpha, q.z_coef, q.loss_scale);
        cudaCheck(cudaGetLastError());
    } else {
        moe_router_backward_launch(d->d_logits, d->probs, d->logits, d->expert_index, d->gates, d->d_gates,
                                   d->logsumexp, d->expert_count, N, E, k, sc.score, sc.rsf, q.aux_alpha, q.z_coef,
                                   q.loss_scale, block_size, 0);
    }
}

// ----------------------------------------------------------------------------------------------------
// double-precision definitions

// the scalar whose gradient the kernels compute, with the picks and counts fixed:
// sum_t sum_j d_gates[t,j] * gate[t,j] + loss_scale * (alpha*E*sum_e f_e P_e + c_z * mean_t lse_t^2)
// (sigmoid: the gates from the affinities a, P from a / sum a; lse from the logits either way)
static double router_loss(const std::vector<double>& logits, const std::vector<int>& picks,
                          const std::vector<float>& d_gates, const std::vector<int>& expert_count, int N, int E, int k,
                          LossCoefficients q, Scoring sc) {
    std::vector<double> p(E), a(E), mean_prob(E, 0.0);
    double gate_term = 0.0, z_sum = 0.0;
    for (int t = 0; t < N; t++) {
        double lse;
        moe_route_row(p.data(), &lse, nullptr, logits.data() + (size_t)t * E, E, k);
        const double* s = p.data();
        if (sc.score == MOE_SCORE_SIGMOID) {
            moe_affinity_row(a.data(), logits.data() + (size_t)t * E, E);
            s = a.data();
        }
        for (int j = 0; j < k; j++)
            gate_term += d_gates[(size_t)t * k + j] * moe_gate(s, picks.data() + (size_t)t * k, j, k, sc.score, sc.rsf);
        double score_sum = 0.0;
        for (int e = 0; e < E; e++) score_sum += s[e];
        for (int e = 0; e < E; e++) mean_prob[e] += s[e] / score_sum / N;
        z_sum += lse * lse;
    }
    double aux = 0.0;
    for (int e = 0; e < E; e++) aux += (double)expert_count[e] / ((double)N * k) * mean_prob[e];
    return gate_term + q.loss_scale * (q.aux_alpha * E * aux + q.z_coef * z_sum / N);
}

// the analytic gradient of router_loss with respect to the logits, written out as doc/moe.md defines it
// (the gates' part is moe_reference.h's moe_gate_backward_row; the aux and z-loss terms are this lab's own)
static void router_backward_reference(std::vector<double>* d_logits, const std::vector<float>& logits,
                                      const std::vector<int>& picks, const std::vector<float>& d_gates,
                                      const std::vector<int>& expert_count, int N, int E, int k, LossCoefficients q,
                                      Scoring sc) {
    std::vector<double> p(E), dp(E), a(E);
    for (int t = 0; t < N; t++) {
        double lse;
        const float* row = logits.data() + (size_t)t * E;
        moe_route_row(p.data(), &lse, nullptr, row, E, k);
        for (int e = 0; e < E; e++) dp[e] = q.loss_scale * q.aux_alpha * E * expert_count[e] / ((double)N * k) / N;
        const double z_scale = q.loss_scale * q.z_coef * 2.0 * lse / N;
        if (sc.score == MOE_SCORE_SIGMOID) {
            // dp is the aux loss's gradient by q = a / A: into da, then the gates', then the sigmoid
            moe_affinity_row(a.data(), row, E);
            double affinity_sum = 0.0, dot = 0.0;
            for (int e = 0; e < E; e++) affinity_sum += a[e];
            for (int e = 0; e < E; e++) dot += a[e] / affinity_sum * dp[e];
            for (int e = 0; e < E; e++) dp[e] = (dp[e] - dot) / affinity_sum;
            moe_gate_backward_row(dp.data(), a.data(), picks.data() + (size_t)t * k, d_gates.data() + (size_t)t * k, k,
                                  sc.score, (double)sc.rsf);
            for (int e = 0; e < E; e++) (*d_logits)[(size_t)t * E + e] = dp[e] * a[e] * (1.0 - a[e]) + z_scale * p[e];
            continue;
        }
        moe_gate_backward_row(dp.data(), p.data(), picks.data() + (size_t)t * k, d_gates.data() + (size_t)t * k, k,
                              sc.score, (double)sc.rsf);
        double dot = 0.0;
        for (int e = 0; e < E; e++) dot += p[e] * dp[e];
        for (int e = 0; e < E; e++) (*d_logits)[(size_t)t * E + e] = p[e] * (dp[e] - dot) + z_scale * p[e];
    }
}

// router_loss at the case's picks and gate gradients, for moe_check_finite_differences
typedef struct {
    const std::vector<int>* picks;
    const std::vector<float>* d_gates;
    const std::vector<int>* expert_count;
    int N, E, k;
    LossCoefficients q;
    Scoring sc;
} RouterLossPoint;
static double router_loss_at(const std::vector<double>& x, const void* context) {
    const RouterLossPoint* p = (const RouterLossPoint*)context;
    return router_loss(x, *p->picks, *p->d_gates, *p->expert_count, p->N, p->E, p->k, p->q, p->sc);
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    struct Case { int N, E, k; bool gate_gradient, finite_differences; Scoring sc; };
    const Scoring softmax = {MOE_SCORE_SOFTMAX, 1.0f}, sigmoid = {MOE_SCORE_SIGMOID, 2.5f};
    const Case full_cases[] = {{65536, 8, 1, true, false, softmax},  {65536, 8, 2, true, false, softmax},
                               {65536, 8, 8, true, false, softmax},  {65536, 64, 1, true, false, softmax},
                               {65536, 64, 2, true, false, softmax}, {65536, 64, 8, true, false, softmax},
                               {65536, 64, 6, true, false, sigmoid}};
    // N = 999, E = 5: 125 blocks of 8 warps, the last with 7, and an odd E (too many logits for finite differences).
    // Sigmoid scores at 1, 2 and 8 logits per lane (top-1: its gate is the constant rsf, so only the losses reach
    // the logits), and the routed scale on softmax gates.
    const Case small_cases[] = {{69, 4, 1, true, true, softmax},    {69, 4, 2, true, true, softmax},
                                {69, 40, 2, true, true, softmax},   {69, 4, 2, false, true, softmax},
                                {999, 5, 2, true, false, softmax},  {69, 4, 1, true, true, sigmoid},
                                {69, 40, 2, true, true, sigmoid},   {69, 200, 3, true, false, sigmoid},
                                {69, 4, 2, true, true, {MOE_SCORE_SOFTMAX, 2.5f}}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? (int)(sizeof(small_cases) / sizeof(small_cases[0]))
                                     : (int)(sizeof(full_cases) / sizeof(full_cases[0]));
    // coefficients far above the trainer's defaults (0.01, 0.001, 1) so that the loss terms are not lost in the
    // gate term's tolerance, and loss_scale != 1 so that a missing factor shows
    const LossCoefficients q = {0.5f, 0.05f, 1.5f};
    const int block_sizes[] = {64, 128, 256, 512, 1024};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_router_backward (%s build; the router is fp32)\n", PRECISION_NAME);
    for (int c = 0; c < num_cases; c++) {
        const int N = cases[c].N, E = cases[c].E, k = cases[c].k;
        const Scoring sc = cases[c].sc;
        const size_t n = (size_t)N * E, num_choices = (size_t)N * k;
        // routing in double, then rounded to the fp32 values the forward kernel would hand over
        std::vector<float> logits = moe_router_logits(N, E);
        std::vector<float> probs(n), gates(num_choices), logsumexp(N);
        std::vector<int> picks(num_choices);
        moe_router_reference(&probs, &picks, &gates, &logsumexp, logits, nullptr, N, E, k, sc.score, sc.rsf);
        // d_gates: random, 0 for the choices a capacity of CF 0.5 drops (what moe_combine_backward hands over)
        std::vector<float> d_gates = lab_random(num_choices);
        const MoeSlots slots = moe_slots_reference(picks, N, E, k, moe_capacity(N, E, k, 0.5), false);
        const std::vector<int>& expert_count = slots.expert_count;
        int dropped = 0;
        for (size_t choice = 0; choice < num_choices; choice++) {
            if (slots.choice_row[choice] < 0 || !cases[c].gate_gradient) {
                d_gates[choice] = 0.0f;
                dropped++;
            }
        }

        std::vector<double> d_logits_double(n);
        router_backward_reference(&d_logits_double, logits, picks, d_gates, expert_count, N, E, k, q, sc);
        std::vector<float> d_logits_ref(d_logits_double.begin(), d_logits_double.end());

        const char* score_name = sc.score == MOE_SCORE_SIGMOID ? "sigmoid" : "softmax";
        printf("N=%d E=%d k=%d %s rsf=%g, d_gates %s (%d of %zu zero)\n", N, E, k, score_name, sc.rsf,
               cases[c].gate_gradient ? "random, dropped at CF 0.5" : "all zero", dropped, num_choices);
        if (args.small && cases[c].finite_differences) {
            RouterLossPoint point = {&picks, &d_gates, &expert_count, N, E, k, q, sc};
            moe_check_finite_differences("reference vs finite diff", d_logits_double, logits, router_loss_at, &point,
                                         1e-7);
        }

        RouterBackwardBuffers d;
        d.logits = lab_to_device<float>(logits);
        d.probs = lab_to_device<float>(probs);
        d.expert_index = lab_ints_to_device(picks);
        d.gates = lab_to_device<float>(gates);
        d.d_gates = lab_to_device<float>(d_gates);
        d.logsumexp = lab_to_device<float>(logsumexp);
        d.expert_count = lab_ints_to_device(expert_count);
        d.d_logits = lab_poisoned<float>(n);

        // The kernels start from fp32 probs, gates and lse (each within 2^-24 relative of the double values) and
        // work in fp32: d_logits = p*(dP - sum p dP) + z, with |dP| <= |d_gate|/S + aux <= E (S >= 1/E), so
        // errors are a few ulp of E*p: atol 1e-6 * E, rtol 1e-5. With d_gates = 0, |dP| is the loss terms'
        // (~1e-2 here): atol 1e-8. Sigmoid: the affinities are recomputed in fp32 (exp's error, ~1e-6 relative
        // with __expf), the gate part is rsf times the softmax one's and a(1 - a) <= 1/4 only shrinks it:
        // atol 1e-6 * E * rsf.
        const float d_logits_atol = cases[c].gate_gradient ? 1e-6f * E * sc.rsf : 1e-8f;
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            cudaCheck(cudaMemset(d.d_logits, 0xff, n * sizeof(float)));
            run_variant(variant, &d, N, E, k, q, sc, MOE_WARP_KERNEL_BLOCK_SIZE);  // the trainer's block size
            cudaCheck(cudaDeviceSynchronize());
            printf("variant %d\n", variant);
            lab_validate("d_logits", d.d_logits, d_logits_ref.data(), n, d_logits_atol, 1e-5f);
        }

        char sizes[64];
        snprintf(sizes, sizeof(sizes), "N=%d E=%d k=%d %s", N, E, k, score_name);
        lab_print_header("moe_router_backward", sizes);
        const double score_bytes = (sc.score == MOE_SCORE_SIGMOID ? 12.0 : 8.0) * n;  // sigmoid reads the logits
        const double backward_bytes = score_bytes + 12.0 * num_choices + 4.0 * N + 4.0 * E;
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            for (int block_size : block_sizes) {
                float ms = lab_time_ms(repeats, [&]() { run_variant(variant, &d, N, E, k, q, sc, block_size); });
                lab_print_row(variant, block_size, ms, backward_bytes, 0.0);
            }
        }
        cudaCheck(cudaFree(d.logits));
        cudaCheck(cudaFree(d.probs));
        cudaCheck(cudaFree(d.expert_index));
        cudaCheck(cudaFree(d.gates));
        cudaCheck(cudaFree(d.d_gates));
        cudaCheck(cudaFree(d.logsumexp));
        cudaCheck(cudaFree(d.expert_count));
        cudaCheck(cudaFree(d.d_logits));
    }
    return 0;
}
