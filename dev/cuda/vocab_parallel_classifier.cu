// dev/cuda/vocab_parallel_classifier.cu: kernel lab for the vocabulary-parallel classifier (tensor parallelism over N
// processes, each holding Vs = Vp / N columns of the logits): per row, the slice's statistics, an all-reduce (max),
// their rescale to the row max, an all-reduce (sum), then the loss on every process and, in place, its slice of the
// gradient dloss * (softmax - onehot(target)), zero in the padding columns. The lab simulates the N processes on one:
// it runs the kernels on each slice and combines the slices' statistics on the host as the all-reduces would.
// Build and run on the CPU backend (small sizes):
//   make build/lab/vocab_parallel_classifier_bf16   (build/lab/vocab_parallel_classifier_fp32: the fp32 build)
//   build/lab/vocab_parallel_classifier_bf16 -s
// On a GPU (one line):
//   nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/vocab_parallel_classifier.cu
//       -o vocab_parallel_classifier
//   ./vocab_parallel_classifier [variant] [-s]   (GPT-2 124M sizes by default: B=8, T=1024, V=50257, Vp=50304,
//                                                 N=2 and 4)
// Variant:
//   1  llmc/fused_classifier.cuh vocab_parallel_classifier_stats, _rescale and _finish: one block per row, 16-byte
//      loads, online maximum and sum in the stats kernel. The tensor-parallel trainer's.
// Validated against a double-precision loop over the whole row and against fused_classifier (the whole-row kernel)
// on the same logits; small sizes cover a slice whose last vector straddles V, slices without any real column, N = 1.
// Floor (see llmc/fused_classifier.cuh), per process, R = B*T rows of Vs columns: stats R*Vs*sizeof(floatX) + 20*R
// bytes, rescale 16*R, finish 2*R*Vs*sizeof(floatX) + 20*R.
#include "common.h"
#include "../../llmc/fused_classifier.cuh"

struct Case {
    int V, Vp, N;
    bool timed;
};

// The logits of one (V, Vp) and their references, shared by the cases that split them differently
struct Problem {
    int rows, V, Vp;
    float dloss;
    std::vector<float> logits;  // (rows, Vp) as floatX holds them; NaN in the padding columns
    std::vector<int> targets;   // (rows)
    std::vector<float> losses, dlogits;              // (rows), (rows, Vp): double-precision references
    std::vector<float> fused_losses, fused_dlogits;  // fused_classifier on the same logits
    std::vector<double> row_max;                     // (rows), over the real columns
};

