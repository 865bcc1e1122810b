// train_gpt.cu: GPT-2 training in C/CUDA: hand-written kernels (llmc/), cuBLASLt GEMMs, bf16/fp16/fp32 mixed
// precision, activation recompute, data parallelism over NCCL with ZeRO stages 1 to 3 and ZeRO-Offload
// (doc/zero.md). -arch llama trains the Llama-style model of doc/kernels.md (RMSNorm, RoPE, grouped-query attention,
// SwiGLU, no biases) through the same code.
// Build and run:
//   make train_gpt [PRECISION=BF16|FP16|FP32]             GPU binary (nvcc), ./train_gpt -i "data/x/*train*.bin" ...
//   make train_gpt_cpu [PRECISION=...]                     the same source on the CPU backend (cpu/cucc)
//   mpirun -np 8 ./train_gpt ...                           data parallel, one process per GPU
// Flags are listed by `./train_gpt -h` (the llm.c conventions, extended; doc/training.md describes each).
// This file is the model (GPT-2 and the Llama-style family, as layers of kinds: doc/architecture.md), the training
// step and main. The configuration and its checks, the activations' layout, the model file, the checkpoints, the
// settings and the memory plan are llmc/model_config.h, activation_memory.h, model_file.h, train_checkpoint.h,
// train_settings.h and memory_plan.h, included where they are used. train_moe.cu (the Switch-MoE
// model) and test_gpt.cu include this file with OMIT_TRAIN_GPT_MAIN defined and bring their own main; the MoE model
// plugs its layers into the model and the loop through an extension's interfaces (llmc/model_extension.h).
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
#include "llmc/deferred_weights.cuh"
#include "llmc/attention.cuh"  // the cuBLAS-and-softmax path, and the size check of attention and matmul
#include "llmc/flash_attention.cuh"
#ifdef ENABLE_CUDNN
#include "llmc/cudnn_att.cuh"  // GPU only: cuDNN's fused attention (make USE_CUDNN=1)
#endif
#include "llmc/gelu.cuh"
#include "llmc/rmsnorm.cuh"
#include "llmc/rope.cuh"
#include "llmc/swiglu.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/adamw.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/copy_cast.cuh"
#include "llmc/multi_gpu.cuh"
#include "llmc/tensor_parallel.cuh"
#include "llmc/pipeline.h"
#include "llmc/optimizer.cuh"
#include "llmc/checkpoint.h"
#include "llmc/cli.h"
#include "llmc/info_table.h"
#include "llmc/output_lock.h"
#include "llmc/preemption.h"
#include "llmc/watchdog.h"

// ----------------------------------------------------------------------------------------------------
// Model description and parameters

#define GPT2_MODEL_MAGIC 20240326
#define STATE_FILE_MAGIC 20240527

#include "llmc/model_config.h"


// The tensors in model-file order, each once: X(id, name, weight decay, seed), PARAM_<id> its index. An MLP
// extension's tensors (train_moe.cu: the routers', the experts' and the shared experts') have slots between the dense
// MLP's and the final LayerNorm's, which GPT-2 leaves empty. Weight decay applies to the matrices only (the
// embeddings and the Linear weights; train_gpt.py: the 2-D ones). The seed numbers each tensor's stochastic rounding
// in the optimizer: in file order, except that slots 6..9 (the shared experts', added after the others) take the
// numbers after lm_head, so that every tensor that existed before them keeps its rounding and BF16 runs without
// shared experts have the same bits as before. A llama model uses the slots of the tensors that play the same role
// (ln*w hold RMSNorm weights, fcw SwiGLU's [gate | up]); its empty slots (wpe, the biases) have size 0, and its untied
// output embedding is the last slot, PARAM_LM_HEAD, after everything GPT-2 has.
#define MLP_EXTENSION_SLOTS 10
#define PARAMETER_TENSORS(X)                                                                                           \
    X(WTE, "wte", 1, 0)                                                                                                \
    X(WPE, "wpe", 1, 1)                                                                                                \
    X(LN1W, "ln1w", 0, 2)                                                                                              \
    X(LN1B, "ln1b", 0, 3)                                                                                              \
    X(QKVW, "qkvw", 1, 4)                                                                                              \
    X(QKVB, "qkvb", 0, 5)                                                                                              \
    X(ATTPROJW, "attprojw", 1, 6)                                                                                      \
    X(ATTPROJB, "attprojb", 0, 7)                                                                                      \
    X(LN2W, "ln2w", 0, 8)                                                                                              \
    X(LN2B, "ln2b", 0, 9)                                                                                              \
    X(FCW, "fcw", 1, 10)                                                                                               \
    X(FCB, "fcb", 0, 11)                                                                                               \
    X(FCPROJW, "fcprojw", 1, 12)                                                                                       \
    X(FCPROJB, "fcprojb", 0, 13)                                                                                       \
    /* the extension's slots: its names and weight decays are its own (FfnExtension)  */                                \
    X(EXTENSION, NULL, 0, 14)                                                                                          \
    X(EXTENSION_1, NULL, 0, 15)                                                                                        \
    X(EXTENSION_2, NULL, 0, 16)                                                                                        \
    X(EXTENSION_3, NULL, 0, 17)                                                                                        \
    X(EXTENSION_4, NULL, 0, 18)                                                                                        \
    X(EXTENSION_5, NULL, 0, 19)                                                                                        \
    X(EXTENSION_6, NULL, 0, 23)                                                                                        \
    X(EXTENSION_7, NULL, 0, 24)                                                                                        \
    X(EXTENSION_8, NULL, 0, 25)                                                                                        \
    X(EXTENSION_9, NULL, 0, 26)                                                                                        \
    X(LNFW, "lnfw", 0, 20)                                                                                             \
    X(LNFB, "lnfb", 0, 21)                                                                                             \
    X(LM_HEAD, "lm_head", 1, 22)
#define PARAMETER_INDEX(id, name, decay, seed) PARAM_##id,
enum { PARAMETER_TENSORS(PARAMETER_INDEX) NUM_PARAMETER_TENSORS };
static_assert(PARAM_LNFW - PARAM_EXTENSION == MLP_EXTENSION_SLOTS, "PARAMETER_TENSORS: one row per extension slot");
#define PARAMETER_DECAY(id, name, decay, seed) decay,
static const int parameter_decays[NUM_PARAMETER_TENSORS] = {PARAMETER_TENSORS(PARAMETER_DECAY)};
#define PARAMETER_SEED(id, name, decay, seed) seed,
static const unsigned int parameter_seeds[NUM_PARAMETER_TENSORS] = {PARAMETER_TENSORS(PARAMETER_SEED)};
#define PARAMETER_NAME(id, name, decay, seed) name,

// Pointers into the parameter set's buffer (and the same into the gradients'). Shapes for GPT-2; llama's: qkvw
// (L, (NH + 2 NKV) HS, C), fcw (L, 2H, C), fcprojw (L, C, H), lm_head (Vp, C) when untied, the others empty (size 0:
// never read).
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
    floatX* fcw;       // (Ld, 4C, C), Ld = the layers with a dense MLP (all, without an extension)
    floatX* fcb;       // (Ld, 4C)
    floatX* fcprojw;   // (Ld, C, 4C)
    floatX* fcprojb;   // (Ld, C)
    floatX* lnfw;      // (C)
    floatX* lnfb;      // (C)
    floatX* lm_head;   // llama untied: (Vp, C)
} ParameterTensors;

// One layer's slices of them. The fc* are the dense MLP's (NULL in a layer whose MLP an extension replaces); the
// tensors the layer kinds lack (biases, RMSNorm's bias) are NULL.
typedef struct {
    floatX *ln1w, *ln1b, *qkvw, *qkvb, *attprojw, *attprojb, *ln2w, *ln2b;
    floatX *fcw, *fcb, *fcprojw, *fcprojb;
} LayerParameters;

// ----------------------------------------------------------------------------------------------------
// Activations. With recompute level r, the per-layer GELU output (r >= 1) and LayerNorm outputs (r >= 2)
// are kept for one layer only and recomputed in the backward pass. Shapes for GPT-2; in a llama model the ln*
// are RMSNorm outputs (no means: ln*_mean are empty), qkvr is (L, B, T, (NH + 2 NKV) HS) with q and k roped,
// fch (Ld, B, T, 2H) is fc's [gate | up] and ffn_act (Ld or 1, B, T, H) the SwiGLU output; scratch_bt4c
// holds (B, T, max((NH + 2 NKV) HS, H)). Under tensor parallelism (-tp N) qkvr, atty, fch, ffn_act and the logits hold
// this process's heads, hidden units and vocabulary rows (a width over N), and with sequence parallelism the
// residual stream (encoded, residual2, residual3, dresidual) and the norms' statistics B*T/N tokens.
// Every activation tensor once, in the order they are laid out in one allocation: X(type, name, elements), the
// elements an expression over fill_in_activation_sizes' locals. The struct, the indices, the sizes and the pointers
// come from it.
#define ACTIVATION_TENSORS(X)                                                                                          \
    X(floatX, encoded, STC)                          /* (B, T, C): the stream's tokens (-sp: B*T/N of them) */        \
    X(floatX, ln1, ln_layers * BTC)                  /* (L or 1, B, T, C) */                                           \
    X(float, ln1_mean, L * means)                    /* (L, B, T) */                                                   \
    X(float, ln1_rstd, L * ST)                       /* (L, B, T) */                                                   \
    X(floatX, atty, L * ATY)                         /* (L, B, T, C) attention output before the projection */         \
    /* att: (L, B, NH, T, T) attention probabilities (cuBLAS-and-softmax path only) */                                 \
    X(floatX, att, L * att_probs)                                                                                      \
    /* att_stats: (L, B, NH, T) softmax statistics: log-sum-exp (flash and cuDNN paths) */                             \
    X(float, att_stats, L * att_stats)                                                                                 \
    /* qkvr: (L, B, T, 3C) q, k, v kept for the backward pass (permuted by the cuBLAS-and-softmax path) */             \
    X(floatX, qkvr, L * QKV)                                                                                           \
    X(floatX, residual2, L * STC)                    /* (L, B, T, C) */                                                \
    X(floatX, ln2, ln_layers * BTC)                  /* (L or 1, B, T, C) */                                           \
    X(float, ln2_mean, L * means)                    /* (L, B, T) */                                                   \
    X(float, ln2_rstd, L * ST)                       /* (L, B, T) */                                                   \
    X(floatX, fch, dense_layers * FC)                /* (Ld, B, T, 4C) pre-GELU, dense MLPs only */                    \
    X(floatX, ffn_act, act_layers * HID)            /* (Ld or 1, B, T, 4C) the activation's output */                 \
    X(floatX, residual3, L * STC)                    /* (L, B, T, C) */                                                \
    X(floatX, lnf, BTC)                              /* (B, T, C) */                                                   \
    X(float, lnf_mean, means)                        /* (B, T) */                                                      \
    X(float, lnf_rstd, ST)                           /* (B, T) */                                                      \
    X(float, losses, BT)                             /* (B, T) */                                                      \
    X(floatX, output, B * T * Vp)                    /* (B, T, Vp) logits, overwritten by their gradient */            \
    /* scratch shared by the forward and backward passes */                                                            \
    X(floatX, scratch_btc, BTC)                      /* (B, T, C) */                                                   \
    X(floatX, scratch_bt4c, BT4C)                    /* (B, T, 4C) */                                                  \
    X(floatX, dresidual, STC)                        /* (B, T, C) */                                                   \
    X(floatX, dbtc, BTC)                             /* (B, T, C) */                                                   \
    X(floatX, dqkvr, probabilities * 3 * BTC)        /* (B, T, 3C) (cuBLAS-and-softmax path only) */                   \
    X(floatX, datt, att_probs)                       /* (B, NH, T, T) (cuBLAS-and-softmax path only) */                \
    /* att_delta: (B, NH, T) rowsum(dout * out) (flash path only) */                                                   \
    X(float, att_delta, model->attention == ATTENTION_FLASH ? BT * NH : 0)                                             \
    /* scratch_f: layernorm backward and bias-gradient scratch */                                                      \
    X(float, scratch_f, ln_scratch > bias_scratch ? ln_scratch : bias_scratch)                                          \
    /* tensor parallelism (llmc/tensor_parallel.cuh): (4, B, T) the classifier's row statistics; with sequence */      \
    /* parallelism (B*T/N, C) a row-parallel block's output reduce-scattered onto this member's tokens (in the */      \
    /* backward pass a norm's input gradient), (B*T/N, C) a norm's output before its all-gather, (B, T, C) the */     \
    /* residual stream's gradient all-gathered */                                                                      \
    X(float, classifier_stats, classifier_stats)                                                                       \
    X(floatX, member_stream, member_tokens)                                                                            \
    X(floatX, member_norm, member_tokens)                                                                              \
    X(floatX, gathered_dout, gathered)
#define ACTIVATION_FIELD(type, name, elements) type* name;
typedef struct {
    ACTIVATION_TENSORS(ACTIVATION_FIELD)
} ActivationTensors;
#define ACTIVATION_INDEX(type, name, elements) ACT_##name,
enum { ACTIVATION_TENSORS(ACTIVATION_INDEX) NUM_ACTIVATION_TENSORS };

// How attention runs: cuBLAS batched GEMMs around a softmax kernel, materialising the (B, NH, T, T) scores (llm.c's
// path, llmc/attention.cuh); the hand-written flash attention, which keeps only a log-sum-exp per row
// (llmc/flash_attention.cuh); or cuDNN's fused attention (USE_CUDNN=1 builds, llmc/cudnn_att.cuh). -fa chooses.
typedef enum { ATTENTION_MATMUL_SOFTMAX, ATTENTION_FLASH, ATTENTION_CUDNN } AttentionPath;

// One layer's slices of them (for the batch the activations were sized for). ln1, ln2 and ffn_act are the
// shared single-layer buffers when recomputed; the mlp_* are NULL in a layer whose MLP an extension replaces.
typedef struct {
    const floatX* residual;  // the layer's input: the embeddings or the previous layer's residual3
    floatX *ln1, *atty, *att, *qkvr, *residual2, *ln2, *residual3, *fch, *ffn_act;
    float *ln1_mean, *ln1_rstd, *att_stats, *ln2_mean, *ln2_rstd;
} LayerActivations;

typedef struct Model Model;
typedef struct Adapter Adapter;

// What a micro-batch in flight keeps from its forward pass to its backward pass (-pp: several at once)
typedef struct {
    ActivationTensors acts;
    void* acts_memory;
    int *inputs, *targets, *inputs_cpu;
    float* losses_cpu;
    cudaEvent_t losses_copied;
    int loss_tokens, loss_targets;
    WeightGradientQueue weights;  // -pps zb: its layers' weight gradients, from its B pass to its W pass
    floatX* adapter_kept;  // -ft adapter: the bottleneck adapters' inputs it keeps (Adapter.site_inputs)
} ActivationSlot;

#include "llmc/model_extension.h"

struct Model {
    ModelConfig config;
    ParameterTensors params;  // pointers into store.params_memory (all NULL under ZeRO-3: model_layer_weights)
    ParameterTensors grads;   // the same into store.grads_memory
    // the flat parameter, gradient and optimizer buffers (llmc/optimizer.cuh), replicated over all processes
    ShardedParameters store;
    int num_processes;        // data-parallel processes (the ZeRO shards of `store`)
    int process_rank;
    LossScaler loss_scaler;   // FP16 loss scaling
    unsigned long long rng_state;  // host generator of stochastic-rounding seeds (identical on every process)
    int use_master_weights;
    int offload_optimizer;  // -oo 1: ZeRO-Offload (the optimizer state and AdamW on the host); 2: AdamW early
    int zero_stage;         // set before building: ZeRO-2 allocates gradient buckets instead of a gradient buffer,
                            // ZeRO-3 only this process's parameter shard and gather buffers
    const MultiGpuConfig* multi_gpu;  // set before building for ZeRO-3: the processes parameters are gathered over
    const TensorParallel* tp;  // set before building: the tensor-parallel layout (NULL: every layer whole)
    Pipeline* pp;              // set before building: the pipeline layout (NULL: one stage), its layers' cut made
                               // when the parameters are allocated (model_cut_stages)
    const char* stage_layers_list;  // -ppl, or NULL: the balanced cut
    floatX* wte_peer;          // a tied wte's gradient from the other stage that holds it (model_sum_shared_wte)
    floatX* wte_grad;          // ZeRO-2/3 with a tied wte on two stages: its gradient, summed over the step's
                               // micro-batches whole (not in a bucket, which is reduced each micro-step) until the
                               // stages have summed their parts (NULL otherwise)
    int frozen;               // set before building: the parameters do not train (fine-tuning, -ft): a frozen set
    int adapter_method;       // ... and with frozen, the adapter's shape: its method, rank and targets
    int adapter_rank;         // (llmc/model_adapter.h)
    unsigned adapter_targets;
    Adapter* adapter;         // -ft: the trainable parameters beside the frozen model, once allocated; or NULL
    // activations
    ActivationTensors acts;
    void* acts_memory;
    ActivationSlot* slots;  // under -pp the micro-batches in flight: one slot each, swapped in (model_use_slot)
    int num_slots;
    WeightGradientQueue* deferring;  // during a ZB pipeline's B pass, where the layers' weight gradients are queued
    int chunk;              // -pp: the stage's model chunk the passes run (interleaved; else 0)
    floatX* staging;        // -pp: pass outputs waiting for their sends (llmc/pipeline.h's staging buffers)
    int batch_size, seq_len;  // what the activations were sized for
    int recompute;
    int gelu_fusion;
    AttentionPath attention;
    int* inputs;       // (B, T) device
    int* targets;      // (B, T) device
    int* inputs_cpu;   // (B, T) host copy for the encoder's backward pass
    float* losses_cpu;  // (B, T) pinned host: the per-token losses of the last forward pass with targets
    cudaEvent_t losses_copied;  // ... are there once this event has completed (model_mean_loss waits for it)
    int loss_tokens;    // B*T of that pass; 0 once model_mean_loss has summed them
    int loss_targets;   // of those, the targets that count (not masked: -1, doc/formats.md "Loss mask")
    float masked_dloss;  // > 0: the classifier's gradient weight per target that counts, for a step over loss masks
                         // (train_step), in place of model_forward's per-token dlogits_scale
    double loss_sum;    // the losses' sum (model_mean_loss)
    float mean_loss;    // their mean over the targets that count (model_mean_loss)
    unsigned int pass_number;  // the training pass (micro-step) number, set by the caller: random layers' seeds
    float* rope_table;         // llama: (maxT, HS) RoPE cos and sin (llmc/rope.cuh); NULL for GPT-2
    ModelExtension extension;  // its parts, never NULL (no_extension: GPT-2's dense MLP in every layer)
    void* extension_state;
};

