// dev/cuda/paged_attention.cu: kernel lab for attention over a paged key/value cache (llmc/paged_attention.cuh):
// paged_kv_write stores new tokens' key and value heads (from the packed qkv (N, (NH + 2 NKV) HS)) into their slots of
// k_cache, v_cache (num_blocks, block_size, NKV, HS); paged_attention_forward attends query i to positions
// 0 .. context_len[i] - 1 of sequence query_seq[i], found through the block table, out (N, NH HS).
// Build and run on the CPU backend (small sizes):
//   make build/lab/paged_attention_bf16   (build/lab/paged_attention_fp32: the fp32 build)
//   build/lab/paged_attention_bf16 -s
// On a GPU: nvcc -std=c++17 -O3 --use_fast_math -arch=sm_90 -I. dev/cuda/paged_attention.cu -o paged_attention
//   ./paged_attention [variant] [-s]
// Cases (decode: one query per sequence at its whole length; block tables a random permutation of the physical
// blocks, two of which no table names; the tail of each last block and the spare blocks hold NaN, which a kernel
// reading past a context or ignoring the table turns into a failure):
//   full size: 64 sequences of 1024 .. 4096 positions, block size 16, GPT-2 124M heads (NH = NKV = 12, HS = 64) and
//   Llama-3 8B heads (NH = 32, NKV = 8, HS = 128);
//   -s: HS 32 with NH = NKV = 4 (lengths 1, 16, 17, 33, 47, 100: a one-position context, whole and partly filled last
//   blocks); HS 64 with NH = 8, NKV = 2 (lengths 1, 40, 75, 129) plus 11 queries of the 75-position sequence at
//   context lengths 64 .. 74 (a prefill chunk's queries); HS 128, NH = 4, NKV = 1 at block size 8 and HS 16 at
//   block size 32 (other compiled head sizes and block sizes). Block size 16 unless said; queries in random order.
// Each case first writes its queries' own keys and values (the position context_len - 1 of their sequence) with
// paged_kv_write into a cache holding every other position, then attends. The write is checked byte for byte: every
// slot it should write holds the token's bits, every other byte is as before (positions filled beforehand, NaN
// tails and spare blocks, and a guard slot in front of the cache that a negative slot, "skip this token", would hit).
// Variants of paged_attention_forward:
//   1  one thread per (query, head), positions in order with an online softmax, scalar loads (the baseline)
//   2  llmc/paged_attention.cuh paged_attention_forward: a block per (query, head), its warps splitting the context
//      into 32-position tiles (a lane per position for q . k, 16-byte loads of whole rows for p . v), the warps'
//      softmax states merged at the end. The trainer-quality kernel; timed at 2, 4 and 8 warps.
// Floor (llmc/paged_attention.cuh): attention 2 NKV HS X * sum over sequences of the longest context + 2 N NH HS X
// bytes (+ the int tables), X = sizeof(floatX): memory-bound in decode; paged_kv_write 4 N NKV HS X + 4 N bytes.
// The timing rows give bytes / time against the GPU's peak bandwidth.
#include <algorithm>
#include "common.h"
#include "../../llmc/paged_attention.cuh"

// Variant 1: thread per (query i, head h); HS <= 128
__global__ void paged_attention_serial_kernel(floatX* out, const floatX* qkv, const floatX* k_cache,
                                              const floatX* v_cache, const int* block_table, int max_blocks,
                                              const int* query_seq, const int* context_len, int N, int NH, int NKV,
                                              int HS, int block_size, float scale_log2) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= N * NH) return;
    const int i = idx / NH, h = idx % NH, kv_head = h / (NH / NKV);
    const floatX* q = qkv + (size_t)i * (NH + 2 * NKV) * HS + (size_t)h * HS;
    const int* table = block_table + (size_t)query_seq[i] * max_blocks;
    float acc[128];
    for (int d = 0; d < HS; d++) acc[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int p = 0; p < context_len[i]; p++) {
        const size_t slot = (size_t)table[p / block_size] * block_size + p % block_size;
        const floatX* k = k_cache + (slot * NKV + kv_head) * HS;
        const floatX* v = v_cache + (slot * NKV + kv_head) * HS;
        float score = 0.0f;
        for (int d = 0; d < HS; d++) score += (float)q[d] * (float)k[d];
        score *= scale_log2;
        const float m_new = fmaxf(m, score);
        const float correction = exp2f(m - m_new);
        const float prob = exp2f(score - m_new);
        l = l * correction + prob;
        for (int d = 0; d < HS; d++) acc[d] = acc[d] * correction + prob * (float)v[d];
        m = m_new;
    }
    for (int d = 0; d < HS; d++) out[(size_t)i * NH * HS + (size_t)h * HS + d] = (floatX)(acc[d] / l);
}

