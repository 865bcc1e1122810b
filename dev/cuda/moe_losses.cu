// dev/cuda/moe_losses.cu: kernel lab for the MoE router's losses (doc/moe.md, "Routing" and "Routing options" 3
// and 7): the load-balancing (Switch) loss aux = alpha*E*sum_e f_e P_e (f_e = expert_count[e] / (N*k), P_e = the
// mean prob) and the z-loss c_z*mean_t lse_t^2 (moe_router_losses); the sequence-wise balance loss
// seq = A*E*mean_s sum_e f[s, e] P[s, e] over the N / T sequences of T tokens, with each sequence's counts
// (moe_seq_losses), and its gradient added to d_logits through the softmax or the sigmoid (moe_seq_loss_backward).
// The gradients of aux and z are the router backward's (dev/cuda/moe_router_backward.cu). The references are plain
// double-precision loops over the definitions, from the fp32 probs and lse the router forward hands over; the
// sequence-wise loss's reference gradient is itself checked against central finite differences of the
// double-precision loss (picks and counts held fixed, as the definition does) at small sizes.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_losses_bf16   (build/lab/moe_losses_fp32: the fp32 build)
//   build/lab/moe_losses_bf16 -s          (the fp32 build is the same: the router is fp32)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_losses.cu -o moe_losses
//   ./moe_losses [variant] [-s]   (default: production sizes N = 65536 tokens in sequences of T = 1024 or 4096,
//                                  E = 8 and 64 with k = 2 softmax, E = 64 k = 6 and E = 256 k = 8 sigmoid;
//                                  -s: N = 69 in sequences of 23 (and one of 69) with E = 4, 40, 200 (1, 2 and 8
//                                  logits per lane), N = 100 with E = 100 (4 per lane), softmax and sigmoid;
//                                  N = 999, E = 5 (N*E not a multiple of 4, sequences of T*k = 666 > 256 choices);
//                                  N = 4104, E = 64 (at block 32 the partials' grid reaches its 512 blocks; validated,
//                                  not timed))
// Variants (each validates and times the three kernels):
//   1  router losses in one block (block_reduce; one SM streams N*E floats); the sequence-wise loss with one
//      thread per sequence (serial counts and sums, then one thread adds the sequences); its backward with one
//      thread per token (serial loops over the row)
//   2  llmc/moe_losses.cuh moe_router_losses (a grid of up to 512 blocks writes partial sums, one warp adds them in
//      block order), moe_seq_losses (one block per sequence, one warp adds the sequences), moe_seq_loss_backward
//      (one warp per token). The trainer's.
// Floors (see llmc/moe_losses.cuh): router losses N*E*4 + N*4 + E*4 bytes; sequence-wise loss N*k*4 + N*E*4 +
// S*E*4 + S*4 (S = N / T); its backward N*E*4 (sigmoid: N*E*4 more, the logits) + S*E*4 + N*E*8 (d_logits).
#include "common.h"
#include "../../llmc/moe_losses.cuh"
#include "moe_reference.h"

// The router losses in one block: a fixed thread layout and block_reduce, deterministic, but one SM's bandwidth.
__global__ void losses_one_block_kernel(float* aux_and_z, const float* probs, const float* logsumexp,
                                        const int* expert_count, int N, int E, int k, float aux_alpha, float z_coef) {
    float weighted = 0.0f;
    const size_t num_probs = (size_t)N * E;
    for (size_t i = threadIdx.x; i < num_probs; i += blockDim.x) weighted += (float)expert_count[i % E] * probs[i];
    float squares = 0.0f;
    for (int t = threadIdx.x; t < N; t += blockDim.x) squares += logsumexp[t] * logsumexp[t];
    weighted = block_reduce<warp_reduce_sum>(weighted, true);
    squares = block_reduce<warp_reduce_sum>(squares);
    if (threadIdx.x == 0) {
        aux_and_z[0] = aux_alpha * (float)E * (weighted / ((float)N * (float)k * (float)N));
        aux_and_z[1] = z_coef * squares / (float)N;
    }
}