template <class T>
static std::vector<float> to_host(const T* device, size_t n) {
    std::vector<T> got(n);
    cudaCheck(cudaMemcpy(got.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
    return std::vector<float>(got.begin(), got.end());
}

// lab_validate on host values: an exact match also passes, so that -inf (the max of a slice without a real column)
// validates against -inf
static void validate_host(const char* name, const std::vector<float>& got, const std::vector<float>& want, float atol,
                          float rtol) {
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < want.size(); i++) {
        if (got[i] == want[i]) continue;
        const float err = fabsf(got[i] - want[i]);
        if (!(err <= atol + rtol * fabsf(want[i]))) {
            if (bad < 5) printf("  %s[%zu]: got %.8g, want %.8g\n", name, i, got[i], want[i]);
            bad++;
        }
        if (err > worst) worst = err;
    }
    if (bad) {
        printf("FAIL %s: %zu of %zu elements outside atol %.2g rtol %.2g\n", name, bad, want.size(), atol, rtol);
        exit(EXIT_FAILURE);
    }
    printf("  %-44s ok (max abs err %.3g over %zu elements)\n", name, worst, want.size());
}

static void make_problem(Problem* p, int rows, int V, int Vp) {
    p->rows = rows;
    p->V = V;
    p->Vp = Vp;
    p->dloss = 1.0f / rows;  // the mean over the batch, as the trainer uses it
    const size_t n = (size_t)rows * Vp;
    // a trained-looking spread, and on every 5th row one logit far above the rest, so that the slices' maxima differ
    // and the rescale matters (exp(own max - row max) down to ~e^-16); row 1's is its target (a loss near 0)
    p->logits = lab_random(n, -4.0f, 4.0f);
    p->targets = lab_random_ints(rows, V);
    p->targets[0] = 0;
    p->targets[rows - 1] = V - 1;  // the first and the last real column
    p->targets[2] = V - 1 < Vp / 4 ? V - 1 : Vp / 4;  // the first column of the second slice at N = 4
    p->targets[3] = V - 1 < Vp / 2 - 1 ? V - 1 : Vp / 2 - 1;  // the last column of the first slice at N = 2
    for (int row = 1; row < rows; row += 5) {
        const int column = row == 1 ? p->targets[row] : lab_random_ints(1, V)[0];
        p->logits[(size_t)row * Vp + column] = lab_rand_uniform(10.0f, 12.0f);
    }
    for (int row = 4; row < rows - 1; row += 7) p->targets[row] = -1;  // masked targets (a loss mask): loss, gradient 0
    p->logits = lab_rounded(p->logits);
    for (int row = 0; row < rows; row++)
        for (int v = V; v < Vp; v++) p->logits[(size_t)row * Vp + v] = NAN;  // no result may pick them up

    p->losses.resize(rows);
    p->dlogits.resize(n);
    p->row_max.resize(rows);
    for (int row = 0; row < rows; row++) {
        const float* x = p->logits.data() + (size_t)row * Vp;
        double m = -INFINITY, sum = 0.0;
        for (int v = 0; v < V; v++) m = x[v] > m ? x[v] : m;
        for (int v = 0; v < V; v++) sum += exp((double)x[v] - m);
        p->row_max[row] = m;
        const int target = p->targets[row];
        p->losses[row] = target < 0 ? 0.0f : (float)(m + log(sum) - x[target]);
        for (int v = 0; v < Vp; v++) {
            const double g = v < V && target >= 0
                                 ? p->dloss * (exp((double)x[v] - m) / sum - (v == target ? 1.0 : 0.0)) : 0.0;
            p->dlogits[(size_t)row * Vp + v] = (float)g;
        }
    }

    // the whole-row kernel on the same logits
    floatX* d_logits = lab_to_device<floatX>(p->logits);
    float* d_losses = lab_poisoned<float>(rows);
    int* d_targets = lab_ints_to_device(p->targets);
    fused_classifier(d_logits, d_losses, p->dloss, d_targets, 1, rows, V, Vp, true, 0);
    cudaCheck(cudaDeviceSynchronize());
    p->fused_losses = to_host(d_losses, rows);
    p->fused_dlogits = to_host(d_logits, n);
    cudaCheck(cudaFree(d_logits));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_targets));
}

// each slice's statistics in double precision, as the stats kernel leaves them: (4, rows) per slice
static std::vector<float> slice_stats_reference(const Problem* p, int Vs, int v0) {
    const int rows = p->rows;
    std::vector<float> want(4 * (size_t)rows);
    for (int row = 0; row < rows; row++) {
        const float* x = p->logits.data() + (size_t)row * p->Vp;
        double m = -INFINITY, sum = 0.0;
        for (int v = v0; v < v0 + Vs && v < p->V; v++) m = x[v] > m ? x[v] : m;
        for (int v = v0; v < v0 + Vs && v < p->V; v++) sum += exp((double)x[v] - m);
        const int target = p->targets[row];
        want[row] = (float)m;
        want[rows + row] = (float)m;
        want[2 * rows + row] = (float)sum;
        want[3 * rows + row] = target >= v0 && target < v0 + Vs ? x[target] : 0.0f;
    }
    return want;
}

