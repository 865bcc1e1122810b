// llmc/generation.h: the generation engine of `generate` and of the trainers' samples (doc/inference.md): sequences
// with a paged KV cache (llmc/kv_cache.h) and continuous batching. A sequence's prefill is the trainers' forward pass
// (flash attention), whose keys and values go into its cache blocks; every running sequence then decodes one token
// per step through llmc/paged_attention.cuh, reading its keys and values through its block table. Waiting sequences
// join as soon as blocks are free; when the cache is full the newest running one is pre-empted (its blocks freed) and
// later resumed by a prefill of everything it has.
// Under tensor parallelism (a trainer's samples with -tp N) every member runs the engine alike on its heads, hidden
// units and vocabulary rows, the row-parallel outputs all-reduced; a step's tokens are padded to a multiple of N with
// rows that read and write a scratch block no sequence owns, since a folded MoE layer and sequence parallelism cut the
// tokens into N equal parts. Under ZeRO-3 and expert parallelism every process runs it alike (collective weights and
// experts).
// train_gpt.cu includes it after the model; generate.cu adds sampling flags, prompts and quantised weights.
// Tests: generate-* rows (dev/test/test_generate.sh), the trainers' samples in test_train_gpt.sh, test_train_moe.sh
// and test_tensor_parallel.sh; generate_by_prefill's logits in test_gpt's prompt, prefix and lladapter rows, the
// samples of fine-tuning-cli.
#pragma once
#include "kv_cache.h"
#include "paged_attention.cuh"
#include "sampler.h"

// ----------------------------------------------------------------------------------------------------
// Sampling (host): temperature, top-k and top-p over the V real logits, then a draw from the softmax of what is kept

typedef struct {
    float temperature;  // 0: greedy
    int top_k;          // 0: all
    float top_p;        // 1: all
} SamplingSettings;

typedef struct {
    float logit;
    int token;
} Candidate;
static int candidate_order(const void* a, const void* b) {  // larger logit first, ties to the lower token
    const Candidate* x = (const Candidate*)a;
    const Candidate* y = (const Candidate*)b;
    if (x->logit != y->logit) return x->logit > y->logit ? -1 : 1;
    return x->token - y->token;
}

// The next token from logits (V). Greedy (temperature 0): the largest logit, ties to the lower token, no draw.
// Otherwise one uniform draw from the sequence's generator: the logits divided by the temperature, the k largest
// (top-k), then the fewest of those, largest first, whose probabilities reach p (top-p, in double), sampled with
// llmc/sampler.h's softmax walk. At temperature 1 with neither cut, exactly sample_softmax over the logits.
static int sample_token(const float* logits, int V, const SamplingSettings* f, uint64_t* rng, Candidate* scratch,
                        float* kept_logits) {
    if (f->temperature == 0.0f) {
        int best = 0;
        for (int v = 1; v < V; v++)
            if (logits[v] > logits[best]) best = v;
        return best;
    }
    float coin = random_f32_host(rng);
    for (int v = 0; v < V; v++) {
        scratch[v].logit = logits[v] / f->temperature;
        scratch[v].token = v;
    }
    int n = V;
    if (f->top_k > 0 || f->top_p < 1.0f) {
        qsort(scratch, V, sizeof(Candidate), candidate_order);
        if (f->top_k > 0 && f->top_k < n) n = f->top_k;
        if (f->top_p < 1.0f) {
            double sum = 0.0, cumulative = 0.0;
            for (int i = 0; i < n; i++) sum += exp((double)scratch[i].logit - scratch[0].logit);
            int keep = 0;
            while (keep < n && cumulative < (double)f->top_p * sum)
                cumulative += exp((double)scratch[keep++].logit - scratch[0].logit);
            n = keep > 0 ? keep : 1;
        }
    }
    for (int i = 0; i < n; i++) kept_logits[i] = scratch[i].logit;
    return scratch[sample_softmax(kept_logits, n, coin)].token;
}

// ----------------------------------------------------------------------------------------------------
// Sequences and the engine

typedef enum { SEQUENCE_WAITING, SEQUENCE_RUNNING, SEQUENCE_FINISHED } SequenceState;
typedef struct {
    int prompt, sample;  // which prompt, which of its samples
    int* tokens;         // (maxT) the prompt, then the generated tokens
    int length;          // tokens held
    int prompt_length;
    int target;          // the length at which it is finished: prompt + generated tokens, at most maxT
    int cached;          // positions whose keys and values are in the cache
    BlockTable table;
    uint64_t rng;        // its own generator: its samples do not depend on what else runs
    SequenceState state;
    long long admitted;  // admission order (the newest is pre-empted first)
} Sequence;