// the layers whose MLP is GPT-2's dense one, and layer l's index among them
static int model_is_dense_layer(const Model* model, int l) {
    const FfnExtension* x = model->extension.ffn;
    return !x->replaces_mlp || !x->replaces_mlp(model, l);
}
static int model_dense_layers(const Model* model) {
    int n = 0;
    for (int l = 0; l < model->config.num_layers; l++) n += model_is_dense_layer(model, l);
    return n;
}
static int model_dense_index(const Model* model, int l) {
    int d = 0;
    for (int i = 0; i < l; i++) d += model_is_dense_layer(model, i);
    return d;
}

#include "llmc/model_tensor_parallel.h"
static void file_tensor_sizes(size_t* sizes, const Model* model);
#include "llmc/model_pipeline.h"

// The tensors' sizes in model-file order: as in the file, and as held in the replicated set (the same but for an
// extension's own part, and under tensor parallelism this process's slices of the split tensors)
static void fill_in_parameter_sizes(const Model* model, size_t* in_file, size_t* in_set) {
    const ModelConfig* cfg = &model->config;
    size_t Vp = cfg->padded_vocab_size, C = cfg->channels, maxT = cfg->max_seq_len, L = cfg->num_layers;
    size_t Ld = model_dense_layers(model);
    size_t QKV = qkv_channels(cfg), FC = fc_channels(cfg), H = cfg->ffn_hidden;
    size_t bias = cfg->biases, norm_bias = cfg->norm == NORM_LAYERNORM;
    size_t* sizes = in_file;
    sizes[PARAM_WTE] = Vp * C;
    sizes[PARAM_WPE] = (cfg->positions == POSITIONS_LEARNED) * maxT * C;
    sizes[PARAM_LN1W] = L * C;
    sizes[PARAM_LN1B] = norm_bias * L * C;
    sizes[PARAM_QKVW] = L * QKV * C;
    sizes[PARAM_QKVB] = bias * L * QKV;
    sizes[PARAM_ATTPROJW] = L * C * C;
    sizes[PARAM_ATTPROJB] = bias * L * C;
    sizes[PARAM_LN2W] = L * C;
    sizes[PARAM_LN2B] = norm_bias * L * C;
    sizes[PARAM_FCW] = Ld * FC * C;
    sizes[PARAM_FCB] = bias * Ld * FC;
    sizes[PARAM_FCPROJW] = Ld * C * H;
    sizes[PARAM_FCPROJB] = bias * Ld * C;
    size_t file[MLP_EXTENSION_SLOTS] = {0}, replicated[MLP_EXTENSION_SLOTS] = {0};
    if (model->extension.ffn->tensor_sizes) model->extension.ffn->tensor_sizes(model, file, replicated);
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++) sizes[PARAM_EXTENSION + i] = file[i];
    sizes[PARAM_LNFW] = C;
    sizes[PARAM_LNFB] = norm_bias * C;
    sizes[PARAM_LM_HEAD] = cfg->tied ? 0 : Vp * C;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {  // this member's slices of this stage's blocks, chunk by chunk
        in_set[i] = 0;
        for (int c = 0; c < model_pp_chunks(model); c++) {
            size_t offset;
            TensorSplit s = model_stage_split(model, i, model_pp_stage(model), c, in_file, &offset);
            in_set[i] += tensor_split_slice_size(&s, model_tp_degree(model));
        }
    }
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++) in_set[PARAM_EXTENSION + i] = replicated[i];
}

static void file_tensor_sizes(size_t* sizes, const Model* model) {
    size_t in_set[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(model, sizes, in_set);
}

// the tensors' names in model-file order (an extension names its own slots)
static const char* const parameter_names[NUM_PARAMETER_TENSORS] = {PARAMETER_TENSORS(PARAMETER_NAME)};
static const char* parameter_name(const Model* model, int i) {
    int slot = i - PARAM_EXTENSION;
    return slot >= 0 && slot < MLP_EXTENSION_SLOTS ? model->extension.ffn->tensor_names[slot] : parameter_names[i];
}

static void replicated_tensor_sizes(size_t* sizes, const Model* model) {
    size_t in_file[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(model, in_file, sizes);
}

static int parameter_decay(const Model* model, int i) {
    int slot = i - PARAM_EXTENSION;
    if (slot >= 0 && slot < MLP_EXTENSION_SLOTS) return model->extension.ffn->tensor_decays[slot];
    return parameter_decays[i];
}

// GPT-2's tensors' pointers into a buffer laid out by `sizes` (the extension's slots are skipped)
static void point_parameters(ParameterTensors* p, floatX* memory, const size_t* sizes) {
    floatX** ptrs[NUM_PARAMETER_TENSORS] = {&p->wte, &p->wpe, &p->ln1w, &p->ln1b, &p->qkvw, &p->qkvb,
                                            &p->attprojw, &p->attprojb, &p->ln2w, &p->ln2b, &p->fcw, &p->fcb,
                                            &p->fcprojw, &p->fcprojb, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
                                            NULL, NULL, &p->lnfw, &p->lnfb, &p->lm_head};
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        if (ptrs[i]) *ptrs[i] = memory;
        memory += sizes[i];
    }
}

// Layer l's slices of the parameters (or of the gradients); under tensor parallelism of this member's slices; under
// pipeline parallelism l is one of this stage's layers, whose slices alone it holds
static LayerParameters model_layer_parameters(const Model* model, const ParameterTensors* p, int l) {
    const ModelConfig* c = &model->config;
    size_t C = c->channels, QKV = local_qkv_channels(model), FC = local_fc_channels(model), H = local_hidden(model);
    size_t Ca = local_channels(model);
    int bias = c->biases, norm_bias = c->norm == NORM_LAYERNORM;
    LayerParameters lp;
    size_t i = model_local_layer(model, l);  // among this stage's layers
    lp.ln1w = p->ln1w + i * C;
    lp.ln1b = norm_bias ? p->ln1b + i * C : NULL;
    lp.qkvw = p->qkvw + i * QKV * C;
    lp.qkvb = bias ? p->qkvb + i * QKV : NULL;
    lp.attprojw = p->attprojw + i * C * Ca;
    lp.attprojb = bias ? p->attprojb + i * C : NULL;
    lp.ln2w = p->ln2w + i * C;
    lp.ln2b = norm_bias ? p->ln2b + i * C : NULL;
    lp.fcw = lp.fcb = lp.fcprojw = lp.fcprojb = NULL;
    if (model_is_dense_layer(model, l)) {
        size_t d = model_stage_dense_index(model, l);
        lp.fcw = p->fcw + d * FC * C;
        lp.fcb = bias ? p->fcb + d * FC : NULL;
        lp.fcprojw = p->fcprojw + d * H * C;
        lp.fcprojb = bias ? p->fcprojb + d * C : NULL;
    }
    return lp;
}

// ----------------------------------------------------------------------------------------------------
// Building the model: from a file or a descriptor

// The groups of gradient slices that the backward pass completes together, and reduces over processes as it goes
// (model_reduce_layer, model_reduce_rest): a layer's slices of the tensors stacked over all layers, of those stacked
// over the dense MLP's layers, an untied lm_head (complete after the classifier), and the rest, complete only after
// the encoder's backward.
static const int every_layer_tensors[] = {PARAM_LN1W,     PARAM_LN1B,     PARAM_QKVW, PARAM_QKVB,
                                               PARAM_ATTPROJW, PARAM_ATTPROJB, PARAM_LN2W, PARAM_LN2B};
static const int dense_tensors[] = {PARAM_FCW, PARAM_FCB, PARAM_FCPROJW, PARAM_FCPROJB};
static const int rest_tensors[] = {PARAM_WTE, PARAM_WPE, PARAM_LNFW, PARAM_LNFB};
static const int lm_head_tensor[] = {PARAM_LM_HEAD};
#define EVERY_LAYER_TENSORS 8
#define DENSE_TENSORS 4
#define REST_TENSORS 4
// ... and with ZB's deferred weight gradients under ZeRO-2/3, a layer's Linear weights (the W pass's, which take their
// bucket space in it) apart from its other tensors (the B pass's): each slice reduced once, by the pass that
// completes it
static const int every_layer_weights[] = {PARAM_QKVW, PARAM_ATTPROJW};
static const int every_layer_others[] = {PARAM_LN1W, PARAM_LN1B, PARAM_QKVB, PARAM_ATTPROJB, PARAM_LN2W, PARAM_LN2B};
static const int dense_weights[] = {PARAM_FCW, PARAM_FCPROJW};
static const int dense_others[] = {PARAM_FCB, PARAM_FCPROJB};
#define EVERY_LAYER_WEIGHTS 2
#define DENSE_WEIGHTS 2
// ZeRO-2's buckets: layers alternate between buckets 0 and 1, so that one layer's gradients are computed while the
// previous one's are reduced; bucket 2 holds the rest (wte's gradient is written first by the classifier, last by
// the encoder). A layer whose MLP an extension replaces puts the extension's slices of the replicated set (stacked
// over those layers: train_moe.cu's routers) into its bucket in place of the dense MLP's.
#define REST_BUCKET 2
// their capacities (values) for the replicated set's tensor sizes `sizes`
static void model_gradient_bucket_sizes(const Model* model, const size_t* sizes, size_t* layer, size_t* rest) {
    size_t L = model_stage_layers(model), Ld = model_stage_dense_layers(model), Lx = L - Ld, dense = 0, extension = 0;
    *layer = *rest = 0;
    for (int j = 0; j < EVERY_LAYER_TENSORS; j++) *layer += sizes[every_layer_tensors[j]] / L;
    if (Ld > 0)
        for (int j = 0; j < DENSE_TENSORS; j++) dense += sizes[dense_tensors[j]] / Ld;
    if (Lx > 0)
        for (int i = 0; i < MLP_EXTENSION_SLOTS; i++) extension += sizes[PARAM_EXTENSION + i] / Lx;
    *layer += dense > extension ? dense : extension;
    for (int j = 0; j < REST_TENSORS; j++) *rest += sizes[rest_tensors[j]];
    *rest += sizes[PARAM_LM_HEAD];
}
// ZeRO-3's gather buffers, the buckets' shapes: layers alternate between 0 and 1, so that the next layer's gather
// overlaps this layer's compute; 2 holds the rest from the forward pass's start to the backward pass's end
static void model_allocate_gather_buffers(Model* model, const size_t* sizes) {
    size_t layer, rest;
    model_gradient_bucket_sizes(model, sizes, &layer, &rest);
    for (int b = 0; b < 2; b++) sharded_parameters_add_gather_buffer(&model->store, layer);
    sharded_parameters_add_gather_buffer(&model->store, rest);
}
static void model_allocate_gradient_buckets(Model* model, const size_t* sizes) {
    size_t layer, rest;
    model_gradient_bucket_sizes(model, sizes, &layer, &rest);
    for (int b = 0; b < 2; b++) sharded_parameters_add_bucket(&model->store, layer);
    sharded_parameters_add_bucket(&model->store, rest);
    memset(&model->grads, 0, sizeof(model->grads));  // no gradient buffer: model_layer_gradients gives the pointers
    if (model->zero_stage == 3) model_allocate_gather_buffers(model, sizes);
}

// Under -pp, the layers' cut into the stages (llmc/pipeline.h): -ppl's, or the one that balances the stages' compute,
// in flops per token of the forward and backward passes: a layer's 6 per parameter and 12 C T of attention, the
// embedding's lookup and gradient (2 C) on the first stage, the classifier's 6 Vp C on the last. A cut that cannot be
// made is refused with one line.
static void model_cut_stages(Model* model) {
    Pipeline* pp = model->pp;
    if (!pp || pp->stages == 1) return;
    const ModelConfig* c = &model->config;
    int L = c->num_layers, p = pp->stages, v = pp->chunks;
    if (p > L || p * v > PIPELINE_MAX_STAGES) {
        fprintf(stderr, "-pp %d: more stages than the model's %d layers (or than %d)\n", p, L, PIPELINE_MAX_STAGES);
        exit(EXIT_FAILURE);
    }
    if (v > 1) {  // interleaved: pv equal chunks, chunk j on stage j % p
        if (L % (p * v) != 0) {
            fprintf(stderr, "-pps interleaved -pp %d -ppv %d: the model's %d layers do not cut into %d equal chunks\n", p,
                    v, L, p * v);
            exit(EXIT_FAILURE);
        }
        for (int j = 0; j <= p * v; j++) pp->first_layer[j] = j * (L / (p * v));
        return;
    }
    if (model->stage_layers_list) {
        if (!pipeline_parse_layers(model->stage_layers_list, L, p, pp->first_layer)) exit(EXIT_FAILURE);
        return;
    }
    size_t sizes[NUM_PARAMETER_TENSORS];
    file_tensor_sizes(sizes, model);
    double layer = 0.0, C = c->channels;
    for (int j = 0; j < EVERY_LAYER_TENSORS; j++) layer += (double)sizes[every_layer_tensors[j]] / L;
    for (int j = 0; j < DENSE_TENSORS; j++) layer += (double)sizes[dense_tensors[j]] / L;
    const FfnExtension* x = model->extension.ffn;  // an extension's layers, their active parameters (MoE: k experts)
    if (x->active_parameters_per_token) layer += x->active_parameters_per_token(model) / L;
    pipeline_balance(L, p, 6.0 * layer + 12.0 * C * pp->seq_len, 2.0 * C, 6.0 * c->padded_vocab_size * C,
                     pp->first_layer);
}

// Before building a model the caller sets num_processes, process_rank and zero_stage (and an extension its process
// layout, and -pp its pipeline).
static void model_allocate_parameters(Model* model) {
    model_cut_stages(model);
    size_t sizes[NUM_PARAMETER_TENSORS];
    int decays[NUM_PARAMETER_TENSORS];
    replicated_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) decays[i] = parameter_decay(model, i);
    if (model->frozen)
        sharded_parameters_allocate_frozen(&model->store, NUM_PARAMETER_TENSORS, sizes, decays, model->process_rank,
                                           model->num_processes, model->zero_stage);
    else
        sharded_parameters_allocate(&model->store, NUM_PARAMETER_TENSORS, sizes, decays, model->process_rank,
                                    model->num_processes, model->zero_stage);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) model->store.seed_ids[i] = parameter_seeds[i];
    if (model->zero_stage < 3) point_parameters(&model->params, model->store.params_memory, sizes);
    else memset(&model->params, 0, sizeof(model->params));  // gathered per layer (model_layer_weights)
    if (model->frozen) {  // no gradients at all; ZeRO-3 still gathers the parameters
        memset(&model->grads, 0, sizeof(model->grads));
        if (model->zero_stage == 3) model_allocate_gather_buffers(model, sizes);
    } else if (model->zero_stage < 2) {
        point_parameters(&model->grads, model->store.grads_memory, sizes);
    } else {
        model_allocate_gradient_buckets(model, sizes);
    }
    if (model->extension.ffn->allocate_parameters) model->extension.ffn->allocate_parameters(model);
    const ModelConfig* c = &model->config;
    if (c->positions == POSITIONS_ROPE) {  // cos and sin for positions 0 .. maxT-1 (llmc/rope.cuh)
        int HS = c->channels / c->num_heads;
        cudaCheck(cudaMalloc((void**)&model->rope_table, (size_t)c->max_seq_len * HS * sizeof(float)));
        rope_table_init(model->rope_table, c->max_seq_len, HS, c->rope_theta);
    }
}

// parameters in the model file
static size_t model_num_parameters(const Model* model) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    file_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    return n;
}

// where the extension's block starts in the model file (in values)
static size_t model_extension_offset(const Model* model) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    file_tensor_sizes(sizes, model);
    for (int i = 0; i < PARAM_EXTENSION; i++) n += sizes[i];
    return n;
}

// The whole model's parameters in model-file order (host) -> this process's tensors on the device: the replicated
// set's part of every tensor, and the extension's own part.
static void model_set_parameters(Model* model, const floatX* file_order) {
    size_t in_file[NUM_PARAMETER_TENSORS], in_set[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(model, in_file, in_set);
    // When the set holds every tensor of the file whole, the file order is the set's order and needs no host copy
    // (GPT-2 1.5B's is 3 GB of fresh pages)
    int same_order = 1;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) same_order &= in_set[i] == in_file[i];
    if (same_order) {
        sharded_parameters_set(&model->store, file_order);
    } else {
        floatX* replicated = (floatX*)malloc_check(model->store.num_parameters * sizeof(floatX) + 1);
        size_t from = 0, to = 0;
        for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
            int chunks = model_pp_chunks(model);
            for (int c = 0; c < chunks; c++) {  // this stage's blocks, chunk by chunk
                size_t offset;
                TensorSplit s = model_stage_split(model, i, model_pp_stage(model), c, in_file, &offset);
                // (one chunk: the set's part, an extension's in the replicated set too; chunks: each one's slice)
                size_t n = chunks == 1 ? in_set[i] : tensor_split_slice_size(&s, model_tp_degree(model));
                if (s.kind != SPLIT_NONE)  // this member's slice
                    tensor_split_copy(&s, model_tp_member(model), model_tp_degree(model),
                                      (floatX*)file_order + from + offset, replicated + to, sizeof(floatX), 0);
                else  // whole, or an extension's part in the replicated set
                    memcpy(replicated + to, file_order + from + offset, n * sizeof(floatX));
                to += n;
            }
            from += in_file[i];
        }
        sharded_parameters_set(&model->store, replicated);
        free(replicated);
    }
    const FfnExtension* x = model->extension.ffn;
    if (x->set_parameters) x->set_parameters(model, file_order + model_extension_offset(model));
}

