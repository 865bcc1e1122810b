// train_gpt.cu: GPT-2 training in C/CUDA: hand-written kernels (llmc/), cuBLASLt GEMMs, bf16/fp16/fp32 mixed
// precision, activation recompute, data parallelism over NCCL with ZeRO-1.
// Build and run:
//   make train_gpt [PRECISION=BF16|FP16|FP32]             GPU binary (nvcc), ./train_gpt -i "data/x/*train*.bin" ...
//   make train_gpt_cpu [PRECISION=...]                     the same source on the CPU backend (cpu/cucc)
//   mpirun -np 8 ./train_gpt ...                           data parallel, one process per GPU
// Flags are listed by `./train_gpt -h` (the llm.c conventions, extended; see README.md).
// test_gpt.cu includes this file with TESTING defined, so everything but main() is shared with the test.
#include <ctype.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "llmc/common.cuh"
#include "llmc/utils.h"
#include "llmc/tokenizer.h"
#include "llmc/dataloader.h"
#include "llmc/rand.h"
#include "llmc/schedulers.h"
#include "llmc/sampler.h"
#include "llmc/logger.h"
#include "llmc/mfu.h"
#include "llmc/outlier_detector.h"
#include "llmc/cublas_common.cuh"
#include "llmc/encoder.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"
#include "llmc/attention.cuh"  // the hand-written path, and the size check of attention and matmul
#ifdef ENABLE_CUDNN
#include "llmc/cudnn_att.cuh"  // GPU only: cuDNN's fused attention (make USE_CUDNN=1)
#endif
#include "llmc/gelu.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/adamw.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/copy_cast.cuh"
#include "llmc/multi_gpu.cuh"
#include "llmc/optimizer.cuh"
#include "llmc/checkpoint.h"
#include "llmc/cli.h"

// ----------------------------------------------------------------------------------------------------
// Model description and parameters

#define GPT2_MODEL_MAGIC 20240326
#define GPT2_STATE_MAGIC 20240527
#define NUM_PARAMETER_TENSORS 16

typedef struct {
    int max_seq_len;        // maxT
    int vocab_size;         // V
    int padded_vocab_size;  // Vp, V rounded up to a multiple of 128
    int num_layers;         // L
    int num_heads;          // NH
    int channels;           // C
} GPT2Config;

// Pointers into one contiguous buffer, in model-file order.
typedef struct {
    floatX* wte;       // (Vp, C)
    floatX* wpe;       // (maxT, C)
    floatX* ln1w;      // (L, C)
    floatX* ln1b;      // (L, C)
    floatX* qkvw;      // (L, 3C, C)
    floatX* qkvb;      // (L, 3C)
    floatX* attprojw;  // (L, C, C)
    floatX* attprojb;  // (L, C)
    floatX* ln2w;      // (L, C)
    floatX* ln2b;      // (L, C)
    floatX* fcw;       // (L, 4C, C)
    floatX* fcb;       // (L, 4C)
    floatX* fcprojw;   // (L, C, 4C)
    floatX* fcprojb;   // (L, C)
    floatX* lnfw;      // (C)
    floatX* lnfb;      // (C)
} ParameterTensors;

static const char* parameter_names[NUM_PARAMETER_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"};
// weight decay applies to the matrices only (the embeddings and the four Linear weights)
static const int parameter_decays[NUM_PARAMETER_TENSORS] = {1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0, 0, 0};

static void fill_in_parameter_sizes(size_t* sizes, const GPT2Config* cfg) {
    size_t Vp = cfg->padded_vocab_size, C = cfg->channels, maxT = cfg->max_seq_len, L = cfg->num_layers;
    sizes[0] = Vp * C;
    sizes[1] = maxT * C;
    sizes[2] = L * C;
    sizes[3] = L * C;
    sizes[4] = L * 3 * C * C;
    sizes[5] = L * 3 * C;
    sizes[6] = L * C * C;
    sizes[7] = L * C;
    sizes[8] = L * C;
    sizes[9] = L * C;
    sizes[10] = L * 4 * C * C;
    sizes[11] = L * 4 * C;
    sizes[12] = L * C * 4 * C;
    sizes[13] = L * C;
    sizes[14] = C;
    sizes[15] = C;
}

static void point_parameters(ParameterTensors* p, floatX* memory, const size_t* sizes) {
    floatX** ptrs[NUM_PARAMETER_TENSORS] = {&p->wte, &p->wpe, &p->ln1w, &p->ln1b, &p->qkvw, &p->qkvb,
                                            &p->attprojw, &p->attprojb, &p->ln2w, &p->ln2b, &p->fcw, &p->fcb,
                                            &p->fcprojw, &p->fcprojb, &p->lnfw, &p->lnfb};
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        *ptrs[i] = memory;
        memory += sizes[i];
    }
}

// ----------------------------------------------------------------------------------------------------
// Activations. With recompute level r, the per-layer GELU output (r >= 1) and LayerNorm outputs (r >= 2)
// are kept for one layer only and recomputed in the backward pass.
typedef struct {
    floatX* encoded;    // (B, T, C)
    floatX* ln1;        // (L or 1, B, T, C)
    float* ln1_mean;    // (L, B, T)
    float* ln1_rstd;    // (L, B, T)
    floatX* atty;       // (L, B, T, C) attention output before the projection
    floatX* att;        // (L, B, NH, T, T) attention probabilities (hand-written path only)
    float* att_stats;   // (L, B, NH, T) softmax statistics (cuDNN path only)
    floatX* qkvr;       // (L, B, T, 3C) q, k, v kept for the backward pass (permuted by the hand-written path)
    floatX* residual2;  // (L, B, T, C)
    floatX* ln2;        // (L or 1, B, T, C)
    float* ln2_mean;    // (L, B, T)
    float* ln2_rstd;    // (L, B, T)
    floatX* fch;        // (L, B, T, 4C) pre-GELU
    floatX* fch_gelu;   // (L or 1, B, T, 4C)
    floatX* residual3;  // (L, B, T, C)
    floatX* lnf;        // (B, T, C)
    float* lnf_mean;    // (B, T)
    float* lnf_rstd;    // (B, T)
    float* losses;      // (B, T)
    floatX* output;     // (B, T, Vp) logits, overwritten by their gradient
    // scratch shared by the forward and backward passes
    floatX* scratch_btc;   // (B, T, C)
    floatX* scratch_bt4c;  // (B, T, 4C)
    floatX* dresidual;     // (B, T, C)
    floatX* dbtc;          // (B, T, C)
    floatX* dqkvr;         // (B, T, 3C)
    floatX* datt;          // (B, NH, T, T) (hand-written path only)
    float* scratch_f;      // layernorm backward and bias-gradient scratch
} ActivationTensors;

typedef struct {
    GPT2Config config;
    ParameterTensors params;  // pointers into store.params_memory
    ParameterTensors grads;   // pointers into store.grads_memory
    ShardedParameters store;  // the flat parameter, gradient and optimizer buffers (llmc/optimizer.cuh)
    int use_master_weights;
    // activations
    ActivationTensors acts;
    void* acts_memory;
    int batch_size, seq_len;  // what the activations were sized for
    int recompute;
    int gelu_fusion;
    int* inputs;       // (B, T) device
    int* targets;      // (B, T) device
    int* inputs_cpu;   // (B, T) host copy for the encoder's backward pass
    float* losses_cpu;  // (B, T) host
    float mean_loss;
} GPT2;

// ----------------------------------------------------------------------------------------------------
// Building the model: from a file or a descriptor