// The decode step's matmuls that read other weights than the model's (generate's -wq): layer l's qkv projection, its
// attention projection, or a dense layer's MLP (la->ln2 to `out`). Returns 0 to leave it to the model's weights.
typedef enum { DECODE_QKV, DECODE_ATTENTION_PROJECTION, DECODE_DENSE_MLP } DecodeMatmul;
typedef struct Engine Engine;
typedef int (*DecodeWeights)(Engine* e, int l, DecodeMatmul which, const LayerParameters* lp,
                             const LayerActivations* la, floatX* out, const floatX* inp, int n);

struct Engine {
    Model* model;
    SamplingSettings sampling;
    int L, C, NH, NKV, HS, QKV, Ca, V, Vp, Vs, maxT, max_batch, max_blocks;
    int tp;              // the tensor-parallel degree: a decode step's rows are a multiple of it
    BlockPool pool;
    int scratch_block;   // the padding rows' block, past the pool's
    floatX* k_cache;     // (L, num_blocks (+ the scratch block), block_size, NKV, HS): this member's heads
    floatX* v_cache;
    size_t layer_cache;  // elements of one layer's cache
    int* block_fill;     // (num_blocks) positions written in each block (the KV waste)
    // the decode step's device buffers for up to max_batch tokens, padded to a multiple of tp
    floatX *residual, *residual2, *ln, *qkv, *atty, *proj, *ffn_out, *logits;
    float *mean, *rstd;
    int *d_tokens, *d_positions, *d_slots, *d_context, *d_query_seq, *d_tables;
    int *h_tokens, *h_positions, *h_slots, *h_context, *h_query_seq, *h_tables;
    int* prefill_tokens_padded;  // (maxT rounded up to tp)
    floatX* host_logits;         // (max_batch, Vp)
    float* row_logits;           // (V)
    Candidate* scratch;          // (V)
    float* kept_logits;          // (V)
    FILE* logits_file;           // each generated position's logits (generate -lo), or NULL
    const char* logits_path;
    long long logits_records;
    DecodeWeights own_weights;   // NULL: the model's weights
    const void* own_weights_data;
    // the summary
    long long prefill_tokens, decode_tokens, decode_steps, preemptions;
    double prefill_seconds, decode_seconds, waste_sum, contiguous_waste_sum;
    cudaStream_t stream;
};

// seconds on the watchdog's monotonic clock, for the summary's rates
static double engine_seconds(void) { return 1e-9 * (double)watchdog_now_ns(); }

static floatX* layer_k(Engine* e, int l) { return e->k_cache + (size_t)l * e->layer_cache; }
static floatX* layer_v(Engine* e, int l) { return e->v_cache + (size_t)l * e->layer_cache; }
static int padded_rows(const Engine* e, int n) { return CEIL_DIV(n, e->tp) * e->tp; }

// The KV cache's bytes per block of `block_size` positions (every layer's keys and values of this member's heads)
static size_t engine_block_bytes(const Model* model, int block_size) {
    const ModelConfig* c = &model->config;
    return 2 * (size_t)c->num_layers * block_size * local_kv_heads(model) * (c->channels / c->num_heads) *
           sizeof(floatX);
}