// The inverse, collective over the tensor-parallel group: this stage's blocks of the whole model in model-file
// order from the replicated set (its parameters, or in test_gpt.cu its gradients as stored: device memory, or host
// memory with `kind` cudaMemcpyHostToHost), the extension filling in its own part.
static void model_get_replicated(const Model* model, floatX* file_order, const floatX* replicated, cudaMemcpyKind kind) {
    if (model_tp_degree(model) > 1) {
        model_join_slices(model, file_order, replicated, kind);
    } else {
        size_t in_file[NUM_PARAMETER_TENSORS], in_set[NUM_PARAMETER_TENSORS];
        fill_in_parameter_sizes(model, in_file, in_set);
        size_t from = 0, to = 0;
        int chunks = model_pp_chunks(model);
        for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
            for (int c = 0; c < chunks; c++) {  // where this stage's blocks start, chunk by chunk
                size_t offset;
                TensorSplit t = model_stage_split(model, i, model_pp_stage(model), c, in_file, &offset);
                size_t n = chunks == 1 ? in_set[i] : tensor_split_slice_size(&t, 1);
                if (n > 0) cudaCheck(cudaMemcpy(file_order + to + offset, replicated + from, n * sizeof(floatX), kind));
                from += n;
            }
            to += in_file[i];
        }
    }
}
// (Under ZeRO-3 collective over the model's processes, which gather the set on the host.)
static void model_get_parameters(Model* model, floatX* file_order, cudaStream_t stream) {
    if (model->zero_stage == 3) {
        floatX* replicated = (floatX*)malloc_check(model->store.num_parameters * sizeof(floatX) + 1);
        sharded_parameters_gather_all(&model->store, replicated, model->multi_gpu, stream);
        model_get_replicated(model, file_order, replicated, cudaMemcpyHostToHost);
        free(replicated);
    } else {
        model_get_replicated(model, file_order, model->store.params_memory, cudaMemcpyDeviceToHost);
    }
    const FfnExtension* x = model->extension.ffn;
    if (x->get_parameters) x->get_parameters(model, file_order + model_extension_offset(model), stream);
    model_join_stages(model, file_order);  // every stage's blocks (collective over the pipeline group)
}


// The attention path (-fa): 1 flash attention, 0 the other one (cuDNN in a USE_CUDNN=1 build, else cuBLAS GEMMs
// around a softmax), -1 (not given) flash attention when the build has no cuDNN and the model's head size has a
// flash kernel, else the other one. Grouped-query attention and RoPE run on flash attention only: the other paths
// take neither fewer key/value heads nor q and k roped after the qkv matmul. 0 and one line naming `source` when the
// chosen path cannot run the model.
static int model_set_attention(Model* model, int flash, const char* source) {
    char why[256];
    const ModelConfig* c = &model->config;
    int supported = flash_attention_support(c->channels, c->num_heads, c->num_kv_heads, why, sizeof(why));
    if (c->positions == POSITIONS_ROPE || c->num_kv_heads != c->num_heads) {
        if (flash == 0) {
            fprintf(stderr, "-fa 0: %s: a llama model runs on flash attention only (-fa 1; the cuBLAS-and-softmax "
                    "and cuDNN paths have no grouped-query attention or RoPE)\n", source);
            return 0;
        }
        if (!supported) {
            fprintf(stderr, "%s: unsupported model size: %s\n", source, why);
            return 0;
        }
        model->attention = ATTENTION_FLASH;
        return 1;
    }
    if (flash == 1 && !supported) {
        fprintf(stderr, "-fa 1: %s: %s\n", source, why);
        return 0;
    }
#ifdef ENABLE_CUDNN
    model->attention = flash == 1 ? ATTENTION_FLASH : ATTENTION_CUDNN;
#else
    model->attention = flash == 1 || (flash == -1 && supported) ? ATTENTION_FLASH : ATTENTION_MATMUL_SOFTMAX;
#endif
    if (model->attention == ATTENTION_MATMUL_SOFTMAX &&
        !attention_support(model->config.channels, model->config.num_heads, why, sizeof(why))) {
        fprintf(stderr, "%s: unsupported model size: %s\n", source, why);
        return 0;
    }
    return 1;
}
static const char* model_attention_name(const Model* model) {
    static const char* names[3] = {"cuBLAS GEMMs and softmax", "flash attention", "cuDNN"};
    return names[model->attention];
}

// Before the parameters and their gradients are allocated for a model from `source`: they fit in the device's free
// memory, or one line says what they need (a GPU out of memory would otherwise name neither, and the CPU backend,
// which fills new device memory, would drive the host into swap).
static void check_parameter_memory(const Model* model, const char* source) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    replicated_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    size_t params = model->zero_stage == 3 ? CEIL_DIV(n, (size_t)model->num_processes) : n;
    const FfnExtension* x = model->extension.ffn;
    if (x->own_parameter_count) {
        size_t own = x->own_parameter_count(model);
        n += own;
        params += model->zero_stage == 3 ? CEIL_DIV(own, (size_t)x->own_group(model)->num_processes) : own;
    }
    // parameters (ZeRO-3: the shards), and gradients unless ZeRO-2/3 (whose buckets and gather buffers are smaller,
    // and whose gradient shard comes with the optimizer)
    size_t need = (params + (model->zero_stage >= 2 ? 0 : n)) * sizeof(floatX), free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && need > free_bytes) {
        fprintf(stderr, "%s: out of device memory: the parameters and gradients of its %zu parameters need %zu bytes, "
                "%zu are free\n", source, n, need, free_bytes);
        exit(EXIT_FAILURE);
    }
}

#include "llmc/model_file.h"
#include "llmc/model_adapter.h"

#include "llmc/activation_memory.h"


// A single process, until the caller sets num_processes and process_rank.
static void model_init_common(Model* model) {
    memset(model, 0, sizeof(*model));
    model->extension = no_extension;
    model->use_master_weights = 1;
    model->recompute = 1;
    model->gelu_fusion = 1;
    model->attention = ATTENTION_MATMUL_SOFTMAX;
    model->num_processes = 1;
    model->loss_scaler = loss_scaler_init();
    model->rng_state = 13371337ull;
}

static void model_free(Model* model) {
    if (model->extension.ffn->free) model->extension.ffn->free(model);
    sharded_parameters_free(&model->store);
    adapter_free(model->adapter);
    cudaCheck(cudaFree(model->rope_table));
    cudaCheck(cudaFree(model->wte_peer));
    cudaCheck(cudaFree(model->wte_grad));
    cudaCheck(cudaFree(model->staging));
    // the activations in use, or under -pp every slot's
    ActivationSlot in_use;
    memset(&in_use, 0, sizeof(in_use));
    in_use.acts_memory = model->acts_memory, in_use.inputs = model->inputs, in_use.targets = model->targets;
    in_use.inputs_cpu = model->inputs_cpu, in_use.losses_cpu = model->losses_cpu;
    in_use.losses_copied = model->losses_copied;
    int slots = model->num_slots > 0 ? model->num_slots : 1;
    for (int k = 0; k < slots; k++) {
        ActivationSlot* a = model->num_slots > 0 ? &model->slots[k] : &in_use;
        cudaCheck(cudaFree(a->acts_memory));
        cudaCheck(cudaFree(a->inputs));
        cudaCheck(cudaFree(a->targets));
        free(a->inputs_cpu);
        cudaCheck(cudaFreeHost(a->losses_cpu));
        if (a->acts_memory) cudaCheck(cudaEventDestroy(a->losses_copied));
    }
    for (int k = 0; k < model->num_slots; k++)
        if (model->slots[k].weights.jobs) weight_queue_free(&model->slots[k].weights);
    free(model->slots);
}

// ----------------------------------------------------------------------------------------------------
// The layer kinds (doc/architecture.md). A layer is a norm, an attention and an FFN, each of a kind the config names:
//   norm: LayerNorm (with a bias, its means kept for the backward pass) or RMSNorm;
//   attention: NH query heads over NKV key/value heads, with learned positions (the encoder adds wpe) or RoPE on q
//     and k, on the path -fa chose (model->attention);
//   FFN: the dense MLP with GELU or SwiGLU, or an extension's FFN in the layers it replaces (train_moe.cu's MoE).
// The passes call the functions below; nothing else looks at a kind.

// out (B, T, C) = norm(inp), with its statistics (mean: LayerNorm only; both NULL when recomputed)
static void norm_forward(const Model* model, floatX* out, float* mean, float* rstd, const floatX* inp,
                         const floatX* weight, const floatX* bias, int B, int T, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    if (c->norm == NORM_RMSNORM) rmsnorm_forward(out, rstd, inp, weight, B, T, c->channels, c->norm_eps, stream);
    else layernorm_forward(out, mean, rstd, inp, weight, bias, B, T, c->channels, stream);
}
// residual = inp1 + inp2, then out = norm(residual): the residual stream's add fused with the next norm (N tokens)
static void residual_norm_forward(const Model* model, floatX* residual, floatX* out, float* mean, float* rstd,
                                  const floatX* inp1, const floatX* inp2, const floatX* weight, const floatX* bias,
                                  int N, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    if (c->norm == NORM_RMSNORM)
        fused_residual_rmsnorm_forward(residual, out, rstd, inp1, inp2, weight, N, c->channels, c->norm_eps, stream);
    else
        fused_residual_layernorm_forward(residual, out, mean, rstd, inp1, inp2, weight, bias, N, c->channels, stream);
}
// dinp (B, T, C) += the gradient through the norm of inp from dout; dweight (and LayerNorm's dbias) +=
static void norm_backward(const Model* model, floatX* dinp, floatX* dweight, floatX* dbias, float* scratch,
                          const floatX* dout, const floatX* inp, const floatX* weight, const float* mean,
                          const float* rstd, int B, int T, cudaStream_t stream) {
    int C = model->config.channels;
    if (model->config.norm == NORM_RMSNORM) rmsnorm_backward(dinp, dweight, scratch, dout, inp, weight, rstd, B, T, C, stream);
    else layernorm_backward(dinp, dweight, dbias, scratch, dout, inp, weight, mean, rstd, B, T, C, stream);
}

// A Linear layer of the kinds: out (B, T, OC) = inp (B, T, C) W^T + b, and with an adapter on its target (-ft lora)
// the adapter's low-rank update on top (llmc/lora.cuh)
static void linear_forward(Model* model, int target, int layer, floatX* out, const floatX* inp, const floatX* weight,
                           const floatX* bias, int B, int T, int C, int OC, cudaStream_t stream) {
    matmul_forward(out, inp, weight, bias, B, T, C, OC, stream);
    if (!lora_has(model, target)) return;
    Adapter* a = model->adapter;
    floatX *A, *Bw;
    lora_layer_pair(model, a->store.params_memory, target, layer, &A, &Bw);
    lora_forward(out, inp, A, Bw, a->scale, a->u, B * T, C, OC, a->rank, stream);
}
// Its transpose: dinp (B, T, C) = dout W (plus the adapter's part), dweight and dbias += (NULL: frozen, not computed),
// the adapter's gradients += into its set
// Whether inp is an activation that recompute keeps for one layer only (the FFN's activation output at -r 1, the norms'
// outputs at -r 2): a deferred weight gradient copies it.
static int model_recomputed(const Model* model, const floatX* inp) {
    const ActivationTensors* a = &model->acts;
    return (model->recompute >= 1 && inp == a->ffn_act) || (model->recompute >= 2 && (inp == a->ln1 || inp == a->ln2));
}
// A layer's Linear backward (matmul_backward), its weight gradient queued for the W pass during a ZB pipeline's B pass
static void layer_matmul_backward(Model* model, floatX* dinp, floatX* dweight, floatX* dbias, const floatX* dout,
                                  const floatX* inp, const floatX* weight, int B, int T, int C, int OC,
                                  cudaStream_t stream, const floatX* pre_gelu = nullptr, int gelu_fusion = 1) {
    int defer = model->deferring && dweight;
    matmul_backward(dinp, defer ? nullptr : dweight, dbias, dout, inp, weight, model->acts.scratch_f, B, T, C, OC,
                    stream, pre_gelu, gelu_fusion);
    if (defer)
        weight_queue_defer(model->deferring, dweight, inp, model_recomputed(model, inp), dout, B * T, C, OC, stream);
}
static void linear_backward(Model* model, int target, int layer, floatX* dinp, floatX* dweight, floatX* dbias,
                            const floatX* dout, const floatX* inp, const floatX* weight, int B, int T, int C, int OC,
                            cudaStream_t stream) {
    if (target == LORA_LM_HEAD)  // (the classifier's weight gradient is never deferred: the logits' is B*T*Vp)
        matmul_backward(dinp, dweight, dbias, dout, inp, weight, model->acts.scratch_f, B, T, C, OC, stream);
    else
        layer_matmul_backward(model, dinp, dweight, dbias, dout, inp, weight, B, T, C, OC, stream);
    if (!lora_has(model, target)) return;
    Adapter* a = model->adapter;
    floatX *A, *Bw, *dA, *dB;
    lora_layer_pair(model, a->store.params_memory, target, layer, &A, &Bw);
    lora_layer_pair(model, a->store.grads_memory, target, layer, &dA, &dB);
    lora_backward(dinp, dA, dB, dout, inp, A, Bw, a->scale, a->u, a->g, B * T, C, OC, a->rank, stream);
}

// The attention block from la->ln1 (B, T, C): the qkv projection, q and k roped (RoPE), attention on the chosen path
// into la->atty, and the output projection into out (B, T, C). Under tensor parallelism on this member's heads (NH/N
// query heads over NKV/N key/value heads, atty (B, T, C/N)), and out is the member's part of the row-parallel
// projection (the bias on member 0), summed over the members by the caller.
static void attention_block_forward(Model* model, int layer, const LayerParameters* lp, const LayerActivations* la,
                                    floatX* out, int B, int T, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    int C = c->channels, NH = local_heads(model), NKV = local_kv_heads(model), Ca = local_channels(model);
    int QKV = (int)local_qkv_channels(model), HS = C / c->num_heads;
    ActivationTensors a = model->acts;
    const floatX* attention = la->atty;  // the output projection's input
    if (model->attention == ATTENTION_MATMUL_SOFTMAX) {
        floatX* qkv = a.scratch_bt4c;  // (B, T, 3C), consumed by attention_forward, which keeps q, k, v permuted
        linear_forward(model, LORA_QKV, layer, qkv, la->ln1, lp->qkvw, lp->qkvb, B, T, C, QKV, stream);
        attention_forward(la->atty, la->qkvr, la->att, qkv, B, T, Ca, NH, stream);
    } else {
        // flash attention and cuDNN read q, k, v in place from the qkv projection's output, kept for the backward
        // pass (with q and k roped: the backward pass needs them so)
        floatX* qkv = la->qkvr;  // (B, T, QKV)
        linear_forward(model, LORA_QKV, layer, qkv, la->ln1, lp->qkvw, lp->qkvb, B, T, C, QKV, stream);
        if (c->positions == POSITIONS_ROPE) rope_forward(qkv, model->rope_table, B, T, NH, NKV, HS, stream);
#ifdef ENABLE_CUDNN
        if (model->attention == ATTENTION_CUDNN)
            attention_forward_cudnn(la->atty, la->att_stats, qkv, B, T, NH, Ca, stream);
        else
#endif
            flash_attention_forward(la->atty, la->att_stats, qkv, B, T, NH, NKV, Ca, stream);
        // prefix tuning's keys join its softmax, llama_adapter's gated prompt adds to its output (flash attention)
        attention = model_adapter_attention_forward(model, layer, lp->qkvw, lp->qkvb, la->atty, la->att_stats, qkv, B,
                                                    T, stream);
    }
    linear_forward(model, LORA_PROJ, layer, out, attention, lp->attprojw, row_parallel_bias(model, lp->attprojb), B, T,
                   Ca, C, stream);
}
// Its transpose: a.dbtc (B, T, C) = the gradient of la->ln1 from dout (B, T, C), the gradients into lg (under tensor
// parallelism the member's part of it, summed over the members by the caller; every member computes the projection's
// whole bias gradient from the whole dout). Under -r 2 the caller has recomputed la->ln1.
static void attention_block_backward(Model* model, int layer, const LayerParameters* lp, const LayerParameters* lg,
                                     const LayerActivations* la, const floatX* dout, int B, int T,
                                     cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    int C = c->channels, NH = local_heads(model), NKV = local_kv_heads(model), Ca = local_channels(model);
    int QKV = (int)local_qkv_channels(model), HS = C / c->num_heads;
    ActivationTensors a = model->acts;
    // the projection's input is la->atty, except under llama_adapter, whose frozen projection reads none here
    linear_backward(model, LORA_PROJ, layer, a.dbtc, lg->attprojw, lg->attprojb, dout, la->atty, lp->attprojw, B, T, Ca,
                    C, stream);
    floatX* dqkv = a.scratch_bt4c;  // (B, T, QKV)
    if (model->attention == ATTENTION_MATMUL_SOFTMAX)
        attention_backward(dqkv, a.dqkvr, a.datt, a.scratch_btc, a.dbtc, la->qkvr, la->att, B, T, Ca, NH, stream);
#ifdef ENABLE_CUDNN
    else if (model->attention == ATTENTION_CUDNN)
        attention_backward_cudnn(dqkv, a.dbtc, la->qkvr, la->atty, la->att_stats, B, T, NH, Ca, stream);
#endif
    else
        flash_attention_backward(dqkv, a.att_delta, a.dbtc, la->qkvr, la->atty, la->att_stats, B, T, NH, NKV, Ca,
                                 stream);
    model_adapter_attention_backward(model, layer, lp->qkvw, dqkv, a.dbtc, la->qkvr, la->atty, la->att_stats, B, T,
                                     stream);
    if (c->positions == POSITIONS_ROPE) rope_backward(dqkv, model->rope_table, B, T, NH, NKV, HS, stream);
    linear_backward(model, LORA_QKV, layer, a.dbtc, lg->qkvw, lg->qkvb, dqkv, la->ln1, lp->qkvw, B, T, C, QKV, stream);
}

// The forward's GELU fusion (-ge): into cuBLASLt's epilogue only when nothing recomputes the GELU (-r 0). With
// recompute the forward evaluates llmc/gelu.cuh, as the recompute does, so that the backward sees the forward's bits.
static int model_forward_gelu_fusion(const Model* model) {
    return model->recompute >= 1 ? 0 : model->gelu_fusion;
}