struct PagedCase {
    const char* name;
    int NH, NKV, HS, block_size;
    std::vector<int> lengths;  // cached positions of each sequence
    int prefill_seq;           // a sequence with prefill_queries more queries, at its length - 1, - 2, ...; -1: none
    int prefill_queries;
};

// A case's cache, table and queries, on the host as the device holds them
struct PagedSetup {
    int num_seqs, max_blocks, num_blocks, N;
    std::vector<int> block_table;  // (num_seqs, max_blocks); -1 past each sequence's blocks
    std::vector<int> query_seq, context_len, slots;  // (N); slots: the query's own position's, or -1 (kept filled)
    std::vector<floatX> k_cache, v_cache;  // (num_blocks, block_size, NKV, HS): every cached position; 0xff elsewhere
    std::vector<floatX> qkv;               // (N, (NH + 2 NKV) HS)
    size_t slot_elements, cache_elements;  // NKV HS; num_blocks block_size NKV HS
};

static int slot_of(const PagedCase& c, const PagedSetup& s, int seq, int p) {
    return s.block_table[(size_t)seq * s.max_blocks + p / c.block_size] * c.block_size + p % c.block_size;
}

// random permutation of 0 .. n-1 (Fisher-Yates with the lab's generator)
static std::vector<int> random_permutation(int n) {
    std::vector<int> order(n);
    for (int k = 0; k < n; k++) order[k] = k;
    for (int k = n - 1; k > 0; k--) {
        const int j = (int)(lab_rand_uniform(0.0f, 1.0f) * (k + 1)) % (k + 1);
        std::swap(order[k], order[j]);
    }
    return order;
}

static PagedSetup paged_setup(const PagedCase& c) {
    PagedSetup s;
    s.num_seqs = (int)c.lengths.size();
    s.max_blocks = 0;
    int used_blocks = 0;
    for (int length : c.lengths) {
        s.max_blocks = std::max(s.max_blocks, CEIL_DIV(length, c.block_size));
        used_blocks += CEIL_DIV(length, c.block_size);
    }
    s.max_blocks += 1;                 // a -1 column past every sequence's blocks
    s.num_blocks = used_blocks + 2;    // two blocks no table names
    const std::vector<int> physical = random_permutation(s.num_blocks);
    s.block_table.assign((size_t)s.num_seqs * s.max_blocks, -1);
    int next = 0;
    for (int q = 0; q < s.num_seqs; q++)
        for (int b = 0; b < CEIL_DIV(c.lengths[q], c.block_size); b++)
            s.block_table[(size_t)q * s.max_blocks + b] = physical[next++];

    // queries: one per sequence at its length, the prefill chunk's, then shuffled
    std::vector<int> seqs, lens;
    for (int q = 0; q < s.num_seqs; q++) {
        seqs.push_back(q);
        lens.push_back(c.lengths[q]);
    }
    for (int k = 1; k <= c.prefill_queries; k++) {
        seqs.push_back(c.prefill_seq);
        lens.push_back(c.lengths[c.prefill_seq] - k);
    }
    s.N = (int)seqs.size();
    const std::vector<int> order = random_permutation(s.N);
    for (int i = 0; i < s.N; i++) {
        s.query_seq.push_back(seqs[order[i]]);
        s.context_len.push_back(lens[order[i]]);
    }

    s.slot_elements = (size_t)c.NKV * c.HS;
    s.cache_elements = (size_t)s.num_blocks * c.block_size * s.slot_elements;
    s.k_cache.resize(s.cache_elements);
    s.v_cache.resize(s.cache_elements);
    memset(s.k_cache.data(), 0xff, s.cache_elements * sizeof(floatX));
    memset(s.v_cache.data(), 0xff, s.cache_elements * sizeof(floatX));
    for (int q = 0; q < s.num_seqs; q++)
        for (int p = 0; p < c.lengths[q]; p++) {
            const size_t at = (size_t)slot_of(c, s, q, p) * s.slot_elements;
            for (size_t e = 0; e < s.slot_elements; e++) {
                s.k_cache[at + e] = (floatX)lab_rand_uniform(-1.0f, 1.0f);
                s.v_cache[at + e] = (floatX)lab_rand_uniform(-1.0f, 1.0f);
            }
        }
    // qkv: random queries; each row's k and v heads are its own position's (context_len - 1), which paged_kv_write
    // stores; every third query's slot is -1 (its position is filled beforehand instead)
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS, q_elements = (size_t)c.NH * c.HS;
    s.qkv.resize((size_t)s.N * width);
    for (int i = 0; i < s.N; i++) {
        const int slot = slot_of(c, s, s.query_seq[i], s.context_len[i] - 1);
        s.slots.push_back(i % 3 == 2 ? -1 : slot);
        floatX* row = &s.qkv[(size_t)i * width];
        for (size_t e = 0; e < q_elements; e++) row[e] = (floatX)lab_rand_uniform(-1.0f, 1.0f);
        memcpy(row + q_elements, &s.k_cache[(size_t)slot * s.slot_elements], s.slot_elements * sizeof(floatX));
        memcpy(row + q_elements + s.slot_elements, &s.v_cache[(size_t)slot * s.slot_elements],
               s.slot_elements * sizeof(floatX));
    }
    return s;
}

