// generate.cu: text generation from any model file the trainers write (GPT-2, llama, MoE; a checkpoint's
// model_%08d.bin too) with a paged KV cache and continuous batching (doc/inference.md). Each prompt's prefill is the
// trainers' forward pass (flash attention), whose keys and values go into cache blocks; every running sequence then
// decodes one token per step through llmc/paged_attention.cuh, reading its keys and values through its block table
// (llmc/kv_cache.h). Waiting prompts join as soon as blocks are free; when the cache is full the newest sequence is
// pre-empted (its blocks freed) and later resumed by a prefill of everything it has. Its model is train_gpt.cu's and
// train_moe.cu's, which this file includes; MoE layers route each token as in evaluation, dropless.
// Build and run:
//   make generate [PRECISION=...]        GPU; make generate_cpu: the CPU backend
//   ./generate -e model.bin -i prompts.txt -g 64 -temp 0.8 -topk 40      (./generate -h lists the flags)
//   ./generate -e model.bin -i ids.txt -ids 1 -temp 0 -lo logits.bin     (token ids in and out; the logits file)
// Tests: dev/test/test_generate.sh (the generate-* rows).
#define OMIT_TRAIN_MOE_MAIN
#include "train_moe.cu"
#include "llmc/kv_cache.h"
#include "llmc/paged_attention.cuh"
#include "llmc/quantize.cuh"

// ----------------------------------------------------------------------------------------------------
// Flags: X(name, type, GenerateFlags member, default, help) as llmc/cli.h's tables. Those the trainers have too mean
// the same thing here (-e, -g, -sd, -b, -tf).
#define GENERATE_FLAGS(X)                                                                                              \
    X("-e", STRING, model_path, "", "the model file: a trainer's model file or checkpoint model_%08d.bin (required)") \
    X("-i", STRING, prompts_path, "", "the prompts, one per line (required unless -vp)")                             \
    X("-ids", INT, ids, 0,                                                                                             \
      "1: each prompt line is token ids separated by spaces, and each output line 'PROMPT SAMPLE: id id ...'\n"       \
      "(0-based indices, the generated ids); 0: text through -tf's tokenizer (default = 0)")                          \
    X("-tf", STRING, tokenizer_path, "data/tinyshakespeare/gpt2_tokenizer.bin",                                       \
      "tokenizer file: decodes the output; encodes text prompts when its vocabulary is bytes\n(default = "            \
      "data/tinyshakespeare/gpt2_tokenizer.bin)")                                                                      \
    X("-g", INT, gen_tokens, 64, "generated tokens per sample (default = 64; fewer where maxT ends a sequence)")     \
    X("-temp", FLOAT, temperature, 1.0f, "sampling temperature; 0 = greedy, the most likely token (default = 1)")  \
    X("-topk", INT, top_k, 0, "sample among the k most likely tokens (default = 0: all)")                            \
    X("-topp", FLOAT, top_p, 1.0f,                                                                                     \
      "sample among the most likely tokens whose probabilities reach p (nucleus; default = 1: all)")                  \
    X("-sd", INT, seed, 1337, "sampling seed: the same seed and flags give the same samples (default = 1337)")       \
    X("-sn", INT, samples, 1, "samples per prompt; they share the prompt's cache blocks (default = 1)")              \
    X("-b", INT, max_batch, 16, "the most sequences running (decoded together) at once (default = 16)")             \
    X("-bs", INT, block_size, 16,                                                                                      \
      "token positions per cache block; 0 = one block of maxT per sequence, a contiguous cache (default = 16)")       \
    X("-km", FLOAT, cache_mib, 0.0f,                                                                                   \
      "the KV cache's size in MiB, a decimal number (default = 0: room for -b sequences of maxT positions)")          \
    X("-lo", STRING, logits_path, "",                                                                                  \
      "write the logits of every generated position to this file (doc/formats.md, \"Logits file\"; default = none)") \
    X("-vp", STRING, perplexity_path, "",                                                                              \
      "report the model's perplexity on this data shard (every whole sequence of maxT + 1 tokens; default = none)") \
    X("-wq", STRING, weight_quant, "none",                                                                             \
      "weight-only quantisation of each layer's qkv, attention projection and dense MLP: none, int8 (per output\n"    \
      "channel absmax) or nf4 (QLoRA's: blocks of 64, double-quantised absmax) (default = none)")                   \
    X("-wm", STRING, dequantized_path, "",                                                                             \
      "with -wq: write the model with its quantised weights dequantised, what the quantised model computes, as a\n"  \
      "model file every program reads (default = none)")
typedef struct {
    GENERATE_FLAGS(FLAG_FIELD)
} GenerateFlags;
static GenerateFlags generate_flags = {GENERATE_FLAGS(FLAG_DEFAULT_VALUE)};
#define FLAG_TARGET generate_flags
static Flag generate_flag_table[] = {GENERATE_FLAGS(FLAG_ROW){"-h", FLAG_INT, NULL, "this help", 0}};
#undef FLAG_TARGET