// One thread per sequence s: its counts seq_count (E) straight in global memory, then its weighted probs, a token's
// E terms at a time (two levels of serial sums rather than one of T*E terms), to partials[s].
__global__ void seq_losses_thread_per_sequence_kernel(float* partials, int* seq_count, const float* probs,
                                                      const int* expert_index, int S, int T, int E, int k) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= S) return;
    int* count = seq_count + (size_t)s * E;
    for (int e = 0; e < E; e++) count[e] = 0;
    const int* picks = expert_index + (size_t)s * T * k;
    for (int i = 0; i < T * k; i++) count[picks[i]]++;
    float weighted = 0.0f;
    for (int t = 0; t < T; t++) {
        const float* row = probs + ((size_t)s * T + t) * E;
        float token = 0.0f;
        for (int e = 0; e < E; e++) token += (float)count[e] * row[e];
        weighted += token;
    }
    partials[s] = weighted;
}

// one thread
__global__ void seq_losses_serial_final_kernel(float* seq_loss, const float* partials, int S, int T, int E, int k,
                                               float alpha) {
    float weighted = 0.0f;
    for (int s = 0; s < S; s++) weighted += partials[s];
    seq_loss[0] = alpha * (float)E * (weighted / ((float)S * (float)T * (float)k * (float)T));
}

// One thread per token: g_e = loss_scale * A*E*c[s, e] / (S*T*k*T), then through the softmax or the sigmoid, added.
__global__ void seq_loss_backward_thread_per_token_kernel(float* d_logits, const float* probs, const float* logits,
                                                          const int* seq_count, int N, int T, int E, int k, int score,
                                                          float alpha, float loss_scale) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= N) return;
    const int S = N / T;
    const float per_count = loss_scale * alpha * (float)E / ((float)S * (float)T * (float)k * (float)T);
    const int* count = seq_count + (size_t)(token / T) * E;
    const float* p = probs + (size_t)token * E;
    const float* row = logits + (size_t)token * E;
    float* d = d_logits + (size_t)token * E;
    float dot = 0.0f, affinity_sum = 0.0f;
    for (int e = 0; e < E; e++) dot += p[e] * per_count * (float)count[e];
    if (score == MOE_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) affinity_sum += moe_sigmoid(row[e]);
        for (int e = 0; e < E; e++) {
            const float a = moe_sigmoid(row[e]);
            d[e] += (per_count * (float)count[e] - dot) / affinity_sum * a * (1.0f - a);
        }
        return;
    }
    for (int e = 0; e < E; e++) d[e] += p[e] * (per_count * (float)count[e] - dot);
}

struct LossBuffers {
    float* logits;         // (N, E)
    float* probs;          // (N, E) softmax probs, or the sigmoid affinities over their sum
    float* logsumexp;      // (N)
    int* expert_index;     // (N, k)
    int* expert_count;     // (E)
    float* aux_and_z;      // (2)
    float* partials;       // moe_router_losses_partials_size() floats
    float* seq_loss;       // (1)
    int* seq_count;        // (S, E) the forward's output
    float* seq_partials;   // (S)
    int* seq_count_input;  // (S, E) the reference's counts, the backward's input
    float* d_logits;       // (N, E)
};

struct Coefficients {
    float aux_alpha, z_coef, seq_alpha, loss_scale;
};

static void run_router_losses(int variant, const LossBuffers* d, int N, int E, int k, Coefficients q, int block_size) {
    if (variant == 1) {
        losses_one_block_kernel<<<1, block_size>>>(d->aux_and_z, d->probs, d->logsumexp, d->expert_count, N, E, k,
                                                   q.aux_alpha, q.z_coef);
        cudaCheck(cudaGetLastError());
    } else {
        moe_router_losses_launch(d->aux_and_z, d->partials, d->probs, d->logsumexp, d->expert_count, N, E, k,
                                 q.aux_alpha, q.z_coef, block_size, 0);
    }
}

// variant 2 has one block size, its header's (256)
static void run_seq_losses(int variant, const LossBuffers* d, int N, int T, int E, int k, Coefficients q,
                           int block_size) {
    const int S = N / T;
    if (variant == 1) {
        seq_losses_thread_per_sequence_kernel<<<CEIL_DIV(S, block_size), block_size>>>(
            d->seq_partials, d->seq_count, d->probs, d->expert_index, S, T, E, k);
        cudaCheck(cudaGetLastError());
        seq_losses_serial_final_kernel<<<1, 1>>>(d->seq_loss, d->seq_partials, S, T, E, k, q.seq_alpha);
        cudaCheck(cudaGetLastError());
    } else {
        moe_seq_losses(d->seq_loss, d->seq_count, d->seq_partials, d->probs, d->expert_index, N, T, E, k, q.seq_alpha,
                       0);
    }
}