// out (N, NH HS) in double from the definition: softmax over the context of q . k / sqrt(HS), times v, with the
// positions' slots from the block table
static std::vector<float> paged_attention_reference(const PagedCase& c, const PagedSetup& s) {
    const size_t width = (size_t)(c.NH + 2 * c.NKV) * c.HS;
    const double scale = 1.0 / sqrt((double)c.HS);
    std::vector<float> out((size_t)s.N * c.NH * c.HS);
    std::vector<double> scores, o(c.HS);
    std::vector<size_t> rows;
    for (int i = 0; i < s.N; i++) {
        const int n = s.context_len[i];
        rows.resize(n);
        for (int p = 0; p < n; p++) rows[p] = (size_t)slot_of(c, s, s.query_seq[i], p) * s.slot_elements;
        for (int h = 0; h < c.NH; h++) {
            const size_t kv = (size_t)(h / (c.NH / c.NKV)) * c.HS;
            const floatX* q = &s.qkv[(size_t)i * width + (size_t)h * c.HS];
            scores.resize(n);
            double max_score = -1e300, sum = 0.0;
            for (int p = 0; p < n; p++) {
                double dot = 0.0;
                for (int d = 0; d < c.HS; d++) dot += (double)(float)q[d] * (double)(float)s.k_cache[rows[p] + kv + d];
                scores[p] = dot * scale;
                max_score = fmax(max_score, scores[p]);
            }
            for (int p = 0; p < n; p++) sum += (scores[p] = exp(scores[p] - max_score));
            for (int d = 0; d < c.HS; d++) o[d] = 0.0;
            for (int p = 0; p < n; p++)
                for (int d = 0; d < c.HS; d++) o[d] += scores[p] * (double)(float)s.v_cache[rows[p] + kv + d];
            for (int d = 0; d < c.HS; d++) out[((size_t)i * c.NH + h) * c.HS + d] = (float)(o[d] / sum);
        }
    }
    return out;
}

// The device caches with a guard slot in front (allocation + slot_elements): a kernel writing token i to slot -1
// lands in it
struct DeviceCache {
    floatX *k_alloc, *v_alloc, *k, *v;
};