// The N processes of one case: each one's slice of the logits (rows, Vs), stats (4, rows) and losses (rows)
struct Slices {
    int N, Vs;
    std::vector<std::vector<floatX>> logits;
    std::vector<floatX*> d_logits;
    std::vector<float*> d_stats, d_losses;
    std::vector<std::vector<float>> stats_reference;  // per slice, (4, rows): slice_stats_reference
};

static void make_slices(Slices* s, const Problem* p, int N) {
    s->N = N;
    s->Vs = p->Vp / N;
    s->logits.assign(N, std::vector<floatX>((size_t)p->rows * s->Vs));
    s->d_logits.resize(N);
    s->d_stats.resize(N);
    s->d_losses.resize(N);
    for (int r = 0; r < N; r++) {
        for (int row = 0; row < p->rows; row++)
            for (int j = 0; j < s->Vs; j++)
                s->logits[r][(size_t)row * s->Vs + j] = (floatX)p->logits[(size_t)row * p->Vp + r * s->Vs + j];
        cudaCheck(cudaMalloc(&s->d_logits[r], s->logits[r].size() * sizeof(floatX)));
        s->d_stats[r] = lab_poisoned<float>(4 * (size_t)p->rows);
        s->d_losses[r] = lab_poisoned<float>(p->rows);
        s->stats_reference.push_back(slice_stats_reference(p, s->Vs, r * s->Vs));
    }
}

static void free_slices(Slices* s) {
    for (int r = 0; r < s->N; r++) {
        cudaCheck(cudaFree(s->d_logits[r]));
        cudaCheck(cudaFree(s->d_stats[r]));
        cudaCheck(cudaFree(s->d_losses[r]));
    }
}

// The tolerances. The slices' maxima and target logits are exact: each is one of the floatX values the reference
// sees, with no arithmetic. A slice's sum of Vs exponentials in fp32 (per-thread chains, then a tree) is within ~1e-6
// relative of the double sum, and __expf's fast-math error (2 + 1.16 |x| ulp on a GPU, |x| up to ~20 here) adds at
// most ~3e-6: rtol 1e-5, for the rescaled sums too (one more __expf). Losses (~5, fp32 in both precisions): rtol and
// atol 1e-5, as in the fused_classifier lab. dlogits: exp(x - max) / sum in fp32, ~5e-6 relative: fp32 rtol 1e-5;
// bf16 rounds the stored gradient once (<= 2^-8 relative): rtol 5e-3; the atol, a millionth of dloss, only covers the
// target column where softmax - 1 can cancel; fp16 stores gradients below 6e-5 as subnormals 2^-24 apart. Against
// fused_classifier's results, each within those bounds of the reference: losses the same; dlogits twice the fp32 rtol,
// and in bf16 one rounding step apart (two roundings of fp32 values ~1e-5 apart can land on neighbouring values, at
// most 2^-7 relative): rtol 8e-3.
static const float SUM_RTOL = 1e-5f;
static const float LOSS_TOL = 1e-5f;
static const float DLOGITS_RTOL = PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 5e-3f;
static const float FUSED_DLOGITS_RTOL = PRECISION_MODE == PRECISION_FP32 ? 2e-5f : 8e-3f;
static float dlogits_atol(float dloss) { return PRECISION_MODE == PRECISION_FP16 ? 5.9604645e-8f : 1e-6f * dloss; }

static const int LLMC_BLOCK_SIZE = 0;  // run the llmc functions themselves, which pick their block sizes