// variant 2 has one block size, its header's (MOE_WARP_KERNEL_BLOCK_SIZE)
static void run_seq_backward(int variant, const LossBuffers* d, int N, int T, int E, int k, int score, Coefficients q,
                             int block_size) {
    if (variant == 1) {
        seq_loss_backward_thread_per_token_kernel<<<CEIL_DIV(N, block_size), block_size>>>(
            d->d_logits, d->probs, d->logits, d->seq_count_input, N, T, E, k, score, q.seq_alpha, q.loss_scale);
        cudaCheck(cudaGetLastError());
    } else {
        moe_seq_loss_backward(d->d_logits, d->probs, d->logits, d->seq_count_input, N, T, E, k, score, q.seq_alpha,
                              q.loss_scale, 0);
    }
}

// ----------------------------------------------------------------------------------------------------
// double-precision definitions

// each sequence's choices per expert before dropping: count (S, E) from expert_index (N, k), S = N / T
static std::vector<int> seq_counts_reference(const std::vector<int>& picks, int N, int T, int E, int k) {
    std::vector<int> count((size_t)(N / T) * E, 0);
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k; j++) count[(size_t)(t / T) * E + picks[(size_t)t * k + j]]++;
    return count;
}

// loss_scale times the sequence-wise loss of doc/moe.md, "Routing options" 7, as a function of the logits with the
// counts fixed: per sequence A*E*sum_e f[s, e] P[s, e], f = count / (T*k), P = the mean over its T tokens of the
// normalised score (softmax probs, or the affinities over their sum), then the mean over the sequences
static double seq_loss_of_logits(const std::vector<double>& logits, const std::vector<int>& count, int N, int T, int E,
                                 int k, int score, double alpha, double loss_scale) {
    const int S = N / T;
    std::vector<double> p(E), mean_prob(E);
    double loss = 0.0;
    for (int s = 0; s < S; s++) {
        for (int e = 0; e < E; e++) mean_prob[e] = 0.0;
        for (int t = s * T; t < (s + 1) * T; t++) {
            const double* row = logits.data() + (size_t)t * E;
            double lse, sum = 0.0;
            if (score == MOE_SCORE_SIGMOID) moe_affinity_row(p.data(), row, E);
            else moe_route_row(p.data(), &lse, (int*)nullptr, row, E, k);
            for (int e = 0; e < E; e++) sum += p[e];
            for (int e = 0; e < E; e++) mean_prob[e] += p[e] / sum / T;
        }
        double sequence = 0.0;
        for (int e = 0; e < E; e++) sequence += (double)count[(size_t)s * E + e] / ((double)T * k) * mean_prob[e];
        loss += alpha * E * sequence / S;
    }
    return loss_scale * loss;
}

// its gradient by the logits: d/d probs[t, e] = loss_scale * A*E*count[s(t), e] / (S*T*k*T), then through
// the softmax (p_e (g_e - p.g)) or through q = a / A and the sigmoid ((g_e - q.g) / A * a_e (1 - a_e))
static void seq_backward_reference(std::vector<double>* d_logits, const std::vector<float>& logits,
                                   const std::vector<int>& count, int N, int T, int E, int k, int score, double alpha,
                                   double loss_scale) {
    const int S = N / T;
    std::vector<double> p(E), g(E);
    for (int t = 0; t < N; t++) {
        const float* row = logits.data() + (size_t)t * E;
        double lse, sum = 0.0, dot = 0.0;
        if (score == MOE_SCORE_SIGMOID) moe_affinity_row(p.data(), row, E);
        else moe_route_row(p.data(), &lse, (int*)nullptr, row, E, k);
        for (int e = 0; e < E; e++) sum += p[e];
        const int* c = count.data() + (size_t)(t / T) * E;
        for (int e = 0; e < E; e++) g[e] = loss_scale * alpha * E * c[e] / ((double)S * T * k * T);
        for (int e = 0; e < E; e++) dot += p[e] / sum * g[e];
        for (int e = 0; e < E; e++) {
            double* out = d_logits->data() + (size_t)t * E + e;
            if (score == MOE_SCORE_SIGMOID) *out = (g[e] - dot) / sum * p[e] * (1.0 - p[e]);
            else *out = p[e] * (g[e] - dot);
        }
    }
}