// byte-for-byte: the device caches, guard slot included, against the expected contents (guard: 0xff bytes)
static void check_cache(const char* name, const DeviceCache& d, const PagedSetup& s) {
    const size_t n = s.slot_elements + s.cache_elements;
    std::vector<floatX> want(n), got(n);
    const std::vector<floatX>* expected[2] = {&s.k_cache, &s.v_cache};
    const floatX* device[2] = {d.k_alloc, d.v_alloc};
    for (int part = 0; part < 2; part++) {
        memset(want.data(), 0xff, s.slot_elements * sizeof(floatX));
        memcpy(want.data() + s.slot_elements, expected[part]->data(), s.cache_elements * sizeof(floatX));
        cudaCheck(cudaMemcpy(got.data(), device[part], n * sizeof(floatX), cudaMemcpyDeviceToHost));
        for (size_t e = 0; e < n; e++)
            if (memcmp(&got[e], &want[e], sizeof(floatX)) != 0) {
                const long long slot = (long long)(e / s.slot_elements) - 1;
                printf("FAIL %s: %s cache element %lld (slot %lld%s) differs: got %.8g, want %.8g\n", name,
                       part == 0 ? "key" : "value", (long long)e - (long long)s.slot_elements, slot,
                       slot < 0 ? ", the guard" : "", (float)got[e], (float)want[e]);
                exit(EXIT_FAILURE);
            }
    }
    printf("  %-28s ok (every slot written bit for bit, nothing else touched)\n", name);
}

static void run_variant(int variant, int threads, floatX* out, const floatX* qkv, const DeviceCache& d,
                        const int* table, const int* query_seq, const int* context_len, const PagedCase& c,
                        const PagedSetup& s) {
    if (variant == 1) {
        const float scale_log2 = 1.44269504088896341f / sqrtf((float)c.HS);
        paged_attention_serial_kernel<<<CEIL_DIV(s.N * c.NH, threads), threads>>>(
            out, qkv, d.k, d.v, table, s.max_blocks, query_seq, context_len, s.N, c.NH, c.NKV, c.HS, c.block_size,
            scale_log2);
        cudaCheck(cudaGetLastError());
    } else if (threads == PAGED_ATTENTION_BLOCK_SIZE) {
        paged_attention_forward(out, qkv, d.k, d.v, table, s.max_blocks, query_seq, context_len, s.N, c.NH, c.NKV,
                                c.HS, c.block_size, 0);
    } else {
        paged_attention_forward_launch(out, qkv, d.k, d.v, table, s.max_blocks, query_seq, context_len, s.N, c.NH,
                                       c.NKV, c.HS, c.block_size, threads, 0);
    }
}

// Timing. Attention: bytes = the floor (each sequence's longest context read once, q read and out written).
// paged_kv_write: over a prefill's worth of tokens (4096; -s: the case's queries) into slots 0, 1, ...: the cache's
// contents no longer matter here; one variant, the header's.
static void time_case(const LabArgs& args, const PagedCase& c, const PagedSetup& s, const DeviceCache& d,
                      const floatX* d_qkv, const int* d_table, const int* d_query_seq, const int* d_context_len,
                      floatX* d_out) {
    const size_t n_out = (size_t)s.N * c.NH * c.HS;
    std::vector<int> longest(s.num_seqs, 0);
    for (int i = 0; i < s.N; i++) longest[s.query_seq[i]] = std::max(longest[s.query_seq[i]], s.context_len[i]);
    double cached = 0.0;
    for (int L : longest) cached += L;
    const double bytes = 2.0 * s.slot_elements * sizeof(floatX) * cached + 2.0 * n_out * sizeof(floatX) +
                         4.0 * (cached / c.block_size + 2.0 * s.N);
    const int repeats = args.small ? 3 : 20;
    char sizes[160];
    snprintf(sizes, sizeof(sizes), "%s, %d queries, NH=%d NKV=%d HS=%d, %.3g MB floor", c.name, s.N, c.NH, c.NKV, c.HS,
             bytes / 1e6);
    lab_print_header("paged_attention_forward", sizes);
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        for (int threads : {64, 128, 256}) {
            // the serial baseline takes milliseconds per call at full size: a few calls tell its time
            float ms = lab_time_ms(variant == 1 ? std::min(repeats, 3) : repeats, [&]() {
                run_variant(variant, threads, d_out, d_qkv, d, d_table, d_query_seq, d_context_len, c, s);
            });
            lab_print_row(variant, threads, ms, bytes, 0.0);
        }
    }
    const int write_tokens = args.small ? s.N : std::min(4096, (int)(s.cache_elements / s.slot_elements));
    std::vector<int> write_slots(write_tokens);
    for (int i = 0; i < write_tokens; i++) write_slots[i] = i;
    int* d_write_slots = lab_ints_to_device(write_slots);
    floatX* d_write_qkv = lab_poisoned<floatX>((size_t)write_tokens * (c.NH + 2 * c.NKV) * c.HS);
    const double write_bytes = 4.0 * write_tokens * s.slot_elements * sizeof(floatX) + 4.0 * write_tokens;
    snprintf(sizes, sizeof(sizes), "%d tokens, NKV=%d HS=%d", write_tokens, c.NKV, c.HS);
    lab_print_header("paged_kv_write", sizes);
    for (int threads : {128, 256, 512}) {
        float ms = lab_time_ms(repeats, [&]() {
            paged_kv_write_launch(d.k, d.v, d_write_qkv, d_write_slots, write_tokens, c.NH, c.NKV, c.HS, c.block_size,
                                  threads, 0);
        });
        lab_print_row(1, threads, ms, write_bytes, 0.0);
    }
    cudaCheck(cudaFree(d_write_slots));
    cudaCheck(cudaFree(d_write_qkv));
}