// seconds on the watchdog's monotonic clock, for the summary's rates
static double wall_seconds(void) { return 1e-9 * (double)watchdog_now_ns(); }

#define LOGITS_MAGIC 20261204
#define LOGITS_VERSION 1

// ----------------------------------------------------------------------------------------------------
// Prompts

typedef struct {
    int* tokens;
    int length;
} Prompt;

// The prompts of -i, one per line: token ids (-ids 1) or text encoded byte by byte through a byte-level tokenizer
// (every piece of ids 0..255 the one byte of that value), after its end-of-text token (a document's start). Refused
// with one line: an unreadable or empty file, an empty prompt, an id outside the vocabulary, a prompt longer than
// maxT - 1 (a sequence generates from position len on), text without a byte-level tokenizer.
static Prompt* read_prompts(const char* path, int ids, const Tokenizer* tokenizer, int V, int maxT, int* count) {
    FILE* f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "-i %s: cannot read the prompts file\n", path);
        exit(EXIT_FAILURE);
    }
    if (!ids && !tokenizer_is_bytes(tokenizer)) {
        fprintf(stderr, "-i %s: text prompts need a byte-level tokenizer (-tf %s is not one): give token ids with -ids "
                "1\n", path, tokenizer->path);
        exit(EXIT_FAILURE);
    }
    Prompt* prompts = NULL;
    int n = 0, capacity = 0;
    char* line = NULL;
    size_t line_capacity = 0;
    ssize_t got;
    while ((got = getline(&line, &line_capacity, f)) != -1) {
        if (got > 0 && line[got - 1] == '\n') line[--got] = '\0';
        if (n == capacity) {
            capacity = capacity ? 2 * capacity : 16;
            prompts = (Prompt*)realloc(prompts, (size_t)capacity * sizeof(Prompt));
            if (prompts == NULL) { fprintf(stderr, "read_prompts: out of memory\n"); exit(EXIT_FAILURE); }
        }
        Prompt* p = &prompts[n];
        p->tokens = (int*)malloc_check(((size_t)got + 2) * sizeof(int));  // ids: at most (got+1)/2; text: got+1
        p->length = 0;
        if (ids) {
            char* at = line;
            while (1) {
                while (*at == ' ' || *at == '\t' || *at == '\r') at++;
                if (*at == '\0') break;
                char* end;
                long id = strtol(at, &end, 10);
                if (end == at || (*end != '\0' && *end != ' ' && *end != '\t' && *end != '\r') || id < 0 || id >= V) {
                    fprintf(stderr, "-i %s: line %d: '%.*s' is not a token id of the model (0..%d)\n", path, n + 1,
                            (int)(strcspn(at, " \t\r")), at, V - 1);
                    exit(EXIT_FAILURE);
                }
                p->tokens[p->length++] = (int)id;
                at = end;
            }
        } else {  // a document's start, as the training data has it, then the text's bytes
            p->tokens[p->length++] = tokenizer->eot_token;
            for (ssize_t i = 0; i < got; i++) p->tokens[p->length++] = (unsigned char)line[i];
        }
        if (p->length == 0) {
            fprintf(stderr, "-i %s: line %d is an empty prompt\n", path, n + 1);
            exit(EXIT_FAILURE);
        }
        if (p->length > maxT - 1) {
            fprintf(stderr, "-i %s: line %d: a prompt of %d tokens; the model's maxT %d leaves room for at most %d\n",
                    path, n + 1, p->length, maxT, maxT - 1);
            exit(EXIT_FAILURE);
        }
        n++;
    }
    free(line);
    fclose(f);
    if (n == 0) {
        fprintf(stderr, "-i %s: no prompts (an empty file)\n", path);
        exit(EXIT_FAILURE);
    }
    *count = n;
    return prompts;
}