static void gpt2_allocate_parameters(GPT2* model, int num_processes) {
    size_t sizes[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(sizes, &model->config);
    sharded_parameters_allocate(&model->store, NUM_PARAMETER_TENSORS, sizes, parameter_decays, num_processes);
    point_parameters(&model->params, model->store.params_memory, sizes);
    point_parameters(&model->grads, model->store.grads_memory, sizes);
}

static void check_config_supported(const GPT2Config* c, const char* source) {
    char why[256];
    if (c->channels <= 0 || c->num_layers <= 0 || c->num_heads <= 0 || c->vocab_size <= 0 || c->max_seq_len <= 0 ||
        c->padded_vocab_size < c->vocab_size) {
        fprintf(stderr, "%s: invalid model sizes (L=%d NH=%d C=%d V=%d Vp=%d maxT=%d)\n", source, c->num_layers,
                c->num_heads, c->channels, c->vocab_size, c->padded_vocab_size, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    if (c->channels % c->num_heads != 0) {
        fprintf(stderr, "%s: channels (%d) must be a multiple of the number of heads (%d)\n", source, c->channels,
                c->num_heads);
        exit(EXIT_FAILURE);
    }
    if (!kernels_a_support(c->channels, c->vocab_size, c->padded_vocab_size, why, sizeof(why)) ||
        !kernels_b_support(c->channels, c->num_heads, why, sizeof(why))) {
        fprintf(stderr, "%s: unsupported model size: %s\n", source, why);
        exit(EXIT_FAILURE);
    }
}

// Loads an llm.c-format model file: version 3 (fp32) or 5 (bf16), converted to floatX.
static void gpt2_build_from_checkpoint(GPT2* model, const char* path, int num_processes) {
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, GPT2_MODEL_MAGIC, "GPT-2 model");
    int version = header[1];
    if (version != 3 && version != 5) {
        fprintf(stderr, "%s: unsupported model file version %d (expected 3 for fp32 or 5 for bf16)\n", path, version);
        exit(EXIT_FAILURE);
    }
    GPT2Config* c = &model->config;
    c->max_seq_len = header[2];
    c->vocab_size = header[3];
    c->num_layers = header[4];
    c->num_heads = header[5];
    c->channels = header[6];
    c->padded_vocab_size = header[7];
    check_config_supported(c, path);
    gpt2_allocate_parameters(model, num_processes);
    size_t n = model->store.num_parameters;
    size_t file_elem = version == 3 ? sizeof(float) : sizeof(__nv_bfloat16);
    void* raw = malloc_check(n * file_elem);
    fread_check(raw, file_elem, n, f, path);
    // the file must end exactly here: a longer file is not the model its header describes
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: file is longer than its header's model (%zu parameters)\n", path, n);
        exit(EXIT_FAILURE);
    }
    fclose_check(f, path);
    floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
    for (size_t i = 0; i < n; i++) {
        float v = version == 3 ? ((float*)raw)[i] : __bfloat162float(((__nv_bfloat16*)raw)[i]);
        host[i] = (floatX)v;
    }
    cudaCheck(cudaMemcpy(model->store.params_memory, host, n * sizeof(floatX), cudaMemcpyHostToDevice));
    free(host);
    free(raw);
}

// "d12" etc.: GPT-2 sizes (d12 = 124M, d24 = 350M, d36 = 774M, d48 = 1558M), or dN for C = 64N with
// N heads of 64; vocabulary and maxT from -ev and -et. GPT-2 initialisation, seeded.
static void gpt2_build_from_descriptor(GPT2* model, const char* descriptor, int vocab_size, int max_seq_len,
                                       unsigned int seed, int num_processes) {
    if (descriptor[0] != 'd' || !isdigit((unsigned char)descriptor[1])) {
        fprintf(stderr, "-e %s: expected a model file or a descriptor such as d12\n", descriptor);
        exit(EXIT_FAILURE);
    }
    char* end;
    long depth = strtol(descriptor + 1, &end, 10);
    if (*end != '\0' || depth <= 0 || depth > 200) {
        fprintf(stderr, "-e %s: bad descriptor (expected dN with N in 1..200)\n", descriptor);
        exit(EXIT_FAILURE);
    }
    GPT2Config* c = &model->config;
    c->num_layers = (int)depth;
    if (depth == 12) { c->channels = 768; c->num_heads = 12; }
    else if (depth == 24) { c->channels = 1024; c->num_heads = 16; }
    else if (depth == 36) { c->channels = 1280; c->num_heads = 20; }
    else if (depth == 48) { c->channels = 1600; c->num_heads = 25; }
    else { c->channels = 64 * (int)depth; c->num_heads = (int)depth; }
    c->vocab_size = vocab_size;
    c->padded_vocab_size = CEIL_DIV(vocab_size, 128) * 128;
    c->max_seq_len = max_seq_len;
    check_config_supported(c, descriptor);
    gpt2_allocate_parameters(model, num_processes);
    // GPT-2 init: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, LayerNorm 1/0;
    // padded vocabulary rows stay zero. Drawn tensor by tensor from one seeded mt19937.
    float* host = (float*)calloc(model->store.num_parameters, sizeof(float));
    mt19937_state rng;
    manual_seed(&rng, seed);
    size_t offset = 0;
    float residual_scale = 1.0f / sqrtf(2.0f * c->num_layers);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        size_t n = model->store.sizes[i];
        const char* name = parameter_names[i];
        if (!strcmp(name, "ln1w") || !strcmp(name, "ln2w") || !strcmp(name, "lnfw")) {
            for (size_t j = 0; j < n; j++) host[offset + j] = 1.0f;
        } else if (parameter_decays[i]) {
            float std = (!strcmp(name, "attprojw") || !strcmp(name, "fcprojw")) ? 0.02f * residual_scale : 0.02f;
            size_t rows_used = n;
            if (i == 0) rows_used = (size_t)c->vocab_size * c->channels;  // padded rows stay zero
            normal_(host + offset, rows_used, 0.0f, std, &rng);
        }
        offset += n;
    }
    floatX* hx = (floatX*)malloc_check(model->store.num_parameters * sizeof(floatX));
    for (size_t i = 0; i < model->store.num_parameters; i++) hx[i] = (floatX)host[i];
    size_t bytes = model->store.num_parameters * sizeof(floatX);
    cudaCheck(cudaMemcpy(model->store.params_memory, hx, bytes, cudaMemcpyHostToDevice));
    free(hx);
    free(host);
}