static void run_case(const LabArgs& args, const PagedCase& c, bool timed) {
    const PagedSetup s = paged_setup(c);
    long long positions = 0;  // attended, summed over queries
    for (int n : s.context_len) positions += n;
    printf("paged_attention (%s) %s: %d sequences, %d queries (%lld positions attended), NH=%d NKV=%d HS=%d, "
           "block size %d, %d physical blocks\n", PRECISION_NAME, c.name, s.num_seqs, s.N, positions, c.NH, c.NKV,
           c.HS, c.block_size, s.num_blocks);
    const std::vector<float> want = paged_attention_reference(c, s);
    const size_t n_out = (size_t)s.N * c.NH * c.HS;

    // the cache before the write: the expected one with the written queries' slots poisoned
    std::vector<floatX> k_before = s.k_cache, v_before = s.v_cache;
    for (int i = 0; i < s.N; i++)
        if (s.slots[i] >= 0) {
            memset(&k_before[(size_t)s.slots[i] * s.slot_elements], 0xff, s.slot_elements * sizeof(floatX));
            memset(&v_before[(size_t)s.slots[i] * s.slot_elements], 0xff, s.slot_elements * sizeof(floatX));
        }
    DeviceCache d;
    d.k_alloc = lab_poisoned<floatX>(s.slot_elements + s.cache_elements);
    d.v_alloc = lab_poisoned<floatX>(s.slot_elements + s.cache_elements);
    d.k = d.k_alloc + s.slot_elements;
    d.v = d.v_alloc + s.slot_elements;
    cudaCheck(cudaMemcpy(d.k, k_before.data(), s.cache_elements * sizeof(floatX), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d.v, v_before.data(), s.cache_elements * sizeof(floatX), cudaMemcpyHostToDevice));
    floatX* d_qkv;
    cudaCheck(cudaMalloc(&d_qkv, s.qkv.size() * sizeof(floatX)));
    cudaCheck(cudaMemcpy(d_qkv, s.qkv.data(), s.qkv.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    int* d_table = lab_ints_to_device(s.block_table);
    int* d_query_seq = lab_ints_to_device(s.query_seq);
    int* d_context_len = lab_ints_to_device(s.context_len);
    int* d_slots = lab_ints_to_device(s.slots);
    floatX* d_out = lab_poisoned<floatX>(n_out);
    floatX* d_out_again = lab_poisoned<floatX>(n_out);

    paged_kv_write(d.k, d.v, d_qkv, d_slots, s.N, c.NH, c.NKV, c.HS, c.block_size, 0);
    cudaCheck(cudaDeviceSynchronize());
    check_cache("paged_kv_write", d, s);

    // Tolerances. Inputs are exact in floatX and every operation is fp32, so out is the fp32 computation's error
    // plus one rounding to floatX. Scores (HS <= 128 products of |x| <= 1, scaled: |s| <~ 4) err by ~1e-6 absolute,
    // a relative error of each probability; exp2 (ex2.approx under fast math) adds 2 ulps; the sums over at most 4096
    // positions grow like a random walk, sqrt(4096) * 2^-24 = 4e-6 relative, and merging the warps adds a few
    // roundings. |out| <= max |v| = 1, so out is within ~1e-5 of the reference before its rounding: atol 2e-5 and,
    // in fp32, rtol 2e-5. The rounding to floatX errs by at most half an ulp, 2^-9 relative in bf16 (rtol 4e-3, as
    // flash attention's lab) and 2^-12 in fp16 (rtol 5e-4). A position left out or read from the wrong slot moves
    // out by about |v - out| / n, ~1e-4 even at n = 4096, and by far more at the -s lengths; the NaN tails and spare
    // blocks turn any read outside the context into NaN.
#if defined(ENABLE_FP32)
    const float rtol = 2e-5f;
#elif defined(ENABLE_FP16)
    const float rtol = 5e-4f;
#else
    const float rtol = 4e-3f;
#endif
    const float atol = 2e-5f;
    for (int variant = 1; variant <= 2; variant++) {
        if (args.variant != 0 && args.variant != variant) continue;
        printf("variant %d\n", variant);
        cudaCheck(cudaMemset(d_out, 0xff, n_out * sizeof(floatX)));
        run_variant(variant, variant == 1 ? 64 : PAGED_ATTENTION_BLOCK_SIZE, d_out, d_qkv, d, d_table, d_query_seq,
                    d_context_len, c, s);
        cudaCheck(cudaDeviceSynchronize());
        lab_validate("out", d_out, want.data(), n_out, atol, rtol);
        if (variant == 2) {
            cudaCheck(cudaMemset(d_out_again, 0xff, n_out * sizeof(floatX)));
            run_variant(variant, 256, d_out_again, d_qkv, d, d_table, d_query_seq, d_context_len, c, s);
            cudaCheck(cudaDeviceSynchronize());
            lab_validate("out (8 warps)", d_out_again, want.data(), n_out, atol, rtol);
            cudaCheck(cudaMemset(d_out_again, 0xff, n_out * sizeof(floatX)));
            run_variant(variant, PAGED_ATTENTION_BLOCK_SIZE, d_out_again, d_qkv, d, d_table, d_query_seq,
                        d_context_len, c, s);
            cudaCheck(cudaDeviceSynchronize());
            lab_require_identical("out", d_out, d_out_again, n_out * sizeof(floatX));
        }
    }

    if (timed) time_case(args, c, s, d, d_qkv, d_table, d_query_seq, d_context_len, d_out);

    cudaCheck(cudaFree(d.k_alloc));
    cudaCheck(cudaFree(d.v_alloc));
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_table));
    cudaCheck(cudaFree(d_query_seq));
    cudaCheck(cudaFree(d_context_len));
    cudaCheck(cudaFree(d_slots));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_out_again));
}

int main(int argc, char** argv) {
    LabArgs args = lab_parse_args(argc, argv);
    if (args.small) {
        // the timing code runs once (the first case): on the CPU backend the times mean nothing
        run_case(args, {"multi-head", 4, 4, 32, 16, {1, 16, 17, 33, 47, 100}, -1, 0}, true);
        run_case(args, {"grouped-query, prefill chunk", 8, 2, 64, 16, {1, 40, 75, 129}, 2, 11}, false);
        run_case(args, {"HS 128, block size 8", 4, 1, 128, 8, {5, 64, 70}, -1, 0}, false);
        run_case(args, {"HS 16, block size 32", 2, 2, 16, 32, {31, 32, 33}, 1, 3}, false);
    } else {
        std::vector<int> lengths(64);
        for (int& n : lengths) n = 1024 + lab_random_ints(1, 3073)[0];  // 1024 .. 4096
        run_case(args, {"GPT-2 124M heads", 12, 12, 64, 16, lengths, -1, 0}, true);
        run_case(args, {"Llama-3 8B heads", 32, 8, 128, 16, lengths, -1, 0}, true);
    }
    return 0;
}
