// dev/cuda/moe_router.cu: kernel lab for the MoE router forward: per token, probs = softmax(logits) over E
// experts (fp32), logsumexp (for the z-loss), the top-k experts (ties to the lower index, in descending order)
// and their gates (the raw prob for k = 1, renormalised over the k picks for k >= 2); with sigmoid scores the
// affinities sigmoid(logits), probs = the affinities over their sum, gates = the picked affinities renormalised
// (k = 1 too), and with a balancing bias b (E) the picks compare the keys fp32(a + b) instead of the logits; either
// way the gates times the routed scale rsf. With a group limit M over G groups of E/G consecutive experts the picks
// are among the M groups of largest score only: a group's best key (device-limited routing), or the sum of its two
// largest affinity + bias (the model's expert groups, "T2" below). doc/moe.md, "Routing" and "Routing options" 3, 4,
// 5, 9 and 11, is the definition; the reference (moe_reference.h, and here its grouped picks) is a plain
// double-precision loop over it.
// Build and run on the CPU backend (small sizes):
//   make build/lab/moe_router_bf16   (build/lab/moe_router_fp32: the fp32 build)
//   build/lab/moe_router_bf16 -s          (the fp32 build is the same: the router is fp32 either way)
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/moe_router.cu -o moe_router
//   ./moe_router [variant] [-s]   (default: N = 8*1024 tokens, E = 8 with k = 1 and 2, E = 64 with k = 2, softmax;
//                                  E = 64 with k = 6, sigmoid with rsf 2.5 (DeepSeek-V3's shape);
//                                  -s: N = 69 with E = 4, k = 1 and 2, E = 40 k = 2, E = 200 k = 3, softmax; E = 4
//                                  k = 1, E = 40 k = 2, E = 200 k = 3 sigmoid, and E = 4 k = 2 softmax, rsf 2.5;
//                                  sigmoid with a balancing bias at E = 4 k = 1, E = 40 k = 2, E = 200 k = 3;
//                                  device-limited: E = 8 G 4 M 1 k 2 softmax and sigmoid + bias, E = 40 G 8 M 2
//                                  k 3, E = 64 G 32 M 3 k 6 and E = 128 G 64 M 3 k 6 sigmoid + bias, E = 200 G 40
//                                  M 2 k 3 softmax, E = 200 G 8 M 1 k 3 sigmoid; the two largest summed: E = 8 G 4
//                                  M 1 k 2 and E = 64 G 32 M 3 k 6 sigmoid + bias (groups of 2, as many as lanes
//                                  hold), E = 200 G 8 M 2 k 3 sigmoid; the full sizes add E = 8 G 4 M 1 k 2 softmax,
//                                  E = 64 G 8 M 3 k 6 sigmoid + bias, and the same with the two largest summed)
// Variants:
//   1  one thread per token: serial loops over the row (max, sum, probs, k scans for the picks)
//   2  llmc/moe_router.cuh moe_router_forward: one warp per token, shuffle reductions, one warp argmax per pick.
//      The trainer's.
// Floor (see llmc/moe_router.cuh): read N*E*4, write N*E*4 + N*k*8 + N*4 bytes (either score, with or without a device
// limit, whose group scores and picks are ~2E + 15G + M(G + 10) operations per token, compute within a warp's
// registers: the floor is the same bytes).
#include <algorithm>
#include "common.h"
#include "../../llmc/moe_router.cuh"
#include "moe_reference.h"