// GPT-2's MLP: fc, GELU (into cuBLASLt's epilogue with -ge), fcproj. la->fch holds fc's output, la->ffn_act the
// GELU's (recomputed from fch with -r 1). Under tensor parallelism, as for attention: fc column-parallel on this
// member's H/N hidden units, fcproj row-parallel (the bias on member 0), out summed over the members by the caller.
// With an adapter on fc (-ft lora) the GELU takes fc's adapted output: no fusion into fc's epilogue; with one on
// fcproj, the GELU's backward follows the adapter's input gradient: no fusion into fcproj's backward epilogue.
static void gelu_mlp_forward(Model* model, int layer, const LayerParameters* lp, const LayerActivations* la,
                             floatX* out, int B, int T, cudaStream_t stream) {
    int C = model->config.channels, H = local_hidden(model);
    if (lora_has(model, LORA_FC)) {
        linear_forward(model, LORA_FC, layer, la->fch, la->ln2, lp->fcw, lp->fcb, B, T, C, H, stream);
        gelu_forward(la->ffn_act, la->fch, (size_t)B * T * H, stream);
    } else {
        matmul_forward(la->ffn_act, la->ln2, lp->fcw, lp->fcb, B, T, C, H, stream, la->fch,
                       model_forward_gelu_fusion(model));
    }
    linear_forward(model, LORA_FC_PROJ, layer, out, la->ffn_act, lp->fcprojw, row_parallel_bias(model, lp->fcprojb), B,
                   T, H, C, stream);
}
static void gelu_mlp_backward(Model* model, int layer, const LayerParameters* lp, const LayerParameters* lg,
                              const LayerActivations* la, floatX* d_ln2, const floatX* dout, int B, int T,
                              cudaStream_t stream) {
    int C = model->config.channels, H = local_hidden(model);
    ActivationTensors a = model->acts;
    floatX* dfch = a.scratch_bt4c;  // (B, T, H)
    if (model->recompute >= 1) gelu_forward(la->ffn_act, la->fch, (size_t)B * T * H, stream);
    if (lora_has(model, LORA_FC_PROJ)) {
        linear_backward(model, LORA_FC_PROJ, layer, dfch, lg->fcprojw, lg->fcprojb, dout, la->ffn_act, lp->fcprojw, B,
                        T, H, C, stream);
        gelu_backward_inplace(dfch, la->fch, (size_t)B * T * H, stream);
    } else {
        layer_matmul_backward(model, dfch, lg->fcprojw, lg->fcprojb, dout, la->ffn_act, lp->fcprojw, B, T, H, C, stream,
                              la->fch, model->gelu_fusion);
    }
    linear_backward(model, LORA_FC, layer, d_ln2, lg->fcw, lg->fcb, dfch, la->ln2, lp->fcw, B, T, C, H, stream);
}
// The llama MLP: fc into la->fch = [gate | up] (B, T, 2H), SwiGLU into la->ffn_act (B, T, H; recomputed with -r 1),
// fcproj. In the backward pass fc's output gradient overwrites fch in place: nothing after the SwiGLU's backward
// needs the forward's [gate | up].
static void swiglu_mlp_forward(Model* model, int layer, const LayerParameters* lp, const LayerActivations* la,
                               floatX* out, int B, int T, cudaStream_t stream) {
    int C = model->config.channels, H = local_hidden(model);
    const floatX* fc_gate_up = lp->fcw;  // (2H, C): the gate's rows, then the up projection's (this member's)
    linear_forward(model, LORA_FC, layer, la->fch, la->ln2, fc_gate_up, lp->fcb, B, T, C, 2 * H, stream);
    swiglu_forward(la->ffn_act, la->fch, B * T, H, stream);
    linear_forward(model, LORA_FC_PROJ, layer, out, la->ffn_act, lp->fcprojw, row_parallel_bias(model, lp->fcprojb), B,
                   T, H, C, stream);
}
static void swiglu_mlp_backward(Model* model, int layer, const LayerParameters* lp, const LayerParameters* lg,
                                const LayerActivations* la, floatX* d_ln2, const floatX* dout, int B, int T,
                                cudaStream_t stream) {
    int C = model->config.channels, H = local_hidden(model);
    ActivationTensors a = model->acts;
    if (model->recompute >= 1) swiglu_forward(la->ffn_act, la->fch, B * T, H, stream);
    floatX* dswiglu = a.scratch_bt4c;  // (B, T, H)
    linear_backward(model, LORA_FC_PROJ, layer, dswiglu, lg->fcprojw, lg->fcprojb, dout, la->ffn_act, lp->fcprojw, B, T,
                    H, C, stream);
    swiglu_backward(la->fch, dswiglu, la->fch, B * T, H, stream);
    linear_backward(model, LORA_FC, layer, d_ln2, lg->fcw, lg->fcb, la->fch, la->ln2, lp->fcw, B, T, C, 2 * H, stream);
}
static const FfnKind gelu_mlp = {gelu_mlp_forward, gelu_mlp_backward};
static const FfnKind swiglu_mlp = {swiglu_mlp_forward, swiglu_mlp_backward};

static const FfnKind* layer_ffn(const Model* model, int l) {
    if (!model_is_dense_layer(model, l)) return &model->extension.ffn->kind;
    return model->config.activation == ACTIVATION_SWIGLU ? &swiglu_mlp : &gelu_mlp;
}

// ----------------------------------------------------------------------------------------------------
// Forward and backward passes

// A layer's tensors from its slices: those of the tensors stacked over every layer (every_layer_tensors' order)
// and, in a dense layer, over the dense layers (dense_tensors'; NULL: an extension's layer). The biases the
// layer kinds lack are NULL, as in model_layer_parameters (a gradient slice of size 0 points anywhere).
static LayerParameters layer_parameters_from_slices(const Model* model, floatX* const* every, floatX* const* dense) {
    int bias = model->config.biases, norm_bias = model->config.norm == NORM_LAYERNORM;
    LayerParameters lp;
    lp.ln1w = every[0], lp.ln1b = norm_bias ? every[1] : NULL, lp.qkvw = every[2], lp.qkvb = bias ? every[3] : NULL;
    lp.attprojw = every[4], lp.attprojb = bias ? every[5] : NULL, lp.ln2w = every[6];
    lp.ln2b = norm_bias ? every[7] : NULL;
    lp.fcw = lp.fcb = lp.fcprojw = lp.fcprojb = NULL;
    if (dense) lp.fcw = dense[0], lp.fcb = bias ? dense[1] : NULL, lp.fcprojw = dense[2];
    if (dense) lp.fcprojb = bias ? dense[3] : NULL;
    return lp;
}

// ZeRO-3: starts gathering layer l's parameters into gather buffer l % 2 (llmc/optimizer.cuh), unless it holds them
// already, and an extension's layer its own; the forward pass prefetches layer l + 1 as layer l begins, the backward
// pass layer l - 1. Without ZeRO-3, nothing to do.
static void model_prefetch_layer(Model* model, int l, cudaStream_t stream) {
    if (model->zero_stage < 3) return;
    ShardedParameters* p = &model->store;
    const MultiGpuConfig* mg = model->multi_gpu;
    int is_dense = model_is_dense_layer(model, l);
    if (sharded_parameters_gather_begin(p, l % 2, l, mg, stream)) {
        sharded_parameters_gather_slices(p, l % 2, every_layer_tensors, EVERY_LAYER_TENSORS,
                                         model_local_layer(model, l), model_stage_layers(model), mg);
        if (is_dense)
            sharded_parameters_gather_slices(p, l % 2, dense_tensors, DENSE_TENSORS,
                                             model_stage_dense_index(model, l), model_stage_dense_layers(model), mg);
        else
            model->extension.ffn->gather_replicated_slices(model, l);
        sharded_parameters_gather_end(p, l % 2, mg);
    }
    if (!is_dense) model->extension.ffn->prefetch_own(model, l, stream);
}

// Layer l's parameters for kernels on `stream`: in the parameter buffer, or under ZeRO-3 in its gather buffer (gathered
// now if no prefetch did; the stream waits for the gather). Valid until the gather two layers on.
static LayerParameters model_layer_weights(Model* model, int l, cudaStream_t stream) {
    if (model->zero_stage < 3) return model_layer_parameters(model, &model->params, l);
    model_prefetch_layer(model, l, stream);
    floatX* every[EVERY_LAYER_TENSORS];
    floatX* dense[DENSE_TENSORS];
    int L = model_stage_layers(model), is_dense = model_is_dense_layer(model, l);
    sharded_parameters_gathered_slices(&model->store, l % 2, every_layer_tensors, EVERY_LAYER_TENSORS,
                                       model_local_layer(model, l), L, every, stream);
    if (is_dense)
        sharded_parameters_gathered_slices(&model->store, l % 2, dense_tensors, DENSE_TENSORS,
                                           model_stage_dense_index(model, l), model_stage_dense_layers(model), dense,
                                           stream);
    return layer_parameters_from_slices(model, every, is_dense ? dense : NULL);
}

// The tensors outside the layers (wte, wpe, the final norm, lm_head; the rest NULL under ZeRO-3): under ZeRO-3 gathered
// into gather buffer 2 before the forward pass's first use and kept until the parameters change.
static ParameterTensors model_rest_weights(Model* model, cudaStream_t stream) {
    if (model->zero_stage < 3) return model->params;
    ShardedParameters* p = &model->store;
    const MultiGpuConfig* mg = model->multi_gpu;
    int L = model->config.num_layers;
    if (sharded_parameters_gather_begin(p, REST_BUCKET, -1, mg, stream)) {
        sharded_parameters_gather_slices(p, REST_BUCKET, rest_tensors, REST_TENSORS, -1, L, mg);
        sharded_parameters_gather_slices(p, REST_BUCKET, lm_head_tensor, 1, -1, L, mg);
        sharded_parameters_gather_end(p, REST_BUCKET, mg);
    }
    ParameterTensors w;
    memset(&w, 0, sizeof(w));
    floatX* s[REST_TENSORS];
    sharded_parameters_gathered_slices(p, REST_BUCKET, rest_tensors, REST_TENSORS, -1, L, s, stream);
    w.wte = s[0], w.wpe = s[1], w.lnfw = s[2], w.lnfb = s[3];
    sharded_parameters_gathered_slices(p, REST_BUCKET, lm_head_tensor, 1, -1, L, s, stream);
    w.lm_head = s[0];
    return w;
}

// The forward pass from the tokens to a.lnf: the embeddings, then each layer's norm, attention, residual add, norm,
// FFN and residual add (the add fused with the next layer's first norm, or the final one). The norms and adds run on
// the stream's tokens (SB, ST): the batch, or with sequence parallelism (1, B*T/N). Under -pp, the layers of this
// stage's chunk that model->chunk names (its only one but with interleaving): from the previous chunk's output in its
// first layer's input (model_chunk_input; the embeddings on the model's first chunk), to its last layer's residual3
// (the model's last chunk goes on to a.lnf).
static void model_forward_layers(Model* model, int B, int T, cudaStream_t stream) {
    const ModelConfig* c = &model->config;
    int begin = model_layer_begin(model), L = model_layer_end(model), N = B * T, Nt = model_stream_tokens(model, N);
    int SB = Nt == N ? B : 1, ST = Nt == N ? T : Nt;
    ParameterTensors p = model_rest_weights(model, stream);
    ActivationTensors a = model->acts;
    if (model_first_chunk(model)) {
        model_embed(model, &p, B, T, stream);
        model_adapter_embed_forward(model, a.encoded, c->positions == POSITIONS_LEARNED ? p.wpe : nullptr, B, T,
                                    stream);
    }
    LayerParameters first = model_layer_weights(model, begin, stream);
    LayerActivations first_a = model_layer_activations(model, begin, B, T);
    norm_forward(model, tp_norm_output(model, first_a.ln1), first_a.ln1_mean, first_a.ln1_rstd, first_a.residual,
                 first.ln1w, first.ln1b, SB, ST, stream);
    tp_gather_norm(model, first_a.ln1, N, stream);
    for (int l = begin; l < L; l++) {
        if (l + 1 < L) model_prefetch_layer(model, l + 1, stream);
        LayerParameters lp = model_layer_weights(model, l, stream);
        LayerActivations la = model_layer_activations(model, l, B, T);
        attention_block_forward(model, l, &lp, &la, a.scratch_btc, B, T, stream);
        model_adapter_site_forward(model, BOTTLENECK_ATTENTION, l, a.scratch_btc, N, 1, stream);
        const floatX* attention = tp_sum_over_members(model, a.scratch_btc, a.member_stream, N, stream);
        residual_norm_forward(model, la.residual2, tp_norm_output(model, la.ln2), la.ln2_mean, la.ln2_rstd,
                              la.residual, attention, lp.ln2w, lp.ln2b, Nt, stream);
        tp_gather_norm(model, la.ln2, N, stream);
        layer_ffn(model, l)->forward(model, l, &lp, &la, a.scratch_btc, B, T, stream);
        model_adapter_site_forward(model, BOTTLENECK_FFN, l, a.scratch_btc, N, 1, stream);
        const floatX* ffn = tp_sum_over_members(model, a.scratch_btc, a.member_stream, N, stream);
        if (l + 1 < L) {
            LayerParameters next_p = model_layer_weights(model, l + 1, stream);
            LayerActivations next = model_layer_activations(model, l + 1, B, T);
            residual_norm_forward(model, la.residual3, tp_norm_output(model, next.ln1), next.ln1_mean, next.ln1_rstd,
                                  la.residual2, ffn, next_p.ln1w, next_p.ln1b, Nt, stream);
            tp_gather_norm(model, next.ln1, N, stream);
        } else if (!model_last_chunk(model)) {  // the next chunk's input
            residual_forward(la.residual3, la.residual2, ffn, (size_t)Nt * c->channels, stream);
        } else {
            residual_norm_forward(model, la.residual3, tp_norm_output(model, a.lnf), a.lnf_mean, a.lnf_rstd,
                                  la.residual2, ffn, p.lnfw, p.lnfb, Nt, stream);
            tp_gather_norm(model, a.lnf, N, stream);
        }
    }
}