// The three kernels on every slice, with the host standing in for the all-reduces; with validate, each slice's stats
// are checked after the stats kernel and after the rescale.
static void run_classifier(const Problem* p, Slices* s, bool write_dlogits, int block_size, bool validate,
                           const int* d_targets) {
    const int rows = p->rows, N = s->N, Vs = s->Vs;
    for (int r = 0; r < N; r++) {
        cudaCheck(cudaMemcpy(s->d_logits[r], s->logits[r].data(), s->logits[r].size() * sizeof(floatX),
                             cudaMemcpyHostToDevice));
        cudaCheck(cudaMemset(s->d_stats[r], 0xff, 4 * (size_t)rows * sizeof(float)));
        cudaCheck(cudaMemset(s->d_losses[r], 0xff, rows * sizeof(float)));
        if (block_size == LLMC_BLOCK_SIZE)
            vocab_parallel_classifier_stats(s->d_stats[r], s->d_logits[r], d_targets, rows, Vs, r * Vs, p->V, 0);
        else
            vocab_parallel_classifier_stats_launch(s->d_stats[r], s->d_logits[r], d_targets, rows, Vs, r * Vs, p->V,
                                                   block_size, 0);
    }
    cudaCheck(cudaDeviceSynchronize());
    std::vector<std::vector<float>> stats(N);
    // every slice's, one after the other: the maxima (twice) and target logits, exact; the sums
    std::vector<float> got_exact, want_exact, got_sums, want_sums;
    for (int r = 0; r < N; r++) {
        stats[r] = to_host(s->d_stats[r], 4 * (size_t)rows);
        if (!validate) continue;
        const std::vector<float>& want = s->stats_reference[r];
        for (int i = 0; i < 4 * rows; i++) {
            const bool sum = i >= 2 * rows && i < 3 * rows;
            (sum ? got_sums : got_exact).push_back(stats[r][i]);
            (sum ? want_sums : want_exact).push_back(want[i]);
        }
    }
    if (validate) {
        validate_host("slice maxima and target logits", got_exact, want_exact, 0.0f, 0.0f);
        validate_host("slice sums", got_sums, want_sums, 0.0f, SUM_RTOL);
    }

    // ncclMax over stats[0, rows)
    std::vector<float> row_max(rows, -INFINITY);
    for (int r = 0; r < N; r++)
        for (int row = 0; row < rows; row++) row_max[row] = fmaxf(row_max[row], stats[r][row]);
    for (int r = 0; r < N; r++) {
        cudaCheck(cudaMemcpy(s->d_stats[r], row_max.data(), rows * sizeof(float), cudaMemcpyHostToDevice));
        vocab_parallel_classifier_rescale(s->d_stats[r], rows, 0);
    }
    cudaCheck(cudaDeviceSynchronize());
    got_sums.clear();
    want_sums.clear();
    for (int r = 0; r < N; r++) {
        stats[r] = to_host(s->d_stats[r], 4 * (size_t)rows);
        if (!validate) continue;
        const std::vector<float>& own = s->stats_reference[r];
        for (int row = 0; row < rows; row++) {
            got_sums.push_back(stats[r][2 * rows + row]);
            const double sum = own[2 * rows + row];  // 0 for a slice without a real column, whose max is -inf
            want_sums.push_back(sum > 0.0 ? (float)(sum * exp((double)own[rows + row] - p->row_max[row])) : 0.0f);
        }
    }
    if (validate) validate_host("rescaled sums", got_sums, want_sums, 0.0f, SUM_RTOL);

    // ncclSum over stats[2 rows, 4 rows), in rank order
    std::vector<float> sums(2 * (size_t)rows, 0.0f);
    for (int r = 0; r < N; r++)
        for (int i = 0; i < 2 * rows; i++) sums[i] += stats[r][2 * rows + i];
    for (int r = 0; r < N; r++) {
        cudaCheck(cudaMemcpy(s->d_stats[r] + 2 * rows, sums.data(), sums.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
        if (block_size == LLMC_BLOCK_SIZE)
            vocab_parallel_classifier_finish(s->d_logits[r], s->d_losses[r], s->d_stats[r], p->dloss, d_targets, rows,
                                             Vs, r * Vs, p->V, write_dlogits, 0);
        else
            vocab_parallel_classifier_finish_launch(s->d_logits[r], s->d_losses[r], s->d_stats[r], p->dloss,
                                                    d_targets, rows, Vs, r * Vs, p->V, write_dlogits, block_size, 0);
    }
    cudaCheck(cudaDeviceSynchronize());
}

// the results of every slice against the references and fused_classifier's
static void validate_results(const Problem* p, const Slices* s, bool write_dlogits) {
    const int rows = p->rows, Vs = s->Vs;
    const std::vector<float> losses = to_host(s->d_losses[0], rows);
    for (int r = 1; r < s->N; r++) {
        if (to_host(s->d_losses[r], rows) != losses) {
            printf("FAIL: the losses of process %d differ from process 0's\n", r);
            exit(EXIT_FAILURE);
        }
    }
    validate_host(write_dlogits ? "losses" : "losses (no dlogits)", losses, p->losses, LOSS_TOL, LOSS_TOL);
    validate_host("losses against fused_classifier", losses, p->fused_losses, LOSS_TOL, LOSS_TOL);
    // the slices side by side, (rows, Vp), as the whole-row kernel lays them out
    std::vector<float> whole((size_t)rows * p->Vp);
    for (int r = 0; r < s->N; r++) {
        const std::vector<float> slice = to_host(s->d_logits[r], (size_t)rows * Vs);
        for (int row = 0; row < rows; row++)
            for (int j = 0; j < Vs; j++) whole[(size_t)row * p->Vp + r * Vs + j] = slice[(size_t)row * Vs + j];
    }
    if (write_dlogits) {
        validate_host("dlogits of every slice", whole, p->dlogits, dlogits_atol(p->dloss), DLOGITS_RTOL);
        validate_host("dlogits against fused_classifier", whole, p->fused_dlogits, dlogits_atol(p->dloss),
                      FUSED_DLOGITS_RTOL);
    } else {
        // untouched: the floatX logits, NaN padding included, bit for bit
        for (int r = 0; r < s->N; r++) {
            std::vector<floatX> after(s->logits[r].size());
            cudaCheck(cudaMemcpy(after.data(), s->d_logits[r], after.size() * sizeof(floatX), cudaMemcpyDeviceToHost));
            if (memcmp(after.data(), s->logits[r].data(), after.size() * sizeof(floatX)) != 0) {
                printf("FAIL: the logits of slice %d changed although no gradient was asked for\n", r);
                exit(EXIT_FAILURE);
            }
        }
        printf("  %-44s ok (untouched)\n", "logits (no dlogits)");
    }
}

static void time_kernels(const Problem* p, Slices* s, const int* d_targets, int repeats) {
    const int rows = p->rows, Vs = s->Vs;
    const double slice_bytes = (double)rows * Vs * sizeof(floatX);
    const int block_sizes[] = {128, 256, 512, 1024};
    char title[128], sizes[128];
    snprintf(sizes, sizeof(sizes), "B*T=%d V=%d Vp=%d N=%d Vs=%d, one process", rows, p->V, p->Vp, s->N, Vs);
    // process 0's slice; the finish kernel overwrites it with its gradient, on which the next call runs: same cost
    float* stats = s->d_stats[0];
    floatX* logits = s->d_logits[0];
    snprintf(title, sizeof(title), "vocab_parallel_classifier_stats N=%d", s->N);
    lab_print_header(title, sizes);
    for (int block_size : block_sizes) {
        float ms = lab_time_ms(repeats, [&]() {
            vocab_parallel_classifier_stats_launch(stats, logits, d_targets, rows, Vs, 0, p->V, block_size, 0);
        });
        lab_print_row(1, block_size, ms, slice_bytes + 20.0 * rows, 0.0);
    }
    snprintf(title, sizeof(title), "vocab_parallel_classifier_rescale N=%d", s->N);
    lab_print_header(title, sizes);
    float ms = lab_time_ms(repeats, [&]() { vocab_parallel_classifier_rescale(stats, rows, 0); });
    lab_print_row(1, 256, ms, 16.0 * rows, 0.0);
    snprintf(title, sizeof(title), "vocab_parallel_classifier_finish N=%d", s->N);
    lab_print_header(title, sizes);
    for (int block_size : block_sizes) {
        ms = lab_time_ms(repeats, [&]() {
            vocab_parallel_classifier_finish_launch(logits, s->d_losses[0], stats, p->dloss, d_targets, rows, Vs, 0,
                                                    p->V, true, block_size, 0);
        });
        lab_print_row(1, block_size, ms, 2.0 * slice_bytes + 20.0 * rows, 0.0);
    }
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    int B = 8, T = 1024;
    // small: V = 263 leaves the last vector of a slice straddling V; at N = 4 the last slice has no real column, and
    // V = 100 leaves two slices without one, and one with 4 real columns
    const Case small_cases[] = {{263, 280, 1, false}, {263, 384, 2, true}, {263, 384, 4, true}, {100, 384, 4, false}};
    const Case full_cases[] = {{50257, 50304, 2, true}, {50257, 50304, 4, true}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? 4 : 2;
    if (args.small) { B = 3; T = 13; }
    const int repeats = args.small ? 3 : 20;

    // the start-up check: the lab's sizes and GPT-2's pass, each unsupported split is refused with a reason
    struct { int V, Vp, N; bool supported; } support_cases[] = {
        {50257, 50304, 1, true}, {50257, 50304, 2, true}, {50257, 50304, 3, true}, {50257, 50304, 4, true},
        {50257, 50304, 8, true}, {263, 280, 1, true}, {263, 384, 4, true}, {100, 384, 4, true},
        {50257, 50304, 5, false}, {50257, 50304, 32, false}, {263, 280, 2, false}, {50257, 50304, 0, false},
        {0, 384, 1, false}, {50305, 50304, 2, false}};
    for (const auto& c : support_cases) {
        char why[256] = "";
        const bool supported = vocab_parallel_classifier_support(c.V, c.Vp, c.N, why, sizeof(why));
        if (supported != c.supported || (!c.supported && why[0] == 0)) {
            printf("FAIL vocab_parallel_classifier_support(V=%d, Vp=%d, N=%d) should say %s\n", c.V, c.Vp, c.N,
                   c.supported ? "supported" : "unsupported, with a reason");
            return EXIT_FAILURE;
        }
    }
    printf("vocab_parallel_classifier_support: ok (%d cases)\n",
           (int)(sizeof(support_cases) / sizeof(support_cases[0])));
    if (args.variant != 0 && args.variant != 1) return 0;

    Problem problem = {};
    for (int i = 0; i < num_cases; i++) {
        const Case c = cases[i];
        if (problem.V != c.V || problem.Vp != c.Vp) make_problem(&problem, B * T, c.V, c.Vp);
        Slices slices;
        make_slices(&slices, &problem, c.N);
        int* d_targets = lab_ints_to_device(problem.targets);
        printf("vocab_parallel_classifier (%s): B*T=%d V=%d Vp=%d N=%d (Vs=%d)\n", PRECISION_NAME, B * T, c.V, c.Vp,
               c.N, slices.Vs);
        // as the trainer calls it, then with 1024 threads, where most threads of a small slice see no element (the
        // trainer's block already at large sizes)
        const int validated_block_sizes[] = {LLMC_BLOCK_SIZE, 1024};
        for (int block_size : validated_block_sizes) {
            if (block_size == 1024 && classifier_block_size(slices.Vs) == 1024) continue;
            if (block_size == LLMC_BLOCK_SIZE) printf("variant 1, as the trainer calls it\n");
            else printf("variant 1, block %d\n", block_size);
            run_classifier(&problem, &slices, true, block_size, true, d_targets);
            validate_results(&problem, &slices, true);
        }
        run_classifier(&problem, &slices, false, LLMC_BLOCK_SIZE, false, d_targets);
        validate_results(&problem, &slices, false);
        if (c.timed) time_kernels(&problem, &slices, d_targets, repeats);
        free_slices(&slices);
        cudaCheck(cudaFree(d_targets));
    }
    return 0;
}