// One thread per token. The picks come out in the order (logit descending, index ascending), so a candidate is
// still free exactly when it comes after the previous pick in that order: no list of taken experts is needed.
// Sigmoid scores overwrite the softmax probs with the affinities, then normalise them once the gates are taken.
// With a balancing bias the order is (key descending, index ascending) on the keys affinity + bias. With a group
// limit the kept groups are M scans over the groups' scores, and a candidate must lie in one of them.
__global__ void router_thread_per_token_kernel(float* probs, int* expert_index, float* gates, float* logsumexp,
                                               const float* logits, const float* bias, int N, int E, int k,
                                               int score, float routed_scale, int groups, int group_limit,
                                               int group_score) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= N) return;
    const float* row = logits + (size_t)token * E;
    float* prob = probs + (size_t)token * E;
    float row_max = -INFINITY;
    for (int e = 0; e < E; e++) row_max = fmaxf(row_max, row[e]);
    float sum = 0.0f;
    for (int e = 0; e < E; e++) sum += expf(row[e] - row_max);
    for (int e = 0; e < E; e++) prob[e] = expf(row[e] - row_max) / sum;
    logsumexp[token] = row_max + logf(sum);
    float affinity_sum = 0.0f;
    if (score == MOE_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) {
            prob[e] = moe_sigmoid(row[e]);
            affinity_sum += prob[e];
        }
    }
    // bit g % 32 of word g / 32: group g is kept; without a limit all E experts are one kept group
    unsigned int kept[MOE_MAX_EXPERTS / 32] = {};
    const int group_size = group_limit > 0 ? E / groups : E;
    if (group_limit == 0) kept[0] = 1u;
    for (int j = 0; j < group_limit; j++) {
        int best_group = -1;
        float best_score = 0.0f;
        for (int g = 0; g < groups; g++) {
            if ((kept[g / 32] >> (g % 32)) & 1u) continue;
            // the group's largest and second largest (another expert's) values
            float first = -INFINITY, second = -INFINITY;
            for (int e = g * group_size; e < (g + 1) * group_size; e++) {
                const float value = group_score == MOE_GROUP_TOP2_SUM ? prob[e] + (bias != nullptr ? bias[e] : 0.0f)
                                    : bias != nullptr ? prob[e] + bias[e] : row[e];
                if (value > first) {
                    second = first;
                    first = value;
                } else if (value > second) {
                    second = value;
                }
            }
            const float score_of_group = group_score == MOE_GROUP_TOP2_SUM ? first + second : first;
            if (best_group < 0 || score_of_group > best_score) {
                best_group = g;
                best_score = score_of_group;
            }
        }
        kept[best_group / 32] |= 1u << (best_group % 32);
    }

    float previous = INFINITY;
    int previous_expert = -1;
    float picked_sum = 0.0f;
    for (int j = 0; j < k; j++) {
        int best_expert = -1;
        float best_key = 0.0f;
        for (int e = 0; e < E; e++) {
            const float key = bias != nullptr ? prob[e] + bias[e] : row[e];
            const bool free = key < previous || (key == previous && e > previous_expert);
            const int group = e / group_size;
            const bool allowed = (kept[group / 32] >> (group % 32)) & 1u;
            if (free && allowed && (best_expert < 0 || key > best_key)) {
                best_expert = e;
                best_key = key;
            }
        }
        expert_index[(size_t)token * k + j] = best_expert;
        gates[(size_t)token * k + j] = prob[best_expert];
        picked_sum += prob[best_expert];
        previous = best_key;
        previous_expert = best_expert;
    }
    for (int j = 0; j < k; j++) {
        if (k >= 2 || score == MOE_SCORE_SIGMOID) gates[(size_t)token * k + j] /= picked_sum;
        gates[(size_t)token * k + j] *= routed_scale;
    }
    if (score == MOE_SCORE_SIGMOID) {
        for (int e = 0; e < E; e++) prob[e] /= affinity_sum;
    }
}

struct RouterBuffers {
    float* logits;
    float* probs;
    int* expert_index;
    float* gates;
    float* logsumexp;
    float* bias;  // (E) or nullptr
};

static void run_variant(int variant, const RouterBuffers* d, int N, int E, int k, int score, float rsf, int groups,
                        int group_limit, int group_score, int block_size) {
    if (variant == 1) {
        router_thread_per_token_kernel<<<CEIL_DIV(N, block_size), block_size>>>(d->probs, d->expert_index, d->gates,
                                                                               d->logsumexp, d->logits, d->bias, N, E,
                                                                               k, score, rsf, groups, group_limit,
                                                                               group_score);
        cudaCheck(cudaGetLastError());
    } else {
        moe_router_forward_launch(d->probs, d->expert_index, d->gates, d->logsumexp, d->logits, d->bias, N, E, k,
                                  score, rsf, groups, group_limit, group_score, block_size, 0);
    }
}