// An engine for `model` of up to max_batch running sequences and a pool of num_blocks blocks of block_size positions,
// its kernels on `stream`
static void engine_init(Engine* e, Model* model, const SamplingSettings* sampling, int max_batch, int block_size,
                        int num_blocks, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    memset(e, 0, sizeof(*e));
    e->model = model;
    e->sampling = *sampling;
    e->stream = stream;
    e->tp = model_tp_degree(model);
    e->L = c->num_layers;
    e->C = c->channels;
    e->NH = local_heads(model);
    e->NKV = local_kv_heads(model);
    e->HS = c->channels / c->num_heads;
    e->QKV = (int)local_qkv_channels(model);
    e->Ca = local_channels(model);
    e->V = c->vocab_size;
    e->Vp = c->padded_vocab_size;
    e->Vs = local_vocab(model);
    e->maxT = c->max_seq_len;
    e->max_batch = max_batch;
    e->max_blocks = CEIL_DIV(e->maxT, block_size);
    block_pool_init(&e->pool, num_blocks, block_size);
    e->scratch_block = num_blocks;  // allocated under tensor parallelism only
    e->layer_cache = (size_t)(num_blocks + (e->tp > 1)) * block_size * e->NKV * e->HS;
    cudaCheck(cudaMalloc((void**)&e->k_cache, e->L * e->layer_cache * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->v_cache, e->L * e->layer_cache * sizeof(floatX)));
    e->block_fill = (int*)calloc(num_blocks, sizeof(int));
    size_t n = (size_t)padded_rows(e, max_batch), C = e->C;
    floatX** buffers[] = {&e->residual, &e->residual2, &e->ln, &e->proj, &e->ffn_out};
    for (size_t i = 0; i < sizeof(buffers) / sizeof(buffers[0]); i++)
        cudaCheck(cudaMalloc((void**)buffers[i], n * C * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->atty, n * e->Ca * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->qkv, n * e->QKV * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->logits, n * e->Vs * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->mean, n * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&e->rstd, n * sizeof(float)));
    size_t rows = n > (size_t)e->maxT ? n : (size_t)e->maxT;  // a decode step's tokens, or a prefill's positions
    int** device_ints[] = {&e->d_tokens, &e->d_positions, &e->d_slots, &e->d_context, &e->d_query_seq};
    int** host_ints[] = {&e->h_tokens, &e->h_positions, &e->h_slots, &e->h_context, &e->h_query_seq};
    for (int i = 0; i < 5; i++) {
        cudaCheck(cudaMalloc((void**)device_ints[i], rows * sizeof(int)));
        *host_ints[i] = (int*)malloc_check(rows * sizeof(int));
    }
    // a table per decode row, and the padding rows' (max_batch on; fewer than tp) of the scratch block alone
    size_t tables = (size_t)max_batch + e->tp;
    cudaCheck(cudaMalloc((void**)&e->d_tables, tables * e->max_blocks * sizeof(int)));
    e->h_tables = (int*)malloc_check(tables * e->max_blocks * sizeof(int));
    memset(e->h_tables, 0, tables * e->max_blocks * sizeof(int));
    for (size_t r = max_batch; r < tables; r++) e->h_tables[r * e->max_blocks] = e->scratch_block;
    e->prefill_tokens_padded = (int*)malloc_check((size_t)padded_rows(e, e->maxT) * sizeof(int));
    e->host_logits = (floatX*)malloc_check(n * e->Vp * sizeof(floatX));
    e->row_logits = (float*)malloc_check((size_t)e->V * sizeof(float));
    e->scratch = (Candidate*)malloc_check((size_t)e->V * sizeof(Candidate));
    e->kept_logits = (float*)malloc_check((size_t)e->V * sizeof(float));
}

static void engine_free(Engine* e) {
    void* device[] = {e->k_cache, e->v_cache, e->residual, e->residual2, e->ln, e->qkv, e->atty, e->proj, e->ffn_out,
                      e->logits, e->mean, e->rstd, e->d_tokens, e->d_positions, e->d_slots, e->d_context,
                      e->d_query_seq, e->d_tables};
    for (size_t i = 0; i < sizeof(device) / sizeof(device[0]); i++) cudaCheck(cudaFree(device[i]));
    void* host[] = {e->block_fill, e->h_tokens, e->h_positions, e->h_slots, e->h_context, e->h_query_seq, e->h_tables,
                    e->prefill_tokens_padded, e->host_logits, e->row_logits, e->scratch, e->kept_logits};
    for (size_t i = 0; i < sizeof(host) / sizeof(host[0]); i++) free(host[i]);
    block_pool_free(&e->pool);
}

// Whether the engine's decode step computes what the model's forward pass does: not with prompt tuning's virtual
// tokens before every sequence, nor with a prefix's or LLaMA-Adapter's shared keys in the attention
// (llmc/model_adapter.h), which the paged cache holds no place for (generate_by_prefill runs those)
static int engine_decodes(const Model* model) {
    return !(model->frozen && (model_adapter_sequence_extra(model) > 0 || shared_keys_on(model)));
}