// ----------------------------------------------------------------------------------------------------
// Sampling (host): temperature, top-k and top-p over the V real logits, then a draw from the softmax of what is kept

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
// llmc/sampler.h's softmax walk.
static int sample_token(const float* logits, int V, const GenerateFlags* f, uint64_t* rng, Candidate* scratch,
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
// Quantised weights (-wq, llmc/quantize.cuh): each layer's qkv, attention projection and dense MLP weights, quantised
// once at load. The model's own copies are then overwritten by their dequantised values, so that the prefill and -vp
// (the trainers' forward pass through cuBLAS) run the quantised model; the decode step's matmuls read the quantised
// weights in matmul_forward_int8 / _nf4, which dequantise to the same fp32 values. Embeddings, norms, lm_head and MoE
// layers (router, experts) stay as they are.

typedef enum { QUANT_NONE, QUANT_INT8, QUANT_NF4 } WeightQuant;
typedef struct {
    int OC, C;
    int8_t* q;        // int8: (OC, C) codes and (OC) scales
    float* scale;
    Nf4Weights nf4;   // nf4
} QuantizedWeight;
typedef struct {
    QuantizedWeight qkv, attproj, fc, fcproj;  // fc, fcproj: dense layers only
} QuantizedLayer;

static WeightQuant weight_quant_of(const char* name) {
    if (!strcmp(name, "none")) return QUANT_NONE;
    if (!strcmp(name, "int8")) return QUANT_INT8;
    if (!strcmp(name, "nf4")) return QUANT_NF4;
    fprintf(stderr, "-wq %s: expected none, int8 or nf4\n", name);
    exit(EXIT_FAILURE);
}

// w (OC, C) of the model quantised into q, and w overwritten with its dequantised values; refused in one line when
// the kernels cannot take the shape
static void quantize_weight(QuantizedWeight* q, WeightQuant kind, floatX* w, int OC, int C, const char* name,
                            cudaStream_t stream) {
    char why[160];
    if (!quantize_support(kind == QUANT_NF4, C, OC, why, sizeof(why))) {
        fprintf(stderr, "-wq %s: %s (%d x %d): %s\n", kind == QUANT_NF4 ? "nf4" : "int8", name, OC, C, why);
        exit(EXIT_FAILURE);
    }
    q->OC = OC;
    q->C = C;
    if (kind == QUANT_INT8) {
        cudaCheck(cudaMalloc((void**)&q->q, (size_t)OC * C));
        cudaCheck(cudaMalloc((void**)&q->scale, (size_t)OC * sizeof(float)));
        quantize_int8(q->q, q->scale, w, OC, C, stream);
        dequantize_int8(w, q->q, q->scale, OC, C, stream);
    } else {
        nf4_allocate(&q->nf4, OC, C);
        quantize_nf4(&q->nf4, w, OC, C, stream);
        dequantize_nf4(w, &q->nf4, OC, C, stream);
    }
}

// out (N, OC) = inp (N, C) · the quantised weight, + bias
static void quantized_matmul(floatX* out, const floatX* inp, const QuantizedWeight* q, WeightQuant kind,
                             const floatX* bias, int N, cudaStream_t stream) {
    if (kind == QUANT_INT8) matmul_forward_int8(out, inp, q->q, q->scale, bias, N, q->C, q->OC, stream);
    else matmul_forward_nf4(out, inp, &q->nf4, bias, N, q->C, q->OC, stream);
}

// Every layer's weights quantised (the model's own overwritten with their dequantised values); the bytes they take
static QuantizedLayer* quantize_model(Model* model, WeightQuant kind, size_t* bytes, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    int C = c->channels, QKV = (int)local_qkv_channels(model), FC = (int)local_fc_channels(model);
    int H = local_hidden(model);
    QuantizedLayer* layers = (QuantizedLayer*)calloc(c->num_layers, sizeof(QuantizedLayer));
    *bytes = 0;
    for (int l = 0; l < c->num_layers; l++) {
        LayerParameters lp = model_layer_weights(model, l, stream);
        QuantizedLayer* q = &layers[l];
        quantize_weight(&q->qkv, kind, lp.qkvw, QKV, C, "qkvw", stream);
        quantize_weight(&q->attproj, kind, lp.attprojw, C, C, "attprojw", stream);
        size_t n = (size_t)QKV * C + (size_t)C * C;
        if (model_is_dense_layer(model, l)) {
            quantize_weight(&q->fc, kind, lp.fcw, FC, C, "fcw", stream);
            quantize_weight(&q->fcproj, kind, lp.fcprojw, C, H, "fcprojw", stream);
            n += (size_t)FC * C + (size_t)C * H;
        }
        *bytes += kind == QUANT_INT8 ? n : 0;
    }
    if (kind == QUANT_INT8) {  // and the scales
        for (int l = 0; l < c->num_layers; l++)
            *bytes += ((size_t)layers[l].qkv.OC + layers[l].attproj.OC + layers[l].fc.OC + layers[l].fcproj.OC) *
                      sizeof(float);
    } else {
        for (int l = 0; l < c->num_layers; l++) {
            const QuantizedLayer* q = &layers[l];
            *bytes += nf4_bytes(q->qkv.OC, q->qkv.C) + nf4_bytes(q->attproj.OC, q->attproj.C);
            if (q->fc.OC > 0) *bytes += nf4_bytes(q->fc.OC, q->fc.C) + nf4_bytes(q->fcproj.OC, q->fcproj.C);
        }
    }
    cudaCheck(cudaStreamSynchronize(stream));
    return layers;
}

// The dense MLP of a decode step on quantised weights: the GELU or SwiGLU MLP of train_gpt.cu (fc into la->fch, the
// activation into la->ffn_act, fcproj into out) with each matmul through the quantised kernel
static void quantized_mlp_forward(const Model* model, const QuantizedLayer* q, WeightQuant kind,
                                  const LayerParameters* lp, const LayerActivations* la, floatX* out, int n,
                                  cudaStream_t stream) {
    int H = local_hidden(model);
    quantized_matmul(la->fch, la->ln2, &q->fc, kind, lp->fcb, n, stream);
    if (model->config.activation == ACTIVATION_SWIGLU) swiglu_forward(la->ffn_act, la->fch, n, H, stream);
    else gelu_forward(la->ffn_act, la->fch, (size_t)n * H, stream);
    quantized_matmul(out, la->ffn_act, &q->fcproj, kind, lp->fcprojb, n, stream);
}

// ----------------------------------------------------------------------------------------------------
// Sequences and the engine

typedef enum { SEQUENCE_WAITING, SEQUENCE_RUNNING, SEQUENCE_FINISHED } SequenceState;
typedef struct {
    int prompt, sample;  // which prompt, which of its -sn samples
    int* tokens;         // (maxT) the prompt, then the generated tokens
    int length;          // tokens held
    int prompt_length;
    int target;          // the length at which it is finished: prompt + -g, at most maxT
    int cached;          // positions whose keys and values are in the cache
    BlockTable table;
    uint64_t rng;        // its own generator: its samples do not depend on what else runs
    SequenceState state;
    long long admitted;  // admission order (the newest is pre-empted first)
} Sequence;

typedef struct {
    Model* model;
    const GenerateFlags* flags;
    int L, C, NH, NKV, HS, QKV, V, Vp, maxT, max_batch, max_blocks;
    BlockPool pool;
    floatX* k_cache;  // (L, num_blocks, block_size, NKV, HS)
    floatX* v_cache;
    size_t layer_cache;  // elements of one layer's cache
    int* block_fill;     // (num_blocks) positions written in each block (the KV waste)
    // the decode step's device buffers for up to max_batch tokens
    floatX *residual, *residual2, *ln, *qkv, *atty, *proj, *ffn_out, *logits;
    float *mean, *rstd;
    int *d_tokens, *d_positions, *d_slots, *d_context, *d_query_seq, *d_tables;
    int *h_tokens, *h_positions, *h_slots, *h_context, *h_query_seq, *h_tables;
    floatX* host_logits;  // (max_batch or maxT, Vp)
    float* row_logits;    // (V)
    Candidate* scratch;   // (V)
    float* kept_logits;   // (V)
    FILE* logits_file;
    long long logits_records;
    WeightQuant quant;
    const QuantizedLayer* quantized;  // (L) with -wq, else NULL
    // the summary
    long long prefill_tokens, decode_tokens, decode_steps, preemptions;
    double prefill_seconds, decode_seconds, waste_sum, contiguous_waste_sum;
    cudaStream_t stream;
} Engine;

static floatX* layer_k(Engine* e, int l) { return e->k_cache + (size_t)l * e->layer_cache; }
static floatX* layer_v(Engine* e, int l) { return e->v_cache + (size_t)l * e->layer_cache; }

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
    int next = sample_token(e->row_logits, e->V, e->flags, &s->rng, e->scratch, e->kept_logits);
    if (e->logits_file != NULL) {
        int record[4] = {s->prompt, s->sample, s->length - 1, next};
        fwrite_check(record, sizeof(int), 4, e->logits_file, e->flags->logits_path);
        fwrite_check(e->row_logits, sizeof(float), e->V, e->logits_file, e->flags->logits_path);
        e->logits_records++;
    }
    s->tokens[s->length++] = next;
    if (s->length >= s->target) s->state = SEQUENCE_FINISHED;
}