// Writes the model in llm.c format: version 5 (bf16) from a BF16 build, version 3 (fp32) otherwise.
static void gpt2_write_model_file(const GPT2* model, const char* path) {
    const GPT2Config* c = &model->config;
    int header[256] = {0};
    header[0] = GPT2_MODEL_MAGIC;
    header[1] = PRECISION_MODE == PRECISION_BF16 ? 5 : 3;
    header[2] = c->max_seq_len;
    header[3] = c->vocab_size;
    header[4] = c->num_layers;
    header[5] = c->num_heads;
    header[6] = c->channels;
    header[7] = c->padded_vocab_size;
    size_t n = model->store.num_parameters;
    floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
    cudaCheck(cudaMemcpy(host, model->store.params_memory, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    char tmp[1024];
    FILE* f = fopen_tmp_for(path, tmp, sizeof(tmp));
    fwrite_check(header, sizeof(int), 256, f, tmp);
    if (PRECISION_MODE == PRECISION_BF16) {
        fwrite_check(host, sizeof(floatX), n, f, tmp);
    } else {
        float* h32 = (float*)malloc_check(n * sizeof(float));
        for (size_t i = 0; i < n; i++) h32[i] = (float)host[i];
        fwrite_check(h32, sizeof(float), n, f, tmp);
        free(h32);
    }
    commit_tmp(f, tmp, path);
    free(host);
}

// ----------------------------------------------------------------------------------------------------
// Activation memory

// Per-layer slices start at multiples of 64 elements, so every slice is 16-byte aligned for vector
// loads whatever B and T are.
static size_t layer_stride(size_t n) { return CEIL_DIV(n, 64) * 64; }

static size_t fill_in_activation_sizes(size_t* s, const GPT2Config* c, size_t B, size_t T, int recompute) {
    size_t C = c->channels, L = c->num_layers, NH = c->num_heads, Vp = c->padded_vocab_size;
    size_t ln_layers = recompute >= 2 ? 1 : L;
    size_t gelu_layers = recompute >= 1 ? 1 : L;
    size_t BTC = layer_stride(B * T * C), BT = layer_stride(B * T), ATT = layer_stride(B * NH * T * T);
#ifdef ENABLE_CUDNN
    size_t att_probs = 0, att_stats = layer_stride(B * NH * T);  // cuDNN keeps softmax statistics, not probabilities
#else
    size_t att_probs = ATT, att_stats = 0;
#endif
    size_t i = 0;
    s[i++] = BTC;                      // encoded
    s[i++] = ln_layers * BTC;          // ln1
    s[i++] = L * BT;                   // ln1_mean (floats)
    s[i++] = L * BT;                   // ln1_rstd (floats)
    s[i++] = L * BTC;                  // atty
    s[i++] = L * att_probs;            // att
    s[i++] = L * att_stats;            // att_stats (floats)
    s[i++] = L * 3 * BTC;              // qkvr
    s[i++] = L * BTC;                  // residual2
    s[i++] = ln_layers * BTC;          // ln2
    s[i++] = L * BT;                   // ln2_mean
    s[i++] = L * BT;                   // ln2_rstd
    s[i++] = L * 4 * BTC;              // fch
    s[i++] = gelu_layers * 4 * BTC;    // fch_gelu
    s[i++] = L * BTC;                  // residual3
    s[i++] = BTC;                      // lnf
    s[i++] = BT;                       // lnf_mean
    s[i++] = BT;                       // lnf_rstd
    s[i++] = BT;                       // losses
    s[i++] = B * T * Vp;               // output
    s[i++] = BTC;                      // scratch_btc
    s[i++] = 4 * BTC;                  // scratch_bt4c
    s[i++] = BTC;                      // dresidual
    s[i++] = BTC;                      // dbtc
    s[i++] = 3 * BTC;                  // dqkvr
    s[i++] = att_probs;                // datt
    size_t ln_scratch = layernorm_backward_scratch_floats((int)B, (int)T, (int)C);
    size_t bias_scratch = matmul_dbias_buffer_floats((int)(Vp > 4 * C ? Vp : 4 * C));
    s[i++] = ln_scratch > bias_scratch ? ln_scratch : bias_scratch;  // scratch_f
    return i;
}
// which activation tensors are fp32 (the rest are floatX)
static const int activation_is_float[] = {0, 0, 1, 1, 0, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1};

static size_t activation_bytes(const GPT2Config* c, size_t B, size_t T, int recompute) {
    size_t sizes[32];
    size_t n = fill_in_activation_sizes(sizes, c, B, T, recompute);
    size_t bytes = 0;
    for (size_t i = 0; i < n; i++) bytes += sizes[i] * (activation_is_float[i] ? sizeof(float) : sizeof(floatX)) + 256;
    return bytes;
}

static void gpt2_allocate_activations(GPT2* model, int B, int T) {
    size_t sizes[32];
    size_t n = fill_in_activation_sizes(sizes, &model->config, B, T, model->recompute);
    size_t bytes = activation_bytes(&model->config, B, T, model->recompute);
    cudaCheck(cudaMalloc(&model->acts_memory, bytes));
    ActivationTensors* a = &model->acts;
    void** ptrs[] = {(void**)&a->encoded, (void**)&a->ln1, (void**)&a->ln1_mean, (void**)&a->ln1_rstd,
                     (void**)&a->atty, (void**)&a->att, (void**)&a->att_stats, (void**)&a->qkvr, (void**)&a->residual2,
                     (void**)&a->ln2, (void**)&a->ln2_mean, (void**)&a->ln2_rstd, (void**)&a->fch,
                     (void**)&a->fch_gelu, (void**)&a->residual3, (void**)&a->lnf, (void**)&a->lnf_mean,
                     (void**)&a->lnf_rstd, (void**)&a->losses, (void**)&a->output, (void**)&a->scratch_btc,
                     (void**)&a->scratch_bt4c, (void**)&a->dresidual, (void**)&a->dbtc, (void**)&a->dqkvr,
                     (void**)&a->datt, (void**)&a->scratch_f};
    char* p = (char*)model->acts_memory;
    for (size_t i = 0; i < n; i++) {
        *ptrs[i] = p;
        size_t b = sizes[i] * (activation_is_float[i] ? sizeof(float) : sizeof(floatX));
        p += CEIL_DIV(b, 256) * 256;  // 256-byte alignment for vector loads and cuBLASLt
    }
    model->batch_size = B;
    model->seq_len = T;
    cudaCheck(cudaMalloc((void**)&model->inputs, (size_t)B * T * sizeof(int)));
    cudaCheck(cudaMalloc((void**)&model->targets, (size_t)B * T * sizeof(int)));
    model->inputs_cpu = (int*)malloc_check((size_t)B * T * sizeof(int));
    model->losses_cpu = (float*)malloc_check((size_t)B * T * sizeof(float));
}

static void gpt2_init_common(GPT2* model) {
    memset(model, 0, sizeof(*model));
    model->use_master_weights = 1;
    model->recompute = 1;
    model->gelu_fusion = 1;
}

static void gpt2_free(GPT2* model) {
    sharded_parameters_free(&model->store);
    cudaCheck(cudaFree(model->acts_memory));
    cudaCheck(cudaFree(model->inputs));
    cudaCheck(cudaFree(model->targets));
    free(model->inputs_cpu);
    free(model->losses_cpu);
}

// ----------------------------------------------------------------------------------------------------
// Forward and backward passes

// Forward pass over (B, T) tokens. With targets, also the mean loss (model->mean_loss); with
// dlogits_scale > 0, the logits are replaced by their gradient (scaled by dlogits_scale) for backward.
static void gpt2_forward(GPT2* model, const int* inputs, const int* targets, int B, int T, float dlogits_scale,
                         cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    if (B > model->batch_size || T > model->seq_len || T > c->max_seq_len || B < 1 || T < 1) {
        fprintf(stderr, "gpt2_forward: batch (%d, %d) exceeds the allocated (%d, %d) or maxT %d\n", B, T,
                model->batch_size, model->seq_len, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    int L = c->num_layers, NH = c->num_heads, C = c->channels, V = c->vocab_size, Vp = c->padded_vocab_size;
    // per-layer slices (layer_stride) of (B, T, C), (B, T) and (B, NH, T, T) tensors
    size_t BTC = layer_stride((size_t)B * T * C), BT = layer_stride((size_t)B * T);
    size_t ATT = layer_stride((size_t)B * NH * T * T);
    ParameterTensors p = model->params;
    ActivationTensors a = model->acts;
    memcpy(model->inputs_cpu, inputs, (size_t)B * T * sizeof(int));
    cudaCheck(cudaMemcpyAsync(model->inputs, inputs, (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, stream));
    if (targets) {
        cudaCheck(cudaMemcpyAsync(model->targets, targets, (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, stream));
    }
    encoder_forward(a.encoded, model->inputs, p.wte, p.wpe, B, T, C, stream);
    layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.encoded, p.ln1w, p.ln1b, B, T, C, stream);
    for (int l = 0; l < L; l++) {
        const floatX* residual = l == 0 ? a.encoded : a.residual3 + (size_t)(l - 1) * BTC;
        floatX* ln1 = model->recompute >= 2 ? a.ln1 : a.ln1 + (size_t)l * BTC;
        floatX* ln2 = model->recompute >= 2 ? a.ln2 : a.ln2 + (size_t)l * BTC;
        floatX* fch_gelu = model->recompute >= 1 ? a.fch_gelu : a.fch_gelu + (size_t)l * 4 * BTC;
#ifdef ENABLE_CUDNN
        // cuDNN reads q, k, v in place from the qkv projection's output, which is kept for backward
        floatX* qkv = a.qkvr + (size_t)l * 3 * BTC;  // (B, T, 3C)
        matmul_forward(qkv, ln1, p.qkvw + (size_t)l * 3 * C * C, p.qkvb + (size_t)l * 3 * C, B, T, C, 3 * C, stream);
        attention_forward_cudnn(a.atty + (size_t)l * BTC, a.att_stats + (size_t)l * layer_stride((size_t)B * NH * T),
                                qkv, B, T, NH, C, stream);
#else
        floatX* qkv = a.scratch_bt4c;  // (B, T, 3C), consumed by attention_forward
        matmul_forward(qkv, ln1, p.qkvw + (size_t)l * 3 * C * C, p.qkvb + (size_t)l * 3 * C, B, T, C, 3 * C, stream);
        attention_forward(a.atty + (size_t)l * BTC, a.qkvr + (size_t)l * 3 * BTC, a.att + (size_t)l * ATT,
                          qkv, B, T, C, NH, stream);
#endif
        matmul_forward(a.scratch_btc, a.atty + (size_t)l * BTC, p.attprojw + (size_t)l * C * C,
                       p.attprojb + (size_t)l * C, B, T, C, C, stream);
        fused_residual_layernorm_forward(a.residual2 + (size_t)l * BTC, ln2, a.ln2_mean + (size_t)l * BT,
                                         a.ln2_rstd + (size_t)l * BT, residual, a.scratch_btc,
                                         p.ln2w + (size_t)l * C, p.ln2b + (size_t)l * C, B * T, C, stream);
        matmul_forward(fch_gelu, ln2, p.fcw + (size_t)l * 4 * C * C, p.fcb + (size_t)l * 4 * C, B, T, C, 4 * C, stream,
                       a.fch + (size_t)l * 4 * BTC, model->gelu_fusion);
        matmul_forward(a.scratch_btc, fch_gelu, p.fcprojw + (size_t)l * 4 * C * C, p.fcprojb + (size_t)l * C, B, T,
                       4 * C, C, stream);
        if (l + 1 < L) {
            floatX* next_ln1 = model->recompute >= 2 ? a.ln1 : a.ln1 + (size_t)(l + 1) * BTC;
            fused_residual_layernorm_forward(a.residual3 + (size_t)l * BTC, next_ln1, a.ln1_mean + (size_t)(l + 1) * BT,
                                             a.ln1_rstd + (size_t)(l + 1) * BT, a.residual2 + (size_t)l * BTC,
                                             a.scratch_btc, p.ln1w + (size_t)(l + 1) * C, p.ln1b + (size_t)(l + 1) * C,
                                             B * T, C, stream);
        } else {
            fused_residual_layernorm_forward(a.residual3 + (size_t)l * BTC, a.lnf, a.lnf_mean, a.lnf_rstd,
                                             a.residual2 + (size_t)l * BTC, a.scratch_btc, p.lnfw, p.lnfb, B * T, C,
                                             stream);
        }
    }
    matmul_forward(a.output, a.lnf, p.wte, nullptr, B, T, C, Vp, stream);
    if (targets) {
        fused_classifier(a.output, a.losses, dlogits_scale, model->targets, B, T, V, Vp, dlogits_scale > 0.0f, stream);
        cudaCheck(cudaMemcpyAsync(model->losses_cpu, a.losses, (size_t)B * T * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream));
        cudaCheck(cudaStreamSynchronize(stream));
        double sum = 0.0;
        for (int i = 0; i < B * T; i++) sum += model->losses_cpu[i];
        model->mean_loss = (float)(sum / (B * T));
    }
}

static void gpt2_reduce_layer(GPT2* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);
static void gpt2_reduce_rest(GPT2* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);

// Backward pass for the batch of the last gpt2_forward (which must have been given targets and a
// dlogits_scale). Gradients accumulate (+=) into model->grads; zero them with sharded_parameters_zero_grad. With
// `reduce` (the last micro-step of a step), each layer's gradients are averaged over the processes (ZeRO-0:
// all-reduce; ZeRO-1: reduced to the owner of each shard) on the NCCL stream as soon as that layer's backward
// pass is done, while the next layer's runs.
static void gpt2_backward(GPT2* model, int B, int T, unsigned int seed, const MultiGpuConfig* mg, int reduce,
                          int zero_stage, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    int L = c->num_layers, NH = c->num_heads, C = c->channels, Vp = c->padded_vocab_size;
    size_t BTC = layer_stride((size_t)B * T * C), BT = layer_stride((size_t)B * T);
    size_t ATT = layer_stride((size_t)B * NH * T * T);
    ParameterTensors p = model->params;
    ParameterTensors g = model->grads;
    ActivationTensors a = model->acts;
    floatX* dresidual = a.dresidual;  // gradient of the residual stream, (B, T, C)
    cudaCheck(cudaMemsetAsync(dresidual, 0, (size_t)B * T * C * sizeof(floatX), stream));
    // classifier: the logits' gradient is in a.output
    matmul_backward(a.dbtc, g.wte, nullptr, a.output, a.lnf, p.wte, a.scratch_f, B, T, C, Vp, stream);
    layernorm_backward(dresidual, g.lnfw, g.lnfb, a.scratch_f, a.dbtc, a.residual3 + (size_t)(L - 1) * BTC, p.lnfw,
                       a.lnf_mean, a.lnf_rstd, B, T, C, stream);
    for (int l = L - 1; l >= 0; l--) {
        const floatX* residual = l == 0 ? a.encoded : a.residual3 + (size_t)(l - 1) * BTC;
        floatX* ln1 = model->recompute >= 2 ? a.ln1 : a.ln1 + (size_t)l * BTC;
        floatX* ln2 = model->recompute >= 2 ? a.ln2 : a.ln2 + (size_t)l * BTC;
        floatX* fch = a.fch + (size_t)l * 4 * BTC;
        floatX* fch_gelu = model->recompute >= 1 ? a.fch_gelu : a.fch_gelu + (size_t)l * 4 * BTC;
        const float* ln1_mean = a.ln1_mean + (size_t)l * BT;
        const float* ln1_rstd = a.ln1_rstd + (size_t)l * BT;
        const float* ln2_mean = a.ln2_mean + (size_t)l * BT;
        const float* ln2_rstd = a.ln2_rstd + (size_t)l * BT;
        floatX* dbt4c = a.scratch_bt4c;
        // MLP: fcproj, GELU, fc
        if (model->recompute >= 1) gelu_forward(fch_gelu, fch, B * T * 4 * C, stream);
        matmul_backward(dbt4c, g.fcprojw + (size_t)l * 4 * C * C, g.fcprojb + (size_t)l * C, dresidual, fch_gelu,
                        p.fcprojw + (size_t)l * 4 * C * C, a.scratch_f, B, T, 4 * C, C, stream, fch, model->gelu_fusion);
        if (model->recompute >= 2) {
            layernorm_forward(ln2, nullptr, nullptr, a.residual2 + (size_t)l * BTC, p.ln2w + (size_t)l * C,
                              p.ln2b + (size_t)l * C, B, T, C, stream);
        }
        matmul_backward(a.dbtc, g.fcw + (size_t)l * 4 * C * C, g.fcb + (size_t)l * 4 * C, dbt4c, ln2,
                        p.fcw + (size_t)l * 4 * C * C, a.scratch_f, B, T, C, 4 * C, stream);
        layernorm_backward(dresidual, g.ln2w + (size_t)l * C, g.ln2b + (size_t)l * C, a.scratch_f, a.dbtc,
                           a.residual2 + (size_t)l * BTC, p.ln2w + (size_t)l * C, ln2_mean, ln2_rstd, B, T, C, stream);
        // attention: projection, attention, qkv
        matmul_backward(a.dbtc, g.attprojw + (size_t)l * C * C, g.attprojb + (size_t)l * C, dresidual,
                        a.atty + (size_t)l * BTC, p.attprojw + (size_t)l * C * C, a.scratch_f, B, T, C, C, stream);
        floatX* dqkv = a.scratch_bt4c;  // (B, T, 3C)
#ifdef ENABLE_CUDNN
        attention_backward_cudnn(dqkv, a.dbtc, a.qkvr + (size_t)l * 3 * BTC, a.atty + (size_t)l * BTC,
                                 a.att_stats + (size_t)l * layer_stride((size_t)B * NH * T), B, T, NH, C, stream);
#else
        attention_backward(dqkv, a.dqkvr, a.datt, a.scratch_btc, a.dbtc, a.qkvr + (size_t)l * 3 * BTC,
                           a.att + (size_t)l * ATT, B, T, C, NH, stream);
#endif
        if (model->recompute >= 2) {
            layernorm_forward(ln1, nullptr, nullptr, residual, p.ln1w + (size_t)l * C, p.ln1b + (size_t)l * C, B, T,
                              C, stream);
        }
        matmul_backward(a.dbtc, g.qkvw + (size_t)l * 3 * C * C, g.qkvb + (size_t)l * 3 * C, dqkv, ln1,
                        p.qkvw + (size_t)l * 3 * C * C, a.scratch_f, B, T, C, 3 * C, stream);
        layernorm_backward(dresidual, g.ln1w + (size_t)l * C, g.ln1b + (size_t)l * C, a.scratch_f, a.dbtc, residual,
                           p.ln1w + (size_t)l * C, ln1_mean, ln1_rstd, B, T, C, stream);
        if (reduce) gpt2_reduce_layer(model, l, mg, zero_stage, stream);
    }
    encoder_backward(g.wte, g.wpe, dresidual, model->inputs, model->inputs_cpu, B, T, C, seed, stream);
    if (reduce) gpt2_reduce_rest(model, mg, zero_stage, stream);
}

// ----------------------------------------------------------------------------------------------------
// Gradient averaging over processes during the backward pass (llmc/optimizer.cuh does the rest of the step)

static void gpt2_reduce_layer(GPT2* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    static const int per_layer[] = {2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};  // ln1w .. fcprojb, stacked over layers
    sharded_parameters_reduce_slices(&model->store, per_layer, 12, layer, model->config.num_layers, mg, zero_stage,
                                     stream);
}
static void gpt2_reduce_rest(GPT2* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    static const int rest[] = {0, 1, 14, 15};  // wte, wpe, lnfw, lnfb: complete only after the encoder's backward
    sharded_parameters_reduce_slices(&model->store, rest, 4, -1, model->config.num_layers, mg, zero_stage, stream);
}

// 6N flops per token for the matmuls of forward+backward plus the attention's 12 L C T
static double gpt2_flops_per_token(const GPT2* model, int T) {
    const GPT2Config* c = &model->config;
    return 6.0 * (double)model->store.num_parameters + 12.0 * c->num_layers * c->channels * (double)T;
}

#ifndef TESTING
// ----------------------------------------------------------------------------------------------------
// Checkpoints: <dir>/model_%08d.bin (rank 0), <dir>/state_%08d_%05d.bin (each rank), <dir>/DONE_%08d
// once every rank has written. Each file is written under a temporary name and renamed.

typedef struct {
    int step;
    int good_steps;
    float loss_scale;
    unsigned long long rng_state;
    unsigned long long sample_rng_state;
    OutlierDetector loss_outlier, norm_outlier;
} TrainerState;


static void write_checkpoint(const char* dir, GPT2* model, const DataLoader* loader, const TrainerState* ts,
                             const MultiGpuConfig* mg) {
    char path[1024], tmp[1100];
    if (mg->process_rank == 0) {
        checkpoint_paths(path, sizeof(path), dir, "model", ts->step, -1);
        gpt2_write_model_file(model, path);
    }
    checkpoint_paths(path, sizeof(path), dir, "state", ts->step, mg->process_rank);
    FILE* f = fopen_tmp_for(path, tmp, sizeof(tmp));
    int header[256] = {0};
    header[0] = GPT2_STATE_MAGIC;
    header[1] = 1;
    header[2] = mg->num_processes;
    header[3] = mg->process_rank;
    header[4] = model->store.master_weights != NULL;
    header[5] = ts->step;
    header[6] = PRECISION_MODE;
    header[7] = (int)sizeof(TrainerState);
    header[8] = (int)(model->store.shard_size >> 31);
    header[9] = (int)(model->store.shard_size & 0x7fffffff);
    size_t loader_bytes = dataloader_state_bytes(loader);
    header[10] = (int)loader_bytes;
    fwrite_check(header, sizeof(int), 256, f, tmp);
    sharded_parameters_write_state(&model->store, f, tmp);
    void* lstate = malloc_check(loader_bytes);
    dataloader_save_state(loader, lstate);
    fwrite_check(lstate, 1, loader_bytes, f, tmp);
    free(lstate);
    fwrite_check(ts, sizeof(TrainerState), 1, f, tmp);
    commit_tmp(f, tmp, path);
    multi_gpu_barrier(mg);
    if (mg->process_rank == 0) {
        checkpoint_paths(path, sizeof(path), dir, "DONE", ts->step, -1);
        FILE* d = fopen_tmp_for(path, tmp, sizeof(tmp));
        commit_tmp(d, tmp, path);
    }
}



static void read_checkpoint_state(const char* dir, int step, GPT2* model, DataLoader* loader, TrainerState* ts,
                                  const MultiGpuConfig* mg) {
    char path[1024];
    checkpoint_paths(path, sizeof(path), dir, "state", step, mg->process_rank);
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, GPT2_STATE_MAGIC, "GPT-2 training state");
    size_t shard_size = ((size_t)header[8] << 31) | (size_t)header[9];
    if (header[1] != 1 || header[2] != mg->num_processes || header[3] != mg->process_rank ||
        header[4] != (model->store.master_weights != NULL) || header[6] != PRECISION_MODE ||
        header[7] != (int)sizeof(TrainerState) || shard_size != model->store.shard_size) {
        fprintf(stderr, "%s: state written by a different run setup (processes %d, rank %d, master weights %d, precision "
                "%d, shard %zu) than this one (%d, %d, %d, %d, %zu)\n", path, header[2], header[3], header[4], header[6],
                shard_size, mg->num_processes, mg->process_rank, model->store.master_weights != NULL, PRECISION_MODE,
                model->store.shard_size);
        exit(EXIT_FAILURE);
    }
    sharded_parameters_read_state(&model->store, f, path);
    size_t loader_bytes = (size_t)header[10];
    if (loader_bytes != dataloader_state_bytes(loader)) {
        fprintf(stderr, "%s: data loader state of %zu bytes does not fit this data loader (%zu bytes)\n", path,
                loader_bytes, dataloader_state_bytes(loader));
        exit(EXIT_FAILURE);
    }
    void* lstate = malloc_check(loader_bytes);
    fread_check(lstate, 1, loader_bytes, f, path);
    dataloader_load_state(loader, lstate);
    free(lstate);
    fread_check(ts, sizeof(TrainerState), 1, f, path);
    if (fgetc(f) != EOF) {
        fprintf(stderr, "%s: file is longer than a training state\n", path);
        exit(EXIT_FAILURE);
    }
    fclose_check(f, path);
}

// ----------------------------------------------------------------------------------------------------
// Sampling: autoregressive from the EOT token, printed through the tokenizer

static void sample_and_print(GPT2* model, const Tokenizer* tokenizer, int gen_tokens, unsigned long long* sample_rng,
                             cudaStream_t stream) {
    int T = model->seq_len < gen_tokens + 1 ? model->seq_len : gen_tokens + 1;
    int Vp = model->config.padded_vocab_size, V = model->config.vocab_size;
    int* tokens = (int*)malloc_check((size_t)T * sizeof(int));
    floatX* logits_x = (floatX*)malloc_check((size_t)Vp * sizeof(floatX));
    float* logits = (float*)malloc_check((size_t)Vp * sizeof(float));
    tokens[0] = tokenizer->eot_token;
    printf("generating:\n---\n");
    for (int t = 1; t < T; t++) {
        gpt2_forward(model, tokens, nullptr, 1, t, 0.0f, stream);
        cudaCheck(cudaMemcpy(logits_x, model->acts.output + (size_t)(t - 1) * Vp, (size_t)Vp * sizeof(floatX),
                             cudaMemcpyDeviceToHost));
        for (int v = 0; v < V; v++) logits[v] = (float)logits_x[v];
        int next = sample_softmax(logits, V, random_f32_host((uint64_t*)sample_rng));
        tokens[t] = next;
        // a token the tokenizer does not know (its vocabulary is smaller than the model's) prints as its id
        if (tokenizer->init_ok && (uint32_t)next < tokenizer->vocab_size) safe_printf(tokenizer_decode(tokenizer, next));
        else printf("<%d>", next);
        fflush(stdout);
    }
    printf("\n---\n");
    free(tokens);
    free(logits_x);
    free(logits);
}

// ----------------------------------------------------------------------------------------------------
// Command line

static void usage(void) {
    fprintf(stderr,
            "Usage:   ./train_gpt [options]\n"
            "Options:\n"
            "  -i <string> train data filename pattern (default = dev/data/tinyshakespeare/tiny_shakespeare_train.bin)\n"
            "  -j <string> val data filename pattern (default = dev/data/tinyshakespeare/tiny_shakespeare_val.bin)\n"
            "  -e <string> input model file or descriptor dN (default = gpt2_124M_bf16.bin)\n"
            "  -ev <int>   vocabulary size for a descriptor (default = 50257)\n"
            "  -et <int>   max sequence length for a descriptor (default = 1024)\n"
            "  -sd <int>   seed of a descriptor's initialisation (default = 42)\n"
            "  -o <string> output log dir and checkpoints (default = none)\n"
            "  -tf <string> tokenizer file for decoding samples (default = gpt2_tokenizer.bin)\n"
            "  -n <int>    write a checkpoint every how many steps (default 0 = never)\n"
            "  -nk <int>   keep the last how many checkpoints (default 0 = all)\n"
            "  -y <int>    resume from the latest complete checkpoint in -o (default 0)\n"
            "  -b <int>    (per-GPU, micro) batch size B (default = 4)\n"
            "  -t <int>    sequence length T (default = 1024)\n"
            "  -d <int>    total desired batch size in tokens (default = B*T*processes: no accumulation)\n"
            "  -x <int>    max steps (default = -1 = one epoch)\n"
            "  -l <float>  learning rate (default = 3e-4)\n"
            "  -u <int>    learning rate warmup iterations (default = 0)\n"
            "  -q <float>  learning rate decay: final fraction, at end of training (default = 1.0 = no decay)\n"
            "  -k <string> learning rate scheduler: cosine, linear, constant, wsd (default = cosine)\n"
            "  -c <float>  weight decay (default = 0.0)\n"
            "  -v <int>    val loss every how many steps (default = 20, 0 = never)\n"
            "  -m <int>    val batches (default = 20)\n"
            "  -s <int>    sample every how many steps (default = 20, 0 = never)\n"
            "  -g <int>    generated tokens per sample (default = 64)\n"
            "  -a <int>    overfit a single batch? 0/1 (default = 0)\n"
            "  -w <int>    keep fp32 master weights? 0/1 (default = 1)\n"
            "  -z <int>    ZeRO stage: 0 (all-reduce) or 1 (sharded optimizer state) (default = 0)\n"
            "  -r <int>    recompute: 0 none, 1 GELU, 2 GELU and LayerNorms (default = 1)\n"
            "  -ge <int>   GELU fusion into cuBLASLt epilogues: 0 off, 1 forward, 2 forward and backward (default = 1)\n"
            "  -sl <float> skip the update when the loss z-score exceeds this (default = 0 = off)\n"
            "  -sg <float> skip the update when the gradient-norm z-score exceeds this (default = 0 = off)\n"
            "  -pi <string> process init: mpi, tcp or fs (default = mpi)\n"
            "  -pf <string> shared directory for -pi fs\n"
            "  -ps <string> server ip for -pi tcp\n"
            "  -pn <int>   number of processes (-pi tcp/fs)\n"
            "  -pr <int>   this process's rank (-pi tcp/fs)\n"
            "  -pg <int>   GPUs per node (-pi tcp/fs, default = 8)\n"
            "  -h          this help\n");
}




int main(int argc, char* argv[]) {
    const char* train_pattern = "dev/data/tinyshakespeare/tiny_shakespeare_train.bin";
    const char* val_pattern = "dev/data/tinyshakespeare/tiny_shakespeare_val.bin";
    const char* model_source = "gpt2_124M_bf16.bin";
    const char* output_dir = NULL;
    const char* lr_scheduler_type = "cosine";
    const char* tokenizer_path = "gpt2_tokenizer.bin";
    const char* init_method = "mpi";
    const char* fs_path = "";
    const char* server_ip = "";
    int descriptor_vocab = 50257, descriptor_maxT = 1024, descriptor_seed = 42;
    int checkpoint_every = 0, checkpoints_keep = 0, resume = 0;
    int B = 4, T = 1024, total_batch_size = -1, max_steps = -1, warmup_iterations = 0;
    float learning_rate = 3e-4f, final_lr_frac = 1.0f, weight_decay = 0.0f;
    int val_every = 20, val_max_steps = 20, sample_every = 20, gen_tokens = 64;
    int overfit_single_batch = 0, use_master_weights = 1, zero_stage = 0, recompute = 1, gelu_fusion = 1;
    float skip_update_lossz = 0.0f, skip_update_gradz = 0.0f;
    int num_processes = 1, process_rank = 0, gpus_per_node = 8;
    for (int i = 1; i < argc; i += 2) {
        const char* flag = argv[i];
        if (!strcmp(flag, "-h") || !strcmp(flag, "--help")) {
            usage();
            return 0;
        }
        if (flag[0] != '-' || i + 1 >= argc) {
            fprintf(stderr, "argument %s: expected '-flag value' pairs (see -h)\n", flag);
            return EXIT_FAILURE;
        }
        const char* v = argv[i + 1];
        if (!strcmp(flag, "-i")) train_pattern = v;
        else if (!strcmp(flag, "-j")) val_pattern = v;
        else if (!strcmp(flag, "-e")) model_source = v;
        else if (!strcmp(flag, "-ev")) descriptor_vocab = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-et")) descriptor_maxT = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-sd")) descriptor_seed = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-o")) output_dir = v;
        else if (!strcmp(flag, "-tf")) tokenizer_path = v;
        else if (!strcmp(flag, "-n")) checkpoint_every = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-nk")) checkpoints_keep = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-y")) resume = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-b")) B = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-t")) T = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-d")) total_batch_size = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-x")) max_steps = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-l")) learning_rate = parse_float_flag(flag, v);
        else if (!strcmp(flag, "-u")) warmup_iterations = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-q")) final_lr_frac = parse_float_flag(flag, v);
        else if (!strcmp(flag, "-k")) lr_scheduler_type = v;
        else if (!strcmp(flag, "-c")) weight_decay = parse_float_flag(flag, v);
        else if (!strcmp(flag, "-v")) val_every = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-m")) val_max_steps = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-s")) sample_every = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-g")) gen_tokens = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-a")) overfit_single_batch = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-w")) use_master_weights = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-z")) zero_stage = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-r")) recompute = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-ge")) gelu_fusion = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-sl")) skip_update_lossz = parse_float_flag(flag, v);
        else if (!strcmp(flag, "-sg")) skip_update_gradz = parse_float_flag(flag, v);
        else if (!strcmp(flag, "-pi")) init_method = v;
        else if (!strcmp(flag, "-pf")) fs_path = v;
        else if (!strcmp(flag, "-ps")) server_ip = v;
        else if (!strcmp(flag, "-pn")) num_processes = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-pr")) process_rank = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-pg")) gpus_per_node = parse_int_flag(flag, v);
        else {
            fprintf(stderr, "unknown flag %s (see -h)\n", flag);
            return EXIT_FAILURE;
        }
    }
    // values that no run can use are refused before anything starts
    if (B < 1) { fprintf(stderr, "-b %d: the micro-batch must be at least 1\n", B); return EXIT_FAILURE; }
    if (T < 1) { fprintf(stderr, "-t %d: the sequence length must be at least 1\n", T); return EXIT_FAILURE; }
    if (recompute < 0 || recompute > 2) { fprintf(stderr, "-r %d: expected 0, 1 or 2\n", recompute); return EXIT_FAILURE; }
    if (zero_stage < 0 || zero_stage > 1) { fprintf(stderr, "-z %d: expected 0 or 1 (ZeRO-2/3 are not implemented)\n", zero_stage); return EXIT_FAILURE; }
    if (use_master_weights != 0 && use_master_weights != 1) { fprintf(stderr, "-w %d: expected 0 or 1\n", use_master_weights); return EXIT_FAILURE; }
    if (overfit_single_batch != 0 && overfit_single_batch != 1) { fprintf(stderr, "-a %d: expected 0 or 1\n", overfit_single_batch); return EXIT_FAILURE; }
    if (gelu_fusion < 0 || gelu_fusion > 2) { fprintf(stderr, "-ge %d: expected 0, 1 or 2\n", gelu_fusion); return EXIT_FAILURE; }
    if (resume && !output_dir) { fprintf(stderr, "-y 1 needs -o, the directory to resume from\n"); return EXIT_FAILURE; }
    if (checkpoint_every > 0 && !output_dir) { fprintf(stderr, "-n %d needs -o, the directory for checkpoints\n", checkpoint_every); return EXIT_FAILURE; }
    if (learning_rate < 0.0f || final_lr_frac < 0.0f || weight_decay < 0.0f || warmup_iterations < 0 || checkpoints_keep < 0) {
        fprintf(stderr, "-l, -q, -c, -u and -nk must not be negative\n");
        return EXIT_FAILURE;
    }

    int device_count = 0;
    cudaError_t device_error = cudaGetDeviceCount(&device_count);
    if (device_error != cudaSuccess || device_count == 0) {
        fprintf(stderr, "no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(device_error));
        return EXIT_FAILURE;
    }
    MultiGpuConfig mg = multi_gpu_config_init(init_method, num_processes, process_rank, gpus_per_node, server_ip, fs_path);
    int rank0 = mg.process_rank == 0;
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream));
    cublas_setup();