// A waiting sequence of `length` prompt tokens that generates up to `generate` more (at most maxT in all) from its
// own generator state `rng`
static void sequence_init(Sequence* s, const Engine* e, int prompt, int sample, const int* tokens, int length,
                          int generate, uint64_t rng) {
    memset(s, 0, sizeof(*s));
    s->prompt = prompt;
    s->sample = sample;
    s->tokens = (int*)malloc_check((size_t)e->maxT * sizeof(int));
    memcpy(s->tokens, tokens, (size_t)length * sizeof(int));
    s->length = s->prompt_length = length;
    s->target = length + generate < e->maxT ? length + generate : e->maxT;
    block_table_init(&s->table, e->max_blocks);
    s->rng = rng;
    s->state = SEQUENCE_WAITING;
}
static void sequence_free(Sequence* s) {
    free(s->tokens);
    free(s->table.blocks);
}

// The physical slot of a sequence's position p (its block must be in its table)
static int slot_of(const Engine* e, const Sequence* s, int p) {
    return s->table.blocks[p / e->pool.block_size] * e->pool.block_size + p % e->pool.block_size;
}

// Position p of s gets a block it may write: a new one past its table, or a copy of a block others still read
// (copy on write: every layer's keys and values of that block). 0 when no block is free.
static int make_writable(Engine* e, Sequence* s, int p) {
    int index = p / e->pool.block_size;
    if (index < s->table.num_blocks && e->pool.refcount[s->table.blocks[index]] == 1) return 1;
    int block = block_take(&e->pool);
    if (block < 0) return 0;
    if (index < s->table.num_blocks) {  // shared: copy what it holds, then read the copy
        int old = s->table.blocks[index];
        size_t n = (size_t)e->pool.block_size * e->NKV * e->HS;
        for (int l = 0; l < e->L; l++) {
            cudaCheck(cudaMemcpyAsync(layer_k(e, l) + block * n, layer_k(e, l) + old * n, n * sizeof(floatX),
                                      cudaMemcpyDeviceToDevice, e->stream));
            cudaCheck(cudaMemcpyAsync(layer_v(e, l) + block * n, layer_v(e, l) + old * n, n * sizeof(floatX),
                                      cudaMemcpyDeviceToDevice, e->stream));
        }
        e->block_fill[block] = e->block_fill[old];
        block_release(&e->pool, old);
        s->table.blocks[index] = block;
    } else {
        e->block_fill[block] = 0;
        s->table.blocks[s->table.num_blocks++] = block;
    }
    return 1;
}

static void note_written(Engine* e, const Sequence* s, int p) {
    int block = s->table.blocks[p / e->pool.block_size], fill = p % e->pool.block_size + 1;
    if (e->block_fill[block] < fill) e->block_fill[block] = fill;
}

// One generated token of s from its logits row (V real columns, floatX): sampled, appended, and its logits recorded
static void take_token(Engine* e, Sequence* s, const floatX* row) {
    for (int v = 0; v < e->V; v++) e->row_logits[v] = (float)row[v];
    int next = sample_token(e->row_logits, e->V, &e->sampling, &s->rng, e->scratch, e->kept_logits);
    if (e->logits_file != NULL) {
        int record[4] = {s->prompt, s->sample, s->length - 1, next};
        fwrite_check(record, sizeof(int), 4, e->logits_file, e->logits_path);
        fwrite_check(e->row_logits, sizeof(float), e->V, e->logits_file, e->logits_path);
        e->logits_records++;
    }
    s->tokens[s->length++] = next;
    if (s->length >= s->target) s->state = SEQUENCE_FINISHED;
}