// seq_loss_of_logits at the case's counts, for moe_check_finite_differences
typedef struct {
    const std::vector<int>* count;
    int N, T, E, k, score;
    double alpha, loss_scale;
} SeqLossPoint;
static double seq_loss_at(const std::vector<double>& x, const void* context) {
    const SeqLossPoint* p = (const SeqLossPoint*)context;
    return seq_loss_of_logits(x, *p->count, p->N, p->T, p->E, p->k, p->score, p->alpha, p->loss_scale);
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    struct Case { int N, T, E, k, score; bool finite_differences; };
    const int SOFTMAX = MOE_SCORE_SOFTMAX, SIGMOID = MOE_SCORE_SIGMOID;
    const Case full_cases[] = {{65536, 1024, 8, 2, SOFTMAX, false},  {65536, 1024, 64, 2, SOFTMAX, false},
                               {65536, 4096, 64, 6, SIGMOID, false}, {65536, 4096, 256, 8, SIGMOID, false}};
    // N = 69 = 3*23: the warp kernel's last block partly empty; E = 4, 40, 100, 200: 1, 2, 4 and 8 logits per lane,
    // lanes owning fewer experts than others; one sequence of 69 (S = 1); sigmoid with k = 1. N = 999, E = 5:
    // N*E = 4995 probabilities, not a multiple of the 4-float vectors, rows that straddle vectors, several blocks of
    // partials, and sequences of 333 tokens whose 666 choices the 256 threads of a block take in turns. N = 4104,
    // E = 64: at block 32 the partials' grid is capped at MOE_LOSSES_MAX_BLOCKS and its threads stride twice.
    const Case small_cases[] = {{69, 23, 4, 1, SOFTMAX, true},    {69, 69, 40, 2, SOFTMAX, true},
                                {999, 333, 5, 2, SOFTMAX, false}, {69, 23, 4, 1, SIGMOID, true},
                                {69, 23, 40, 2, SIGMOID, true},   {100, 25, 100, 4, SOFTMAX, false},
                                {69, 23, 200, 3, SIGMOID, false}, {4104, 513, 64, 6, SIGMOID, false}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? (int)(sizeof(small_cases) / sizeof(small_cases[0]))
                                     : (int)(sizeof(full_cases) / sizeof(full_cases[0]));
    // coefficients far above the trainer's defaults (0.01, 0.001, 0.0001, 1), so that a wrong factor cannot hide in
    // a tolerance, and loss_scale != 1 so that a missing one shows
    const Coefficients q = {0.5f, 0.05f, 0.3f, 1.5f};
    const int block_sizes[] = {64, 128, 256, 512, 1024};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_losses (%s build; the router is fp32)\n", PRECISION_NAME);
    for (int c = 0; c < num_cases; c++) {
        const int N = cases[c].N, T = cases[c].T, E = cases[c].E, k = cases[c].k, score = cases[c].score;
        const int S = N / T;
        const size_t n = (size_t)N * E;
        // the router forward in double, rounded to the fp32 values its kernel hands over
        std::vector<float> logits = moe_router_logits(N, E);
        std::vector<float> probs(n), gates((size_t)N * k), logsumexp(N);
        std::vector<int> picks((size_t)N * k);
        moe_router_reference(&probs, &picks, &gates, &logsumexp, logits, nullptr, N, E, k, score, 1.0f);
        std::vector<int> expert_count(E, 0);
        for (int choice : picks) expert_count[choice]++;

        // aux = alpha*E*sum_e f_e P_e, z = c_z * mean lse^2, from the fp32 probs and lse the kernels read
        std::vector<double> mean_prob(E, 0.0);
        double z_sum = 0.0;
        for (int t = 0; t < N; t++) {
            for (int e = 0; e < E; e++) mean_prob[e] += (double)probs[(size_t)t * E + e] / N;
            z_sum += (double)logsumexp[t] * logsumexp[t];
        }
        double aux = 0.0;
        for (int e = 0; e < E; e++) aux += (double)expert_count[e] / ((double)N * k) * mean_prob[e];
        const float losses_ref[2] = {(float)(q.aux_alpha * E * aux), (float)(q.z_coef * z_sum / N)};

        // the sequence-wise loss by its definition from the same fp32 probs, its counts, and its gradient added to
        // random d_logits of the gradient's own scale (the other terms' gradient, which the kernels add to)
        const std::vector<int> seq_count = seq_counts_reference(picks, N, T, E, k);
        std::vector<double> seq_mean_prob(E);
        double seq = 0.0;
        for (int s = 0; s < S; s++) {
            for (int e = 0; e < E; e++) seq_mean_prob[e] = 0.0;
            for (int t = s * T; t < (s + 1) * T; t++)
                for (int e = 0; e < E; e++) seq_mean_prob[e] += (double)probs[(size_t)t * E + e] / T;
            double sequence = 0.0;
            for (int e = 0; e < E; e++)
                sequence += (double)seq_count[(size_t)s * E + e] / ((double)T * k) * seq_mean_prob[e];
            seq += q.seq_alpha * E * sequence / S;
        }
        const float seq_ref = (float)seq;
        std::vector<double> d_seq(n);
        seq_backward_reference(&d_seq, logits, seq_count, N, T, E, k, score, q.seq_alpha, q.loss_scale);
        double d_scale = 0.0;
        for (double v : d_seq) d_scale = fmax(d_scale, fabs(v));
        const std::vector<float> d_logits_in = lab_random(n, -(float)d_scale, (float)d_scale);
        std::vector<float> d_logits_ref(n);
        for (size_t i = 0; i < n; i++) d_logits_ref[i] = (float)(d_logits_in[i] + d_seq[i]);

        const char* score_name = score == SIGMOID ? "sigmoid" : "softmax";
        printf("N=%d T=%d (S=%d) E=%d k=%d %s: aux %.6g, z %.6g, seq %.6g, seq gradient up to %.3g\n", N, T, S, E, k,
               score_name, losses_ref[0], losses_ref[1], seq_ref, d_scale);
        if (args.small && cases[c].finite_differences) {
            SeqLossPoint point = {&seq_count, N, T, E, k, score, q.seq_alpha, q.loss_scale};
            moe_check_finite_differences("seq reference vs finite diff", d_seq, logits, seq_loss_at, &point, 1e-9);
        }

        LossBuffers d;
        d.logits = lab_to_device<float>(logits);
        d.probs = lab_to_device<float>(probs);
        d.logsumexp = lab_to_device<float>(logsumexp);
        d.expert_index = lab_ints_to_device(picks);
        d.expert_count = lab_ints_to_device(expert_count);
        d.aux_and_z = lab_poisoned<float>(2);
        d.seq_loss = lab_poisoned<float>(1);
        d.seq_count = lab_poisoned<int>((size_t)S * E);
        d.seq_count_input = lab_ints_to_device(seq_count);
        d.d_logits = lab_poisoned<float>(n);

        // Tolerances. The losses: fp32 sums of N*E (aux, seq) or N (z) positive terms from exact fp32 inputs; each
        // thread's serial part adds rounding errors of random sign (~2^-24 * sqrt(terms) relative), and the
        // threads' independent errors shrink further in their sum: rtol 1e-5 holds at a million terms a thread.
        // The counts are ints: exact. The seq gradient: fp32 products and a sum of E terms each at most the
        // largest g (d_scale), sigmoid's affinities recomputed in fp32 (~1e-6 relative with __expf), added to
        // d_logits of the same scale (one rounding, 2^-24 of it): atol 1e-5 * d_scale, rtol 1e-5.
        const float d_logits_atol = 1e-5f * (float)d_scale;
        const std::vector<float> seq_count_floats = lab_as_floats(seq_count);
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            // 256: the trainer's (MOE_LOSSES_BLOCK_SIZE); 32: the most blocks of partials
            const int validation_block_sizes[] = {256, 32};
            for (int block_size : validation_block_sizes) {
                if (variant == 1 && block_size != validation_block_sizes[0]) continue;
                cudaCheck(cudaMemset(d.aux_and_z, 0xff, 2 * sizeof(float)));
                // fresh scratch, never written: a checked build reports any read of it before the kernels write it
                cudaCheck(cudaMalloc(&d.partials, moe_router_losses_partials_size() * sizeof(float)));
                run_router_losses(variant, &d, N, E, k, q, block_size);
                cudaCheck(cudaDeviceSynchronize());
                cudaCheck(cudaFree(d.partials));
                printf("variant %d, router losses, block %d\n", variant, block_size);
                lab_validate("aux_and_z", d.aux_and_z, losses_ref, 2, 0.0f, 1e-5f);
            }
            cudaCheck(cudaMemset(d.seq_loss, 0xff, sizeof(float)));
            cudaCheck(cudaMemset(d.seq_count, 0xff, (size_t)S * E * sizeof(int)));
            cudaCheck(cudaMalloc(&d.seq_partials, (size_t)S * sizeof(float)));
            run_seq_losses(variant, &d, N, T, E, k, q, 256);
            cudaCheck(cudaDeviceSynchronize());
            cudaCheck(cudaFree(d.seq_partials));
            printf("variant %d, sequence-wise loss\n", variant);
            lab_validate("seq_loss", d.seq_loss, &seq_ref, 1, 0.0f, 1e-5f);
            lab_validate("seq_count", d.seq_count, seq_count_floats.data(), (size_t)S * E, 0.0f, 0.0f);
            cudaCheck(cudaMemcpy(d.d_logits, d_logits_in.data(), n * sizeof(float), cudaMemcpyHostToDevice));
            run_seq_backward(variant, &d, N, T, E, k, score, q, MOE_WARP_KERNEL_BLOCK_SIZE);
            cudaCheck(cudaDeviceSynchronize());
            lab_validate("d_logits (+= seq gradient)", d.d_logits, d_logits_ref.data(), n, d_logits_atol, 1e-5f);
        }

        // the capped grid's case (N*E > 2^18) is validated, not timed, at -s: its timing rows would take most of
        // the run on the CPU backend, and its checked build's
        const bool timed = !args.small || n <= ((size_t)1 << 18);
        char sizes[64];
        snprintf(sizes, sizeof(sizes), "N=%d T=%d E=%d k=%d %s", N, T, E, k, score_name);
        cudaCheck(cudaMalloc(&d.partials, moe_router_losses_partials_size() * sizeof(float)));
        cudaCheck(cudaMalloc(&d.seq_partials, (size_t)S * sizeof(float)));
        const double bytes[3] = {4.0 * n + 4.0 * N + 4.0 * E, 4.0 * N * k + 4.0 * n + 4.0 * S * E + 4.0 * S,
                                 (score == SIGMOID ? 16.0 : 12.0) * n + 4.0 * S * E};
        const char* names[3] = {"moe_router_losses", "moe_seq_losses", "moe_seq_loss_backward"};
        for (int kernel = 0; kernel < 3 && timed; kernel++) {
            lab_print_header(names[kernel], sizes);
            for (int variant = 1; variant <= 2; variant++) {
                if (args.variant != 0 && args.variant != variant) continue;
                for (int block_size : block_sizes) {
                    if (kernel > 0 && variant == 2 && block_size != 256) continue;  // their header's block size
                    // the backward adds in place: repeated calls keep growing d_logits, which only the timing sees
                    float ms = lab_time_ms(repeats, [&]() {
                        if (kernel == 0) run_router_losses(variant, &d, N, E, k, q, block_size);
                        else if (kernel == 1) run_seq_losses(variant, &d, N, T, E, k, q, block_size);
                        else run_seq_backward(variant, &d, N, T, E, k, score, q, block_size);
                    });
                    lab_print_row(variant, block_size, ms, bytes[kernel], 0.0);
                }
            }
        }
        cudaCheck(cudaFree(d.logits));
        cudaCheck(cudaFree(d.probs));
        cudaCheck(cudaFree(d.logsumexp));
        cudaCheck(cudaFree(d.expert_index));
        cudaCheck(cudaFree(d.expert_count));
        cudaCheck(cudaFree(d.aux_and_z));
        cudaCheck(cudaFree(d.partials));
        cudaCheck(cudaFree(d.seq_loss));
        cudaCheck(cudaFree(d.seq_count));
        cudaCheck(cudaFree(d.seq_partials));
        cudaCheck(cudaFree(d.seq_count_input));
        cudaCheck(cudaFree(d.d_logits));
    }
    return 0;
}