#ifdef ENABLE_CUDNN
    cudnn_attention_setup();
#endif
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, mg.local_device_idx));

    // the model
    GPT2 model;
    gpt2_init_common(&model);
    model.use_master_weights = use_master_weights;
    model.recompute = recompute;
    model.gelu_fusion = gelu_fusion;
    char resume_dir_model[1024] = "";
    int resume_step = -1;
    if (resume) {
        resume_step = find_latest_checkpoint(output_dir);
        if (resume_step < 0) {
            if (rank0) printf("-y 1: no complete checkpoint in %s, starting from -e %s\n", output_dir, model_source);
        } else {
            checkpoint_paths(resume_dir_model, sizeof(resume_dir_model), output_dir, "model", resume_step, -1);
            model_source = resume_dir_model;
        }
    }
    if (file_exists(model_source)) gpt2_build_from_checkpoint(&model, model_source, mg.num_processes);
    else if (model_source[0] == 'd' && isdigit((unsigned char)model_source[1]))
        gpt2_build_from_descriptor(&model, model_source, descriptor_vocab, descriptor_maxT, descriptor_seed, mg.num_processes);
    else {
        fprintf(stderr, "-e %s: no such model file (and not a descriptor such as d12)\n", model_source);
        return EXIT_FAILURE;
    }
    const GPT2Config* cfg = &model.config;
    if (T > cfg->max_seq_len) {
        fprintf(stderr, "-t %d: longer than the model's maximum sequence length %d\n", T, cfg->max_seq_len);
        return EXIT_FAILURE;
    }
    int tokens_per_micro_step = B * T * mg.num_processes;
    if (total_batch_size < 0) total_batch_size = tokens_per_micro_step;
    if (total_batch_size % tokens_per_micro_step != 0) {
        fprintf(stderr, "-d %d: must be a multiple of B*T*processes = %d\n", total_batch_size, tokens_per_micro_step);
        return EXIT_FAILURE;
    }
    int grad_accum_steps = total_batch_size / tokens_per_micro_step;

    // data
    DataLoader train_loader, val_loader;
    dataloader_init(&train_loader, train_pattern, B, T, mg.process_rank, mg.num_processes, !overfit_single_batch, 1337);
    int run_val = val_every > 0 && val_max_steps > 0 && strlen(val_pattern) > 0;
    if (run_val) dataloader_init(&val_loader, val_pattern, B, T, mg.process_rank, mg.num_processes, 0, 0);
    int train_num_batches = max_steps > 0 ? max_steps : (int)(dataloader_num_tokens(&train_loader) / total_batch_size);
    if (train_num_batches < 1) train_num_batches = 1;
    Tokenizer tokenizer;
    tokenizer_init(&tokenizer, tokenizer_path);
    if (tokenizer.init_ok && tokenizer.vocab_size != (uint32_t)cfg->vocab_size && rank0) {
        printf("note: tokenizer %s has %u tokens, the model %d: tokens it lacks print as <id>\n", tokenizer_path,
               tokenizer.vocab_size, cfg->vocab_size);
    }

    gpt2_allocate_activations(&model, B, T);
    sharded_parameters_allocate_optimizer(&model.store, model.use_master_weights, mg.process_rank, mg.num_processes,
                                          zero_stage);

    // the memory plan
    size_t param_bytes = model.store.num_parameters_padded * sizeof(floatX);
    size_t opt_bytes = model.store.shard_size * sizeof(float) * (model.store.master_weights ? 3 : 2);
    size_t act_bytes = activation_bytes(cfg, B, T, recompute);
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    // the activations are already allocated: a batch fits if its activations fit in what they use plus what is free
    int max_fit_B = 0;
    while (max_fit_B < 65536 && activation_bytes(cfg, max_fit_B + 1, T, recompute) <= free_bytes + act_bytes) max_fit_B++;
    if (rank0) {
        printf("+-----------------------+----------------------------------------------------+\n");
        printf("| device                | %-50.50s |\n", prop.name);
        printf("| precision             | %-50s |\n", PRECISION_NAME);
        printf("| model                 | L=%d NH=%d C=%d V=%d Vp=%d maxT=%d%*s|\n", cfg->num_layers, cfg->num_heads,
               cfg->channels, cfg->vocab_size, cfg->padded_vocab_size, cfg->max_seq_len, 1, "");
        printf("| parameters            | %-50zu |\n", model.store.num_parameters);
        printf("| batch                 | B=%d T=%d processes=%d accumulation=%d%*s|\n", B, T, mg.num_processes,
               grad_accum_steps, 1, "");
        printf("| memory: parameters    | %10.1f MiB%40s|\n", param_bytes / 1048576.0, "");
        printf("| memory: gradients     | %10.1f MiB%40s|\n", param_bytes / 1048576.0, "");
        printf("| memory: optimizer     | %10.1f MiB (m, v%s, ZeRO-%d shard)%*s|\n", opt_bytes / 1048576.0,
               model.store.master_weights ? ", master" : "", zero_stage, model.store.master_weights ? 7 : 15, "");
        printf("| memory: activations   | %10.1f MiB (recompute %d)%24s|\n", act_bytes / 1048576.0, recompute, "");
        printf("| largest B that fits   | %-50d |\n", max_fit_B);
        printf("+-----------------------+----------------------------------------------------+\n");
    }

    TrainerState ts;
    memset(&ts, 0, sizeof(ts));
    ts.loss_scale = model.store.loss_scale;
    ts.rng_state = model.store.rng_state;
    ts.sample_rng_state = 1337ull;
    init_detector(&ts.loss_outlier);
    init_detector(&ts.norm_outlier);
    int start_step = 0;
    if (resume_step >= 0) {
        read_checkpoint_state(output_dir, resume_step, &model, &train_loader, &ts, &mg);
        model.store.rng_state = ts.rng_state;
        model.store.loss_scale = ts.loss_scale;
        model.store.good_steps = ts.good_steps;
        start_step = ts.step;
        if (rank0) printf("resumed from step %d of %s\n", start_step, output_dir);
    }
    if (output_dir) create_dir_if_not_exists(output_dir);
    Logger logger;
    logger_init(&logger, output_dir, mg.process_rank, resume_step >= 0);
    LearningRateScheduler scheduler;
    lr_scheduler_init(&scheduler, lr_scheduler_type, learning_rate, warmup_iterations, train_num_batches, final_lr_frac);
    AdamWConfig opt = {learning_rate, 0.9f, 0.95f, 1e-8f, weight_decay, 1.0f};
    float flops_promised = get_flops_promised(prop.name, PRECISION_MODE);

    for (int step = start_step; step <= train_num_batches; step++) {
        int last_step = step == train_num_batches;
        if (run_val && (step % val_every == 0 || last_step)) {
            dataloader_reset(&val_loader);
            double val_loss = 0.0;
            for (int i = 0; i < val_max_steps; i++) {
                dataloader_next_batch(&val_loader);
                gpt2_forward(&model, val_loader.inputs, val_loader.targets, B, T, 0.0f, stream);
                val_loss += model.mean_loss;
            }
            val_loss = multi_gpu_cpu_float_sum((float)(val_loss / val_max_steps), &mg) / mg.num_processes;
            if (rank0) printf("val loss %f\n", val_loss);
            logger_log_val(&logger, step, (float)val_loss);
        }
        if (rank0 && sample_every > 0 && (step % sample_every == 0 || last_step) && gen_tokens > 0) {
            sample_and_print(&model, &tokenizer, gen_tokens, &ts.sample_rng_state, stream);
        }
        if (output_dir && checkpoint_every > 0 && step > start_step && (step % checkpoint_every == 0 || last_step)) {
            ts.step = step;
            ts.rng_state = model.store.rng_state;
            ts.loss_scale = model.store.loss_scale;
            ts.good_steps = model.store.good_steps;
            write_checkpoint(output_dir, &model, &train_loader, &ts, &mg);
            if (rank0) {
                printf("checkpoint written: step %d\n", step);
                if (checkpoints_keep > 0) {
                    int old = step - checkpoints_keep * checkpoint_every;
                    if (old > 0) delete_checkpoint(output_dir, old, mg.num_processes);
                }
            }
        }
        if (last_step) break;

        struct timespec ts0, ts1;
        clock_gettime(CLOCK_MONOTONIC, &ts0);
        sharded_parameters_zero_grad(&model.store, stream);
        double step_loss = 0.0;
        for (int micro = 0; micro < grad_accum_steps; micro++) {
            if (overfit_single_batch) dataloader_reset(&train_loader);
            dataloader_next_batch(&train_loader);
            float dlogits_scale = model.store.loss_scale / (float)(B * T * grad_accum_steps);
            gpt2_forward(&model, train_loader.inputs, train_loader.targets, B, T, dlogits_scale, stream);
            int last_micro_step = micro == grad_accum_steps - 1;
            gpt2_backward(&model, B, T, sharded_parameters_next_seed(&model.store), &mg, last_micro_step, zero_stage,
                          stream);
            step_loss += model.mean_loss;
        }
        float loss = (float)(step_loss / grad_accum_steps);
        if (mg.num_processes > 1) loss = multi_gpu_cpu_float_sum(loss, &mg) / mg.num_processes;
        float norm = sharded_parameters_reduce_and_norm(&model.store, &mg, zero_stage, stream);
        // outliers: a spike in the loss or the gradient norm against the last 128 steps skips the update
        double loss_z = update_detector(&ts.loss_outlier, loss);
        double norm_z = isfinite(norm) ? update_detector(&ts.norm_outlier, norm) : NAN;
        int loss_spike = skip_update_lossz > 0.0f && isfinite(loss_z) && loss_z > skip_update_lossz;
        int norm_spike = skip_update_gradz > 0.0f && isfinite(norm_z) && norm_z > skip_update_gradz;
        opt.learning_rate = lr_scheduler_get(&scheduler, step);
        if (!loss_spike && !norm_spike) sharded_parameters_apply_update(&model.store, &opt, norm, step + 1, &mg, zero_stage, stream);
        cudaCheck(cudaStreamSynchronize(stream));
        clock_gettime(CLOCK_MONOTONIC, &ts1);
        float ms = (float)((ts1.tv_sec - ts0.tv_sec) * 1e3 + (ts1.tv_nsec - ts0.tv_nsec) * 1e-6);
        float tokens_per_second = total_batch_size / (ms * 1e-3f);
        float mfu = -1.0f;
        if (flops_promised > 0) {
            double achieved = gpt2_flops_per_token(&model, T) * total_batch_size / (ms * 1e-3) / mg.num_processes;
            mfu = (float)(100.0 * achieved / (flops_promised * 1e12));
        }
        if (rank0) {
            if (loss_spike) printf("step %d: loss z-score %.1f exceeds -sl %.1f: update skipped\n", step + 1, loss_z, skip_update_lossz);
            if (norm_spike) printf("step %d: gradient norm z-score %.1f exceeds -sg %.1f: update skipped\n", step + 1, norm_z, skip_update_gradz);
            if (!isfinite(norm)) printf("step %d: gradient overflow, update skipped, loss scale now %.0f\n", step + 1, model.store.loss_scale);
            if (mfu >= 0.0f)
                printf("step %d/%d | loss %f | norm %f | lr %e | %.2f ms | %.1f%% MFU | %.0f tok/s\n", step + 1,
                       train_num_batches, loss, norm, opt.learning_rate, ms, mfu, tokens_per_second);
            else
                printf("step %d/%d | loss %f | norm %f | lr %e | %.2f ms | %.0f tok/s\n", step + 1, train_num_batches,
                       loss, norm, opt.learning_rate, ms, tokens_per_second);
            fflush(stdout);
        }
        logger_log_train(&logger, step + 1, loss, norm, opt.learning_rate, ms, mfu, tokens_per_second);
    }

    logger_free(&logger);
    tokenizer_free(&tokenizer);
    dataloader_free(&train_loader);
    if (run_val) dataloader_free(&val_loader);
    gpt2_free(&model);
#ifdef ENABLE_CUDNN
    cudnn_attention_teardown();
#endif
    cublas_teardown();
    cudaCheck(cudaStreamDestroy(stream));
    multi_gpu_config_free(&mg);
    return 0;
}
#endif