// The prefill of `count` sequences that hold the same tokens (a prompt's samples, or one resumed sequence): the
// trainers' forward pass over them (flash attention; under tensor parallelism over T rounded up to a multiple of N,
// the causal mask keeping the padding out of the real positions), its keys and values written into the first one's
// blocks, which the others then share; the last position's logits give each its next token. 0 (nothing done) when
// the blocks are not free.
static int prefill(Engine* e, Sequence** group, int count) {
    Sequence* first = group[0];
    int T = first->length, Tp = padded_rows(e, T);
    if (blocks_for(&e->pool, T) > e->pool.num_free) return 0;
    for (int p = 0; p < T; p++) {
        if (!make_writable(e, first, p)) return 0;  // cannot happen: checked above
        e->h_slots[p] = slot_of(e, first, p);
        note_written(e, first, p);
    }
    Model* model = e->model;
    double start = engine_seconds();
    memcpy(e->prefill_tokens_padded, first->tokens, (size_t)T * sizeof(int));
    for (int p = T; p < Tp; p++) e->prefill_tokens_padded[p] = first->tokens[T - 1];
    model_forward(model, e->prefill_tokens_padded, nullptr, 1, Tp, 0.0f, e->stream);
    cudaCheck(cudaMemcpyAsync(e->d_slots, e->h_slots, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, e->stream));
    for (int l = 0; l < e->L; l++) {
        LayerActivations la = model_layer_activations(model, l, 1, Tp);  // la.qkvr: (1, Tp, QKV), q and k roped
        paged_kv_write(layer_k(e, l), layer_v(e, l), la.qkvr, e->d_slots, T, e->NH, e->NKV, e->HS,
                       e->pool.block_size, e->stream);
    }
    model_copy_logits(model, e->host_logits, (size_t)(T - 1), 1, e->stream);
    e->prefill_seconds += engine_seconds() - start;
    e->prefill_tokens += T;
    for (int i = 0; i < count; i++) {
        Sequence* s = group[i];
        if (i > 0) block_table_share(&s->table, &first->table, &e->pool);
        s->cached = T;
        s->state = SEQUENCE_RUNNING;
        take_token(e, s, e->host_logits);
    }
    return 1;
}

// One sequence generated by forward passes alone, for a model the decode step cannot run (engine_decodes): each token
// from the trainers' forward pass over everything the sequence holds (with prompt tuning behind its virtual tokens,
// whose logits rows come first), drawn by take_token from the sequence's generator as the engine draws. T tokens cost
// T passes over up to T positions where the cache's decode steps read each earlier position's keys once: a trainer's
// samples of a fine-tuned model, not serving. No tensor parallelism (fine-tuning refuses it: no padded rows here).
static void generate_by_prefill(Engine* e, Sequence* s) {
    Model* model = e->model;
    int extra = model_adapter_sequence_extra(model);
    while (s->length < s->target) {
        double start = engine_seconds();
        model_forward(model, s->tokens, nullptr, 1, s->length, 0.0f, e->stream);
        model_copy_logits(model, e->host_logits, (size_t)(extra + s->length - 1), 1, e->stream);
        e->prefill_seconds += engine_seconds() - start;
        e->prefill_tokens += s->length;
        take_token(e, s, e->host_logits);
    }
    s->state = SEQUENCE_FINISHED;
}

// A row-parallel block's output rows summed over the tensor-parallel members (every member gets every row: the decode
// step's stream is whole on each, sequence parallelism or not)
static void engine_sum_over_members(Engine* e, floatX* rows, int n) {
    if (e->tp > 1) tensor_parallel_all_reduce(e->model->tp, rows, (size_t)n * e->C, e->stream);
}

