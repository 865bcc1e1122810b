// generate.cu: text generation from any model file the trainers write (GPT-2, llama, MoE; a checkpoint's
// model_%08d.bin too) with a paged KV cache and continuous batching (doc/inference.md). The engine, shared with the
// trainers' samples, is llmc/generation.h's: each prompt's prefill through the trainers' forward pass (flash
// attention) into cache blocks, then one decode step per token through llmc/paged_attention.cuh, waiting prompts
// joining as blocks free up, the newest sequence pre-empted when the cache is full. This file adds the flags, the
// prompts, the output, -vp's perplexity and -wq's quantised weights. Its model is train_gpt.cu's and train_moe.cu's,
// which it includes; MoE layers route each token as in evaluation, dropless.
// Build and run:
//   make generate [PRECISION=...]        GPU; make generate_cpu: the CPU backend
//   ./generate -e model.bin -i prompts.txt -g 64 -temp 0.8 -topk 40      (./generate -h lists the flags)
//   ./generate -e model.bin -i ids.txt -ids 1 -temp 0 -lo logits.bin     (token ids in and out; the logits file)
// Tests: dev/test/test_generate.sh (the generate-* rows).
#define OMIT_TRAIN_MOE_MAIN
#include "train_moe.cu"
#include "llmc/quantize.cuh"
#include "llmc/bpe_encoder.h"

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
      "tokenizer file: encodes text prompts (a byte-level BPE) and decodes the output\n(default = "            \
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

#define LOGITS_MAGIC 20261204
#define LOGITS_VERSION 1

// ----------------------------------------------------------------------------------------------------
// Prompts

typedef struct {
    int* tokens;
    int length;
} Prompt;

// The prompts of -i, one per line: token ids (-ids 1) or text, after the tokenizer's end-of-text token (a document's
// start, as the training data has it) encoded by its byte-level BPE (llmc/bpe_encoder.h). Refused with one line: an
// unreadable or empty file, an empty prompt, an id outside the vocabulary, a prompt longer than maxT - 1 (a sequence
// generates from position len on), text that is not UTF-8, text without a byte-level tokenizer file.
static Prompt* read_prompts(const char* path, int ids, const Tokenizer* tokenizer, int V, int maxT, int* count) {
    FILE* f = fopen(path, "rb");
    if (f == NULL) {
        fprintf(stderr, "-i %s: cannot read the prompts file\n", path);
        exit(EXIT_FAILURE);
    }
    BpeEncoder encoder;
    if (!ids) bpe_encoder_init(&encoder, tokenizer);
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
        } else {
            p->tokens[p->length++] = tokenizer->eot_token;
            size_t bad_offset;
            int encoded = bpe_encode(&encoder, line, (size_t)got, p->tokens + 1, &bad_offset);
            if (encoded < 0) {
                fprintf(stderr, "-i %s: line %d is not UTF-8 text (byte %zu): give token ids with -ids 1\n", path,
                        n + 1, bad_offset);
                exit(EXIT_FAILURE);
            }
            p->length += encoded;
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
    if (!ids) bpe_encoder_free(&encoder);
    if (n == 0) {
        fprintf(stderr, "-i %s: no prompts (an empty file)\n", path);
        exit(EXIT_FAILURE);
    }
    *count = n;
    return prompts;
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

typedef struct {
    WeightQuant kind;
    const QuantizedLayer* layers;  // (L)
} QuantizedModel;

// The decode step's matmuls on the quantised weights (llmc/generation.h's DecodeWeights)
static int quantized_decode_matmul(Engine* e, int l, DecodeMatmul which, const LayerParameters* lp,
                                   const LayerActivations* la, floatX* out, const floatX* inp, int n) {
    const QuantizedModel* qm = (const QuantizedModel*)e->own_weights_data;
    const QuantizedLayer* q = &qm->layers[l];
    if (which == DECODE_QKV) quantized_matmul(out, inp, &q->qkv, qm->kind, lp->qkvb, n, e->stream);
    else if (which == DECODE_ATTENTION_PROJECTION)
        quantized_matmul(out, inp, &q->attproj, qm->kind, lp->attprojb, n, e->stream);
    else quantized_mlp_forward(e->model, q, qm->kind, lp, la, out, n, e->stream);
    return 1;
}

// ----------------------------------------------------------------------------------------------------
// main

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
// positions (maxT + 1 tokens with its targets) in order, through the trainers' forward pass, the mean in double over
// the targets that count (all of them without a loss mask, doc/formats.md).
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
    size_t targets = 0;
    for (size_t i = 0; i < sequences; i++) {
        dataloader_next_batch(&loader);
        model_forward(model, loader.inputs, loader.targets, 1, T, 0.0f, stream);
        model_mean_loss(model);
        loss += model->loss_sum;
        targets += (size_t)model->loss_targets;
    }
    loss = targets > 0 ? loss / (double)targets : 0.0;
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
        moe_extension.trainer->setup(&model, &world, 0);
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

    SamplingSettings sampling = {f->temperature, f->top_k, f->top_p};
    int maxT = c->max_seq_len;
    int block_size = f->block_size > 0 ? f->block_size : maxT;
    size_t block_bytes = engine_block_bytes(&model, block_size);
    int num_blocks = f->cache_mib > 0.0f ? (int)((double)f->cache_mib * 1048576.0 / (double)block_bytes)
                                         : f->max_batch * CEIL_DIV(maxT, block_size);
    int longest = 0;
    for (int i = 0; i < num_prompts; i++) {
        int length = prompts[i].length + f->gen_tokens < maxT ? prompts[i].length + f->gen_tokens : maxT;
        if (length > longest) longest = length;
    }
    if (num_blocks < CEIL_DIV(longest, block_size)) {
        fprintf(stderr, "-km %g: a cache of %d blocks of %d positions (%zu bytes each) cannot hold one sequence of %d "
                "positions (%d blocks)\n", f->cache_mib, num_blocks, block_size, block_bytes, longest,
                CEIL_DIV(longest, block_size));
        return EXIT_FAILURE;
    }
    Engine e;
    engine_init(&e, &model, &sampling, f->max_batch, block_size, num_blocks, stream);
    QuantizedModel quantized_model = {quant, quantized};
    if (quantized != NULL) {
        e.own_weights = quantized_decode_matmul;
        e.own_weights_data = &quantized_model;
    }
    if (f->logits_path[0] != '\0') {
        e.logits_file = fopen_check(f->logits_path, "wb");
        e.logits_path = f->logits_path;
        int header[256] = {LOGITS_MAGIC, LOGITS_VERSION, e.V};
        fwrite_check(header, sizeof(int), 256, e.logits_file, f->logits_path);
    }

    int count = num_prompts * f->samples;
    Sequence* seqs = (Sequence*)calloc(count, sizeof(Sequence));
    for (int i = 0; i < count; i++) {
        int prompt = i / f->samples, sample = i % f->samples;
        // a generator per (seed, prompt, sample), so that a sample does not depend on the batch it ran in
        uint64_t rng = ((uint64_t)(uint32_t)f->seed << 32) ^ (0x9E3779B97F4A7C15ull * (uint64_t)(prompt + 1)) ^
                       (0xBF58476D1CE4E5B9ull * (uint64_t)(sample + 1));
        sequence_init(&seqs[i], &e, prompt, sample, prompts[prompt].tokens, prompts[prompt].length, f->gen_tokens,
                      rng != 0 ? rng : 1);
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