// Grouped routing's picks and gates (doc/moe.md, "Routing options" 9 and 11) over those of moe_router_reference
// (whose probs and logsumexp the limit leaves alone): per token the keys as the kernel compares them (the fp32
// logits, or fp32(a) + bias with a balancing bias), each group's score (MOE_GROUP_MAX_KEY: its best key;
// MOE_GROUP_TOP2_SUM: fp32(fp32(a) + bias) of its two largest experts, summed in fp32), the `limit` groups of
// largest score (ties to the lower group), then top-k among their experts (ties to the lower index); the gates
// from the double scores. Returns how many tokens' picks differ from the unlimited ones in `expert_index`.
static int limit_reference_picks(std::vector<int>* expert_index, std::vector<float>* gates,
                                 const std::vector<float>& logits, const float* bias, int N, int E, int k, int score,
                                 float rsf, int groups, int limit, int group_rule) {
    const int group_size = E / groups;
    std::vector<double> s(E), key(E), group_score(groups);  // the keys fp32 values, exact in double
    std::vector<int> picks(k), kept_groups(limit);
    std::vector<char> allowed(E);
    int changed = 0;
    for (int t = 0; t < N; t++) {
        const float* row = logits.data() + (size_t)t * E;
        double lse;
        if (score == MOE_SCORE_SIGMOID) moe_affinity_row(s.data(), row, E);
        else moe_route_row(s.data(), &lse, (int*)nullptr, row, E, k);
        for (int e = 0; e < E; e++) key[e] = bias != nullptr ? (float)s[e] + bias[e] : row[e];
        for (int g = 0; g < groups; g++) {
            std::vector<double> values(group_size);
            for (int i = 0; i < group_size; i++) {
                const int e = g * group_size + i;
                const float affinity_key = (float)s[e] + (bias != nullptr ? bias[e] : 0.0f);
                values[i] = group_rule == MOE_GROUP_TOP2_SUM ? (double)affinity_key : key[e];
            }
            std::sort(values.begin(), values.end(), [](double a, double b) { return a > b; });
            group_score[g] = values[0];
            if (group_rule == MOE_GROUP_TOP2_SUM) group_score[g] = (float)values[0] + (float)values[1];
        }
        moe_top_k(kept_groups.data(), group_score.data(), nullptr, groups, limit);
        for (int e = 0; e < E; e++) allowed[e] = 0;
        for (int j = 0; j < limit; j++)
            for (int e = kept_groups[j] * group_size; e < (kept_groups[j] + 1) * group_size; e++) allowed[e] = 1;
        moe_top_k(picks.data(), key.data(), allowed.data(), E, k);
        int* out = expert_index->data() + (size_t)t * k;
        bool differs = false;
        for (int j = 0; j < k; j++) differs = differs || out[j] != picks[j];
        changed += differs;
        for (int j = 0; j < k; j++) {
            out[j] = picks[j];
            (*gates)[(size_t)t * k + j] = (float)moe_gate(s.data(), picks.data(), j, k, score, rsf);
        }
    }
    return changed;
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    // group_limit 0: no grouped routing; group_score: MOE_GROUP_MAX_KEY (0, -dl) or MOE_GROUP_TOP2_SUM (1)
    struct Case { int N, E, k, score; float rsf; int bias, groups, group_limit, group_score; };
    const int SOFTMAX = MOE_SCORE_SOFTMAX, SIGMOID = MOE_SCORE_SIGMOID;
    const Case full_cases[] = {{8 * 1024, 8, 1, SOFTMAX, 1.0f, 0},        {8 * 1024, 8, 2, SOFTMAX, 1.0f, 0},
                               {8 * 1024, 64, 2, SOFTMAX, 1.0f, 0},       {8 * 1024, 64, 6, SIGMOID, 2.5f, 0},
                               {8 * 1024, 64, 6, SIGMOID, 2.5f, 1},       {8 * 1024, 8, 2, SOFTMAX, 1.0f, 0, 4, 1},
                               {8 * 1024, 64, 6, SIGMOID, 2.5f, 1, 8, 3}, {8 * 1024, 64, 6, SIGMOID, 2.5f, 1, 8, 3, 1}};
    // 69 = 3*23 tokens: warps of the warp variant's last block partly empty; E = 40 and 200 cover 2 and 8
    // logits per lane, with lanes that own fewer experts than others; sigmoid scores at each of those, top-1
    // among them (its gate is rsf); the routed scale on softmax gates; a balancing bias at each width; device limits,
    // all with M < k (with M >= k the k best experts lie in at most k groups, which are among the M best: the limit
    // changes nothing): groups inside one lane's experts (E = 8, 40, 64), 64 groups of 2 (two groups per lane),
    // groups of 5 across lanes (E = 200, G = 40) and one group of 25 kept; the rows of equal logits tie the groups
    // too, to the lower one; the most experts the trainer takes (MOE_MAX_EXPERTS 256: 8 logits per lane) with top-8
    const Case small_cases[] = {{69, 4, 1, SOFTMAX, 1.0f, 0},   {69, 4, 2, SOFTMAX, 1.0f, 0},
                                {69, 40, 2, SOFTMAX, 1.0f, 0},  {69, 200, 3, SOFTMAX, 1.0f, 0},
                                {69, 4, 1, SIGMOID, 2.5f, 0},   {69, 40, 2, SIGMOID, 2.5f, 0},
                                {69, 200, 3, SIGMOID, 2.5f, 0}, {69, 4, 2, SOFTMAX, 2.5f, 0},
                                {69, 4, 1, SIGMOID, 1.0f, 1},   {69, 40, 2, SIGMOID, 2.5f, 1},
                                {69, 200, 3, SIGMOID, 2.5f, 1}, {69, 8, 2, SOFTMAX, 1.0f, 0, 4, 1},
                                {69, 8, 2, SIGMOID, 2.5f, 1, 4, 1}, {69, 40, 3, SIGMOID, 2.5f, 1, 8, 2},
                                {69, 64, 6, SIGMOID, 2.5f, 1, 32, 3}, {69, 128, 6, SIGMOID, 2.5f, 1, 64, 3},
                                {69, 200, 3, SOFTMAX, 1.0f, 0, 40, 2}, {69, 200, 3, SIGMOID, 1.0f, 0, 8, 1},
                                {69, 256, 8, SOFTMAX, 1.0f, 0},   {69, 256, 8, SIGMOID, 2.5f, 1},
                                {69, 8, 2, SIGMOID, 2.5f, 1, 4, 1, 1}, {69, 64, 6, SIGMOID, 2.5f, 1, 32, 3, 1},
                                {69, 200, 3, SIGMOID, 1.0f, 0, 8, 2, 1}};
    const Case* cases = args.small ? small_cases : full_cases;
    const int num_cases = args.small ? (int)(sizeof(small_cases) / sizeof(small_cases[0]))
                                     : (int)(sizeof(full_cases) / sizeof(full_cases[0]));
    const int block_sizes[] = {64, 128, 256, 512};
    const int repeats = args.small || lab_on_cpu_backend() ? 3 : 100;  // CPU-backend times are only indicative

    printf("moe_router (%s build; the router is fp32)\n", PRECISION_NAME);
    for (int c = 0; c < num_cases; c++) {
        const int N = cases[c].N, E = cases[c].E, k = cases[c].k, score = cases[c].score;
        const float rsf = cases[c].rsf;
        const int groups = cases[c].groups, group_limit = cases[c].group_limit, group_score = cases[c].group_score;
        const size_t n = (size_t)N * E;
        std::vector<float> logits = moe_router_logits(N, E);
        std::vector<float> probs(n), gates((size_t)N * k), logsumexp(N);
        std::vector<int> picks((size_t)N * k);
        // biases of the order of the affinities' gaps, so that they change picks; pairs of equal biases keep some
        // of the planted logit ties as key ties
        std::vector<float> bias = lab_random(E, -0.1f, 0.1f);
        for (int e = 1; e < E; e += 2) bias[e] = bias[e - 1];
        const float* host_bias = cases[c].bias ? bias.data() : nullptr;
        moe_router_reference(&probs, &picks, &gates, &logsumexp, logits, host_bias, N, E, k, score, rsf);
        char limit_name[64] = "";
        if (group_limit > 0) {
            const int changed = limit_reference_picks(&picks, &gates, logits, host_bias, N, E, k, score, rsf, groups,
                                                      group_limit, group_score);
            const char* rule = group_score == MOE_GROUP_TOP2_SUM ? " T2" : "";
            snprintf(limit_name, sizeof(limit_name), " G=%d M=%d%s", groups, group_limit, rule);
            printf("group limit G=%d M=%d%s: %d of %d tokens pick otherwise than without it\n", groups, group_limit,
                   rule, changed, N);
        }
        const std::vector<float> expert_index = lab_as_floats(picks);

        RouterBuffers d;
        d.logits = lab_to_device<float>(logits);
        d.probs = lab_poisoned<float>(n);
        d.expert_index = lab_poisoned<int>((size_t)N * k);
        d.gates = lab_poisoned<float>((size_t)N * k);
        d.logsumexp = lab_poisoned<float>(N);
        d.bias = host_bias != nullptr ? lab_to_device<float>(bias) : nullptr;

        const char* score_name = score == SIGMOID ? "sigmoid" : "softmax";
        printf("N=%d E=%d k=%d %s rsf=%g%s%s\n", N, E, k, score_name, rsf, host_bias ? " bias" : "", limit_name);
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            cudaCheck(cudaMemset(d.probs, 0xff, n * sizeof(float)));
            cudaCheck(cudaMemset(d.expert_index, 0xff, (size_t)N * k * sizeof(int)));
            cudaCheck(cudaMemset(d.gates, 0xff, (size_t)N * k * sizeof(float)));
            cudaCheck(cudaMemset(d.logsumexp, 0xff, N * sizeof(float)));
            run_variant(variant, &d, N, E, k, score, rsf, groups, group_limit, group_score, 256);
            cudaCheck(cudaDeviceSynchronize());
            printf("variant %d\n", variant);
            // fp32 softmax from exact fp32 logits: max and subtraction exact, exp correctly rounded on the CPU
            // (--use_fast_math __expf on a GPU: <= 2 + 1.16*|x| ulp, ~1.2e-6 relative at |x| = 8), a sum of E
            // terms in another order (~E * 2^-24 relative): rtol 1e-5 covers E = 200. The picks are exact
            // comparisons of the same fp32 logits: no tolerance. lse ~ 1..10, atol 1e-5. Sigmoid: 1 / (1 + exp(-x))
            // from |x| <= 4 has exp's relative error and two roundings (~1e-6 with __expf), the sum of E of them
            // E * 2^-24: the same rtol 1e-5; gates up to rsf = 2.5, relative to it likewise.
            lab_validate("probs", d.probs, probs.data(), n, 1e-7f, 1e-5f);
            lab_validate("expert_index", d.expert_index, expert_index.data(), (size_t)N * k, 0.0f, 0.0f);
            lab_validate("gates", d.gates, gates.data(), (size_t)N * k, 1e-7f, 1e-5f);
            lab_validate("logsumexp", d.logsumexp, logsumexp.data(), N, 1e-5f, 1e-6f);
        }

        char sizes[64];
        snprintf(sizes, sizeof(sizes), "N=%d E=%d k=%d %s%s%s", N, E, k, score_name, host_bias ? " bias" : "",
                 limit_name);
        lab_print_header("moe_router", sizes);
        const double bytes = 8.0 * n + 8.0 * N * k + 4.0 * N;
        for (int variant = 1; variant <= 2; variant++) {
            if (args.variant != 0 && args.variant != variant) continue;
            for (int block_size : block_sizes) {
                float ms = lab_time_ms(repeats, [&]() {
                    run_variant(variant, &d, N, E, k, score, rsf, groups, group_limit, group_score, block_size);
                });
                lab_print_row(variant, block_size, ms, bytes, 0.0);
            }
        }
        cudaCheck(cudaFree(d.logits));
        cudaCheck(cudaFree(d.probs));
        cudaCheck(cudaFree(d.expert_index));
        cudaCheck(cudaFree(d.gates));
        cudaCheck(cudaFree(d.logsumexp));
        if (d.bias != nullptr) cudaCheck(cudaFree(d.bias));
    }
    return 0;
}