// One decode step of the n running sequences `run` (each with a writable block for its last position): their last
// tokens through every layer, attention through the cache, their next tokens from the logits.
static void decode_step(Engine* e, Sequence** run, int n) {
    Model* model = e->model;
    const ModelConfig* c = &model->config;
    cudaStream_t stream = e->stream;
    int rows = padded_rows(e, n);
    double start = engine_seconds();
    for (int i = 0; i < rows; i++) {
        if (i >= n) {  // padding: position 0 of the scratch block, attending to itself
            e->h_tokens[i] = 0;
            e->h_positions[i] = 0;
            e->h_slots[i] = e->scratch_block * e->pool.block_size;
            e->h_context[i] = 1;
            e->h_query_seq[i] = e->max_batch + (i - n);
            continue;
        }
        Sequence* s = run[i];
        int p = s->length - 1;
        e->h_tokens[i] = s->tokens[p];
        e->h_positions[i] = p;
        e->h_slots[i] = slot_of(e, s, p);
        e->h_context[i] = p + 1;
        e->h_query_seq[i] = i;
        memcpy(e->h_tables + (size_t)i * e->max_blocks, s->table.blocks, (size_t)s->table.num_blocks * sizeof(int));
        note_written(e, s, p);
    }
    size_t ints = (size_t)rows * sizeof(int);
    cudaCheck(cudaMemcpyAsync(e->d_tokens, e->h_tokens, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_positions, e->h_positions, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_slots, e->h_slots, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_context, e->h_context, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_query_seq, e->h_query_seq, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_tables, e->h_tables, ((size_t)e->max_batch + e->tp) * e->max_blocks * sizeof(int),
                              cudaMemcpyHostToDevice, stream));

    const FfnExtension* x = model->extension.ffn;
    if (x->begin_forward) x->begin_forward(model, rows, 1, 0.0f);
    ParameterTensors p = model_rest_weights(model, stream);
    const floatX* wpe = c->positions == POSITIONS_LEARNED ? p.wpe : nullptr;
    int member = model_tp_member(model);
    // the embeddings, vocabulary-parallel under tensor parallelism (member 0 adds wpe)
    encoder_forward_vocab_range_at(e->residual, e->d_tokens, e->d_positions, p.wte, member == 0 ? wpe : nullptr,
                                   rows, e->C, member * e->Vs, e->tp > 1 ? e->Vs : INT_MAX, stream);
    engine_sum_over_members(e, e->residual, rows);
    LayerParameters first = model_layer_weights(model, 0, stream);
    norm_forward(model, e->ln, e->mean, e->rstd, e->residual, first.ln1w, first.ln1b, rows, 1, stream);
    for (int l = 0; l < e->L; l++) {
        LayerParameters lp = model_layer_weights(model, l, stream);
        LayerActivations la = model_layer_activations(model, l, rows, 1);  // the FFN's own buffers, for these rows
        la.ln2 = e->ln;
        // attention: qkv, RoPE at each token's position, its key and value into the cache, attention through it
        if (e->own_weights == NULL || !e->own_weights(e, l, DECODE_QKV, &lp, &la, e->qkv, e->ln, rows))
            linear_forward(model, LORA_QKV, l, e->qkv, e->ln, lp.qkvw, lp.qkvb, rows, 1, e->C, e->QKV, stream);
        if (c->positions == POSITIONS_ROPE)
            rope_forward_at(e->qkv, model->rope_table, e->d_positions, rows, e->NH, e->NKV, e->HS, stream);
        paged_kv_write(layer_k(e, l), layer_v(e, l), e->qkv, e->d_slots, rows, e->NH, e->NKV, e->HS,
                       e->pool.block_size, stream);
        paged_attention_forward(e->atty, e->qkv, layer_k(e, l), layer_v(e, l), e->d_tables, e->max_blocks,
                                e->d_query_seq, e->d_context, rows, e->NH, e->NKV, e->HS, e->pool.block_size, stream);
        if (e->own_weights == NULL ||
            !e->own_weights(e, l, DECODE_ATTENTION_PROJECTION, &lp, &la, e->proj, e->atty, rows))
            linear_forward(model, LORA_PROJ, l, e->proj, e->atty, lp.attprojw, row_parallel_bias(model, lp.attprojb),
                           rows, 1, e->Ca, e->C, stream);
        model_adapter_site_forward(model, BOTTLENECK_ATTENTION, l, e->proj, rows, 0, stream);
        engine_sum_over_members(e, e->proj, rows);
        residual_norm_forward(model, e->residual2, e->ln, e->mean, e->rstd, e->residual, e->proj, lp.ln2w, lp.ln2b,
                              rows, stream);
        if (!model_is_dense_layer(model, l) || e->own_weights == NULL ||
            !e->own_weights(e, l, DECODE_DENSE_MLP, &lp, &la, e->ffn_out, e->ln, rows))
            layer_ffn(model, l)->forward(model, l, &lp, &la, e->ffn_out, rows, 1, stream);
        model_adapter_site_forward(model, BOTTLENECK_FFN, l, e->ffn_out, rows, 0, stream);
        engine_sum_over_members(e, e->ffn_out, rows);
        // the residual add fused with the next layer's first norm, or the final one
        const floatX* norm_w = p.lnfw;
        const floatX* norm_b = p.lnfb;
        if (l + 1 < e->L) {
            LayerParameters next = model_layer_weights(model, l + 1, stream);
            norm_w = next.ln1w;
            norm_b = next.ln1b;
        }
        residual_norm_forward(model, e->residual, e->ln, e->mean, e->rstd, e->residual2, e->ffn_out, norm_w, norm_b,
                              rows, stream);
    }
    // the logits: this member's vocabulary rows, put together on the host
    linear_forward(model, LORA_LM_HEAD, 0, e->logits, e->ln, c->tied ? p.wte : p.lm_head, nullptr, rows, 1, e->C, e->Vs,
                   stream);
    tp_copy_logits(model, e->host_logits, e->logits, (size_t)n, stream);
    e->decode_seconds += engine_seconds() - start;
    e->decode_tokens += n;
    e->decode_steps++;
    for (int i = 0; i < n; i++) {
        run[i]->cached = run[i]->length;
        take_token(e, run[i], e->host_logits + (size_t)i * e->Vp);
    }
}