// The prefill of `count` sequences that hold the same tokens (a prompt's -sn samples, or one resumed sequence):
// the trainers' forward pass over them (flash attention), its keys and values written into the first one's blocks,
// which the others then share; the last position's logits give each its next token. 0 (nothing done) when the
// blocks are not free.
static int prefill(Engine* e, Sequence** group, int count) {
    Sequence* first = group[0];
    int T = first->length;
    if (blocks_for(&e->pool, T) > e->pool.num_free) return 0;
    for (int p = 0; p < T; p++) {
        if (!make_writable(e, first, p)) return 0;  // cannot happen: checked above
        e->h_slots[p] = slot_of(e, first, p);
        note_written(e, first, p);
    }
    Model* model = e->model;
    double start = wall_seconds();
    model_forward(model, first->tokens, nullptr, 1, T, 0.0f, e->stream);
    cudaCheck(cudaMemcpyAsync(e->d_slots, e->h_slots, (size_t)T * sizeof(int), cudaMemcpyHostToDevice, e->stream));
    for (int l = 0; l < e->L; l++) {
        LayerActivations la = model_layer_activations(model, l, 1, T);  // la.qkvr: (1, T, QKV), q and k roped
        paged_kv_write(layer_k(e, l), layer_v(e, l), la.qkvr, e->d_slots, T, e->NH, e->NKV, e->HS,
                       e->pool.block_size, e->stream);
    }
    model_copy_logits(model, e->host_logits, (size_t)(T - 1), 1, e->stream);
    e->prefill_seconds += wall_seconds() - start;
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

// One decode step of the n running sequences `run` (each with a writable block for its last position): their last
// tokens through every layer, attention through the cache, their next tokens from the logits.
static void decode_step(Engine* e, Sequence** run, int n) {
    Model* model = e->model;
    const ModelConfig* c = &model->config;
    cudaStream_t stream = e->stream;
    double start = wall_seconds();
    for (int i = 0; i < n; i++) {
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
    size_t ints = (size_t)n * sizeof(int);
    cudaCheck(cudaMemcpyAsync(e->d_tokens, e->h_tokens, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_positions, e->h_positions, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_slots, e->h_slots, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_context, e->h_context, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_query_seq, e->h_query_seq, ints, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaMemcpyAsync(e->d_tables, e->h_tables, ints * e->max_blocks, cudaMemcpyHostToDevice, stream));

    const FfnExtension* x = model->extension.ffn;
    if (x->begin_forward) x->begin_forward(model, n, 1, 0.0f);
    ParameterTensors p = model_rest_weights(model, stream);
    const floatX* wpe = c->positions == POSITIONS_LEARNED ? p.wpe : nullptr;
    encoder_forward_at(e->residual, e->d_tokens, e->d_positions, p.wte, wpe, n, e->C, stream);
    LayerParameters first = model_layer_weights(model, 0, stream);
    norm_forward(model, e->ln, e->mean, e->rstd, e->residual, first.ln1w, first.ln1b, n, 1, stream);
    for (int l = 0; l < e->L; l++) {
        LayerParameters lp = model_layer_weights(model, l, stream);
        // attention: qkv, RoPE at each token's position, its key and value into the cache, attention through it
        const QuantizedLayer* q = e->quantized != NULL ? &e->quantized[l] : NULL;
        if (q != NULL) quantized_matmul(e->qkv, e->ln, &q->qkv, e->quant, lp.qkvb, n, stream);
        else matmul_forward(e->qkv, e->ln, lp.qkvw, lp.qkvb, n, 1, e->C, e->QKV, stream);
        if (c->positions == POSITIONS_ROPE)
            rope_forward_at(e->qkv, model->rope_table, e->d_positions, n, e->NH, e->NKV, e->HS, stream);
        paged_kv_write(layer_k(e, l), layer_v(e, l), e->qkv, e->d_slots, n, e->NH, e->NKV, e->HS,
                       e->pool.block_size, stream);
        paged_attention_forward(e->atty, e->qkv, layer_k(e, l), layer_v(e, l), e->d_tables, e->max_blocks,
                                e->d_query_seq, e->d_context, n, e->NH, e->NKV, e->HS, e->pool.block_size, stream);
        if (q != NULL) quantized_matmul(e->proj, e->atty, &q->attproj, e->quant, lp.attprojb, n, stream);
        else matmul_forward(e->proj, e->atty, lp.attprojw, lp.attprojb, n, 1, e->C, e->C, stream);
        LayerActivations la = model_layer_activations(model, l, n, 1);  // the FFN's own buffers, for n tokens
        la.ln2 = e->ln;
        residual_norm_forward(model, e->residual2, e->ln, e->mean, e->rstd, e->residual, e->proj, lp.ln2w, lp.ln2b, n,
                              stream);
        if (q != NULL && model_is_dense_layer(model, l))
            quantized_mlp_forward(model, q, e->quant, &lp, &la, e->ffn_out, n, stream);
        else
            layer_ffn(model, l)->forward(model, l, &lp, &la, e->ffn_out, n, 1, stream);
        // the residual add fused with the next layer's first norm, or the final one
        const floatX* norm_w = p.lnfw;
        const floatX* norm_b = p.lnfb;
        if (l + 1 < e->L) {
            LayerParameters next = model_layer_weights(model, l + 1, stream);
            norm_w = next.ln1w;
            norm_b = next.ln1b;
        }
        residual_norm_forward(model, e->residual, e->ln, e->mean, e->rstd, e->residual2, e->ffn_out, norm_w, norm_b, n,
                              stream);
    }
    matmul_forward(e->logits, e->ln, c->tied ? p.wte : p.lm_head, nullptr, n, 1, e->C, e->Vp, stream);
    cudaCheck(cudaMemcpyAsync(e->host_logits, e->logits, (size_t)n * e->Vp * sizeof(floatX), cudaMemcpyDeviceToHost,
                              stream));
    cudaCheck(cudaStreamSynchronize(stream));
    e->decode_seconds += wall_seconds() - start;
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
// running one (whose blocks go back; it waits at the head of the queue and later resumes by a prefill of all it holds).
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

// ----------------------------------------------------------------------------------------------------
// main

static void allocate_engine(Engine* e, int num_blocks) {
    size_t n = (size_t)e->max_batch;
    size_t C = e->C;
    e->layer_cache = (size_t)num_blocks * e->pool.block_size * e->NKV * e->HS;
    cudaCheck(cudaMalloc((void**)&e->k_cache, e->L * e->layer_cache * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->v_cache, e->L * e->layer_cache * sizeof(floatX)));
    e->block_fill = (int*)calloc(num_blocks, sizeof(int));
    floatX** buffers[] = {&e->residual, &e->residual2, &e->ln, &e->atty, &e->proj, &e->ffn_out};
    for (size_t i = 0; i < sizeof(buffers) / sizeof(buffers[0]); i++)
        cudaCheck(cudaMalloc((void**)buffers[i], n * C * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->qkv, n * e->QKV * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->logits, n * e->Vp * sizeof(floatX)));
    cudaCheck(cudaMalloc((void**)&e->mean, n * sizeof(float)));
    cudaCheck(cudaMalloc((void**)&e->rstd, n * sizeof(float)));
    size_t rows = n > (size_t)e->maxT ? n : (size_t)e->maxT;  // a decode step's tokens, or a prefill's positions
    int** device_ints[] = {&e->d_tokens, &e->d_positions, &e->d_slots, &e->d_context, &e->d_query_seq};
    int** host_ints[] = {&e->h_tokens, &e->h_positions, &e->h_slots, &e->h_context, &e->h_query_seq};
    for (int i = 0; i < 5; i++) {
        cudaCheck(cudaMalloc((void**)device_ints[i], rows * sizeof(int)));
        *host_ints[i] = (int*)malloc_check(rows * sizeof(int));
    }
    cudaCheck(cudaMalloc((void**)&e->d_tables, n * e->max_blocks * sizeof(int)));
    e->h_tables = (int*)malloc_check(n * e->max_blocks * sizeof(int));
    e->host_logits = (floatX*)malloc_check(n * e->Vp * sizeof(floatX));
    e->row_logits = (float*)malloc_check((size_t)e->V * sizeof(float));
    e->scratch = (Candidate*)malloc_check((size_t)e->V * sizeof(Candidate));
    e->kept_logits = (float*)malloc_check((size_t)e->V * sizeof(float));
}

static void check_flags(const GenerateFlags* f) {
    const char* why = NULL;
    if (f->model_path[0] == '\0') why = "-e: a model file is required";
    else if (f->prompts_path[0] == '\0' && f->perplexity_path[0] == '\0') why = "-i: a prompts file is required";
    else if (f->ids != 0 && f->ids != 1) why = "-ids: expected 0 or 1";
    else if (f->gen_tokens < 1) why = "-g: at least 1 generated token";
    else if (!(f->temperature >= 0.0f)) why = "-temp: a temperature >= 0";
    else if (f->top_k < 0) why = "-topk: expected >= 0 (0: all)";
    else if (!(f->top_p > 0.0f && f->top_p <= 1.0f)) why = "-topp: expected in (0, 1]";
    else if (f->samples < 1) why = "-sn: at least 1 sample per prompt";
    else if (f->max_batch < 1) why = "-b: at least 1 running sequence";
    else if (f->block_size < 0) why = "-bs: expected >= 0 (0: contiguous)";
    else if (!(f->cache_mib >= 0.0f)) why = "-km: expected >= 0 (0: room for -b sequences of maxT)";
    else if (f->samples > f->max_batch) why = "-sn: a prompt's samples run together: at most -b";
    if (why != NULL) {
        fprintf(stderr, "%s\n", why);
        exit(EXIT_FAILURE);
    }
    // a quantisation it does not know is refused now, before the model loads
    if (weight_quant_of(f->weight_quant) == QUANT_NONE && f->dequantized_path[0] != '\0') {
        fprintf(stderr, "-wm %s: needs -wq int8 or nf4\n", f->dequantized_path);
        exit(EXIT_FAILURE);
    }
}

// The perplexity exp(mean cross-entropy) of the model on the data shard at `path`: every whole sequence of maxT
// positions (maxT + 1 tokens with its targets) in order, through the trainers' forward pass, the mean in double.
static void report_perplexity(Model* model, const char* path, cudaStream_t stream) {
    int T = model->config.max_seq_len;
    DataLoader loader;
    dataloader_init(&loader, path, 1, T, 0, 1, 0, 0);
    dataloader_set_vocab_size(&loader, model->config.vocab_size);
    size_t sequences = (dataloader_num_tokens(&loader) - 1) / T;
    if (sequences == 0) {
        fprintf(stderr, "-vp %s: fewer than maxT + 1 = %d tokens\n", path, T + 1);
        exit(EXIT_FAILURE);
    }
    double loss = 0.0;
    for (size_t i = 0; i < sequences; i++) {
        dataloader_next_batch(&loader);
        model_forward(model, loader.inputs, loader.targets, 1, T, 0.0f, stream);
        loss += model_mean_loss(model);
    }
    loss /= (double)sequences;
    printf("perplexity %.6f (loss %.6f) over %zu sequences of %d tokens of %s\n", exp(loss), loss, sequences, T, path);
    dataloader_free(&loader);
}

// The model file's magic: which trainer's model it is
static int is_moe_model_file(const char* path) {
    FILE* f = fopen_check(path, "rb");
    int magic = 0;
    size_t got = fread(&magic, sizeof(int), 1, f);
    fclose(f);
    if (got != 1) {
        fprintf(stderr, "-e %s: not a model file (shorter than its magic number)\n", path);
        exit(EXIT_FAILURE);
    }
    return magic == MOE_MODEL_MAGIC;
}

int main(int argc, char* argv[]) {
    FlagTables tables = {{generate_flag_table}, {(int)(sizeof(generate_flag_table) / sizeof(Flag))}, 1};
    const char* titles[1] = {"generate: text from a model file with a paged KV cache and continuous batching"};
    int help = flags_parse(&tables, argc, argv);
    if (help == 1) { flags_usage(&tables, titles); return EXIT_SUCCESS; }
    if (help == 2) { flags_markdown(&tables, titles); return EXIT_SUCCESS; }
    GenerateFlags* f = &generate_flags;
    check_flags(f);
    int device_count = 0;
    cudaError_t device_error = cudaGetDeviceCount(&device_count);
    if (device_error != cudaSuccess || device_count == 0) {
        fprintf(stderr, "no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(device_error));
        return EXIT_FAILURE;
    }
    if (!file_exists(f->model_path)) {
        fprintf(stderr, "-e %s: no such model file\n", f->model_path);
        return EXIT_FAILURE;
    }
    MultiGpuConfig world = multi_gpu_config_init("mpi", 1, 0, 8, "", "");
    if (world.num_processes != 1) {
        fprintf(stderr, "generate runs on one process (%d started)\n", world.num_processes);
        return EXIT_FAILURE;
    }
    TensorParallel tp;
    tensor_parallel_init(&tp, &world, 1, 0);
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream));
    cublas_setup();

    Model model;
    model_init_common(&model);
    model.multi_gpu = &world;
    model.tp = &tp;
    if (is_moe_model_file(f->model_path)) {
        model.extension = moe_extension;
        moe_extension.trainer->setup(&model, &world);
        trainer_moe.settings.capacity_factor_eval = 0.0;  // generation is dropless: no token's output depends on others
    }
    model_build_from_checkpoint(&model, f->model_path);
    if (!model_set_attention(&model, 1, f->model_path)) return EXIT_FAILURE;
    const ModelConfig* c = &model.config;
    WeightQuant quant = weight_quant_of(f->weight_quant);
    QuantizedLayer* quantized = NULL;
    if (quant != QUANT_NONE) {
        size_t bytes;
        quantized = quantize_model(&model, quant, &bytes, stream);
        fprintf(stderr, "generate: -wq %s: the layers' matmul weights in %.2f MiB\n", f->weight_quant,
                (double)bytes / 1048576.0);
        if (f->dequantized_path[0] != '\0') model_write_model_file(&model, f->dequantized_path, stream);
    }

    // the tokenizer: text in and out (token ids need none); one with more tokens than the model is not the model's
    // the prefill is the trainers' forward pass over one sequence of up to maxT; a decode step's FFN reads model
    // activations of up to -b tokens
    model_allocate_activations(&model, CEIL_DIV(f->max_batch, c->max_seq_len), c->max_seq_len);
    if (f->perplexity_path[0] != '\0') report_perplexity(&model, f->perplexity_path, stream);
    if (f->prompts_path[0] == '\0') return EXIT_SUCCESS;

    Tokenizer tokenizer;
    memset(&tokenizer, 0, sizeof(tokenizer));
    if (!f->ids) tokenizer_init(&tokenizer, f->tokenizer_path);
    if (tokenizer.init_ok && tokenizer.vocab_size > (uint32_t)c->vocab_size) {
        fprintf(stderr, "-tf %s: %u tokens, more than the model's V = %d: not the model's tokenizer\n",
                f->tokenizer_path, tokenizer.vocab_size, c->vocab_size);
        return EXIT_FAILURE;
    }
    int num_prompts;
    Prompt* prompts = read_prompts(f->prompts_path, f->ids, &tokenizer, c->vocab_size, c->max_seq_len, &num_prompts);

    Engine e;
    memset(&e, 0, sizeof(e));
    e.model = &model;
    e.flags = f;
    e.quant = quant;
    e.quantized = quantized;
    e.stream = stream;
    e.L = c->num_layers;
    e.C = c->channels;
    e.NH = c->num_heads;
    e.NKV = c->num_kv_heads;
    e.HS = c->channels / c->num_heads;
    e.QKV = (e.NH + 2 * e.NKV) * e.HS;
    e.V = c->vocab_size;
    e.Vp = c->padded_vocab_size;
    e.maxT = c->max_seq_len;
    e.max_batch = f->max_batch;
    int block_size = f->block_size > 0 ? f->block_size : e.maxT;
    e.max_blocks = CEIL_DIV(e.maxT, block_size);
    size_t block_bytes = 2 * (size_t)e.L * block_size * e.NKV * e.HS * sizeof(floatX);
    int num_blocks = f->cache_mib > 0.0f ? (int)((double)f->cache_mib * 1048576.0 / (double)block_bytes)
                                         : f->max_batch * e.max_blocks;
    int longest = 0;
    for (int i = 0; i < num_prompts; i++) {
        int length = prompts[i].length + f->gen_tokens < e.maxT ? prompts[i].length + f->gen_tokens : e.maxT;
        if (length > longest) longest = length;
    }
    if (num_blocks < CEIL_DIV(longest, block_size)) {
        fprintf(stderr, "-km %g: a cache of %d blocks of %d positions (%zu bytes each) cannot hold one sequence of %d "
                "positions (%d blocks)\n", f->cache_mib, num_blocks, block_size, block_bytes, longest,
                CEIL_DIV(longest, block_size));
        return EXIT_FAILURE;
    }
    block_pool_init(&e.pool, num_blocks, block_size);
    allocate_engine(&e, num_blocks);
    if (f->logits_path[0] != '\0') {
        e.logits_file = fopen_check(f->logits_path, "wb");
        int header[256] = {LOGITS_MAGIC, LOGITS_VERSION, e.V};
        fwrite_check(header, sizeof(int), 256, e.logits_file, f->logits_path);
    }

    int count = num_prompts * f->samples;
    Sequence* seqs = (Sequence*)calloc(count, sizeof(Sequence));
    for (int i = 0; i < count; i++) {
        Sequence* s = &seqs[i];
        const Prompt* p = &prompts[i / f->samples];
        s->prompt = i / f->samples;
        s->sample = i % f->samples;
        s->tokens = (int*)malloc_check((size_t)e.maxT * sizeof(int));
        memcpy(s->tokens, p->tokens, (size_t)p->length * sizeof(int));
        s->length = s->prompt_length = p->length;
        s->target = p->length + f->gen_tokens < e.maxT ? p->length + f->gen_tokens : e.maxT;
        block_table_init(&s->table, e.max_blocks);
        // a generator per (seed, prompt, sample), so that a sample does not depend on the batch it ran in
        s->rng = ((uint64_t)(uint32_t)f->seed << 32) ^ (0x9E3779B97F4A7C15ull * (uint64_t)(s->prompt + 1)) ^
                 (0xBF58476D1CE4E5B9ull * (uint64_t)(s->sample + 1));
        if (s->rng == 0) s->rng = 1;
    }
    run_engine(&e, seqs, count, f->samples);

    // the output, in prompt order
    for (int i = 0; i < count; i++) {
        const Sequence* s = &seqs[i];
        if (f->ids) {
            printf("%d %d:", s->prompt, s->sample);
            for (int t = s->prompt_length; t < s->length; t++) printf(" %d", s->tokens[t]);
        } else {
            for (int t = s->prompt_length; t < s->length; t++) {
                int token = s->tokens[t];
                const char* piece = tokenizer.init_ok && (uint32_t)token < tokenizer.vocab_size
                                        ? tokenizer_decode(&tokenizer, token) : NULL;
                if (piece == NULL) printf("<%d>", token);
                else if (!strcmp(piece, "\n")) printf("\\n");  // one line per sample
                else safe_printf(piece);
            }
        }
        printf("\n");
    }
    fflush(stdout);
    if (e.logits_file != NULL) {  // the record count, now known, into the header
        fseek(e.logits_file, 3 * sizeof(int), SEEK_SET);
        int records = (int)e.logits_records;
        fwrite_check(&records, sizeof(int), 1, e.logits_file, f->logits_path);
        fclose_check(e.logits_file, f->logits_path);
    }
    fprintf(stderr, "generate: %d prompts x %d samples | prefill %lld tokens, %.1f tokens/s | decode %lld tokens in "
            "%lld steps, %.1f tokens/s | blocks of %d: %d in the cache, at most %d used, %lld taken | %lld "
            "pre-emptions | KV waste %.1f%% paged, %.1f%% as a contiguous maxT cache\n", num_prompts, f->samples,
            e.prefill_tokens, e.prefill_tokens / (e.prefill_seconds > 0 ? e.prefill_seconds : 1e-9),
            e.decode_tokens, e.decode_steps, e.decode_tokens / (e.decode_seconds > 0 ? e.decode_seconds : 1e-9),
            block_size, num_blocks, e.pool.peak_used, e.pool.taken, e.preemptions,
            e.decode_steps ? 100.0 * e.waste_sum / e.decode_steps : 0.0,
            e.decode_steps ? 100.0 * e.contiguous_waste_sum / e.decode_steps : 0.0);
    return EXIT_SUCCESS;
}