// Forward pass over (B, T) tokens. With targets, also the losses, whose mean model_mean_loss returns; with
// dlogits_scale > 0, the logits are replaced by their gradient (scaled by dlogits_scale) for backward. Under tensor
// parallelism a.output holds this member's Vp/N columns of the logits (model_copy_logits puts rows together). Under
// prompt tuning (-ft prompt) each sequence runs behind the P virtual tokens: a.output holds B x (P + T) rows.
static void model_forward(Model* model, const int* inputs, const int* targets, int B, int T, float dlogits_scale,
                         cudaStream_t stream) {
    int real_T = T;
    model_adapter_prompt_batch(model, &inputs, &targets, B, &T);
    const ModelConfig* c = &model->config;
    if (B > model->batch_size || T > model->seq_len || T > c->max_seq_len || B < 1 || T < 1) {
        fprintf(stderr, "model_forward: batch (%d, %d) exceeds the allocated (%d, %d) or maxT %d\n", B, T,
                model->batch_size, model->seq_len, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    if (model_sequence_parallel(model) && (B * T) % model_tp_degree(model) != 0) {
        fprintf(stderr, "model_forward: sequence parallelism cuts B*T = %d tokens into %d equal parts\n", B * T,
                model_tp_degree(model));
        exit(EXIT_FAILURE);
    }
    int C = c->channels, V = c->vocab_size, Vp = local_vocab(model);
    ActivationTensors a = model->acts;
    memcpy(model->inputs_cpu, inputs, (size_t)B * T * sizeof(int));
    cudaCheck(cudaMemcpyAsync(model->inputs, inputs, (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, stream));
    if (targets) {
        cudaCheck(cudaMemcpyAsync(model->targets, targets, (size_t)B * T * sizeof(int), cudaMemcpyHostToDevice, stream));
    }
    const FfnExtension* x = model->extension.ffn;
    // an extension's losses average over every position, a prompt's virtual ones too (an MoE routes them): their
    // per-position weight spreads the real positions' total over all of them
    float extension_scale = T == real_T ? dlogits_scale : dlogits_scale * (float)real_T / (float)T;
    if (x->begin_forward) x->begin_forward(model, B, T, extension_scale);
    model_forward_layers(model, B, T, stream);
    if (targets && x->end_forward) x->end_forward(model, B * T, stream);  // (under -pp each chunk's layers)
    if (!model_last_chunk(model)) return;  // -pp: the classifier is the last chunk's
    // the classifier: against wte (GPT-2, tied llama) or lm_head
    ParameterTensors p = model_rest_weights(model, stream);
    linear_forward(model, LORA_LM_HEAD, 0, a.output, a.lnf, c->tied ? p.wte : p.lm_head, nullptr, B, T, C, Vp, stream);
    if (targets) {
        float dloss = model->masked_dloss > 0.0f ? model->masked_dloss : dlogits_scale;
        if (model_tp_degree(model) > 1)
            vocab_parallel_loss(model, dloss, B * T, dlogits_scale > 0.0f, stream);
        else
            fused_classifier(a.output, a.losses, dloss, model->targets, B, T, V, Vp, dlogits_scale > 0.0f, stream);
        // the losses come back without a host synchronisation: the host queues the backward pass (and what else it
        // can) before model_mean_loss waits for them, so that the GPU never waits for the host between the passes
        cudaCheck(cudaMemcpyAsync(model->losses_cpu, a.losses, (size_t)B * T * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream));
        cudaCheck(cudaEventRecord(model->losses_copied, stream));
        model->loss_tokens = B * T;
        model->loss_targets = 0;
        for (int i = 0; i < B * T; i++) model->loss_targets += targets[i] >= 0;
    }
}

// The mean language-model cross-entropy of the last forward pass with targets, over the targets that count (a masked
// one's loss is 0; none counting: 0): waits for its losses (host, in double, in token order). Their sum stays in
// model->loss_sum.
static float model_mean_loss(Model* model) {
    if (model->loss_tokens > 0) {
        cudaCheck(cudaEventSynchronize(model->losses_copied));
        double sum = 0.0;
        for (int i = 0; i < model->loss_tokens; i++) sum += model->losses_cpu[i];
        model->loss_sum = sum;
        model->mean_loss = model->loss_targets > 0 ? (float)(sum / model->loss_targets) : 0.0f;
        model->loss_tokens = 0;
    }
    return model->mean_loss;
}

static ShardedParameters* model_own_set(Model* model) {
    return model->extension.ffn->own_set ? model->extension.ffn->own_set(model) : NULL;
}

static void model_reduce_layer(Model* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);
static void model_reduce_rest(Model* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);
static void model_reduce_adapter(Model* model, const MultiGpuConfig* mg, cudaStream_t stream);

// A ZB pass under ZeRO-2/3: whether the layers' weight gradients and their other gradients take their bucket space
// apart, layer l's weights' slices in the W pass (`take`: into bucket l % 2; else where they will be there, for the B
// pass to queue their GEMMs), into `every` and `dense` at their places in every_layer_tensors and dense_tensors
static int model_defers_weight_slices(const Model* model) {
    return model->deferring && model->store.zero_stage >= 2 && !model->store.frozen;
}
static void model_weight_slices(Model* model, int l, int take, floatX** every, floatX** dense, cudaStream_t stream) {
    int is_dense = model_is_dense_layer(model, l);
    int li = model_local_layer(model, l), L = model_stage_layers(model);
    int di = model_stage_dense_index(model, l), Ld = model_stage_dense_layers(model);
    floatX *w[EVERY_LAYER_WEIGHTS], *d[DENSE_WEIGHTS];
    if (take) {
        sharded_parameters_gradient_slices(&model->store, l % 2, every_layer_weights, EVERY_LAYER_WEIGHTS, li, L, w,
                                           stream);
        if (is_dense)
            sharded_parameters_gradient_slices(&model->store, l % 2, dense_weights, DENSE_WEIGHTS, di, Ld, d, stream);
    } else {
        size_t used = 0;
        sharded_parameters_bucket_slices_ahead(&model->store, l % 2, every_layer_weights, EVERY_LAYER_WEIGHTS, li, L,
                                               &used, w);
        if (is_dense)
            sharded_parameters_bucket_slices_ahead(&model->store, l % 2, dense_weights, DENSE_WEIGHTS, di, Ld, &used,
                                                   d);
    }
    every[2] = w[0], every[4] = w[1];  // qkvw, attprojw
    if (is_dense) dense[0] = d[0], dense[2] = d[1];  // fcw, fcprojw
}

// Where the backward pass accumulates layer l's gradients: in the gradient buffer, or under ZeRO-2 in a bucket
// (zeroed) that model_reduce_layer then reduces (llmc/optimizer.cuh).
static LayerParameters model_layer_gradients(Model* model, int l, cudaStream_t stream) {
    floatX* every[EVERY_LAYER_TENSORS];
    floatX* dense[DENSE_TENSORS];
    int is_dense = model_is_dense_layer(model, l);
    if (model_defers_weight_slices(model)) {  // ZB's B pass under ZeRO-2/3: the other tensors now, the weights ahead
        floatX *o[EVERY_LAYER_TENSORS - EVERY_LAYER_WEIGHTS], *od[DENSE_TENSORS - DENSE_WEIGHTS];
        sharded_parameters_gradient_slices(&model->store, l % 2, every_layer_others,
                                           EVERY_LAYER_TENSORS - EVERY_LAYER_WEIGHTS, model_local_layer(model, l),
                                           model_stage_layers(model), o, stream);
        every[0] = o[0], every[1] = o[1], every[3] = o[2], every[5] = o[3], every[6] = o[4], every[7] = o[5];
        if (is_dense) {
            sharded_parameters_gradient_slices(&model->store, l % 2, dense_others, DENSE_TENSORS - DENSE_WEIGHTS,
                                               model_stage_dense_index(model, l), model_stage_dense_layers(model), od,
                                               stream);
            dense[1] = od[0], dense[3] = od[1];
        }
        model_weight_slices(model, l, 0, every, dense, stream);
        return layer_parameters_from_slices(model, every, is_dense ? dense : NULL);
    }
    sharded_parameters_gradient_slices(&model->store, l % 2, every_layer_tensors, EVERY_LAYER_TENSORS,
                                       model_local_layer(model, l), model_stage_layers(model), every, stream);
    if (is_dense)
        sharded_parameters_gradient_slices(&model->store, l % 2, dense_tensors, DENSE_TENSORS,
                                           model_stage_dense_index(model, l), model_stage_dense_layers(model), dense,
                                           stream);
    return layer_parameters_from_slices(model, every, is_dense ? dense : NULL);
}
// ... and the gradients of an untied lm_head (reduced as soon as the classifier's backward is done), of wte, wpe and
// the final norm (the other fields NULL)
static ParameterTensors model_rest_gradients(Model* model, cudaStream_t stream) {
    ParameterTensors g;
    memset(&g, 0, sizeof(g));
    floatX* s[REST_TENSORS];
    sharded_parameters_gradient_slices(&model->store, REST_BUCKET, lm_head_tensor, 1, -1,
                                       model->config.num_layers, s, stream);
    g.lm_head = s[0];
    int whole_wte = model->wte_grad != NULL;  // rest_tensors[0] is wte
    sharded_parameters_gradient_slices(&model->store, REST_BUCKET, rest_tensors + whole_wte, REST_TENSORS - whole_wte,
                                       -1, model->config.num_layers, s + whole_wte, stream);
    g.wte = whole_wte ? model->wte_grad : s[0], g.wpe = s[1], g.lnfw = s[2], g.lnfb = s[3];
    return g;
}

// Backward pass for the batch of the last model_forward (which must have been given targets and a
// dlogits_scale). Gradients accumulate (+=) into model->grads; zero them with model_zero_grad. With
// `reduce` (the last micro-step of a step), each layer's gradients are averaged over the processes (ZeRO-0:
// all-reduce; ZeRO-1: reduced to the owner of each shard) on the NCCL stream as soon as that layer's backward
// pass is done, while the next layer's runs. The recompute levels: r >= 1 recomputes the FFN's activation output
// (its kind does), r >= 2 also the norms' outputs (bit for bit the forward's: the fused residual-and-norm kernels
// round the residual first, as a separate add would).
static void model_backward(Model* model, int B, int T, unsigned int seed, const MultiGpuConfig* mg, int reduce,
                          int zero_stage, cudaStream_t stream) {
    T += model_adapter_sequence_extra(model);  // the positions model_forward ran (prompt tuning's virtual ones)
    const ModelConfig* c = &model->config;
    int L = c->num_layers, C = c->channels, Vp = local_vocab(model), N = B * T, Nt = model_stream_tokens(model, N);
    int SB = Nt == N ? B : 1, ST = Nt == N ? T : Nt;  // the stream's tokens (model_forward_layers)
    int begin = model_layer_begin(model), end = model_layer_end(model);  // this stage's chunk's layers
    ParameterTensors p = model_rest_weights(model, stream);
    // the gradients of the tensors outside the layers, in the passes of the model's first and last chunk (ZeRO-2 takes
    // their bucket space only where it reduces them)
    ParameterTensors g;
    if (model_first_chunk(model) || model_last_chunk(model)) g = model_rest_gradients(model, stream);
    else memset(&g, 0, sizeof(g));
    ActivationTensors a = model->acts;
    floatX* dresidual = a.dresidual;  // gradient of the residual stream, (B, T, C): the stream's tokens
    // ZeRO-Offload copies the step's gradient to the host piece by piece on the last micro-step
    model->store.last_micro_step = reduce;
    if (model_own_set(model)) model_own_set(model)->last_micro_step = reduce;
    int last_micro_step = reduce;
    if (model->adapter) model->adapter->store.last_micro_step = reduce;
    reduce = reduce || model->zero_stage >= 2;  // ZeRO-2/3 reduce on every micro-step
    if (model_last_chunk(model)) {  // (before -pp's other chunks, the next chunk's input gradient is in a.dresidual)
        cudaCheck(cudaMemsetAsync(dresidual, 0, (size_t)Nt * C * sizeof(floatX), stream));
        // classifier: the logits' gradient is in a.output; a tied output embedding's gradient adds to the encoder's
        linear_backward(model, LORA_LM_HEAD, 0, a.dbtc, c->tied ? g.wte : g.lm_head, nullptr, a.output, a.lnf,
                        c->tied ? p.wte : p.lm_head, B, T, C, Vp, stream);
        if (reduce)  // an untied lm_head's gradient is complete: reduced while the layers' backward runs
            sharded_parameters_reduce_slices(&model->store, lm_head_tensor, 1, -1, L, mg, zero_stage, stream);
        LayerActivations last = model_layer_activations(model, end - 1, B, T);
        const floatX* dlnf = tp_sum_over_members(model, a.dbtc, a.member_stream, N, stream);
        norm_backward(model, dresidual, g.lnfw, g.lnfb, a.scratch_f, dlnf, last.residual3, p.lnfw, a.lnf_mean,
                      a.lnf_rstd, SB, ST, stream);
    }
    for (int l = end - 1; l >= begin; l--) {
        if (model->deferring) weight_queue_begin_group(model->deferring);  // (the layer's deferred weight gradients)
        if (l > begin) model_prefetch_layer(model, l - 1, stream);
        LayerParameters lp = model_layer_weights(model, l, stream);
        LayerParameters lg = model_layer_gradients(model, l, stream);
        LayerActivations la = model_layer_activations(model, l, B, T);
        if (model->recompute >= 2) {  // the norms' outputs, kept for one layer only
            norm_forward(model, tp_norm_output(model, la.ln2), nullptr, nullptr, la.residual2, lp.ln2w, lp.ln2b, SB,
                         ST, stream);
            tp_gather_norm(model, la.ln2, N, stream);
            norm_forward(model, tp_norm_output(model, la.ln1), nullptr, nullptr, la.residual, lp.ln1w, lp.ln1b, SB, ST,
                         stream);
            tp_gather_norm(model, la.ln1, N, stream);
        }
        const floatX* dout = tp_whole_gradient(model, dresidual, N, stream);
        dout = model_adapter_site_backward(model, BOTTLENECK_FFN, l, dout, N, a.scratch_f, stream);
        layer_ffn(model, l)->backward(model, l, &lp, &lg, &la, a.dbtc, dout, B, T, stream);
        const floatX* dln2 = tp_sum_over_members(model, a.dbtc, a.member_stream, N, stream);
        norm_backward(model, dresidual, lg.ln2w, lg.ln2b, a.scratch_f, dln2, la.residual2, lp.ln2w, la.ln2_mean,
                      la.ln2_rstd, SB, ST, stream);
        dout = tp_whole_gradient(model, dresidual, N, stream);
        dout = model_adapter_site_backward(model, BOTTLENECK_ATTENTION, l, dout, N, a.scratch_f, stream);
        attention_block_backward(model, l, &lp, &lg, &la, dout, B, T, stream);
        const floatX* dln1 = tp_sum_over_members(model, a.dbtc, a.member_stream, N, stream);
        norm_backward(model, dresidual, lg.ln1w, lg.ln1b, a.scratch_f, dln1, la.residual, lp.ln1w, la.ln1_mean,
                      la.ln1_rstd, SB, ST, stream);
        // (ZB: once its last W pass has computed the weight gradients; under ZeRO-2/3 all but the weights now)
        if (reduce && (!model->deferring || model_defers_weight_slices(model))) {
            tp_sum_norm_gradients(model, lg.ln1w, lg.ln1b, stream);
            tp_sum_norm_gradients(model, lg.ln2w, lg.ln2b, stream);
            model_reduce_layer(model, l, mg, zero_stage, stream);
        }
    }
    if (model_first_chunk(model)) {  // (under -pp the other chunks send a.dresidual, their input's gradient, back)
        floatX* dwpe = c->positions == POSITIONS_LEARNED ? g.wpe : nullptr;
        const floatX* dembedded = tp_whole_gradient(model, dresidual, N, stream);
        if (model->frozen) {  // the embeddings do not train; prompt tuning's prompt does
            model_adapter_embed_backward(model, dembedded, B, T, stream);
        } else if (model_tp_degree(model) == 1) {
            encoder_backward(g.wte, dwpe, dembedded, model->inputs, model->inputs_cpu, B, T, C, seed, stream);
        } else {  // this member's vocabulary rows; every member the whole wpe gradient
            int Vs = local_vocab(model);
            encoder_backward_vocab_range(g.wte, dwpe, dembedded, model->inputs, model->inputs_cpu, B, T, C,
                                         model_tp_member(model) * Vs, Vs, seed, stream);
        }
    }
    // the tensors outside the layers: under -pp those of the model's first or last chunk (none of the others')
    if (reduce && (model_first_chunk(model) || model_last_chunk(model))) {
        // (a slice of size 0, RMSNorm's bias, points at the next tensor: NULL)
        if (model_last_chunk(model))
            tp_sum_norm_gradients(model, g.lnfw, c->norm == NORM_LAYERNORM ? g.lnfb : nullptr, stream);
        model_reduce_rest(model, mg, zero_stage, stream);
    }
    // the adapter's set is reduced whole, once, on the step's last micro-step (under -pp after the step's passes)
    if (model->adapter && last_micro_step && model_pp_stages(model) == 1) model_reduce_adapter(model, mg, stream);
}

// ----------------------------------------------------------------------------------------------------
// Gradient averaging over processes during the backward pass (llmc/optimizer.cuh does the rest of the step)

// (ZB's B pass under ZeRO-2/3: all but the layer's weights, whose W pass reduces them: model_weight_pass)
static void model_reduce_layer(Model* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    int others = model_defers_weight_slices(model);
    sharded_parameters_reduce_slices(&model->store, others ? every_layer_others : every_layer_tensors,
                                     others ? EVERY_LAYER_TENSORS - EVERY_LAYER_WEIGHTS : EVERY_LAYER_TENSORS,
                                     model_local_layer(model, layer), model_stage_layers(model), mg, zero_stage,
                                     stream);
    if (model_is_dense_layer(model, layer))
        sharded_parameters_reduce_slices(&model->store, others ? dense_others : dense_tensors,
                                         others ? DENSE_TENSORS - DENSE_WEIGHTS : DENSE_TENSORS,
                                         model_stage_dense_index(model, layer), model_stage_dense_layers(model), mg,
                                         zero_stage, stream);
    else
        model->extension.ffn->reduce_layer(model, layer, mg, zero_stage, stream);
}
// The adapter's set (ZeRO-1 at most), whole. Every process holds all of it; under -pp each stage has computed its own
// layers' part of the gradient (the rest zero, which the sum adds exactly): summed over the stages first, so that
// every stage reduces, and updates, the whole gradient alike.
static void model_reduce_adapter(Model* model, const MultiGpuConfig* mg, cudaStream_t stream) {
    ShardedParameters* adapter = &model->adapter->store;
    if (model_pp_stages(model) > 1) pipeline_sum(model->pp, adapter->grads_memory, adapter->num_parameters, stream);
    int all[ADAPTER_MAX_TENSORS];
    for (int i = 0; i < adapter->num_tensors; i++) all[i] = i;
    sharded_parameters_reduce_slices(adapter, all, adapter->num_tensors, -1, model->config.num_layers, mg,
                                     model->adapter->zero_stage, stream);
}
// ... the rest, but for a tied wte that two stages hold: the pipeline's step reduces it once the stages have summed
// their parts (model_sum_shared_wte)
static void model_reduce_rest(Model* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    int shared = model_shares_wte(model);  // rest_tensors[0] is wte
    sharded_parameters_reduce_slices(&model->store, rest_tensors + shared, REST_TENSORS - shared, -1,
                                     model->config.num_layers, mg, zero_stage, stream);
}

// ----------------------------------------------------------------------------------------------------
// The optimizer step over the replicated parameter set and an extension's own (llmc/optimizer.cuh)


// m, v and master weights for this process's shards of both parameter sets
static void model_allocate_optimizer(Model* model, int zero_stage) {
    sharded_parameters_allocate_optimizer(&model->store, model->use_master_weights, model->process_rank,
                                          model->num_processes, zero_stage, model->offload_optimizer);
    ShardedParameters* own = model_own_set(model);
    if (own) {
        const MultiGpuConfig* group = model->extension.ffn->own_group(model);
        sharded_parameters_allocate_optimizer(own, model->use_master_weights, group->process_rank,
                                              group->num_processes, zero_stage, model->offload_optimizer);
    }
    if (model->adapter)
        sharded_parameters_allocate_optimizer(&model->adapter->store, model->use_master_weights, model->process_rank,
                                              model->num_processes, model->adapter->zero_stage, model->offload_optimizer);
}

static void model_zero_grad(Model* model, cudaStream_t stream) {
    sharded_parameters_zero_grad(&model->store, stream);
    ShardedParameters* own = model_own_set(model);
    if (own) sharded_parameters_zero_grad(own, stream);
    if (model->adapter) sharded_parameters_zero_grad(&model->adapter->store, stream);
    if (model->wte_grad)
        cudaCheck(cudaMemsetAsync(model->wte_grad, 0, (size_t)local_vocab(model) * model->config.channels *
                                                          sizeof(floatX), stream));
}

// After the last micro-step's backward pass: the global norm of the step's gradient (the loss scale undone),
// identical on every process: the replicated set's part, plus the extension's own, summed over its processes.
static float model_gradient_norm(Model* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    float norm2;
    if (model_tp_degree(model) > 1 || model_shares_wte(model)) {
        // the split tensors' slices of every member, the whole ones once; a tied wte that two stages hold, once
        int include[NUM_PARAMETER_TENSORS];
        model_norm_tensors(model, include);
        if (model_shares_wte(model) && !model_first_stage(model)) include[PARAM_WTE] = 0;
        norm2 = sharded_parameters_norm_squared_of(&model->store, include, mg, zero_stage, stream);
        norm2 = tensor_parallel_float_sum(model->tp, norm2, stream);
    } else {
        norm2 = sharded_parameters_norm_squared(&model->store, mg, zero_stage, stream);
    }
    if (model_own_set(model)) norm2 += model->extension.ffn->own_norm_squared(model, zero_stage, stream);
    if (model_pp_stages(model) > 1) norm2 = pipeline_float_sum(model->pp, norm2);  // every stage's part
    // (the adapter's gradient, summed over the stages, whole on each)
    if (model->adapter) norm2 += sharded_parameters_norm_squared(&model->adapter->store, mg, model->adapter->zero_stage, stream);
    return sqrtf(norm2) / model->loss_scaler.scale;
}

// -oo 2, right after queuing the last micro-step's backward pass: each set's early update of step t (from 1) on the host
// (llmc/optimizer.cuh), with the seeds model_update will draw
static void model_early_update(Model* model, const AdamWConfig* opt, int t) {
    if (model->offload_optimizer != 2) return;
    unsigned long long rng = model->rng_state;  // drawn in model_update's order
    sharded_parameters_early_update(&model->store, opt, model->loss_scaler.scale, optimizer_next_seed(&rng), t);
    ShardedParameters* own = model_own_set(model);
    if (own) sharded_parameters_early_update(own, opt, model->loss_scaler.scale, optimizer_next_seed(&rng), t);
    if (model->adapter)
        sharded_parameters_early_update(&model->adapter->store, opt, model->loss_scaler.scale, optimizer_next_seed(&rng),
                                        t);
}
// ... and a step that is skipped undoes it
static void model_discard_early_update(Model* model) {
    sharded_parameters_discard_early_update(&model->store);
    ShardedParameters* own = model_own_set(model);
    if (own) sharded_parameters_discard_early_update(own);
    if (model->adapter) sharded_parameters_discard_early_update(&model->adapter->store);
}

// The AdamW step t (from 1) with gradient norm `norm`; a non-finite norm (FP16 overflow) skips it. Returns 1 if the
// parameters were updated. The loss scale changes afterwards (LossScaler).
static int model_update(Model* model, const AdamWConfig* opt, float norm, int t, const MultiGpuConfig* mg,
                       int zero_stage, cudaStream_t stream) {
    int finite = isfinite(norm);
    if (finite) {
        float scale = model->loss_scaler.scale;
        sharded_parameters_apply_update(&model->store, opt, norm, scale, optimizer_next_seed(&model->rng_state), t, mg,
                                        zero_stage, stream);
        ShardedParameters* own = model_own_set(model);
        if (own)
            sharded_parameters_apply_update(own, opt, norm, scale, optimizer_next_seed(&model->rng_state), t,
                                            model->extension.ffn->own_group(model), zero_stage, stream);
        if (model->adapter)
            sharded_parameters_apply_update(&model->adapter->store, opt, norm, scale,
                                            optimizer_next_seed(&model->rng_state), t, mg, model->adapter->zero_stage,
                                            stream);
        if (model->extension.ffn->after_update) model->extension.ffn->after_update(model, mg, stream);
    } else {
        model_discard_early_update(model);
    }
    loss_scaler_update(&model->loss_scaler, norm);
    return finite;
}

// 6 flops per active parameter per token for the matmuls of forward+backward (an extension counts its own: a
// token meets k of the E experts of an MoE layer) plus the attention's 12 L C T. The same for llama: its lm_head
// (untied) is a matmul's weight like the rest, the embeddings count as in llm.c's GPT-2 formula, and attention's
// score and value products are those of NH query heads of HS, C = NH HS, whatever NKV (grouped-query attention
// shares k and v, not their products); the RMSNorm, RoPE and SwiGLU elementwise flops are left out, as GPT-2's are.
static double model_flops_per_token(const Model* model, int T) {
    const ModelConfig* c = &model->config;
    size_t sizes[NUM_PARAMETER_TENSORS];
    file_tensor_sizes(sizes, model);
    double active = 0.0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++)
        if (i < PARAM_EXTENSION || i >= PARAM_EXTENSION + MLP_EXTENSION_SLOTS) active += (double)sizes[i];
    const FfnExtension* x = model->extension.ffn;
    if (x->active_parameters_per_token) active += x->active_parameters_per_token(model);
    return 6.0 * active + 12.0 * c->num_layers * c->channels * (double)T;
}

// Whether every parameter of every process is finite (collective: the same answer on every process).
static int model_parameters_finite(Model* model, const MultiGpuConfig* mg, cudaStream_t stream) {
    ShardedParameters* sets[3] = {&model->store, model_own_set(model), model->adapter ? &model->adapter->store : NULL};
    int bad = 0;
    for (int k = 0; k < 3; k++) {
        if (!sets[k]) continue;
        // this process's parameters: all of them, or under ZeRO-3 its shard (the padding past the tensors is zero)
        size_t n = sets[k]->params_count;
        floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
        cudaCheck(cudaMemcpyAsync(host, sets[k]->params_memory, n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        for (size_t i = 0; i < n && !bad; i++) bad = !isfinite((float)host[i]);
        free(host);
    }
    return multi_gpu_cpu_float_sum((float)bad, mg) == 0.0f;
}

#include "llmc/train_checkpoint.h"

// ----------------------------------------------------------------------------------------------------
// Sampling: autoregressive from the EOT token through generate's engine (llmc/generation.h: the seed token's
// prefill, then one decode step per token through a paged KV cache), printed through the tokenizer

#include "llmc/generation.h"

// Every process that calls this computes the same tokens (the same weights and generator); only `print` prints. The
// generator advances by one draw per token, each a draw from the softmax of the logits (temperature 1).
static void sample_and_print(Model* model, const Tokenizer* tokenizer, int seed_token, int gen_tokens,
                             unsigned long long* sample_rng, int print, cudaStream_t stream) {
    int T = model->seq_len < gen_tokens + 1 ? model->seq_len : gen_tokens + 1;
    SamplingSettings sampling = {1.0f, 0, 1.0f};
    const int block_size = 16;
    Engine e;
    engine_init(&e, model, &sampling, 1, block_size, CEIL_DIV(T, block_size), stream);
    Sequence s;
    sequence_init(&s, &e, 0, 0, &seed_token, 1, T - 1, (uint64_t)*sample_rng);
    if (engine_decodes(model)) run_engine(&e, &s, 1, 1);
    else generate_by_prefill(&e, &s);
    *sample_rng = (unsigned long long)s.rng;
    if (print) {
        printf("generating:\n---\n");
        for (int t = 1; t < s.length; t++) {
            int token = s.tokens[t];
            // a token the tokenizer does not know (its vocabulary is smaller than the model's) prints as its id
            if (tokenizer->init_ok && (uint32_t)token < tokenizer->vocab_size)
                safe_printf(tokenizer_decode(tokenizer, token));
            else printf("<%d>", token);
        }
        printf("\n---\n");
        fflush(stdout);
    }
    sequence_free(&s);
    engine_free(&e);
}

// ----------------------------------------------------------------------------------------------------
// The trainer: its settings and flags, the memory plan, evaluation, the training step, checkpoints, and main

#include "llmc/train_settings.h"
#include "llmc/memory_plan.h"

// ----------------------------------------------------------------------------------------------------
// Pipeline parallelism (-pp; llmc/pipeline.h, doc/parallelism.md): a stage's micro-batches in flight, each in an
// activation slot of its own, and its passes in the schedule's order

static void model_save_slot(const Model* m, ActivationSlot* s) {
    s->acts = m->acts, s->acts_memory = m->acts_memory;
    s->inputs = m->inputs, s->targets = m->targets, s->inputs_cpu = m->inputs_cpu;
    s->losses_cpu = m->losses_cpu, s->losses_copied = m->losses_copied;
    s->loss_tokens = m->loss_tokens, s->loss_targets = m->loss_targets;
    if (m->adapter) s->adapter_kept = m->adapter->site_inputs;
}
// (a slot's weight-gradient queue stays in the slot: the pipeline's step hands it to model->deferring)
static void model_use_slot(Model* m, const ActivationSlot* s) {
    m->acts = s->acts, m->acts_memory = s->acts_memory;
    m->inputs = s->inputs, m->targets = s->targets, m->inputs_cpu = s->inputs_cpu;
    m->losses_cpu = s->losses_cpu, m->losses_copied = s->losses_copied;
    m->loss_tokens = s->loss_tokens, m->loss_targets = s->loss_targets;
    if (m->adapter) m->adapter->site_inputs = s->adapter_kept;
    if (m->extension.ffn->use_slot) m->extension.ffn->use_slot(m, (int)(s - m->slots));
}
// `slots` micro-batches' activations at (B, T), each allocated as model_allocate_activations does one; slot 0 in use.
// With a tied wte shared by two stages, the buffer its gradient comes into from the other stage.
static void model_allocate_slots(Model* model, int B, int T, int slots) {
    model->slots = (ActivationSlot*)calloc(slots, sizeof(ActivationSlot));
    for (int k = 0; k < slots; k++) {
        model_allocate_activations(model, B, T);
        model_save_slot(model, &model->slots[k]);
    }
    model->num_slots = slots;
    model_use_slot(model, &model->slots[0]);
    size_t message = (size_t)model_stream_tokens(model, B * T) * model->config.channels;  // the outputs' staging
    cudaCheck(cudaMalloc((void**)&model->staging, (model->pp->staging_buffers > 0 ? model->pp->staging_buffers : 1) *
                                                      message * sizeof(floatX)));
    if (model->pp->schedule == SCHEDULE_ZB) {  // per layer 4 weight gradients, their output gradients and inputs
        size_t N = (size_t)B * T, C = model->config.channels, H = local_hidden(model);
        size_t per_layer = N * (local_qkv_channels(model) + C + local_fc_channels(model) + C);
        if (model->recompute >= 1) per_layer += N * H;      // fcproj's input, the recomputed activation
        if (model->recompute >= 2) per_layer += 2 * N * C;  // qkv's and fc's, the recomputed norms
        for (int k = 0; k < slots; k++)
            weight_queue_allocate(&model->slots[k].weights, 4 * model_stage_layers(model),
                                  per_layer * model_stage_layers(model));
    }
    if (model_shares_wte(model) && !model->frozen && (model_first_stage(model) || model_last_stage(model))) {
        size_t wte = (size_t)local_vocab(model) * model->config.channels * sizeof(floatX);
        cudaCheck(cudaMalloc((void**)&model->wte_peer, wte));
        if (model->zero_stage >= 2) cudaCheck(cudaMalloc((void**)&model->wte_grad, wte));
    }
}

// ZB's W pass of a micro-batch: the layers' weight gradients its B pass queued; after the step's last one, each layer's
// gradients (complete now) are reduced over the stage's data-parallel processes, as model_backward does without ZB.
// Under ZeRO-2/3 each layer's weights take their bucket space (where its B pass queued them), are computed and
// reduced in turn, on every micro-batch.
static void model_weight_pass(Model* model, WeightGradientQueue* q, int reduce, const MultiGpuConfig* mg,
                              int zero_stage, cudaStream_t stream) {
    if (zero_stage >= 2 && !model->store.frozen) {
        model->store.last_micro_step = reduce;  // (-oo: the step's gradient pieces go to the host as completed)
        for (int l = model_layer_end(model) - 1, g = 0; l >= model_layer_begin(model); l--, g++) {
            floatX *ahead[EVERY_LAYER_TENSORS], *taken[EVERY_LAYER_TENSORS], *dense_ahead[DENSE_TENSORS],
                *dense_taken[DENSE_TENSORS];
            model_weight_slices(model, l, 0, ahead, dense_ahead, stream);
            model_weight_slices(model, l, 1, taken, dense_taken, stream);
            int dense = model_is_dense_layer(model, l);
            if (ahead[2] != taken[2] || ahead[4] != taken[4] || (dense && (dense_ahead[0] != dense_taken[0] ||
                                                                           dense_ahead[2] != dense_taken[2]))) {
                fprintf(stderr, "model_weight_pass: layer %d's weight gradients are not where its B pass queued them\n",
                        l);
                exit(EXIT_FAILURE);
            }
            weight_queue_run_group(q, g, stream);
            sharded_parameters_reduce_slices(&model->store, every_layer_weights, EVERY_LAYER_WEIGHTS,
                                             model_local_layer(model, l), model_stage_layers(model), mg, zero_stage,
                                             stream);
            if (dense)
                sharded_parameters_reduce_slices(&model->store, dense_weights, DENSE_WEIGHTS,
                                                 model_stage_dense_index(model, l), model_stage_dense_layers(model), mg,
                                                 zero_stage, stream);
        }
        weight_queue_clear(q);
        return;
    }
    weight_queue_run(q, stream);
    for (int l = model_layer_end(model) - 1; reduce && l >= model_layer_begin(model); l--) {
        LayerParameters lg = model_layer_gradients(model, l, stream);
        tp_sum_norm_gradients(model, lg.ln1w, lg.ln1b, stream);
        tp_sum_norm_gradients(model, lg.ln2w, lg.ln2b, stream);
        model_reduce_layer(model, l, mg, zero_stage, stream);
    }
}

// Pass k's output (n values at `values`) into its staging buffer, where it waits for its send (llmc/pipeline.h)
static floatX* stage_pass_output(Model* model, const Pipeline* pp, int k, const floatX* values, size_t n,
                                 cudaStream_t stream) {
    floatX* staged = model->staging + (size_t)pp->staging_of[k] * n;
    cudaCheck(cudaMemcpyAsync(staged, values, n * sizeof(floatX), cudaMemcpyDeviceToDevice, stream));
    return staged;
}

// The values a stage sends its neighbour per micro-batch: the stream's (B, T, C), or its gradient
static size_t pipeline_message(const Model* model, int B, int T) {
    return (size_t)model_stream_tokens(model, B * T) * model->config.channels;
}
// Where the current chunk's output is (its last layer's residual3), and where its input goes (its first layer's)
static floatX* stage_output(Model* model, int B, int T) {
    return model_layer_activations(model, model_layer_end(model) - 1, B, T).residual3;
}
static floatX* chunk_input(Model* model, int B, int T) {
    return (floatX*)model_layer_activations(model, model_layer_begin(model), B, T).residual;
}

// A forward pass with targets through every stage, for validation: each stage's chunks' layers on the micro-batch in
// turn, the loss on the last (model_mean_loss there; 0 on the others). Collective over the pipeline group.
static void pipeline_forward_only(Model* model, const int* inputs, const int* targets, int B, int T,
                                  cudaStream_t stream) {
    Pipeline* pp = model->pp;
    int Tm = T + model_adapter_sequence_extra(model);  // the positions the passes run (prompt tuning's virtual ones)
    size_t n = pipeline_message(model, B, Tm);
    model_use_slot(model, &model->slots[0]);
    for (int c = 0; c < pp->chunks; c++) {
        model->chunk = c;
        int before = model_first_chunk(model) ? -1 : (pp->stage + pp->stages - 1) % pp->stages;
        int after = model_last_chunk(model) ? -1 : (pp->stage + 1) % pp->stages;
        pipeline_exchange(pp, NULL, -1, chunk_input(model, B, Tm), before, n, stream);
        model_forward(model, inputs, targets, B, T, 0.0f, stream);
        pipeline_exchange(pp, stage_output(model, B, Tm), after, NULL, -1, n, stream);
    }
    model->chunk = 0;
    model_save_slot(model, &model->slots[0]);
    // its sends complete before the validation's sums over other groups (on their own streams) begin
    cudaCheck(cudaStreamSynchronize(stream));
}

// A training step's micro-batches through this stage's passes (pp->passes, the schedule's order): before each pass the
// sends and receives of llmc/pipeline.h's order (the previous chunk's output before a forward pass, the next chunk's
// input gradient before a backward pass; each pass's output sent when its key is due). The backward passes run in micro-batch order and
// draw the stochastic-rounding seeds in that order, as -pp 1's micro-steps do, and the last one reduces the stage's
// gradients over its data-parallel processes; a tied wte's two parts are then summed between the first and last stage
// and reduced. Returns the sum of the micro-batches' mean losses (with loss masks, of their loss sums times
// target_weight) on the last stage, 0 on the others.
static double pipeline_micro_steps(Model* model, const TrainerSettings* s, DataLoader* loader, int step, int m,
                                   int masked, double target_weight, const MultiGpuConfig* mg, cudaStream_t stream) {
    Pipeline* pp = model->pp;
    int B = s->B, T = s->T, BT = B * T, first = model_first_stage(model), last = model_last_stage(model);
    int Tm = T + model_adapter_sequence_extra(model);  // the positions the passes run (prompt tuning's virtual ones)
    size_t n = pipeline_message(model, B, Tm);
    // every stage reads the step's batches, as every process of -pp 1 would: the first stage uses the inputs, the last
    // the targets
    int* inputs = (int*)malloc_check((size_t)m * BT * sizeof(int));
    int* targets = (int*)malloc_check((size_t)m * BT * sizeof(int));
    unsigned int* seeds = (unsigned int*)malloc_check((size_t)m * sizeof(unsigned int));
    for (int i = 0; i < m; i++) {
        if (s->overfit_single_batch) dataloader_reset(loader);
        dataloader_next_batch(loader);
        memcpy(inputs + (size_t)i * BT, loader->inputs, (size_t)BT * sizeof(int));
        memcpy(targets + (size_t)i * BT, loader->targets, (size_t)BT * sizeof(int));
        seeds[i] = optimizer_next_seed(&model->rng_state);
    }
    float dlogits_scale = model->loss_scaler.scale / (float)(BT * m);
    double loss = 0.0;
    // each pass's output (the stream up, or the input gradient down; NULL: none), sent at a later point
    floatX** outputs = (floatX**)calloc(pp->num_passes, sizeof(floatX*));
    cudaCheck(cudaEventRecord(pp->start, stream));
    for (int k = 0; k < pp->num_passes; k++) {
        PipelinePass pass = pp->passes[k];
        ActivationSlot* slot = &model->slots[pass.micro % pp->slots];
        int forward = pass.kind == PASS_FORWARD;
        model_use_slot(model, slot);
        model->chunk = pass.chunk;
        pipeline_point(pp, k, outputs, forward ? chunk_input(model, B, Tm) : model->acts.dresidual, n, stream);
        cudaCheck(cudaEventRecord(pp->begin[k], stream));
        if (forward) {
            model->pass_number = (unsigned int)(step * m + pass.micro);
            model_forward(model, inputs + (size_t)pass.micro * BT, targets + (size_t)pass.micro * BT, B, T,
                          dlogits_scale, stream);
            if (!model_last_chunk(model))
                outputs[k] = stage_pass_output(model, pp, k, stage_output(model, B, Tm), n, stream);
        } else if (pass.kind == PASS_BACKWARD) {
            model->deferring = pp->schedule == SCHEDULE_ZB ? &slot->weights : NULL;
            model_backward(model, B, T, seeds[pass.micro], mg, pass.micro == m - 1, s->zero_stage, stream);
            model->deferring = NULL;
            if (!model_first_chunk(model)) outputs[k] = stage_pass_output(model, pp, k, model->acts.dresidual, n, stream);
        } else {
            model_weight_pass(model, &slot->weights, pass.micro == m - 1, mg, s->zero_stage, stream);
        }
        cudaCheck(cudaEventRecord(pp->end[k], stream));
        if (pass.kind == PASS_BACKWARD && model_last_chunk(model)) {
            float mean_loss = model_mean_loss(model);
            loss += masked ? model->loss_sum * target_weight : mean_loss;
        }
        // the micro-batch's last backward pass on this stage: what its forward passes measured is complete
        if (pass.kind == PASS_BACKWARD && pass.chunk == 0 && model->extension.ffn->micro_step_done)
            model->extension.ffn->micro_step_done(model);
        model_save_slot(model, slot);
    }
    model->chunk = 0;
    pipeline_point(pp, pp->num_passes, outputs, NULL, n, stream);
    free(outputs);
    cudaCheck(cudaEventRecord(pp->finish, stream));
    if (model->extension.telemetry->join_stages) model->extension.telemetry->join_stages(model, 0);
    if (model->adapter) model_reduce_adapter(model, mg, stream);
    if (model_shares_wte(model) && !model->frozen && (first || last)) {
        int L = model->config.num_layers;
        floatX* dwte = model->wte_grad ? model->wte_grad : model_rest_gradients(model, stream).wte;
        floatX* sum = dwte;  // ZeRO-2/3: into the rest's bucket (its other slices all reduced), reduced from there
        if (model->wte_grad)
            sharded_parameters_gradient_slices(&model->store, REST_BUCKET, rest_tensors, 1, -1, L, &sum, stream);
        model_sum_shared_wte(model, dwte, model->wte_peer, sum, stream);
        sharded_parameters_reduce_slices(&model->store, rest_tensors, 1, -1, L, mg, s->zero_stage, stream);
    }
    free(inputs);
    free(targets);
    free(seeds);
    return loss;
}

// The validation loss over -m batches, averaged over the data-parallel processes `mg` (collective), printed (`print`:
// process 0) and logged.
static void evaluate(Model* model, DataLoader* val_loader, const TrainerSettings* s, const MultiGpuConfig* mg,
                     int print, Logger* logger, int step, cudaStream_t stream) {
    dataloader_reset(val_loader);
    double val_loss = 0.0, loss_sum = 0.0;
    uint64_t targets = 0;
    for (int i = 0; i < s->val_max_steps; i++) {
        watchdog_begin("validation", step);
        dataloader_next_batch(val_loader);
        if (model_pp_stages(model) > 1)
            pipeline_forward_only(model, val_loader->inputs, val_loader->targets, s->B, s->T, stream);
        else
            model_forward(model, val_loader->inputs, val_loader->targets, s->B, s->T, 0.0f, stream);
        val_loss += model_mean_loss(model);
        loss_sum += model->loss_sum;
        targets += (uint64_t)model->loss_targets;
    }
    watchdog_begin("the validation loss all-reduce", step);
    // under -pp the losses are the last stage's (0 on the others): summed over the stages too
    const MultiGpuConfig* stages = model_pp_stages(model) > 1 ? &model->pp->group : NULL;
    if (val_loader->has_masks) {  // the mean over every target that counts
        targets = multi_gpu_cpu_count_sum(targets, mg);
        float sum = multi_gpu_cpu_float_sum((float)loss_sum, mg);
        if (stages) targets = multi_gpu_cpu_count_sum(targets, stages), sum = multi_gpu_cpu_float_sum(sum, stages);
        val_loss = targets > 0 ? sum / (double)targets : 0.0;
    } else {
        val_loss = multi_gpu_cpu_float_sum((float)(val_loss / s->val_max_steps), mg) / mg->num_processes;
        if (stages) val_loss = multi_gpu_cpu_float_sum((float)val_loss, stages);
    }
    watchdog_end();
    if (print) printf("val loss %f\n", val_loss);
    logger_log_val(logger, step, (float)val_loss);
    const TelemetryExtension* x = model->extension.telemetry;
    if (model_pp_stages(model) > 1 && x->join_stages) x->join_stages(model, 1);
    if (print && x->print_validation) x->print_validation(model, s->B * s->T, logger, step);
}

// Writes the checkpoint of `step` if one is due (collective; `preempted`: due with -o, whatever -n), and returns
// whether it did: never one of non-finite state, neither after a step whose loss or norm was not finite nor of
// parameters that are not (every process checks its own, so that all decide alike).
static int checkpoint_if_due(Model* model, const TrainerSettings* s, const DataLoader* train_loader, TrainerState* ts,
                             const MultiGpuConfig* mg, int step, int start_step, int last_step, int preempted,
                             int bad_steps, cudaStream_t stream) {
    int rank0 = mg->process_rank == 0;
    int due = preempted || (s->checkpoint_every > 0 && (step % s->checkpoint_every == 0 || last_step));
    if (!s->output_dir || step <= start_step || !due) return 0;
    if (bad_steps > 0) {
        if (rank0) printf("step %d: not finite for the last %d step%s: checkpoint not written\n", step, bad_steps,
                          bad_steps == 1 ? "" : "s");
        return 0;
    }
    watchdog_begin("the checkpoint's parameter check", step);
    int finite = model_parameters_finite(model, mg, stream);
    watchdog_end();
    if (!finite) {
        if (rank0) printf("step %d: parameters not finite: checkpoint not written\n", step);
        return 0;
    }
    ts->step = step;
    ts->rng_state = model->rng_state;
    ts->loss_scale = model->loss_scaler.scale;
    ts->good_steps = model->loss_scaler.good_steps;
    watchdog_begin("writing the checkpoint", step);
    write_checkpoint(s->output_dir, model, train_loader, ts, mg, s->zero_stage, stream);
    watchdog_end();
    if (rank0) {
        printf("checkpoint written: step %d\n", step);
        // the newest -nk complete ones stay, whatever steps they are: so the last checkpoint written
        // before a run got into trouble is never the one deleted; files of no complete checkpoint go
        prune_checkpoints(s->output_dir, s->checkpoints_keep > 0 ? s->checkpoints_keep : INT_MAX, mg->num_processes);
    }
    return 1;
}

// What one training step measured.
typedef struct {
    float loss;  // averaged over micro-steps and processes
    float norm;  // of the step's gradient
    int loss_spike, norm_spike;  // the outlier detectors skipped the update
    double loss_z, norm_z;
    float ms;
    double most_idle, least_idle;  // -pp: the idlest and the busiest stage's idle time over their busy time
} StepResult;

// Training step `step` (from 0): the micro-steps' forward and backward passes with the gradient reduction, the
// norm, the outlier and divergence checks, and the update. *bad_steps counts the steps in a row whose loss or
// gradient norm was not finite (those update nothing).
static StepResult train_step(Model* model, const TrainerSettings* s, DataLoader* train_loader, TrainerState* ts,
                             const MultiGpuConfig* mg, AdamWConfig* opt, LearningRateScheduler* scheduler, int step,
                             int grad_accum_steps, int* bad_steps, cudaStream_t stream) {
    StepResult r;
    struct timespec ts0, ts1;
    clock_gettime(CLOCK_MONOTONIC, &ts0);
    model_zero_grad(model, stream);
    if (model->extension.ffn->step_begin) model->extension.ffn->step_begin(model);
    opt->learning_rate = lr_scheduler_get(scheduler, step);
    // Each target's weight in the step's loss: 1/(B*T*micro-steps), the mean of the micro-steps' means. With loss
    // masks, D/(the step's targets that count over the D data-parallel processes; 0 if none), counted before the first
    // micro-step: the gradients' all-reduce averages over the D processes, so loss and gradients are the mean over
    // every target of the step that counts, however the masks share them out. The MoE's balance losses, over every
    // token, keep dlogits_scale's per-token weight.
    const int masked = train_loader->has_masks;
    double target_weight = 0.0;
    if (masked) {
        watchdog_begin("the count of the step's targets", step + 1);
        if (s->overfit_single_batch) dataloader_reset(train_loader);
        uint64_t mine = s->overfit_single_batch ? dataloader_count_targets_ahead(train_loader, 1) * grad_accum_steps
                                                : dataloader_count_targets_ahead(train_loader, grad_accum_steps);
        uint64_t targets = multi_gpu_cpu_count_sum(mine, mg);
        target_weight = targets > 0 ? (double)mg->num_processes / (double)targets : 0.0;
        model->masked_dloss = (float)(model->loss_scaler.scale * target_weight);
    }
    double step_loss = 0.0;
    if (model_pp_stages(model) > 1) {
        watchdog_begin("the pipeline's passes with the gradient reduction", step + 1);
        step_loss = pipeline_micro_steps(model, s, train_loader, step, grad_accum_steps, masked, target_weight, mg,
                                         stream);
        model_early_update(model, opt, step + 1);  // -oo 2
    }
    for (int micro = 0; micro < grad_accum_steps && model_pp_stages(model) == 1; micro++) {
        watchdog_begin("the forward and backward passes with the gradient reduction", step + 1);
        if (s->overfit_single_batch) dataloader_reset(train_loader);
        dataloader_next_batch(train_loader);
        float dlogits_scale = model->loss_scaler.scale / (float)(s->B * s->T * grad_accum_steps);
        model->pass_number = (unsigned int)(step * grad_accum_steps + micro);
        model_forward(model, train_loader->inputs, train_loader->targets, s->B, s->T, dlogits_scale, stream);
        int last_micro_step = micro == grad_accum_steps - 1;
        model_backward(model, s->B, s->T, optimizer_next_seed(&model->rng_state), mg, last_micro_step, s->zero_stage,
                      stream);
        if (last_micro_step) model_early_update(model, opt, step + 1);  // -oo 2: while the device finishes the pass
        float mean_loss = model_mean_loss(model);
        step_loss += masked ? model->loss_sum * target_weight : mean_loss;
        if (model->extension.ffn->micro_step_done) model->extension.ffn->micro_step_done(model);
    }
    r.loss = (float)(masked ? step_loss : step_loss / grad_accum_steps);
    watchdog_begin("the loss all-reduce", step + 1);
    if (mg->num_processes > 1) r.loss = multi_gpu_cpu_float_sum(r.loss, mg) / mg->num_processes;
    if (model_pp_stages(model) > 1) r.loss = pipeline_float_sum(model->pp, r.loss);  // the last stage's
    watchdog_begin("the gradient norm all-reduce", step + 1);
    r.norm = model_gradient_norm(model, mg, s->zero_stage, stream);
    watchdog_end();
    // outliers: a spike in the loss or the gradient norm against the last 128 steps skips the update
    // divergence: a step whose loss or gradient norm is not finite updates nothing; -ns such steps in a row stop
    // the run. In FP16 a non-finite norm is an overflow the loss scale handles, until the scale is down to 1.
    int loss_finite = isfinite(r.loss);
    int norm_bad = !isfinite(r.norm) && (PRECISION_MODE != PRECISION_FP16 || model->loss_scaler.scale <= 1.0f);
    *bad_steps = !loss_finite || norm_bad ? *bad_steps + 1 : 0;
    r.loss_z = update_detector(&ts->loss_outlier, r.loss);
    r.norm_z = isfinite(r.norm) ? update_detector(&ts->norm_outlier, r.norm) : NAN;
    r.loss_spike = s->skip_update_lossz > 0.0f && isfinite(r.loss_z) && r.loss_z > s->skip_update_lossz;
    r.norm_spike = s->skip_update_gradz > 0.0f && isfinite(r.norm_z) && r.norm_z > s->skip_update_gradz;
    watchdog_begin("the optimizer update", step + 1);
    if (!r.loss_spike && !r.norm_spike)
        model_update(model, opt, loss_finite ? r.norm : NAN, step + 1, mg, s->zero_stage, stream);
    else
        model_discard_early_update(model);
    cudaCheck(cudaStreamSynchronize(stream));
    watchdog_end();
    clock_gettime(CLOCK_MONOTONIC, &ts1);
    r.ms = (float)((ts1.tv_sec - ts0.tv_sec) * 1e3 + (ts1.tv_nsec - ts0.tv_nsec) * 1e-6);
    return r;
}

// The step's line (process 0) and log entries.
static void report_step(const Model* model, const TrainerSettings* s, const StepResult* r, const MultiGpuConfig* mg,
                        Logger* logger, const AdamWConfig* opt, float flops_promised, int step, int train_num_batches,
                        int grad_accum_steps, int total_batch_size, int bad_steps) {
    float tokens_per_second = total_batch_size / (r->ms * 1e-3f);
    float mfu = -1.0f;
    if (flops_promised > 0) {
        double achieved = model_flops_per_token(model, s->T) * total_batch_size / (r->ms * 1e-3) / mg->num_processes;
        mfu = (float)(100.0 * achieved / (flops_promised * 1e12));
    }
    if (mg->process_rank == 0) {
        if (r->loss_spike)
            printf("step %d: loss z-score %.1f exceeds -sl %.1f: update skipped\n", step + 1, r->loss_z,
                   s->skip_update_lossz);
        if (r->norm_spike)
            printf("step %d: gradient norm z-score %.1f exceeds -sg %.1f: update skipped\n", step + 1, r->norm_z,
                   s->skip_update_gradz);
        if (bad_steps > 0)
            printf("step %d: loss %f, gradient norm %f: not finite, update skipped (%d of -ns %d in a row)\n",
                   step + 1, r->loss, r->norm, bad_steps, s->divergence_steps);
        else if (!isfinite(r->norm) && PRECISION_MODE == PRECISION_FP16)
            printf("step %d: gradient overflow, update skipped, loss scale now %.0f\n", step + 1,
                   model->loss_scaler.scale);
        char fields[128] = "";  // an extension's, after the loss
        const TelemetryExtension* x = model->extension.telemetry;
        if (x->step_fields) x->step_fields(model, grad_accum_steps, fields, sizeof(fields));
        char idle[128] = "";  // -pp: the stages' measured idle fractions beside the schedule's
        if (model_pp_stages(model) > 1)
            snprintf(idle, sizeof(idle), " | idle %.3f-%.3f (%s %.3f)", r->least_idle, r->most_idle,
                     pipeline_schedule_names[model->pp->schedule],
                     pipeline_formula_idle(model->pp->schedule, model->pp->stages, grad_accum_steps, model->pp->chunks));
        if (mfu >= 0.0f)
            printf("step %d/%d | loss %f%s | norm %f | lr %e | %.2f ms | %.1f%% MFU | %.0f tok/s%s\n", step + 1,
                   train_num_batches, r->loss, fields, r->norm, opt->learning_rate, r->ms, mfu, tokens_per_second, idle);
        else
            printf("step %d/%d | loss %f%s | norm %f | lr %e | %.2f ms | %.0f tok/s%s\n", step + 1, train_num_batches,
                   r->loss, fields, r->norm, opt->learning_rate, r->ms, tokens_per_second, idle);
        fflush(stdout);
    }
    logger_log_train(logger, step + 1, r->loss, r->norm, opt->learning_rate, r->ms, mfu, tokens_per_second);
    if (model->extension.telemetry->log_step) model->extension.telemetry->log_step(model, logger, step + 1, grad_accum_steps);
}

// The trainer's main: train_gpt.cu's for GPT-2 (no extension: NULL), train_moe.cu's with its extension.
static int trainer_main(int argc, char* argv[], const ModelExtension* model_extension_parts) {
    ModelExtension extension = model_extension(model_extension_parts);
    const TrainerExtension* x = extension.trainer;
    // line-buffered even into a pipe or a file: the memory plan and every step line are out before a crash
    setvbuf(stdout, NULL, _IOLBF, 0);
    TrainerSettings s;
    Flag flags[MAX_TRAINER_FLAGS];
    int num_flags = trainer_flags(flags, &s);
    FlagTables tables = {{flags, x->flags}, {num_flags, x->num_flags}, x->flags ? 2 : 1};
    int help = flags_parse(&tables, argc, argv);
    if (help == 1) {
        fprintf(stderr, "Usage:   ./%s [options]\n", x->trainer ? x->trainer : "train_gpt");
        const char* titles[2] = {"Options:", x->flags_title};
        flags_usage(&tables, titles);
        return 0;
    }
    if (help == 2) {  // doc/flags.md (dev/test/test_flags_doc.sh)
        char own[64] = "";
        if (x->trainer) snprintf(own, sizeof(own), "%s only", x->trainer);
        const char* titles[2] = {"every trainer", own};
        flags_markdown(&tables, titles);
        return 0;
    }
    if (!trainer_check_settings(&s, flags, num_flags) || (x->check_flags && !x->check_flags())) return EXIT_FAILURE;

    int device_count = 0;
    cudaError_t device_error = cudaGetDeviceCount(&device_count);
    if (device_error != cudaSuccess || device_count == 0) {
        fprintf(stderr, "no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(device_error));
        return EXIT_FAILURE;
    }
    // -pm plans a layout of -pn processes from one process (or of the processes started)
    int planned_processes = s.plan_gib > 0 && flag_find(flags, num_flags, "-pn")->given ? s.num_processes : 0;
    MultiGpuConfig mg = multi_gpu_config_init(s.init_method, planned_processes ? 1 : s.num_processes, s.process_rank,
                                              s.gpus_per_node, s.server_ip, s.fs_path);
    MultiGpuConfig plan_world = mg;  // the world the plan takes its sizes from
    if (planned_processes) plan_world.num_processes = planned_processes;
    int rank0 = mg.process_rank == 0;
    if (mg.num_processes % (s.pipeline_stages * s.tensor_parallel) != 0 && s.plan_gib == 0) {
        if (rank0) fprintf(stderr, "-pp %d -tp %d: their product must divide the number of processes (%d)\n",
                           s.pipeline_stages, s.tensor_parallel, mg.num_processes);
        return EXIT_FAILURE;
    }
    // the pipeline's stages (the outermost groups), in each the tensor-parallel groups and the data-parallel group that
    // gradients are averaged over (the stage's processes at -tp 1, the world at -pp 1 -tp 1); the memory plan (-pm)
    // takes the layout's sizes only, on any number of processes
    Pipeline pp;
    if (s.plan_gib > 0) pipeline_plan(&pp, &plan_world, s.pipeline_stages);
    else pipeline_init(&pp, &mg, s.pipeline_stages);
    pp.schedule = (PipelineSchedule)pipeline_schedule_number(s.pipeline_schedule);
    pp.chunks = pp.stages > 1 ? s.pipeline_chunks : 1;
    pp.seq_len = s.T;
    pp.trace_path = s.pipeline_trace;
    TensorParallel tp;
    if (s.plan_gib > 0) tensor_parallel_plan(&tp, &pp.stage_world, s.tensor_parallel, s.sequence_parallel);
    else tensor_parallel_init(&tp, &pp.stage_world, s.tensor_parallel, s.sequence_parallel);
    const MultiGpuConfig* dp = &tp.dp;
    if (s.output_dir && rank0) {  // one run at a time, one run per directory, and names it can hold
        lock_output_dir(s.output_dir);
        check_output_names(s.output_dir);
        if (!s.resume) refuse_used_output_dir(s.output_dir);
    }
    watchdog_start(&mg, s.watchdog_s);
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream));
    cublas_setup();
#ifdef ENABLE_CUDNN
    cudnn_attention_setup();
#endif
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, mg.local_device_idx));

    // the model
    Model model;
    model_init_common(&model);
    model.use_master_weights = s.use_master_weights;
    model.offload_optimizer = s.offload_optimizer;
    model.zero_stage = s.zero_stage;
    model.multi_gpu = dp;
    model.tp = &tp;
    model.pp = &pp;
    model.stage_layers_list = s.pipeline_layers;
    model.recompute = s.recompute;
    model.gelu_fusion = s.gelu_fusion;
    model.num_processes = dp->num_processes;
    model.process_rank = dp->process_rank;
    model.extension = extension;
    model.frozen = s.fine_tune[0] != 0;
    if (model.frozen) {
        model.adapter_method = ft_method_number(s.fine_tune);
        model.adapter_rank = s.ft_rank;
        model.adapter_targets = model.adapter_method == FT_METHOD_LORA ? lora_parse_targets(s.ft_targets)
                                : adapter_fixed_targets(model.adapter_method);
    }
    // (an extension's process layout is within a stage; the memory plan's is of its sizes alone)
    if (x->setup) x->setup(&model, &pp.stage_world, s.plan_gib > 0);
    char* resume_model = NULL;
    int resume_step = s.resume ? trainer_resume_step(&s, &mg) : -1;
    char* resume_adapter = NULL;  // a fine-tuning run resumes its adapter from the checkpoint, its model from -e
    if (resume_step >= 0 && model.frozen) {
        resume_adapter = checkpoint_path(s.output_dir, "adapter", resume_step, -1);
    } else if (resume_step >= 0) {
        resume_model = checkpoint_path(s.output_dir, "model", resume_step, -1);
        s.model_source = resume_model;
    }
    int from_file = file_exists(s.model_source);
    if (s.plan_gib > 0) {  // the plan from the descriptor's shape alone: nothing is allocated
        if (from_file || s.model_source[0] != 'd') {
            fprintf(stderr, "-pm %d: needs a descriptor (-e dN), not a model file\n", s.plan_gib);
            return EXIT_FAILURE;
        }
        ModelConfig arch = trainer_descriptor_arch(&s);
        model_build_from_descriptor(&model, s.model_source, s.descriptor_vocab, s.descriptor_maxT, s.descriptor_seed,
                                   &arch, 0);
        if (!model_set_attention(&model, s.flash_attention, s.model_source)) return EXIT_FAILURE;
        if (!model_check_tensor_parallel(&model, s.T, s.model_source)) return EXIT_FAILURE;
        if (!adapter_set_layers(&model, s.ft_layers)) return EXIT_FAILURE;
        model_cut_stages(&model);
        // the micro-batches the stages' activations are planned for: -d's, at the layout's data-parallel processes
        int plan_tokens = s.B * s.T * dp->num_processes;
        pp.micro_batches = s.total_batch_size > plan_tokens ? s.total_batch_size / plan_tokens : 1;
        print_memory_plan(&model, &s, &plan_world);
        multi_gpu_config_free(&mg);
        return EXIT_SUCCESS;
    }
    if (model.frozen && !from_file) {
        fprintf(stderr, "-ft %s: fine-tunes a model file (-e FILE); %s is none\n", s.fine_tune, s.model_source);
        return EXIT_FAILURE;
    }
    if (from_file) model_build_from_checkpoint(&model, s.model_source);
    else if (s.model_source[0] == 'd' && isdigit((unsigned char)s.model_source[1])) {
        ModelConfig arch = trainer_descriptor_arch(&s);
        model_build_from_descriptor(&model, s.model_source, s.descriptor_vocab, s.descriptor_maxT, s.descriptor_seed,
                                   &arch);
    } else {
        fprintf(stderr, "-e %s: no such model file (and not a descriptor such as d12)\n", s.model_source);
        return EXIT_FAILURE;
    }
    if (from_file && !trainer_check_arch_of_file(&s, flags, num_flags, &model)) return EXIT_FAILURE;
    if (model.frozen && s.ft_merged && !lora_can_merge(&model)) {
        fprintf(stderr, "-fm %s: %s ties its output embedding to wte, which the inputs read too: an adapter on lm_head "
                "has no merged form (-fw without lm_head, or an untied llama model)\n", s.ft_merged, s.model_source);
        return EXIT_FAILURE;
    }
    unsigned mlp_targets = (1u << LORA_FC) | (1u << LORA_FC_PROJ);
    if (model.frozen && model.adapter_method == FT_METHOD_LORA && (model.adapter_targets & mlp_targets) &&
        model_dense_layers(&model) == 0) {
        fprintf(stderr, "-fw %s: %s has no dense MLP for fc or fc_proj (every layer's FFN is an MoE layer)\n",
                s.ft_targets, s.model_source);
        return EXIT_FAILURE;
    }
    if (model.frozen && model.adapter_method == FT_METHOD_LORA && (model.adapter_targets & LORA_EXPERTS_TARGETS) &&
        lora_target_layers(&model, LORA_EXPERTS_FC) == 0) {
        fprintf(stderr, "-fw %s: %s has no experts (the experts targets are an MoE model's)\n", s.ft_targets,
                s.model_source);
        return EXIT_FAILURE;
    }
    if (x->check_model) x->check_model(&model, s.model_source, from_file);
    if (!model_set_attention(&model, s.flash_attention, s.model_source)) return EXIT_FAILURE;
    if (!adapter_set_layers(&model, s.ft_layers)) return EXIT_FAILURE;
    if (model.frozen && shared_keys_on(&model) && model.attention != ATTENTION_FLASH) {
        fprintf(stderr, "-ft %s: its shared keys join flash attention (-fa 1); the %s path takes none\n", s.fine_tune,
                model_attention_name(&model));
        return EXIT_FAILURE;
    }
    if (!model_check_tensor_parallel(&model, s.T, s.model_source)) return EXIT_FAILURE;
    const ModelConfig* cfg = &model.config;
    if (s.T > cfg->max_seq_len) {
        fprintf(stderr, "-t %d: longer than the model's maximum sequence length %d\n", s.T, cfg->max_seq_len);
        return EXIT_FAILURE;
    }
    int extra = model_adapter_sequence_extra(&model);  // prompt tuning's virtual tokens
    if (s.T + extra > cfg->max_seq_len) {
        fprintf(stderr, "-ft prompt -fr %d: %d virtual tokens and -t %d exceed the model's maximum sequence length %d\n",
                extra, extra, s.T, cfg->max_seq_len);
        return EXIT_FAILURE;
    }
    // the processes of a tensor-parallel group share a batch: the data-parallel ones take distinct batches
    int tokens_per_micro_step = s.B * s.T * dp->num_processes;
    int total_batch_size = s.total_batch_size < 0 ? tokens_per_micro_step : s.total_batch_size;
    if (total_batch_size % tokens_per_micro_step != 0) {
        fprintf(stderr, "-d %d: must be a multiple of B*T*(data-parallel processes) = %d\n", total_batch_size,
                tokens_per_micro_step);
        return EXIT_FAILURE;
    }
    int grad_accum_steps = total_batch_size / tokens_per_micro_step;
    // a sample is one forward pass over at most T positions: the first is the seed token, so T-1 are generated
    if (s.sample_every > 0 && s.gen_tokens > s.T - 1) {
        if (rank0) printf("-g %d: more than the sequence length -t %d allows; samples will have %d tokens\n",
                          s.gen_tokens, s.T, s.T - 1);
        s.gen_tokens = s.T - 1;
    }
    pp.micro_batches = grad_accum_steps;  // (the plan counts the activation slots of the schedule over them)
    if (!check_training_memory(&model, &s)) return EXIT_FAILURE;

    // data
    DataLoader train_loader, val_loader;
    dataloader_init(&train_loader, s.train_pattern, s.B, s.T, dp->process_rank, dp->num_processes,
                    !s.overfit_single_batch, 1337);
    int run_val = s.val_every > 0 && s.val_max_steps > 0 && strlen(s.val_pattern) > 0;
    if (run_val) dataloader_init(&val_loader, s.val_pattern, s.B, s.T, dp->process_rank, dp->num_processes, 0, 0);
    dataloader_set_vocab_size(&train_loader, cfg->vocab_size);
    if (run_val) dataloader_set_vocab_size(&val_loader, cfg->vocab_size);
    int train_num_batches =
        s.max_steps > 0 ? s.max_steps : (int)(dataloader_num_tokens(&train_loader) / total_batch_size);
    if (train_num_batches < 1) train_num_batches = 1;
    Tokenizer tokenizer;
    tokenizer_init(&tokenizer, s.tokenizer_path);
    // A tokenizer with more tokens than the model is not the model's: its EOT (the seed of every sample) may be no
    // token of the model at all, so it is not used. One with fewer decodes what it knows.
    if (tokenizer.init_ok && tokenizer.vocab_size > (uint32_t)cfg->vocab_size) {
        if (rank0) printf("note: tokenizer %s has %u tokens, more than the model's V = %d: not used, samples print token "
                          "ids\n", s.tokenizer_path, tokenizer.vocab_size, cfg->vocab_size);
        tokenizer_free(&tokenizer);
    } else if (tokenizer.init_ok && tokenizer.vocab_size != (uint32_t)cfg->vocab_size && rank0) {
        printf("note: tokenizer %s has %u tokens, the model %d: tokens it lacks print as <id>\n", s.tokenizer_path,
               tokenizer.vocab_size, cfg->vocab_size);
    }
    // Samples start from the end-of-text token: the tokenizer's, else the one the project's two vocabularies put last
    // (GPT-2's 50257 tokens, the byte level's 257), else token 0; never an id the model does not have.
    int sample_seed_token = 0;
    if (tokenizer.init_ok) sample_seed_token = tokenizer.eot_token;
    else if (cfg->vocab_size == 50257 || cfg->vocab_size == 257) sample_seed_token = cfg->vocab_size - 1;
    if (!tokenizer.init_ok && rank0 && s.sample_every > 0)
        printf("note: no tokenizer: samples start from token %d and print token ids\n", sample_seed_token);

    if (pp.schedule == SCHEDULE_INTERLEAVED && pp.stages > 1 && grad_accum_steps % pp.stages != 0) {
        // (every process says it: one that exits first may end the job before process 0 has)
        fprintf(stderr, "-pps interleaved: %d micro-batches per step (-d %d), not a multiple of the %d stages: the "
                "chunks pass the micro-batches round in groups of p\n", grad_accum_steps, total_batch_size, pp.stages);
        return EXIT_FAILURE;
    }
    if (pp.schedule == SCHEDULE_ZB && pp.stages > 1 && grad_accum_steps < pp.stages) {
        // (every process says it: one that exits first may end the job before process 0 has)
        fprintf(stderr, "-pps zb: %d micro-batches per step (-d %d), fewer than the %d stages: ZB-H1 fills the bubbles "
                "with p or more micro-batches\n", grad_accum_steps, total_batch_size, pp.stages);
        return EXIT_FAILURE;
    }
    if (pp.stages > 1) {  // the schedule's passes, and a slot for each micro-batch it holds at once
        pipeline_prepare(&pp, grad_accum_steps);
        model_allocate_slots(&model, s.B, s.T + extra, pp.slots);
    } else {
        model_allocate_activations(&model, s.B, s.T + extra);
    }
    if (model.frozen) {  // the adapter, tied to the model file by its checksum
        model.adapter = adapter_allocate(&model, s.ft_alpha, s.B, s.T + extra);
        if (!checkpoint_checksum(s.model_source, &model.adapter->base_size, &model.adapter->base_hash)) {
            fprintf(stderr, "-e %s: cannot read the model file back for its checksum\n", s.model_source);
            return EXIT_FAILURE;
        }
        if (resume_adapter) adapter_read_file(&model, resume_adapter);
        else if (s.ft_adapter) adapter_read_file(&model, s.ft_adapter);
        else adapter_init(&model, (unsigned int)s.descriptor_seed);
    }
    model_allocate_optimizer(&model, s.zero_stage);
    if (resume_adapter) adapter_read_optimizer_state(&model, resume_adapter);
    print_startup_table(&model, &s, &prop, &mg, grad_accum_steps);

    TrainerState ts;
    memset(&ts, 0, sizeof(ts));
    ts.loss_scale = model.loss_scaler.scale;
    ts.rng_state = model.rng_state;
    ts.sample_rng_state = 1337ull;
    init_detector(&ts.loss_outlier);
    init_detector(&ts.norm_outlier);
    int start_step = 0;
    int bad_steps = 0;  // steps in a row whose loss or gradient norm was not finite
    if (resume_step >= 0) {
        read_checkpoint_state(s.output_dir, resume_step, &model, &train_loader, &ts, &mg);
        model.rng_state = ts.rng_state;
        model.loss_scaler.scale = ts.loss_scale;
        model.loss_scaler.good_steps = ts.good_steps;
        start_step = ts.step;
        if (rank0) printf("resumed from step %d of %s\n", start_step, s.output_dir);
    }
    if (s.output_dir) create_dir_if_not_exists(s.output_dir);
    Logger logger;
    logger_init(&logger, s.output_dir, mg.process_rank, resume_step >= 0);
    if (resume_step >= 0)
        logger_resume(&logger, start_step,
                      run_val && (start_step % s.val_every == 0 || start_step == train_num_batches));
    LearningRateScheduler scheduler;
    lr_scheduler_init(&scheduler, s.lr_scheduler_type, s.learning_rate, s.warmup_iterations, train_num_batches,
                      s.final_lr_frac);
    AdamWConfig opt = {s.learning_rate, 0.9f, 0.95f, 1e-8f, s.weight_decay, s.grad_clip > 0.0f ? s.grad_clip : INFINITY};
    float flops_promised = get_flops_promised(prop.name, PRECISION_MODE);
    // with an extension whose forward pass is collective, or under ZeRO-3 (whose forward pass gathers parameters),
    // every process samples (the same tokens)
    const FfnExtension* ffn = model.extension.ffn;
    int samples = rank0 || (ffn->collective_forward && ffn->collective_forward(&model)) || s.zero_stage == 3 ||
                  tp.degree > 1;
    if (pp.stages > 1 && s.sample_every > 0) {  // generation runs one model's layers, not a pipeline's stages
        if (rank0) printf("note: -pp %d: no samples (sampling runs on one process's whole model: -pp 1)\n", pp.stages);
        samples = 0;
    }

    int checkpoints_written = 0;
    preemption_install();
    for (int step = start_step; step <= train_num_batches; step++) {
        int last_step = step == train_num_batches;
        // pre-emption (llmc/preemption.h): at this step boundary every process agrees whether any was signalled
        int signal_number = step > start_step ? preemption_agreed(&mg) : 0;
        if (signal_number) {
            int written = checkpoint_if_due(&model, &s, &train_loader, &ts, &mg, step, start_step, last_step, 1,
                                            bad_steps, stream);
            if (rank0)
                printf("step %d: %s received: %s; exiting with status %d\n", step,
                       signal_number == SIGTERM ? "SIGTERM" : "SIGUSR1",
                       written ? "checkpoint written" : !s.output_dir ? "no -o, nothing saved" : "nothing saved",
                       128 + signal_number);
            fflush(stdout);
            exit(128 + signal_number);
        }
        if (run_val && (step % s.val_every == 0 || last_step)) evaluate(&model, &val_loader, &s, dp, rank0, &logger, step, stream);
        if (samples && s.sample_every > 0 && (step % s.sample_every == 0 || last_step) && s.gen_tokens > 0) {
            watchdog_begin("sampling", step);
            sample_and_print(&model, &tokenizer, sample_seed_token, s.gen_tokens, &ts.sample_rng_state, rank0, stream);
            watchdog_end();
        }
        checkpoints_written += checkpoint_if_due(&model, &s, &train_loader, &ts, &mg, step, start_step, last_step, 0,
                                                 bad_steps, stream);
        if (last_step) break;

        test_hook_stop(step + 1, mg.process_rank);
        StepResult r = train_step(&model, &s, &train_loader, &ts, dp, &opt, &scheduler, step, grad_accum_steps,
                                  &bad_steps, stream);
        if (pp.stages > 1) pipeline_report(&pp, &mg, step + 1, step == start_step, &r.most_idle, &r.least_idle);
        report_step(&model, &s, &r, &mg, &logger, &opt, flops_promised, step, train_num_batches, grad_accum_steps,
                    total_batch_size, bad_steps);
        if (bad_steps >= s.divergence_steps) {
            // every process saw the same loss and norm (both reduced over all of them): all stop here
            if (rank0) {
                int latest = s.output_dir ? find_latest_checkpoint(s.output_dir) : -1;
                fprintf(stderr, "step %d: training diverged: the loss or the gradient norm was not finite for %d steps "
                        "in a row (-ns %d); ", step + 1, bad_steps, s.divergence_steps);
                if (latest >= 0) fprintf(stderr, "the last checkpoint is step %d in %s\n", latest, s.output_dir);
                else fprintf(stderr, "no checkpoint to resume from\n");
            }
            fflush(stdout);
            exit(EXIT_FAILURE);
        }
    }

    if (s.ft_merged) {  // collective under ZeRO-3 (the model's parameters are gathered)
        model_write_merged_model_file(&model, s.ft_merged, stream);
        if (rank0) printf("wrote %s: the model with the adapter merged into it\n", s.ft_merged);
    }
    if (rank0 && s.offload_optimizer == 2 && train_num_batches > start_step)
        printf("-oo 2: the early update was kept in %d of %d steps (a step that clips makes it again)\n",
               (model.adapter ? model.adapter->store : model.store).early_adopted, train_num_batches - start_step);
    // a run that was to keep checkpoints and kept none has lost its training: not a success
    int exit_status = EXIT_SUCCESS;
    if (s.output_dir && s.checkpoint_every > 0 && train_num_batches > start_step && checkpoints_written == 0) {
        if (rank0)
            fprintf(stderr, "-o %s -n %d: no checkpoint was written (each one due followed a non-finite loss or "
                    "gradient norm, or found parameters that are not finite)\n", s.output_dir, s.checkpoint_every);
        exit_status = EXIT_FAILURE;
    }
    logger_free(&logger);
    free(resume_model);
    free(resume_adapter);
    tokenizer_free(&tokenizer);
    dataloader_free(&train_loader);
    if (run_val) dataloader_free(&val_loader);
    model_free(&model);
#ifdef ENABLE_CUDNN
    cudnn_attention_teardown();
#endif
    cublas_teardown();
    cudaCheck(cudaStreamDestroy(stream));
    tensor_parallel_free(&tp);
    pipeline_free(&pp);
    multi_gpu_config_free(&mg);
    return exit_status;
}

#ifndef OMIT_TRAIN_GPT_MAIN
int main(int argc, char* argv[]) { return trainer_main(argc, argv, NULL); }
#endif