// The KV memory this step holds but no token fills, paged and as a contiguous cache of maxT per sequence would hold
static void note_waste(Engine* e, int running) {
    long long used = 0, filled = 0;
    for (int b = 0; b < e->pool.num_blocks; b++) {
        if (e->pool.refcount[b] == 0) continue;
        used++;
        filled += e->block_fill[b];
    }
    if (used == 0) return;
    e->waste_sum += 1.0 - (double)filled / ((double)used * e->pool.block_size);
    e->contiguous_waste_sum += 1.0 - (double)filled / ((double)running * e->maxT);
}

// The scheduler: admit waiting sequences in order while a running place and their prefill's blocks are free, then
// one decode step of everything running; a sequence that needs a block when none is free pre-empts the newest
// running one (whose blocks go back; it waits at the head of the queue and later resumes by a prefill of all it
// holds). A prompt's `samples` sequences (consecutive in seqs, sample 0 first) are admitted together and share its
// prefill.
static void run_engine(Engine* e, Sequence* seqs, int count, int samples) {
    Sequence** queue = (Sequence**)malloc_check((size_t)count * sizeof(Sequence*));  // waiting, in order
    Sequence** run = (Sequence**)malloc_check((size_t)count * sizeof(Sequence*));
    int queued = count, running = 0, finished = 0;
    long long admissions = 0;
    for (int i = 0; i < count; i++) queue[i] = &seqs[i];
    while (finished < count) {
        // admission: a prompt's samples together (they share its prefill), a resumed sequence alone
        while (queued > 0) {
            int group = 1;
            Sequence* head = queue[0];
            if (head->length == head->prompt_length && head->sample == 0)
                while (group < samples && group < queued && queue[group]->prompt == head->prompt) group++;
            if (running + group > e->max_batch || !prefill(e, queue, group)) break;
            for (int i = 0; i < group; i++) {
                queue[i]->admitted = admissions++;
                if (queue[i]->state == SEQUENCE_FINISHED) {
                    block_table_release(&queue[i]->table, &e->pool);
                    finished++;
                } else {
                    run[running++] = queue[i];
                }
            }
            memmove(queue, queue + group, (size_t)(queued - group) * sizeof(Sequence*));
            queued -= group;
        }
        if (running == 0) {
            if (queued > 0) {
                fprintf(stderr, "generate: the cache (%d blocks of %d) cannot hold one waiting sequence\n",
                        e->pool.num_blocks, e->pool.block_size);
                exit(EXIT_FAILURE);
            }
            break;
        }
        // every running sequence's last position gets a writable block; the newest give theirs up when none is free
        // (removed in place, so that run[] keeps its order and index i follows the sequence it names)
        for (int i = 0; i < running; i++) {
            while (!make_writable(e, run[i], run[i]->length - 1)) {
                int newest = 0;
                for (int j = 1; j < running; j++)
                    if (run[j]->admitted > run[newest]->admitted) newest = j;
                Sequence* out = run[newest];
                block_table_release(&out->table, &e->pool);
                out->cached = 0;
                out->state = SEQUENCE_WAITING;
                memmove(queue + 1, queue, (size_t)queued * sizeof(Sequence*));
                queue[0] = out;
                queued++;
                memmove(run + newest, run + newest + 1, (size_t)(running - newest - 1) * sizeof(Sequence*));
                running--;
                e->preemptions++;
                if (newest <= i) i--;     // run[i] moved down one place, or (newest == i) was the one pre-empted
                if (newest == i + 1) break;  // i + 1 was i before: the sequence that needed the block went
            }
        }
        if (running == 0) continue;
        note_waste(e, running);
        decode_step(e, run, running);
        int still = 0;  // the finished leave, the others keep their order
        for (int i = 0; i < running; i++) {
            if (run[i]->state != SEQUENCE_FINISHED) {
                run[still++] = run[i];
                continue;
            }
            block_table_release(&run[i]->table, &e->pool);
            finished++;
        }
        running = still;
    }
    free(queue);
    free(run);
}
