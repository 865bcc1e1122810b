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
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/file.h>
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
#include "llmc/expert_matmul.cuh"
#include "llmc/router_matmul.cuh"
#include "llmc/attention.cuh"  // the hand-written path, and the size check of attention and matmul
#ifdef ENABLE_CUDNN
#include "llmc/cudnn_att.cuh"  // GPU only: cuDNN's fused attention (make USE_CUDNN=1)
#endif
#include "llmc/gelu.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/adamw.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/copy_cast.cuh"
#include "llmc/moe.cuh"
#include "llmc/moe_noise.cuh"
#include "llmc/multi_gpu.cuh"
#include "llmc/expert_parallel.cuh"
#include "llmc/optimizer.cuh"
#include "llmc/checkpoint.h"
#include "llmc/cli.h"

// ----------------------------------------------------------------------------------------------------
// Model description and parameters

#define GPT2_MODEL_MAGIC 20240326
#define MOE_MODEL_MAGIC 20261129
#define GPT2_STATE_MAGIC 20240527
#define NUM_PARAMETER_TENSORS 22

// The model: GPT-2, where with num_experts > 0 (train_moe.cu) layer l's MLP is a Switch-MoE layer iff
// (l + 1) % moe_every == 0 (doc/moe.md). num_experts == 0 is the dense GPT-2 of train_gpt.cu.
typedef struct {
    int max_seq_len;        // maxT
    int vocab_size;         // V
    int padded_vocab_size;  // Vp, V rounded up to a multiple of 128
    int num_layers;         // L
    int num_heads;          // NH
    int channels;           // C
    int num_experts;        // E (0: dense)
    int top_k;              // k
    int moe_every;          // MoE every N layers
    int expert_hidden;      // H
    int noisy_gating;       // noisy top-k gating: the MoE layers have routernw (doc/moe.md, "Router noise")
} GPT2Config;

static int is_moe_layer(const GPT2Config* c, int l) { return c->num_experts > 0 && (l + 1) % c->moe_every == 0; }
static int num_moe_layers(const GPT2Config* c) { return c->num_experts > 0 ? c->num_layers / c->moe_every : 0; }
// index of layer l among the dense layers, or among the MoE layers
static int dense_index(const GPT2Config* c, int l) { return l - (c->num_experts > 0 ? (l + 1) / c->moe_every : 0); }
static int moe_index(const GPT2Config* c, int l) { return (l + 1) / c->moe_every - 1; }

// The MoE hyperparameters that are not part of the model file.
typedef struct {
    double capacity_factor;       // in training (<= 0: dropless)
    double capacity_factor_eval;  // in evaluation
    float aux_alpha;              // load-balancing loss coefficient
    float z_coef;                 // router z-loss coefficient
    float jitter;                 // router jitter EPS (0: off)
    float importance_coef;        // noisy gating's importance and load loss coefficients
    float load_coef;
} MoESettings;

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
    floatX* fcw;       // (Ld, 4C, C), Ld = the dense layers
    floatX* fcb;       // (Ld, 4C)
    floatX* fcprojw;   // (Ld, C, 4C)
    floatX* fcprojb;   // (Ld, C)
    floatX* routerw;   // (Lm, E, C), Lm = the MoE layers
    floatX* routernw;  // (Lm, E, C) noisy gating's noise weights (noisy_gating only)
    floatX* efcw;      // (Lm, E, H, C) the experts' fc
    floatX* efcb;      // (Lm, E, H)
    floatX* efcprojw;  // (Lm, E, C, H)
    floatX* efcprojb;  // (Lm, E, C)
    floatX* lnfw;      // (C)
    floatX* lnfb;      // (C)
} ParameterTensors;

// the tensors' indices in model-file order (parameter_names)
enum {
    PARAM_WTE, PARAM_WPE, PARAM_LN1W, PARAM_LN1B, PARAM_QKVW, PARAM_QKVB, PARAM_ATTPROJW, PARAM_ATTPROJB, PARAM_LN2W,
    PARAM_LN2B, PARAM_FCW, PARAM_FCB, PARAM_FCPROJW, PARAM_FCPROJB, PARAM_ROUTERW, PARAM_ROUTERNW, PARAM_EFCW,
    PARAM_EFCB, PARAM_EFCPROJW, PARAM_EFCPROJB, PARAM_LNFW, PARAM_LNFB
};
static const char* parameter_names[NUM_PARAMETER_TENSORS] = {
    "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "routerw", "routernw", "efcw", "efcb", "efcprojw", "efcprojb",
    "lnfw", "lnfb"};
// weight decay applies to the matrices only (the embeddings and the four Linear weights)
static const int parameter_decays[NUM_PARAMETER_TENSORS] = {1, 1, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 1, 0,
                                                             1, 1, 1, 0, 1, 0, 0, 0};
// The experts' tensors (efcw .. efcprojb): each process keeps those of its own experts (llmc/expert_parallel.cuh)
// in a second parameter set, reduced and sharded over the processes holding the same experts.
#define FIRST_EXPERT_TENSOR PARAM_EFCW
#define NUM_EXPERT_TENSORS 4
static int is_expert_tensor(int i) { return i >= FIRST_EXPERT_TENSOR && i < FIRST_EXPERT_TENSOR + NUM_EXPERT_TENSORS; }

// sizes in model-file order with E experts per MoE layer: the file's (all experts) or a process's (its own)
static void fill_in_parameter_sizes(size_t* sizes, const GPT2Config* cfg, int experts) {
    size_t Vp = cfg->padded_vocab_size, C = cfg->channels, maxT = cfg->max_seq_len, L = cfg->num_layers;
    size_t Lm = num_moe_layers(cfg), Ld = L - Lm, E = experts, H = cfg->expert_hidden;
    sizes[PARAM_WTE] = Vp * C;
    sizes[PARAM_WPE] = maxT * C;
    sizes[PARAM_LN1W] = L * C;
    sizes[PARAM_LN1B] = L * C;
    sizes[PARAM_QKVW] = L * 3 * C * C;
    sizes[PARAM_QKVB] = L * 3 * C;
    sizes[PARAM_ATTPROJW] = L * C * C;
    sizes[PARAM_ATTPROJB] = L * C;
    sizes[PARAM_LN2W] = L * C;
    sizes[PARAM_LN2B] = L * C;
    sizes[PARAM_FCW] = Ld * 4 * C * C;
    sizes[PARAM_FCB] = Ld * 4 * C;
    sizes[PARAM_FCPROJW] = Ld * C * 4 * C;
    sizes[PARAM_FCPROJB] = Ld * C;
    sizes[PARAM_ROUTERW] = Lm * cfg->num_experts * C;  // the router scores every expert on every process
    sizes[PARAM_ROUTERNW] = cfg->noisy_gating ? Lm * cfg->num_experts * C : 0;
    sizes[PARAM_EFCW] = Lm * E * H * C;
    sizes[PARAM_EFCB] = Lm * E * H;
    sizes[PARAM_EFCPROJW] = Lm * E * C * H;
    sizes[PARAM_EFCPROJB] = Lm * E * C;
    sizes[PARAM_LNFW] = C;
    sizes[PARAM_LNFB] = C;
}

// the expert tensors point into expert_memory (in order), the others into memory (in order)
static void point_parameters(ParameterTensors* p, floatX* memory, floatX* expert_memory, const size_t* sizes) {
    floatX** ptrs[NUM_PARAMETER_TENSORS] = {&p->wte, &p->wpe, &p->ln1w, &p->ln1b, &p->qkvw, &p->qkvb,
                                            &p->attprojw, &p->attprojb, &p->ln2w, &p->ln2b, &p->fcw, &p->fcb,
                                            &p->fcprojw, &p->fcprojb, &p->routerw, &p->routernw, &p->efcw,
                                            &p->efcb, &p->efcprojw, &p->efcprojb, &p->lnfw, &p->lnfb};
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        floatX** next = is_expert_tensor(i) ? &expert_memory : &memory;
        *ptrs[i] = *next;
        *next += sizes[i];
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
    floatX* fch;        // (Ld, B, T, 4C) pre-GELU, dense layers only
    floatX* fch_gelu;   // (Ld or 1, B, T, 4C)
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
    // MoE layers (N = B*T tokens), kept per MoE layer for the backward pass. Rsrc = the rows of this process's
    // dispatch layout, Rown = those of its experts' layout (llmc/expert_parallel.cuh; the same with one process
    // per expert group): E*cap each when padded to a capacity, N*k and up to ep.degree*N*k when packed (dropless)
    float* router_logits;  // (Lm, N, E) the logits routing uses (H, with noisy gating)
    float* router_clean;   // (Lm, N, E) noisy gating: the clean logits
    float* router_noise;   // (Lm, N, E) noisy gating: the noise logits (softplus of them: the noise's std)
    float* router_probs;   // (Lm, N, E)
    float* router_lse;     // (Lm, N) logsumexp, for the z-loss
    int* expert_index;     // (Lm, N, k)
    float* gates;          // (Lm, N, k)
    int* choice_row;       // (Lm, N, k) row in the dispatch layout, -1 dropped
    int* row_choice;       // (Lm, Rsrc) the choice filling each row, -1 padding
    int* expert_count;     // (Lm, E) choices routed to each expert before dropping
    int* kept_count;       // (Lm, E) rows used
    float* moe_stats;      // (Lm, 4 + 2E) the load-balancing, z, importance and load losses; Importance, Load (E)
    floatX* expert_input;  // (Lm, Rown, C)
    floatX* expert_pre;    // (Lm, Rown, H) pre-GELU
    floatX* expert_act;    // (Lm or 1, Rown, H) GELU output (recomputed with -r >= 1)
    floatX* expert_output; // (Lm, Rsrc, C) back in the dispatch layout
    // MoE backward scratch (one layer)
    float* d_gates;        // (N, k)
    float* d_logits;       // (N, E) of the routing's logits, then (noisy gating) of the clean ones
    float* d_noise;        // (N, E) noisy gating: of the noise logits
    floatX* d_logits_x;    // (N, E)
    float* noise_partials; // noisy gating's loss scratch (moe_noisy_losses_partials_size)
    floatX* router_input;  // (2, N, C) with jitter: the router's jittered input and its gradient
    floatX* moe_scratch_own;  // (Rown, C) the expert output, then the gradients of the experts' output and input
    floatX* d_expert_hidden;  // (Rown, H)
    floatX* moe_scratch_src;  // (Rsrc, C) the same in the dispatch layout, with expert parallelism only
} ActivationTensors;

typedef struct {
    GPT2Config config;
    ParameterTensors params;  // pointers into store.params_memory and expert_store.params_memory
    ParameterTensors grads;   // the same into the grads_memory
    // the flat parameter, gradient and optimizer buffers (llmc/optimizer.cuh): every tensor but the experts',
    // replicated over all processes; and this process's experts (MoE models), replicated over ep.replicas
    ShardedParameters store;
    ShardedParameters expert_store;
    ExpertParallel ep;        // which process holds which experts (degree 1: every process all of them)
    int num_processes;        // data-parallel processes (the ZeRO shards of `store`)
    int process_rank;
    int local_experts;        // experts per MoE layer on this process: E / ep.degree
    LossScaler loss_scaler;   // FP16 loss scaling
    unsigned long long rng_state;  // host generator of stochastic-rounding seeds (identical on every process)
    MoESettings moe;
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
    float mean_loss;    // the language-model cross-entropy of the last forward pass with targets
    // MoE: of the last forward pass
    int moe_capacity_used;          // rows per expert
    int moe_dropless;               // dropless routing (-cf 0): the expert buffers packed (else padded to capacity)
    int* moe_rows_src;              // (Lm, E) host: rows per global expert in this process's dispatch layout
    int* moe_rows_own;              // (Lm, E) host: rows per (group member, local expert) in the expert layout
    float aux_loss, z_loss;         // summed over MoE layers
    float importance_loss, load_loss;  // noisy gating's, summed over MoE layers
    int moe_training;               // the last forward pass was a training one (jitter and noise on)
    unsigned int noise_pass;        // the router noise's pass number (doc/moe.md, "Router noise" 4), set by the caller
    float drop_fraction;            // dropped choices / all choices, over MoE layers
    float load_min, load_max, load_cv;  // expert loads (choices before dropping / mean), over MoE layers
    float aux_grad_scale;           // scale of the aux and z gradients (the loss-scale / micro-steps)
    int* expert_counts_cpu;         // (Lm, E) host
    int* kept_counts_cpu;           // (Lm, E) host
    float* moe_losses_cpu;          // (Lm, 4) host: aux, z, importance, load of each MoE layer
} GPT2;

// ----------------------------------------------------------------------------------------------------
// Building the model: from a file or a descriptor

// Before building a model the caller sets num_processes, process_rank and ep (the run's process layout).
static void gpt2_allocate_parameters(GPT2* model) {
    const GPT2Config* c = &model->config;
    if (c->num_experts > 0 && c->num_experts % model->ep.degree != 0) {
        fprintf(stderr, "-ep %d: the %d experts per MoE layer must divide evenly over the expert-parallel degree\n",
                model->ep.degree, c->num_experts);
        exit(EXIT_FAILURE);
    }
    model->local_experts = c->num_experts / model->ep.degree;
    size_t sizes[NUM_PARAMETER_TENSORS], replicated[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(sizes, c, model->local_experts);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) replicated[i] = is_expert_tensor(i) ? 0 : sizes[i];
    sharded_parameters_allocate(&model->store, NUM_PARAMETER_TENSORS, replicated, parameter_decays,
                                model->num_processes);
    floatX* expert_params = nullptr;
    floatX* expert_grads = nullptr;
    if (c->num_experts > 0) {
        sharded_parameters_allocate(&model->expert_store, NUM_EXPERT_TENSORS, sizes + FIRST_EXPERT_TENSOR,
                                    parameter_decays + FIRST_EXPERT_TENSOR, model->ep.replicas.num_processes);
        // an owner's expert gradient sums its group's ep.degree micro-batches, which the replicas then average:
        // the step's gradient (the mean over all processes) is that over ep.degree
        model->expert_store.grad_multiplier = 1.0f / (float)model->ep.degree;
        expert_params = model->expert_store.params_memory;
        expert_grads = model->expert_store.grads_memory;
    }
    point_parameters(&model->params, model->store.params_memory, expert_params, sizes);
    point_parameters(&model->grads, model->store.grads_memory, expert_grads, sizes);
}

// parameters in the model file (every expert)
static size_t gpt2_num_parameters(const GPT2Config* c) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    fill_in_parameter_sizes(sizes, c, c->num_experts);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    return n;
}

// The whole model's parameters in model-file order (host, every expert) -> this process's tensors on the device.
static void gpt2_set_parameters(GPT2* model, const floatX* file_order) {
    const GPT2Config* c = &model->config;
    size_t global[NUM_PARAMETER_TENSORS], local[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(global, c, c->num_experts);
    fill_in_parameter_sizes(local, c, model->local_experts);
    int Lm = num_moe_layers(c), first_expert = model->ep.member * model->local_experts;
    floatX* replicated = (floatX*)malloc_check(model->store.num_parameters * sizeof(floatX) + 1);
    floatX* experts = (floatX*)malloc_check(model->expert_store.num_parameters * sizeof(floatX) + 1);
    size_t from = 0, to_replicated = 0, to_experts = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        if (!is_expert_tensor(i)) {
            memcpy(replicated + to_replicated, file_order + from, global[i] * sizeof(floatX));
            to_replicated += global[i];
        } else if (Lm > 0) {
            // per MoE layer, this process's experts are a contiguous run of the layer's E
            size_t per_expert = global[i] / Lm / c->num_experts, run = local[i] / Lm;
            for (int m = 0; m < Lm; m++) {
                memcpy(experts + to_experts, file_order + from + global[i] / Lm * m + first_expert * per_expert,
                       run * sizeof(floatX));
                to_experts += run;
            }
        }
        from += global[i];
    }
    cudaCheck(cudaMemcpy(model->store.params_memory, replicated, model->store.num_parameters * sizeof(floatX),
                         cudaMemcpyHostToDevice));
    if (c->num_experts > 0) {
        cudaCheck(cudaMemcpy(model->expert_store.params_memory, experts,
                             model->expert_store.num_parameters * sizeof(floatX), cudaMemcpyHostToDevice));
    }
    free(replicated);
    free(experts);
}

// The experts of every process of the group, in the global layout of the model file's expert tensors (efcw ..
// efcprojb, each (Lm, E, ...)), from this process's `local` (device, laid out as expert_store, elem bytes per
// value: parameters, gradients or optimizer state) into `host`. Collective over the expert group.
static void gpt2_gather_experts(const GPT2* model, void* host, const void* local, size_t elem, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    int Lm = num_moe_layers(c), N = model->ep.degree;
    size_t sizes[NUM_PARAMETER_TENSORS], largest = 0;
    fill_in_parameter_sizes(sizes, c, model->local_experts);
    for (int i = FIRST_EXPERT_TENSOR; i < FIRST_EXPERT_TENSOR + NUM_EXPERT_TENSORS; i++)
        largest = sizes[i] / Lm > largest ? sizes[i] / Lm : largest;
    char* gathered;
    cudaCheck(cudaMalloc((void**)&gathered, N * largest * elem));
    const char* from = (const char*)local;
    char* to = (char*)host;
    for (int i = FIRST_EXPERT_TENSOR; i < FIRST_EXPERT_TENSOR + NUM_EXPERT_TENSORS; i++) {
        size_t layer_bytes = sizes[i] / Lm * elem;  // this process's experts of one layer
        for (int m = 0; m < Lm; m++) {
            // members in order hold consecutive experts: the gathered runs are the layer's E experts in order
            expert_parallel_allgather(&model->ep, gathered, from + m * layer_bytes, layer_bytes, stream);
            cudaCheck(cudaMemcpy(to + m * N * layer_bytes, gathered, N * layer_bytes, cudaMemcpyDeviceToHost));
        }
        from += sizes[i] * elem;
        to += Lm * N * layer_bytes;
    }
    cudaCheck(cudaFree(gathered));
}

// The inverse of gpt2_set_parameters, collective over the expert group: the whole model in model-file order, from
// replicated (the store's tensors) and experts_local (the expert_store's): the parameters (gpt2_get_parameters) or
// their gradients as stored (gpt2_get_gradients: the experts' times expert_store.grad_multiplier once reduced are
// the step's; see gpt2_allocate_parameters).
static void gpt2_get_tensors(const GPT2* model, floatX* file_order, const floatX* replicated,
                             const floatX* experts_local, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    size_t global[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(global, c, c->num_experts);
    size_t before_experts = 0, experts = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        if (i < FIRST_EXPERT_TENSOR) before_experts += global[i];
        if (is_expert_tensor(i)) experts += global[i];
    }
    // the replicated tensors are the file's with the expert block cut out
    cudaCheck(cudaMemcpy(file_order, replicated, before_experts * sizeof(floatX), cudaMemcpyDeviceToHost));
    cudaCheck(cudaMemcpy(file_order + before_experts + experts, replicated + before_experts,
                         (model->store.num_parameters - before_experts) * sizeof(floatX), cudaMemcpyDeviceToHost));
    if (c->num_experts > 0)
        gpt2_gather_experts(model, file_order + before_experts, experts_local, sizeof(floatX), stream);
}
static void gpt2_get_parameters(const GPT2* model, floatX* file_order, cudaStream_t stream) {
    gpt2_get_tensors(model, file_order, model->store.params_memory, model->expert_store.params_memory, stream);
}
static void gpt2_get_gradients(const GPT2* model, floatX* file_order, cudaStream_t stream) {
    gpt2_get_tensors(model, file_order, model->store.grads_memory, model->expert_store.grads_memory, stream);
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
    // each kernel header's own size check
    if (!encoder_support(c->channels, why, sizeof(why)) || !layernorm_support(c->channels, why, sizeof(why)) ||
        !fused_classifier_support(c->vocab_size, c->padded_vocab_size, why, sizeof(why)) ||
        !attention_support(c->channels, c->num_heads, why, sizeof(why)) || !matmul_support(c->channels, why, sizeof(why))) {
        fprintf(stderr, "%s: unsupported model size: %s\n", source, why);
        exit(EXIT_FAILURE);
    }
    if (c->num_experts > 0) {
        if (c->moe_every < 1 || c->moe_every > c->num_layers) {
            fprintf(stderr, "%s: MoE every %d layers: expected 1..%d\n", source, c->moe_every, c->num_layers);
            exit(EXIT_FAILURE);
        }
        if (c->top_k < 1 || c->top_k > c->num_experts) {
            fprintf(stderr, "%s: top-k %d: expected 1..%d (the number of experts)\n", source, c->top_k,
                    c->num_experts);
            exit(EXIT_FAILURE);
        }
        if (!moe_support(c->channels, c->num_experts, c->top_k, c->expert_hidden, why, sizeof(why))) {
            fprintf(stderr, "%s: unsupported MoE size: %s\n", source, why);
            exit(EXIT_FAILURE);
        }
        if (c->noisy_gating && c->top_k >= c->num_experts) {
            fprintf(stderr, "%s: noisy top-k gating needs top-k (%d) below the number of experts (%d): its load loss "
                    "compares with the (k+1)-th logit\n", source, c->top_k, c->num_experts);
            exit(EXIT_FAILURE);
        }
    }
}

// Before the parameters and their gradients are allocated for a model from `source`: they fit in the device's free
// memory, or one line says what they need (a GPU out of memory would otherwise name neither, and the CPU backend,
// which fills new device memory, would drive the host into swap).
static void check_parameter_memory(const GPT2* model, const char* source) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    int local = model->config.num_experts / (model->ep.degree > 0 ? model->ep.degree : 1);
    fill_in_parameter_sizes(sizes, &model->config, local);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    size_t need = 2 * n * sizeof(floatX), free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && need > free_bytes) {
        fprintf(stderr, "%s: out of device memory: the parameters and gradients of its %zu parameters need %zu bytes, "
                "%zu are free\n", source, n, need, free_bytes);
        exit(EXIT_FAILURE);
    }
}

// Loads a model file, converted to floatX: a GPT-2 file in llm.c's format (version 3 fp32, 5 bf16) for the
// dense trainer, or an MoE file (version 1 fp32, 2 bf16; doc/formats.md) for the MoE trainer.
static void gpt2_build_from_checkpoint(GPT2* model, const char* path, int moe) {
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, moe ? MOE_MODEL_MAGIC : GPT2_MODEL_MAGIC, moe ? "MoE model" : "GPT-2 model");
    int version = header[1];
    int fp32_version = moe ? 1 : 3, bf16_version = moe ? 2 : 5;
    if (version != fp32_version && version != bf16_version) {
        fprintf(stderr, "%s: unsupported model file version %d (expected %d for fp32 or %d for bf16)\n", path, version,
                fp32_version, bf16_version);
        exit(EXIT_FAILURE);
    }
    GPT2Config* c = &model->config;
    if (moe) {
        c->num_experts = header[8];
        c->top_k = header[9];
        c->moe_every = header[10];
        c->expert_hidden = header[11];
        c->noisy_gating = header[12];
        if (c->noisy_gating != 0 && c->noisy_gating != 1) {
            fprintf(stderr, "%s: header[12] = %d: expected 0, or 1 for a noisy-gating model with routernw\n", path,
                    c->noisy_gating);
            exit(EXIT_FAILURE);
        }
        if (c->num_experts < 1) {
            fprintf(stderr, "%s: %d experts: an MoE model has at least 1\n", path, c->num_experts);
            exit(EXIT_FAILURE);
        }
    }
    c->max_seq_len = header[2];
    c->vocab_size = header[3];
    c->num_layers = header[4];
    c->num_heads = header[5];
    c->channels = header[6];
    c->padded_vocab_size = header[7];
    check_config_supported(c, path);
    // The header's sizes are checked against the file's length before anything is allocated for them: a corrupt
    // header must fail fast with "truncated", not ask for terabytes. In double first, where no product overflows.
    double estimate = (double)c->padded_vocab_size * c->channels + (double)c->max_seq_len * c->channels +
                      (double)c->num_layers * c->channels * c->channels * 12.0 +
                      (double)c->num_layers * c->num_experts * c->channels * (c->expert_hidden * 2.0 + 2.0);
    if (estimate > 1e15) {
        fprintf(stderr, "%s: its header describes a model of about %.3g parameters (L=%d C=%d V=%d maxT=%d): not a model "
                "file this trainer can load\n", path, estimate, c->num_layers, c->channels, c->vocab_size, c->max_seq_len);
        exit(EXIT_FAILURE);
    }
    size_t n = gpt2_num_parameters(c);
    size_t file_elem = version == fp32_version ? sizeof(float) : sizeof(__nv_bfloat16);
    size_t expected_bytes = 256 * sizeof(int) + n * file_elem;
    if (fseek(f, 0, SEEK_END) != 0) {
        fprintf(stderr, "%s: cannot seek to the end to check its size\n", path);
        exit(EXIT_FAILURE);
    }
    size_t file_bytes = (size_t)ftell(f);
    if (file_bytes < expected_bytes) {
        fprintf(stderr, "%s is truncated: its header describes %zu parameters (%zu bytes with the header), the file has "
                "%zu bytes\n", path, n, expected_bytes, file_bytes);
        exit(EXIT_FAILURE);
    }
    if (file_bytes > expected_bytes) {  // a longer file is not the model its header describes
        fprintf(stderr, "%s: file is longer than its header's model (%zu parameters, %zu bytes with the header; the file "
                "has %zu)\n", path, n, expected_bytes, file_bytes);
        exit(EXIT_FAILURE);
    }
    if (fseek(f, 256 * sizeof(int), SEEK_SET) != 0) {
        fprintf(stderr, "%s: cannot seek to its parameters\n", path);
        exit(EXIT_FAILURE);
    }
    check_parameter_memory(model, path);
    gpt2_allocate_parameters(model);
    void* raw = malloc_for(n * file_elem, "the parameters as stored", path);
    fread_check(raw, file_elem, n, f, path);
    fclose_check(f, path);
    floatX* host = (floatX*)malloc_for(n * sizeof(floatX), "the parameters", path);
    for (size_t i = 0; i < n; i++) {
        float v = version == fp32_version ? ((float*)raw)[i] : __bfloat162float(((__nv_bfloat16*)raw)[i]);
        host[i] = (floatX)v;
    }
    gpt2_set_parameters(model, host);
    free(host);
    free(raw);
}

// "d12" etc.: GPT-2 sizes (d12 = 124M, d24 = 350M, d36 = 774M, d48 = 1558M), or dN for C = 64N with
// N heads of 64; vocabulary and maxT from -ev and -et. GPT-2 initialisation, seeded.
// With experts (c->num_experts etc. set by the caller), Switch's reduced scale: router and expert weights
// drawn with the std above times sqrt(init_scale).
static void gpt2_build_from_descriptor(GPT2* model, const char* descriptor, int vocab_size, int max_seq_len,
                                       unsigned int seed, float init_scale) {
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
    if (c->num_experts > 0 && c->expert_hidden <= 0) c->expert_hidden = 4 * c->channels;
    check_config_supported(c, descriptor);
    check_parameter_memory(model, descriptor);
    gpt2_allocate_parameters(model);
    // GPT-2 init: weights N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), biases 0, LayerNorm 1/0;
    // padded vocabulary rows stay zero. Drawn tensor by tensor from one seeded mt19937, in model-file order with
    // every expert, so that the weights do not depend on the expert-parallel degree.
    size_t num_parameters = gpt2_num_parameters(c), sizes[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(sizes, c, c->num_experts);
    float* host = (float*)calloc(num_parameters, sizeof(float));
    mt19937_state rng;
    manual_seed(&rng, seed);
    size_t offset = 0;
    float residual_scale = 1.0f / sqrtf(2.0f * c->num_layers);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        size_t n = sizes[i];
        const char* name = parameter_names[i];
        if (!strcmp(name, "ln1w") || !strcmp(name, "ln2w") || !strcmp(name, "lnfw")) {
            for (size_t j = 0; j < n; j++) host[offset + j] = 1.0f;
        } else if (parameter_decays[i] && strcmp(name, "routernw") != 0) {  // routernw starts at 0 (Shazeer)
            int residual = !strcmp(name, "attprojw") || !strcmp(name, "fcprojw") || !strcmp(name, "efcprojw");
            int expert = !strcmp(name, "routerw") || !strcmp(name, "efcw") || !strcmp(name, "efcprojw");
            float std = (residual ? 0.02f * residual_scale : 0.02f) * (expert ? sqrtf(init_scale) : 1.0f);
            size_t rows_used = n;
            if (i == PARAM_WTE) rows_used = (size_t)c->vocab_size * c->channels;  // padded rows stay zero
            normal_(host + offset, rows_used, 0.0f, std, &rng);
        }
        offset += n;
    }
    floatX* hx = (floatX*)malloc_check(num_parameters * sizeof(floatX));
    for (size_t i = 0; i < num_parameters; i++) hx[i] = (floatX)host[i];
    gpt2_set_parameters(model, hx);
    free(hx);
    free(host);
}

// Writes the model file: llm.c's format for a dense model (version 5 bf16 from a BF16 build, 3 fp32
// otherwise), the MoE format with experts (version 2 bf16, 1 fp32). Process 0 writes, after gathering every expert
// over its expert group (collective over that group; every other process returns at once).
// The model file's header words 0..12 as this build writes them.
static void gpt2_model_header(const GPT2* model, int* header) {
    const GPT2Config* c = &model->config;
    int moe = c->num_experts > 0;
    header[0] = moe ? MOE_MODEL_MAGIC : GPT2_MODEL_MAGIC;
    header[1] = PRECISION_MODE == PRECISION_BF16 ? (moe ? 2 : 5) : (moe ? 1 : 3);
    header[8] = c->num_experts;
    header[9] = moe ? c->top_k : 0;
    header[10] = moe ? c->moe_every : 0;
    header[11] = moe ? c->expert_hidden : 0;
    header[12] = c->noisy_gating;
    header[2] = c->max_seq_len;
    header[3] = c->vocab_size;
    header[4] = c->num_layers;
    header[5] = c->num_heads;
    header[6] = c->channels;
    header[7] = c->padded_vocab_size;
}

static void gpt2_write_model_file(const GPT2* model, const char* path, cudaStream_t stream) {
    if (model->ep.group != 0) return;
    const GPT2Config* c = &model->config;
    int header[256] = {0};
    gpt2_model_header(model, header);
    size_t n = gpt2_num_parameters(c);
    floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
    gpt2_get_parameters(model, host, stream);
    if (model->process_rank != 0) {
        free(host);
        return;
    }
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

// The row stride of one MoE layer's expert buffers, padded to `capacity` rows per expert or packed (dropless): in
// this process's dispatch layout (src) and in its experts' layout (own), which with expert parallelism of degree N
// may receive every choice of the N processes of its group.
static void moe_layer_rows(const GPT2Config* c, int capacity, int dropless, int N, int degree, size_t* src,
                           size_t* own) {
    size_t padded = (size_t)c->num_experts * capacity, choices = (size_t)N * c->top_k;
    *src = layer_stride(dropless ? choices : padded);
    *own = layer_stride(dropless ? degree * choices : padded);
}

// ... the larger of training's and evaluation's, which the activations hold
static void moe_allocated_rows(const GPT2Config* c, const MoESettings* m, int N, int degree, size_t* src, size_t* own) {
    *src = *own = 0;
    if (c->num_experts == 0) return;
    const double factors[2] = {m->capacity_factor, m->capacity_factor_eval};
    for (int i = 0; i < 2; i++) {
        size_t s, o;
        moe_layer_rows(c, moe_capacity(N, c->num_experts, c->top_k, factors[i]), factors[i] <= 0.0, N, degree, &s, &o);
        *src = s > *src ? s : *src;
        *own = o > *own ? o : *own;
    }
}

// The activation tensors' sizes in bytes, in the order gpt2_allocate_activations points them.
static size_t fill_in_activation_sizes(size_t* s, const GPT2Config* c, const MoESettings* moe, size_t B, size_t T,
                                       int recompute, int ep_degree) {
    size_t C = c->channels, L = c->num_layers, NH = c->num_heads, Vp = c->padded_vocab_size;
    size_t ln_layers = recompute >= 2 ? 1 : L;
    size_t dense_layers = L - num_moe_layers(c);
    size_t gelu_layers = recompute >= 1 ? (dense_layers ? 1 : 0) : dense_layers;
    size_t BTC = layer_stride(B * T * C), BT = layer_stride(B * T), ATT = layer_stride(B * NH * T * T);
#ifdef ENABLE_CUDNN
    size_t att_probs = 0, att_stats = layer_stride(B * NH * T);  // cuDNN keeps softmax statistics, not probabilities
#else
    size_t att_probs = ATT, att_stats = 0;
#endif
    size_t i = 0;
    s[i++] = (BTC) * sizeof(floatX);                           // encoded
    s[i++] = (ln_layers * BTC) * sizeof(floatX);               // ln1
    s[i++] = (L * BT) * sizeof(float);                         // ln1_mean
    s[i++] = (L * BT) * sizeof(float);                         // ln1_rstd
    s[i++] = (L * BTC) * sizeof(floatX);                       // atty
    s[i++] = (L * att_probs) * sizeof(floatX);                 // att
    s[i++] = (L * att_stats) * sizeof(float);                  // att_stats
    s[i++] = (L * 3 * BTC) * sizeof(floatX);                   // qkvr
    s[i++] = (L * BTC) * sizeof(floatX);                       // residual2
    s[i++] = (ln_layers * BTC) * sizeof(floatX);               // ln2
    s[i++] = (L * BT) * sizeof(float);                         // ln2_mean
    s[i++] = (L * BT) * sizeof(float);                         // ln2_rstd
    s[i++] = (dense_layers * 4 * BTC) * sizeof(floatX);        // fch
    s[i++] = (gelu_layers * 4 * BTC) * sizeof(floatX);         // fch_gelu
    s[i++] = (L * BTC) * sizeof(floatX);                       // residual3
    s[i++] = (BTC) * sizeof(floatX);                           // lnf
    s[i++] = (BT) * sizeof(float);                             // lnf_mean
    s[i++] = (BT) * sizeof(float);                             // lnf_rstd
    s[i++] = (BT) * sizeof(float);                             // losses
    s[i++] = (B * T * Vp) * sizeof(floatX);                    // output
    s[i++] = (BTC) * sizeof(floatX);                           // scratch_btc
    s[i++] = (4 * BTC) * sizeof(floatX);                       // scratch_bt4c
    s[i++] = (BTC) * sizeof(floatX);                           // dresidual
    s[i++] = (BTC) * sizeof(floatX);                           // dbtc
    s[i++] = (3 * BTC) * sizeof(floatX);                       // dqkvr
    s[i++] = (att_probs) * sizeof(floatX);                     // datt
    size_t ln_scratch = layernorm_backward_scratch_floats((int)B, (int)T, (int)C);
    size_t bias_scratch = matmul_dbias_buffer_floats((int)(Vp > 4 * C ? Vp : 4 * C));
    size_t E = c->num_experts, K = c->top_k, H = c->expert_hidden, Lm = num_moe_layers(c), N = B * T;
    size_t rows_src, rows_own;
    moe_allocated_rows(c, moe, (int)N, ep_degree, &rows_src, &rows_own);
    // the experts' bias gradients: E / ep_degree batches or groups of up to max(H, C) columns
    int local_experts = E ? (int)E / ep_degree : 0, widest = (int)(H > C ? H : C);
    size_t batched_scratch = E ? matmul_batched_dbias_buffer_floats(local_experts, widest) : 0;
    size_t grouped_scratch = E ? matmul_grouped_dbias_buffer_floats(local_experts, widest) : 0;
    size_t expert_bias_scratch = batched_scratch > grouped_scratch ? batched_scratch : grouped_scratch;
    size_t scratch = ln_scratch > bias_scratch ? ln_scratch : bias_scratch;
    s[i++] = (scratch > expert_bias_scratch ? scratch : expert_bias_scratch) * sizeof(float);  // scratch_f
    size_t NE = layer_stride(N * E), NK = layer_stride(N * K);
    size_t noisy = c->noisy_gating, jitter = moe->jitter > 0.0f;
    s[i++] = (Lm * NE) * sizeof(float);                        // router_logits
    s[i++] = (noisy * Lm * NE) * sizeof(float);                // router_clean
    s[i++] = (noisy * Lm * NE) * sizeof(float);                // router_noise
    s[i++] = (Lm * NE) * sizeof(float);                        // router_probs
    s[i++] = (Lm * BT) * sizeof(float);                        // router_lse
    s[i++] = (Lm * NK) * sizeof(int);                          // expert_index
    s[i++] = (Lm * NK) * sizeof(float);                        // gates
    s[i++] = (Lm * NK) * sizeof(int);                          // choice_row
    s[i++] = (Lm * rows_src) * sizeof(int);                    // row_choice
    s[i++] = (Lm * layer_stride(E)) * sizeof(int);             // expert_count
    s[i++] = (Lm * layer_stride(E)) * sizeof(int);             // kept_count
    s[i++] = (Lm * layer_stride(4 + 2 * E)) * sizeof(float);   // moe_stats
    s[i++] = (Lm * rows_own * C) * sizeof(floatX);             // expert_input
    s[i++] = (Lm * rows_own * H) * sizeof(floatX);             // expert_pre
    s[i++] = ((recompute >= 1 ? (Lm ? 1 : 0) : Lm) * rows_own * H) * sizeof(floatX);  // expert_act
    s[i++] = (Lm * rows_src * C) * sizeof(floatX);             // expert_output
    s[i++] = (Lm ? NK : 0) * sizeof(float);                    // d_gates
    s[i++] = (Lm ? NE : 0) * sizeof(float);                    // d_logits
    s[i++] = (Lm ? noisy * NE : 0) * sizeof(float);            // d_noise
    s[i++] = (Lm ? NE : 0) * sizeof(floatX);                   // d_logits_x
    s[i++] = (Lm && noisy ? moe_noisy_losses_partials_size((int)E) : 0) * sizeof(float);  // noise_partials
    s[i++] = (Lm ? jitter * 2 * BTC : 0) * sizeof(floatX);     // router_input
    s[i++] = (Lm ? rows_own * C : 0) * sizeof(floatX);         // moe_scratch_own
    s[i++] = (Lm ? rows_own * H : 0) * sizeof(floatX);         // d_expert_hidden
    s[i++] = (Lm && ep_degree > 1 ? rows_src * C : 0) * sizeof(floatX);  // moe_scratch_src
    return i;
}

static size_t activation_bytes(const GPT2Config* c, const MoESettings* moe, size_t B, size_t T, int recompute,
                               int ep_degree) {
    size_t sizes[64];
    size_t n = fill_in_activation_sizes(sizes, c, moe, B, T, recompute, ep_degree);
    size_t bytes = 0;
    for (size_t i = 0; i < n; i++) bytes += CEIL_DIV(sizes[i], 256) * 256;  // gpt2_allocate_activations aligns them
    return bytes;
}

static void gpt2_allocate_activations(GPT2* model, int B, int T) {
    size_t sizes[64];
    size_t n = fill_in_activation_sizes(sizes, &model->config, &model->moe, B, T, model->recompute, model->ep.degree);
    size_t bytes = activation_bytes(&model->config, &model->moe, B, T, model->recompute, model->ep.degree);
    cudaCheck(cudaMalloc(&model->acts_memory, bytes));
    ActivationTensors* a = &model->acts;
    void** ptrs[] = {(void**)&a->encoded, (void**)&a->ln1, (void**)&a->ln1_mean, (void**)&a->ln1_rstd,
                     (void**)&a->atty, (void**)&a->att, (void**)&a->att_stats, (void**)&a->qkvr, (void**)&a->residual2,
                     (void**)&a->ln2, (void**)&a->ln2_mean, (void**)&a->ln2_rstd, (void**)&a->fch,
                     (void**)&a->fch_gelu, (void**)&a->residual3, (void**)&a->lnf, (void**)&a->lnf_mean,
                     (void**)&a->lnf_rstd, (void**)&a->losses, (void**)&a->output, (void**)&a->scratch_btc,
                     (void**)&a->scratch_bt4c, (void**)&a->dresidual, (void**)&a->dbtc, (void**)&a->dqkvr,
                     (void**)&a->datt, (void**)&a->scratch_f, (void**)&a->router_logits, (void**)&a->router_clean,
                     (void**)&a->router_noise, (void**)&a->router_probs,
                     (void**)&a->router_lse, (void**)&a->expert_index, (void**)&a->gates, (void**)&a->choice_row,
                     (void**)&a->row_choice, (void**)&a->expert_count, (void**)&a->kept_count, (void**)&a->moe_stats,
                     (void**)&a->expert_input, (void**)&a->expert_pre, (void**)&a->expert_act,
                     (void**)&a->expert_output, (void**)&a->d_gates, (void**)&a->d_logits, (void**)&a->d_noise,
                     (void**)&a->d_logits_x, (void**)&a->noise_partials, (void**)&a->router_input,
                     (void**)&a->moe_scratch_own, (void**)&a->d_expert_hidden, (void**)&a->moe_scratch_src};
    char* p = (char*)model->acts_memory;
    for (size_t i = 0; i < n; i++) {
        *ptrs[i] = p;
        p += CEIL_DIV(sizes[i], 256) * 256;  // 256-byte alignment for vector loads and cuBLASLt
    }
    model->batch_size = B;
    model->seq_len = T;
    cudaCheck(cudaMalloc((void**)&model->inputs, (size_t)B * T * sizeof(int)));
    cudaCheck(cudaMalloc((void**)&model->targets, (size_t)B * T * sizeof(int)));
    model->inputs_cpu = (int*)malloc_check((size_t)B * T * sizeof(int));
    model->losses_cpu = (float*)malloc_check((size_t)B * T * sizeof(float));
    int Lm = num_moe_layers(&model->config), E = model->config.num_experts;
    model->expert_counts_cpu = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
    model->kept_counts_cpu = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
    model->moe_losses_cpu = (float*)malloc_check((size_t)(4 * Lm + 1) * sizeof(float));
    char why[256];
    if (Lm > 0 && !moe_noise_support(B * T, model->config.channels, E, model->config.top_k, model->config.noisy_gating,
                                     model->moe.jitter, why, sizeof(why))) {
        fprintf(stderr, "router noise: %s\n", why);
        exit(EXIT_FAILURE);
    }
    model->moe_rows_src = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
    model->moe_rows_own = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
}

// A single process holding every expert, until the caller sets num_processes, process_rank and ep.
static void gpt2_init_common(GPT2* model) {
    memset(model, 0, sizeof(*model));
    model->use_master_weights = 1;
    model->recompute = 1;
    model->gelu_fusion = 1;
    model->num_processes = 1;
    model->ep.degree = 1;
    model->ep.replicas.num_processes = 1;
    model->loss_scaler = loss_scaler_init();
    model->rng_state = 13371337ull;
}

static void gpt2_free(GPT2* model) {
    sharded_parameters_free(&model->store);
    if (model->config.num_experts > 0) sharded_parameters_free(&model->expert_store);
    free(model->moe_rows_src);
    free(model->moe_rows_own);
    cudaCheck(cudaFree(model->acts_memory));
    cudaCheck(cudaFree(model->inputs));
    cudaCheck(cudaFree(model->targets));
    free(model->inputs_cpu);
    free(model->losses_cpu);
    free(model->expert_counts_cpu);
    free(model->kept_counts_cpu);
    free(model->moe_losses_cpu);
}

// ----------------------------------------------------------------------------------------------------
// Forward and backward passes

// ----------------------------------------------------------------------------------------------------
// The MoE layer (llmc/moe.cuh): router in fp32, top-k, slots, dispatch to the expert buffer, with expert
// parallelism the all-to-all to the experts' owners and back (llmc/expert_parallel.cuh), the experts as batched
// GEMMs over buffers padded to the capacity or as grouped GEMMs over their exact rows (dropless), combine weighted
// by the gates. Its output (N, C) goes to `out`, like the dense MLP's.

typedef struct {
    float* logits;        // what routing uses: H with noisy gating
    float* clean;         // noisy gating
    float* noise;         // noisy gating
    float* probs;
    float* lse;
    int* expert_index;
    float* gates;
    int* choice_row;
    int* row_choice;
    int* expert_count;
    int* kept_count;
    float* losses;        // (4) aux, z, importance, load
    float* importance;    // (E) noisy gating
    float* load;          // (E) noisy gating
    floatX* expert_input;
    floatX* expert_pre;
    floatX* expert_act;
    floatX* expert_output;
    int* rows_src;  // (E) host: rows per global expert in the dispatch layout
    int* rows_own;  // (ep.degree, E / ep.degree) host: rows per (group member, local expert) in the expert layout
} MoELayerActivations;

static MoELayerActivations moe_layer_activations(const GPT2* model, int m, int N) {
    const GPT2Config* c = &model->config;
    const ActivationTensors* a = &model->acts;
    size_t E = c->num_experts, K = c->top_k, H = c->expert_hidden, C = c->channels;
    size_t NE = layer_stride(N * E), NK = layer_stride(N * K), SRC, OWN;
    moe_layer_rows(c, model->moe_capacity_used, model->moe_dropless, N, model->ep.degree, &SRC, &OWN);
    MoELayerActivations l;
    l.logits = a->router_logits + m * NE;
    l.clean = c->noisy_gating ? a->router_clean + m * NE : nullptr;
    l.noise = c->noisy_gating ? a->router_noise + m * NE : nullptr;
    l.probs = a->router_probs + m * NE;
    l.lse = a->router_lse + m * layer_stride(N);
    l.expert_index = a->expert_index + m * NK;
    l.gates = a->gates + m * NK;
    l.choice_row = a->choice_row + m * NK;
    l.row_choice = a->row_choice + m * SRC;
    l.expert_count = a->expert_count + m * layer_stride(E);
    l.kept_count = a->kept_count + m * layer_stride(E);
    l.losses = a->moe_stats + m * layer_stride(4 + 2 * E);
    l.importance = l.losses + 4;
    l.load = l.losses + 4 + E;
    l.expert_input = a->expert_input + m * OWN * C;
    l.expert_pre = a->expert_pre + m * OWN * H;
    l.expert_act = a->expert_act + (model->recompute >= 1 ? 0 : m * OWN * H);
    l.expert_output = a->expert_output + m * SRC * C;
    l.rows_src = model->moe_rows_src + m * E;
    l.rows_own = model->moe_rows_own + m * E;
    return l;
}

// The row counts of layer m's buffers (host): the capacity everywhere when padded; when packed, the kept counts of
// this process's routing and, exchanged over the expert group, what each member sends to this process's experts.
static void moe_layer_row_counts(GPT2* model, const MoELayerActivations* l, cudaStream_t stream) {
    int E = model->config.num_experts;
    if (!model->moe_dropless) {
        for (int e = 0; e < E; e++) l->rows_src[e] = l->rows_own[e] = model->moe_capacity_used;
        return;
    }
    cudaCheck(cudaMemcpyAsync(l->rows_src, l->kept_count, E * sizeof(int), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    expert_parallel_exchange_counts(&model->ep, l->rows_own, l->rows_src, E, stream);
}

// Packed layout: the rows of each of this process's experts (E_l, host), what every group member sent it; returns
// their sum, the rows of the expert layout in use (padded: E * capacity, all rows).
static size_t moe_local_expert_rows(const GPT2* model, const MoELayerActivations* l, int* rows) {
    int E_l = model->local_experts, N = model->ep.degree;
    if (!model->moe_dropless) return (size_t)model->config.num_experts * model->moe_capacity_used;
    size_t total = 0;
    for (int e = 0; e < E_l; e++) {
        rows[e] = 0;
        for (int s = 0; s < N; s++) rows[e] += l->rows_own[s * E_l + e];
        total += rows[e];
    }
    return total;
}

// The forward's GELU fusion (-ge): into cuBLASLt's epilogue only when nothing recomputes the GELU (-r 0). With
// recompute the forward evaluates llmc/gelu.cuh, as the recompute does, so that the backward sees the forward's bits.
static int gpt2_forward_gelu_fusion(const GPT2* model) {
    return model->recompute >= 1 ? 0 : model->gelu_fusion;
}

// One Linear layer of this process's experts on their rows in the expert layout: weight (E_l, OC, IC), bias
// (E_l, OC), inp (Rown, IC) -> out (Rown, OC) [pre_gelu: out = GELU(pre_gelu)]. Padded: E_l buffers of
// ep.degree * capacity rows, one batched GEMM; packed: each local expert's rows from every member, one grouped GEMM.
static void moe_experts_linear_forward(const GPT2* model, const MoELayerActivations* l, floatX* out, const floatX* inp,
                                       const floatX* weight, const floatX* bias, int IC, int OC, floatX* pre_gelu,
                                       cudaStream_t stream) {
    int E_l = model->local_experts, N = model->ep.degree;
    if (!model->moe_dropless) {
        matmul_forward_batched(out, inp, weight, bias, E_l, N * model->moe_capacity_used, IC, OC, stream, pre_gelu,
                               gpt2_forward_gelu_fusion(model));
        return;
    }
    int rows[MOE_MAX_EXPERTS];
    moe_local_expert_rows(model, l, rows);
    matmul_forward_grouped(out, inp, weight, bias, E_l, rows, IC, OC, stream, pre_gelu,
                           gpt2_forward_gelu_fusion(model));
}

// Its backward: dinp (Rown, IC) overwritten, dweight and dbias accumulated (+=); pre_gelu as in the forward.
static void moe_experts_linear_backward(const GPT2* model, const MoELayerActivations* l, floatX* dinp, floatX* dweight,
                                        floatX* dbias, const floatX* dout, const floatX* inp, const floatX* weight,
                                        int IC, int OC, const floatX* pre_gelu, cudaStream_t stream) {
    int E_l = model->local_experts, N = model->ep.degree;
    float* scratch = model->acts.scratch_f;
    if (!model->moe_dropless) {
        matmul_backward_batched(dinp, dweight, dbias, dout, inp, weight, scratch, E_l, N * model->moe_capacity_used, IC,
                                OC, stream, pre_gelu, model->gelu_fusion);
        return;
    }
    int rows[MOE_MAX_EXPERTS];
    moe_local_expert_rows(model, l, rows);
    matmul_backward_grouped(dinp, dweight, dbias, dout, inp, weight, scratch, E_l, rows, IC, OC, stream, pre_gelu);
}

// The seed of MoE layer m's jitter or gating noise in the current pass (doc/moe.md, "Router noise" 1)
static unsigned int moe_layer_seed(const GPT2* model, int m, int kind) {
    return moe_noise_seed((unsigned int)model->process_rank, model->noise_pass, m, kind);
}

// What the router reads: ln2, or in a training pass with jitter ln2 times its multipliers (in router_input)
static const floatX* moe_router_input(const GPT2* model, int m, const floatX* ln2, int N, cudaStream_t stream) {
    if (!model->moe_training || model->moe.jitter <= 0.0f) return ln2;
    floatX* jittered = model->acts.router_input;
    moe_jitter_forward(jittered, ln2, N, model->config.channels, model->moe.jitter,
                       moe_layer_seed(model, m, MOE_NOISE_JITTER), stream);
    return jittered;
}

static void moe_layer_forward(GPT2* model, int m, floatX* out, const floatX* ln2, int N, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    const ParameterTensors* p = &model->params;
    const ActivationTensors* a = &model->acts;
    int E = c->num_experts, E_l = model->local_experts, K = c->top_k, C = c->channels, H = c->expert_hidden;
    int exchange_rows = model->ep.degree > 1;  // expert parallelism: rows go to and come back from the experts' owners
    MoELayerActivations l = moe_layer_activations(model, m, N);
    const floatX* router_in = moe_router_input(model, m, ln2, N, stream);
    if (c->noisy_gating) {
        matmul_forward_fp32_output(l.clean, router_in, p->routerw + (size_t)m * E * C, N, C, E, stream);
        matmul_forward_fp32_output(l.noise, router_in, p->routernw + (size_t)m * E * C, N, C, E, stream);
        moe_noisy_logits_forward(l.logits, l.clean, l.noise, N, E, moe_layer_seed(model, m, MOE_NOISE_GATING),
                                 model->moe_training, stream);
    } else {
        matmul_forward_fp32_output(l.logits, router_in, p->routerw + (size_t)m * E * C, N, C, E, stream);
    }
    moe_router_forward(l.probs, l.expert_index, l.gates, l.lse, l.logits, N, E, K, stream);
    moe_assign_slots(l.choice_row, l.row_choice, l.expert_count, l.kept_count, l.expert_index, N, E, K,
                     model->moe_capacity_used, model->moe_dropless, stream);
    moe_layer_row_counts(model, &l, stream);
    int rows_src = model->moe_dropless ? N * K : E * model->moe_capacity_used;
    floatX* dispatched = exchange_rows ? a->moe_scratch_src : l.expert_input;
    moe_dispatch(dispatched, ln2, l.row_choice, rows_src, K, C, stream);
    if (exchange_rows)
        expert_parallel_exchange(&model->ep, dispatched, l.expert_input, l.rows_src, l.rows_own, E, C, 1, stream);
    moe_experts_linear_forward(model, &l, l.expert_act, l.expert_input, p->efcw + (size_t)m * E_l * H * C,
                               p->efcb + (size_t)m * E_l * H, C, H, l.expert_pre, stream);
    floatX* expert_output = exchange_rows ? a->moe_scratch_own : l.expert_output;
    moe_experts_linear_forward(model, &l, expert_output, l.expert_act, p->efcprojw + (size_t)m * E_l * C * H,
                               p->efcprojb + (size_t)m * E_l * C, H, C, nullptr, stream);
    if (exchange_rows)
        expert_parallel_exchange(&model->ep, l.expert_output, expert_output, l.rows_src, l.rows_own, E, C, 0, stream);
    moe_combine(out, l.expert_output, l.choice_row, l.gates, N, K, C, stream);
    moe_router_losses(l.losses, l.probs, l.lse, l.expert_count, N, E, K, model->moe.aux_alpha, model->moe.z_coef,
                      stream);
    if (c->noisy_gating) {
        moe_noisy_losses_forward(l.importance, l.load, l.losses + 2, a->noise_partials, l.clean, l.noise, l.logits,
                                 l.expert_index, l.gates, N, E, K, model->moe.importance_coef, model->moe.load_coef,
                                 stream);
    } else {
        cudaCheck(cudaMemsetAsync(l.losses + 2, 0, 2 * sizeof(float), stream));
    }
}

// dout (N, C): the gradient of the layer's output; d_ln2 (N, C) = the gradient of its input (overwritten);
// the router's aux and z losses add their gradients scaled by model->aux_grad_scale.
static void moe_layer_backward(GPT2* model, int m, floatX* d_ln2, const floatX* dout, const floatX* ln2, int N,
                               cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    const ParameterTensors* p = &model->params;
    const ParameterTensors* g = &model->grads;
    const ActivationTensors* a = &model->acts;
    int E = c->num_experts, E_l = model->local_experts, K = c->top_k, C = c->channels, H = c->expert_hidden;
    int exchange_rows = model->ep.degree > 1;
    MoELayerActivations l = moe_layer_activations(model, m, N);
    int rows_src = model->moe_dropless ? N * K : E * model->moe_capacity_used;
    // d_own: the experts' output gradient, then their input gradient, in the expert layout; d_src: the same in
    // the dispatch layout (one buffer without expert parallelism)
    floatX* d_own = a->moe_scratch_own;
    floatX* d_src = exchange_rows ? a->moe_scratch_src : d_own;
    moe_combine_backward(d_src, a->d_gates, dout, l.expert_output, l.choice_row, l.gates, l.row_choice, N, rows_src, K,
                         C, stream);
    if (exchange_rows) expert_parallel_exchange(&model->ep, d_src, d_own, l.rows_src, l.rows_own, E, C, 1, stream);
    // dropless, this process's experts may have received no row at all
    int rows[MOE_MAX_EXPERTS];
    size_t own_rows = moe_local_expert_rows(model, &l, rows);
    if (model->recompute >= 1 && own_rows > 0) gelu_forward(l.expert_act, l.expert_pre, (int)(own_rows * H), stream);
    moe_experts_linear_backward(model, &l, a->d_expert_hidden, g->efcprojw + (size_t)m * E_l * C * H,
                                g->efcprojb + (size_t)m * E_l * C, d_own, l.expert_act,
                                p->efcprojw + (size_t)m * E_l * C * H, H, C, l.expert_pre, stream);
    // the output gradient in d_own is consumed: the input gradient overwrites it
    moe_experts_linear_backward(model, &l, d_own, g->efcw + (size_t)m * E_l * H * C, g->efcb + (size_t)m * E_l * H,
                                a->d_expert_hidden, l.expert_input, p->efcw + (size_t)m * E_l * H * C, C, H, nullptr,
                                stream);
    if (exchange_rows) expert_parallel_exchange(&model->ep, d_src, d_own, l.rows_src, l.rows_own, E, C, 0, stream);
    cudaCheck(cudaMemsetAsync(d_ln2, 0, (size_t)N * C * sizeof(floatX), stream));
    moe_dispatch_backward(d_ln2, d_src, l.choice_row, N, K, C, stream);
    // the router: the gates' gradient (with noisy gating, plus the importance loss's), the Switch and z losses
    // through the softmax into the routing logits, then (noisy gating) through H into the clean and noise logits
    if (c->noisy_gating)
        moe_importance_backward(a->d_gates, l.importance, l.expert_index, N, E, K, model->moe.importance_coef,
                                model->aux_grad_scale, stream);
    moe_router_backward(a->d_logits, l.probs, l.expert_index, l.gates, a->d_gates, l.lse, l.expert_count, N, E, K,
                        model->moe.aux_alpha, model->moe.z_coef, model->aux_grad_scale, stream);
    if (c->noisy_gating)
        moe_noisy_backward(a->d_logits, a->d_noise, a->d_logits, l.clean, l.noise, l.logits, l.expert_index, l.load, N,
                           E, K, model->moe.load_coef, model->aux_grad_scale,
                           moe_layer_seed(model, m, MOE_NOISE_GATING), stream);
    // with jitter the router read its jittered input: recomputed here, its gradient then scaled by the same
    // multipliers into d_ln2; without, the router's input gradient adds into d_ln2 directly
    int jitter = model->moe.jitter > 0.0f;
    const floatX* router_in = moe_router_input(model, m, ln2, N, stream);
    floatX* d_router_in = jitter ? a->router_input + (size_t)N * C : d_ln2;
    if (jitter) cudaCheck(cudaMemsetAsync(d_router_in, 0, (size_t)N * C * sizeof(floatX), stream));
    matmul_backward_fp32_dout(d_router_in, g->routerw + (size_t)m * E * C, a->d_logits, router_in,
                              p->routerw + (size_t)m * E * C, a->d_logits_x, N, C, E, stream);
    if (c->noisy_gating)
        matmul_backward_fp32_dout(d_router_in, g->routernw + (size_t)m * E * C, a->d_noise, router_in,
                                  p->routernw + (size_t)m * E * C, a->d_logits_x, N, C, E, stream);
    if (jitter)
        moe_jitter_backward(d_ln2, d_router_in, N, C, model->moe.jitter, moe_layer_seed(model, m, MOE_NOISE_JITTER),
                            stream);
}

// Routing statistics of MoE layer m from the counts of the last forward pass (host): the fraction of
// choices dropped and the expert loads (choices before dropping over their mean: min, max, CV).
typedef struct {
    double drop_fraction, load_min, load_max, load_cv;
} MoELayerStatistics;

static MoELayerStatistics moe_layer_statistics(const GPT2* model, int m, int N) {
    const GPT2Config* c = &model->config;
    int E = c->num_experts, K = c->top_k;
    double mean = (double)N * K / E, var = 0.0, dropped = 0.0;
    MoELayerStatistics st = {0.0, 1e30, 0.0, 0.0};
    for (int e = 0; e < E; e++) {
        int routed = model->expert_counts_cpu[m * E + e];
        dropped += routed - model->kept_counts_cpu[m * E + e];
        st.load_min = fmin(st.load_min, routed / mean);
        st.load_max = fmax(st.load_max, routed / mean);
        var += (routed - mean) * (routed - mean) / E;
    }
    st.drop_fraction = dropped / ((double)N * K);
    st.load_cv = sqrt(var) / mean;
    return st;
}

// Telemetry of the last forward pass's MoE layers (host): aux and z losses, and the routing statistics
// (drop fraction averaged, load min and max over layers, CV averaged).
static void moe_collect_statistics(GPT2* model, int N, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    int Lm = num_moe_layers(c), E = c->num_experts;
    model->aux_loss = model->z_loss = model->importance_loss = model->load_loss = model->drop_fraction = 0.0f;
    model->load_min = model->load_max = model->load_cv = 0.0f;
    if (Lm == 0) return;
    double drop = 0.0, load_min = 1e30, load_max = 0.0, cv = 0.0;
    for (int m = 0; m < Lm; m++) {
        MoELayerActivations l = moe_layer_activations(model, m, N);
        cudaCheck(cudaMemcpyAsync(model->moe_losses_cpu + 4 * m, l.losses, 4 * sizeof(float), cudaMemcpyDeviceToHost,
                                  stream));
        cudaCheck(cudaMemcpyAsync(model->expert_counts_cpu + m * E, l.expert_count, E * sizeof(int),
                                  cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaMemcpyAsync(model->kept_counts_cpu + m * E, l.kept_count, E * sizeof(int), cudaMemcpyDeviceToHost,
                                  stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
    for (int m = 0; m < Lm; m++) {
        model->aux_loss += model->moe_losses_cpu[4 * m];
        model->z_loss += model->moe_losses_cpu[4 * m + 1];
        model->importance_loss += model->moe_losses_cpu[4 * m + 2];
        model->load_loss += model->moe_losses_cpu[4 * m + 3];
        MoELayerStatistics st = moe_layer_statistics(model, m, N);
        drop += st.drop_fraction;
        load_min = fmin(load_min, st.load_min);
        load_max = fmax(load_max, st.load_max);
        cv += st.load_cv;
    }
    model->drop_fraction = (float)(drop / Lm);
    model->load_min = (float)load_min;
    model->load_max = (float)load_max;
    model->load_cv = (float)(cv / Lm);
}

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
    if (c->num_experts > 0) {
        // the capacity factor of training (a backward pass follows) or of evaluation
        double cf = dlogits_scale > 0.0f ? model->moe.capacity_factor : model->moe.capacity_factor_eval;
        model->moe_capacity_used = moe_capacity(B * T, c->num_experts, c->top_k, cf);
        model->moe_dropless = cf <= 0.0;
        model->moe_training = dlogits_scale > 0.0f;
        model->aux_grad_scale = dlogits_scale * B * T;
    }
    encoder_forward(a.encoded, model->inputs, p.wte, p.wpe, B, T, C, stream);
    layernorm_forward(a.ln1, a.ln1_mean, a.ln1_rstd, a.encoded, p.ln1w, p.ln1b, B, T, C, stream);
    for (int l = 0; l < L; l++) {
        const floatX* residual = l == 0 ? a.encoded : a.residual3 + (size_t)(l - 1) * BTC;
        floatX* ln1 = model->recompute >= 2 ? a.ln1 : a.ln1 + (size_t)l * BTC;
        floatX* ln2 = model->recompute >= 2 ? a.ln2 : a.ln2 + (size_t)l * BTC;
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
        if (is_moe_layer(c, l)) {
            moe_layer_forward(model, moe_index(c, l), a.scratch_btc, ln2, B * T, stream);
        } else {
            int d = dense_index(c, l);
            floatX* fch_gelu = model->recompute >= 1 ? a.fch_gelu : a.fch_gelu + (size_t)d * 4 * BTC;
            matmul_forward(fch_gelu, ln2, p.fcw + (size_t)d * 4 * C * C, p.fcb + (size_t)d * 4 * C, B, T, C, 4 * C,
                           stream, a.fch + (size_t)d * 4 * BTC, gpt2_forward_gelu_fusion(model));
            matmul_forward(a.scratch_btc, fch_gelu, p.fcprojw + (size_t)d * 4 * C * C, p.fcprojb + (size_t)d * C, B, T,
                           4 * C, C, stream);
        }
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
        moe_collect_statistics(model, B * T, stream);
    }
}

static void gpt2_reduce_layer(GPT2* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);
static void gpt2_reduce_rest(GPT2* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);

// Backward pass for the batch of the last gpt2_forward (which must have been given targets and a
// dlogits_scale). Gradients accumulate (+=) into model->grads; zero them with gpt2_zero_grad. With
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
        const float* ln1_mean = a.ln1_mean + (size_t)l * BT;
        const float* ln1_rstd = a.ln1_rstd + (size_t)l * BT;
        const float* ln2_mean = a.ln2_mean + (size_t)l * BT;
        const float* ln2_rstd = a.ln2_rstd + (size_t)l * BT;
        floatX* dbt4c = a.scratch_bt4c;
        if (model->recompute >= 2) {
            layernorm_forward(ln2, nullptr, nullptr, a.residual2 + (size_t)l * BTC, p.ln2w + (size_t)l * C,
                              p.ln2b + (size_t)l * C, B, T, C, stream);
        }
        if (is_moe_layer(c, l)) {
            moe_layer_backward(model, moe_index(c, l), a.dbtc, dresidual, ln2, B * T, stream);
        } else {
            // MLP: fcproj, GELU, fc
            int d = dense_index(c, l);
            floatX* fch = a.fch + (size_t)d * 4 * BTC;
            floatX* fch_gelu = model->recompute >= 1 ? a.fch_gelu : a.fch_gelu + (size_t)d * 4 * BTC;
            if (model->recompute >= 1) gelu_forward(fch_gelu, fch, B * T * 4 * C, stream);
            matmul_backward(dbt4c, g.fcprojw + (size_t)d * 4 * C * C, g.fcprojb + (size_t)d * C, dresidual, fch_gelu,
                            p.fcprojw + (size_t)d * 4 * C * C, a.scratch_f, B, T, 4 * C, C, stream, fch,
                            model->gelu_fusion);
            matmul_backward(a.dbtc, g.fcw + (size_t)d * 4 * C * C, g.fcb + (size_t)d * 4 * C, dbt4c, ln2,
                            p.fcw + (size_t)d * 4 * C * C, a.scratch_f, B, T, C, 4 * C, stream);
        }
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
    const GPT2Config* c = &model->config;
    // stacked over all layers, over the dense layers, over the MoE layers (the router's, and expert_store's tensors)
    static const int every_layer[] = {PARAM_LN1W,     PARAM_LN1B,     PARAM_QKVW, PARAM_QKVB,
                                      PARAM_ATTPROJW, PARAM_ATTPROJB, PARAM_LN2W, PARAM_LN2B};
    static const int dense[] = {PARAM_FCW, PARAM_FCB, PARAM_FCPROJW, PARAM_FCPROJB};
    static const int router[] = {PARAM_ROUTERW, PARAM_ROUTERNW};  // routernw is empty without noisy gating
    static const int experts[] = {PARAM_EFCW - FIRST_EXPERT_TENSOR, PARAM_EFCB - FIRST_EXPERT_TENSOR,
                                  PARAM_EFCPROJW - FIRST_EXPERT_TENSOR, PARAM_EFCPROJB - FIRST_EXPERT_TENSOR};
    int Lm = num_moe_layers(c);
    sharded_parameters_reduce_slices(&model->store, every_layer, 8, layer, c->num_layers, mg, zero_stage, stream);
    if (is_moe_layer(c, layer)) {
        sharded_parameters_reduce_slices(&model->store, router, 2, moe_index(c, layer), Lm, mg, zero_stage, stream);
        // the experts' gradients over exactly the processes that hold the same experts
        sharded_parameters_reduce_slices(&model->expert_store, experts, NUM_EXPERT_TENSORS, moe_index(c, layer), Lm,
                                         &model->ep.replicas, zero_stage, stream);
    } else {
        sharded_parameters_reduce_slices(&model->store, dense, 4, dense_index(c, layer), c->num_layers - Lm, mg,
                                         zero_stage, stream);
    }
}
static void gpt2_reduce_rest(GPT2* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    // complete only after the encoder's backward
    static const int rest[] = {PARAM_WTE, PARAM_WPE, PARAM_LNFW, PARAM_LNFB};
    sharded_parameters_reduce_slices(&model->store, rest, 4, -1, model->config.num_layers, mg, zero_stage, stream);
}

// ----------------------------------------------------------------------------------------------------
// The optimizer step over both parameter sets (llmc/optimizer.cuh)

// m, v and master weights for this process's shards of both parameter sets
static void gpt2_allocate_optimizer(GPT2* model, int zero_stage) {
    sharded_parameters_allocate_optimizer(&model->store, model->use_master_weights, model->process_rank,
                                          model->num_processes, zero_stage);
    if (model->config.num_experts > 0)
        sharded_parameters_allocate_optimizer(&model->expert_store, model->use_master_weights,
                                              model->ep.replicas.process_rank, model->ep.replicas.num_processes,
                                              zero_stage);
}

static void gpt2_zero_grad(GPT2* model, cudaStream_t stream) {
    sharded_parameters_zero_grad(&model->store, stream);
    if (model->config.num_experts > 0) sharded_parameters_zero_grad(&model->expert_store, stream);
}

// After the last micro-step's backward pass: the global norm of the step's gradient (the loss scale undone),
// identical on every process: the replicated tensors' part, plus every expert's, summed over the expert group.
static float gpt2_gradient_norm(GPT2* model, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    float norm2 = sharded_parameters_norm_squared(&model->store, mg, zero_stage, stream);
    if (model->config.num_experts > 0) {
        float experts2 = sharded_parameters_norm_squared(&model->expert_store, &model->ep.replicas, zero_stage, stream);
        norm2 += expert_parallel_float_sum(&model->ep, experts2, stream);
    }
    return sqrtf(norm2) / model->loss_scaler.scale;
}

// The AdamW step t (from 1) with gradient norm `norm`; a non-finite norm (FP16 overflow) skips it. Returns 1 if the
// parameters were updated. The loss scale changes afterwards (LossScaler).
static int gpt2_update(GPT2* model, const AdamWConfig* opt, float norm, int t, const MultiGpuConfig* mg,
                       int zero_stage, cudaStream_t stream) {
    int finite = isfinite(norm);
    if (finite) {
        float scale = model->loss_scaler.scale;
        sharded_parameters_apply_update(&model->store, opt, norm, scale, optimizer_next_seed(&model->rng_state), t, mg,
                                        zero_stage, stream);
        if (model->config.num_experts > 0)
            sharded_parameters_apply_update(&model->expert_store, opt, norm, scale,
                                            optimizer_next_seed(&model->rng_state), t, &model->ep.replicas, zero_stage,
                                            stream);
    }
    loss_scaler_update(&model->loss_scaler, norm);
    return finite;
}

// 6 flops per active parameter per token for the matmuls of forward+backward (a token meets k of the E experts of
// an MoE layer) plus the attention's 12 L C T
static double gpt2_flops_per_token(const GPT2* model, int T) {
    const GPT2Config* c = &model->config;
    size_t sizes[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(sizes, c, c->num_experts);
    double active = 0.0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++)
        active += is_expert_tensor(i) ? (double)sizes[i] * c->top_k / c->num_experts : (double)sizes[i];
    return 6.0 * active + 12.0 * c->num_layers * c->channels * (double)T;
}

// Whether every parameter of every process is finite (collective: the same answer on every process).
static int gpt2_parameters_finite(const GPT2* model, const MultiGpuConfig* mg, cudaStream_t stream) {
    const ShardedParameters* sets[2] = {&model->store, &model->expert_store};
    int bad = 0;
    for (int k = 0; k < (model->config.num_experts > 0 ? 2 : 1); k++) {
        size_t n = sets[k]->num_parameters;
        floatX* host = (floatX*)malloc_check(n * sizeof(floatX));
        cudaCheck(cudaMemcpyAsync(host, sets[k]->params_memory, n * sizeof(floatX), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
        for (size_t i = 0; i < n && !bad; i++) bad = !isfinite((float)host[i]);
        free(host);
    }
    return multi_gpu_cpu_float_sum((float)bad, mg) == 0.0f;
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


#define EXPERT_STATE_MAGIC 20261130

// The experts' optimizer state (m, v, and the master weights if any) of every expert, in the global layout of the
// model file's expert tensors, so that a run may resume with another expert-parallel degree or ZeRO stage:
// <dir>/expert_state_%08d.bin, header [0] magic, [1] version 1, [2] E, [3] Lm, [4] master weights 0/1,
// [5] precision, [6] and [7] the values per buffer (every expert's; high and low 31 bits); then each buffer in
// turn (fp32). Collective: the shards are gathered over the replicas, then process 0's group gathers the experts,
// and process 0 writes.
static void write_expert_state(const char* dir, int step, GPT2* model, int zero_stage, cudaStream_t stream) {
    const GPT2Config* c = &model->config;
    ShardedParameters* x = &model->expert_store;
    size_t all_experts = x->num_parameters * model->ep.degree;
    float* full;
    cudaCheck(cudaMalloc((void**)&full, x->num_parameters_padded * sizeof(float)));
    int gathers = model->ep.group == 0;  // process 0's group, the one that writes
    float* host = gathers ? (float*)malloc_check(all_experts * sizeof(float)) : NULL;
    char path[1024], tmp[1100];
    FILE* f = NULL;
    if (model->process_rank == 0) {
        checkpoint_paths(path, sizeof(path), dir, "expert_state", step, -1);
        f = fopen_tmp_for(path, tmp, sizeof(tmp));
        int header[256] = {0};
        header[0] = EXPERT_STATE_MAGIC;
        header[1] = 1;
        header[2] = c->num_experts;
        header[3] = num_moe_layers(c);
        header[4] = x->master_weights != NULL;
        header[5] = PRECISION_MODE;
        header[6] = (int)(all_experts >> 31);
        header[7] = (int)(all_experts & 0x7fffffff);
        fwrite_check(header, sizeof(int), 256, f, tmp);
    }
    for (int buffer = 0; buffer < (x->master_weights ? 3 : 2); buffer++) {
        sharded_parameters_gather_state(x, buffer, full, &model->ep.replicas, zero_stage, stream);
        if (gathers) gpt2_gather_experts(model, host, full, sizeof(float), stream);
        if (f) fwrite_check(host, sizeof(float), all_experts, f, tmp);
    }
    if (f) commit_tmp(f, tmp, path);
    free(host);
    cudaCheck(cudaFree(full));
}

// Each process reads its own experts' runs of every buffer and keeps its shard.
static void read_expert_state(const char* dir, int step, GPT2* model) {
    const GPT2Config* c = &model->config;
    ShardedParameters* x = &model->expert_store;
    size_t all_experts = x->num_parameters * model->ep.degree;
    char path[1024];
    checkpoint_paths(path, sizeof(path), dir, "expert_state", step, -1);
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, EXPERT_STATE_MAGIC, "MoE expert optimizer state");
    int Lm = num_moe_layers(c);
    size_t values = ((size_t)header[6] << 31) | (size_t)header[7];
    if (header[1] != 1 || header[2] != c->num_experts || header[3] != Lm || header[4] != (x->master_weights != NULL) ||
        header[5] != PRECISION_MODE || values != all_experts) {
        fprintf(stderr, "%s: expert state of another setup (E %d, MoE layers %d, master weights %d, precision %d, %zu "
                "values) than this run's (%d, %d, %d, %d, %zu)\n", path, header[2], header[3], header[4], header[5],
                values, c->num_experts, Lm, x->master_weights != NULL, PRECISION_MODE, all_experts);
        exit(EXIT_FAILURE);
    }
    size_t local[NUM_PARAMETER_TENSORS];
    fill_in_parameter_sizes(local, c, model->local_experts);
    float* full = (float*)calloc(x->num_parameters_padded, sizeof(float));
    for (int buffer = 0; buffer < (x->master_weights ? 3 : 2); buffer++) {
        // in the file: per tensor and MoE layer, the layer's E experts; ours are a contiguous run of them
        size_t file_offset = 1024 + (size_t)buffer * all_experts * sizeof(float), at = 0;
        for (int i = FIRST_EXPERT_TENSOR; i < FIRST_EXPERT_TENSOR + NUM_EXPERT_TENSORS; i++) {
            size_t run = local[i] / Lm;
            for (int m = 0; m < Lm; m++) {
                size_t position = file_offset + ((size_t)m * model->ep.degree + model->ep.member) * run * sizeof(float);
                if (fseek(f, (long)position, SEEK_SET) != 0) {
                    fprintf(stderr, "%s: cannot seek to byte %zu\n", path, position);
                    exit(EXIT_FAILURE);
                }
                fread_check(full + at, sizeof(float), run, f, path);
                at += run;
            }
            file_offset += local[i] * model->ep.degree * sizeof(float);
        }
        sharded_parameters_scatter_state(x, buffer, full);
    }
    long end = 1024 + (long)((x->master_weights ? 3 : 2) * all_experts * sizeof(float));
    if (fseek(f, 0, SEEK_END) != 0 || ftell(f) != end) {
        fprintf(stderr, "%s: expected %ld bytes, the file has another size\n", path, end);
        exit(EXIT_FAILURE);
    }
    free(full);
    fclose_check(f, path);
}

// Collective over all processes.
static void write_checkpoint(const char* dir, GPT2* model, const DataLoader* loader, const TrainerState* ts,
                             const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    char path[1024], tmp[1100];
    checkpoint_paths(path, sizeof(path), dir, "model", ts->step, -1);
    gpt2_write_model_file(model, path, stream);
    if (model->config.num_experts > 0) write_expert_state(dir, ts->step, model, zero_stage, stream);
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
    // every process checksums its own state file (in parallel, from the page cache); process 0 gathers them, which
    // is also the barrier before the DONE marker
    uint64_t mine[2], *all = (uint64_t*)malloc_check(2 * (size_t)mg->num_processes * sizeof(uint64_t));
    if (!checkpoint_checksum(path, &mine[0], &mine[1])) {
        fprintf(stderr, "%s: cannot read back the file just written\n", path);
        exit(EXIT_FAILURE);
    }
    uint64_t* device;
    cudaCheck(cudaMalloc((void**)&device, 2 * (size_t)(mg->num_processes + 1) * sizeof(uint64_t)));
    cudaCheck(cudaMemcpy(device, mine, sizeof(mine), cudaMemcpyHostToDevice));
    ncclCheck(ncclAllGather(device, device + 2, 2, ncclUint64, mg->nccl_comm, mg->nccl_stream));
    cudaCheck(cudaStreamSynchronize(mg->nccl_stream));
    cudaCheck(cudaMemcpy(all, device + 2, 2 * (size_t)mg->num_processes * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device));
    if (mg->process_rank == 0) {
        checkpoint_paths(path, sizeof(path), dir, "DONE", ts->step, -1);
        FILE* d = fopen_tmp_for(path, tmp, sizeof(tmp));
        int header[13];
        gpt2_model_header(model, header);
        fprintf(d, "checkpoint 1\nstep %d\nprocesses %d\nmodel", ts->step, mg->num_processes);
        for (int i = 1; i <= 12; i++) fprintf(d, " %d", header[i]);
        fprintf(d, "\n");
        const char* kinds[2] = {"model", "expert_state"};
        for (int k = 0; k < (model->config.num_experts > 0 ? 2 : 1); k++) {
            char file[1024];
            uint64_t size, hash;
            checkpoint_paths(file, sizeof(file), dir, kinds[k], ts->step, -1);
            if (!checkpoint_checksum(file, &size, &hash)) {
                fprintf(stderr, "%s: cannot read back the file just written\n", file);
                exit(EXIT_FAILURE);
            }
            fprintf(d, "file %s %llu %016llx\n", strrchr(file, '/') + 1, (unsigned long long)size,
                    (unsigned long long)hash);
        }
        for (int r = 0; r < mg->num_processes; r++) {
            char file[1024];
            checkpoint_paths(file, sizeof(file), dir, "state", ts->step, r);
            fprintf(d, "file %s %llu %016llx\n", strrchr(file, '/') + 1, (unsigned long long)all[2 * r],
                    (unsigned long long)all[2 * r + 1]);
        }
        commit_tmp(d, tmp, path);
    }
    free(all);
}

// Whether the checkpoint of `step` in dir is sound for this process: its DONE marker's step, process count and model
// header agree with the files, and the checksums of the model, the expert state and this process's state match.
// An empty DONE marker (an older trainer's) has no checksums: only the step and process count of the state and
// the model header's readability are checked, and *legacy is set. On failure `why` says what, naming the file.
static int verify_checkpoint(const char* dir, int step, int rank, int num_processes, int* legacy, char* why,
                             size_t why_size) {
    char done[1024], path[1024];
    checkpoint_paths(done, sizeof(done), dir, "DONE", step, -1);
    *legacy = 0;
    FILE* f = fopen(done, "r");
    if (f == NULL) { snprintf(why, why_size, "%s: cannot open", done); return 0; }
    char line[2048];
    int version = -1, done_step = -1, processes = -1, have_model = 0, model_header[13] = {0}, lines = 0;
    // the files the DONE lists, checked as they come; this process's state must be among them
    int checked_state = 0, ok = 1;
    while (ok && fgets(line, sizeof(line), f) != NULL) {
        lines++;
        char name[1024];
        unsigned long long size, hash;
        if (sscanf(line, "checkpoint %d", &version) == 1) continue;
        if (sscanf(line, "step %d", &done_step) == 1) continue;
        if (sscanf(line, "processes %d", &processes) == 1) continue;
        if (strncmp(line, "model ", 6) == 0) {
            char* at = line + 6;
            have_model = 1;
            for (int i = 1; i <= 12; i++) model_header[i] = (int)strtol(at, &at, 10);
            continue;
        }
        if (sscanf(line, "file %1023s %llu %llx", name, &size, &hash) == 3) {
            int r, s2;
            char rest;
            int is_state = sscanf(name, "state_%8d_%5d.bin%c", &s2, &r, &rest) == 2;
            if (is_state && r != rank) continue;  // every process checks its own
            snprintf(path, sizeof(path), "%s/%s", dir, name);
            uint64_t got_size, got_hash;
            if (!checkpoint_checksum(path, &got_size, &got_hash)) {
                snprintf(why, why_size, "%s: cannot read it", path);
                ok = 0;
            } else if (got_size != size || got_hash != hash) {
                snprintf(why, why_size, "%s: %llu bytes, checksum %016llx; %s lists %llu bytes, checksum %016llx", path,
                         (unsigned long long)got_size, (unsigned long long)got_hash, done, size, hash);
                ok = 0;
            }
            checked_state |= is_state;
            continue;
        }
        snprintf(why, why_size, "%s: unexpected line '%.60s'", done, line);
        ok = 0;
    }
    fclose(f);
    if (!ok) return 0;
    if (lines == 0) {
        *legacy = 1;
    } else if (version != 1 || done_step != step || processes != num_processes || !have_model || !checked_state) {
        snprintf(why, why_size, "%s: says checkpoint %d, step %d, %d processes%s; expected version 1, step %d, %d "
                 "processes and this process's state", done, version, done_step, processes,
                 have_model ? "" : ", no model header", step, num_processes);
        return 0;
    }
    // the files' own headers: the model's configuration as the DONE lists it, the state's step and process count
    checkpoint_paths(path, sizeof(path), dir, "model", step, -1);
    int header[256];
    FILE* m = fopen(path, "rb");
    if (m == NULL || fread(header, sizeof(int), 256, m) != 256) {
        if (m) fclose(m);
        snprintf(why, why_size, "%s: cannot read its header", path);
        return 0;
    }
    fclose(m);
    for (int i = 1; i <= 12 && !*legacy; i++) {
        if (header[i] != model_header[i]) {
            snprintf(why, why_size, "%s: header[%d] = %d, but %s says %d", path, i, header[i], done, model_header[i]);
            return 0;
        }
    }
    checkpoint_paths(path, sizeof(path), dir, "state", step, rank);
    FILE* st = fopen(path, "rb");
    if (st == NULL || fread(header, sizeof(int), 256, st) != 256) {
        if (st) fclose(st);
        snprintf(why, why_size, "%s: cannot read its header", path);
        return 0;
    }
    fclose(st);
    if (header[0] != GPT2_STATE_MAGIC || header[5] != step || header[2] != num_processes) {
        snprintf(why, why_size, "%s: a state of step %d for %d processes (magic %d), not of step %d for %d", path,
                 header[5], header[2], header[0], step, num_processes);
        return 0;
    }
    return 1;
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
    if (model->config.num_experts > 0) read_expert_state(dir, step, model);
}

// ----------------------------------------------------------------------------------------------------
// Sampling: autoregressive from the EOT token, printed through the tokenizer

// Every process that calls this computes the same tokens (the same weights and generator); only `print` prints.
static void sample_and_print(GPT2* model, const Tokenizer* tokenizer, int seed_token, int gen_tokens,
                             unsigned long long* sample_rng, int print, cudaStream_t stream) {
    int T = model->seq_len < gen_tokens + 1 ? model->seq_len : gen_tokens + 1;
    int Vp = model->config.padded_vocab_size, V = model->config.vocab_size;
    int* tokens = (int*)malloc_check((size_t)T * sizeof(int));
    floatX* logits_x = (floatX*)malloc_check((size_t)Vp * sizeof(floatX));
    float* logits = (float*)malloc_check((size_t)Vp * sizeof(float));
    tokens[0] = seed_token;  // checked by the caller to be a token of the model
    if (print) printf("generating:\n---\n");
    for (int t = 1; t < T; t++) {
        gpt2_forward(model, tokens, nullptr, 1, t, 0.0f, stream);
        cudaCheck(cudaMemcpy(logits_x, model->acts.output + (size_t)(t - 1) * Vp, (size_t)Vp * sizeof(floatX),
                             cudaMemcpyDeviceToHost));
        for (int v = 0; v < V; v++) logits[v] = (float)logits_x[v];
        int next = sample_softmax(logits, V, random_f32_host((uint64_t*)sample_rng));
        tokens[t] = next;
        if (!print) continue;
        // a token the tokenizer does not know (its vocabulary is smaller than the model's) prints as its id
        if (tokenizer->init_ok && (uint32_t)next < tokenizer->vocab_size) safe_printf(tokenizer_decode(tokenizer, next));
        else printf("<%d>", next);
        fflush(stdout);
    }
    if (print) printf("\n---\n");
    free(tokens);
    free(logits_x);
    free(logits);
}

// ----------------------------------------------------------------------------------------------------
// Command line

static void usage(int moe) {
    fprintf(stderr,
            "Usage:   ./%s [options]\n", moe ? "train_moe" : "train_gpt");
    fprintf(stderr,
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
            "  -ge <int>   GELU fusion into cuBLASLt epilogues: 0 off, 1 forward (only with -r 0: a recomputed GELU is\n"
            "              llmc/gelu.cuh's in the forward too), 2 forward and backward (default = 1)\n"
            "  -sl <float> skip the update when the loss z-score exceeds this (default = 0 = off)\n"
            "  -sg <float> skip the update when the gradient-norm z-score exceeds this (default = 0 = off)\n"
            "  -wt <int>   collective watchdog: end the job when processes wait on each other this many seconds\n"
            "              (default = 600, 0 = off)\n"
            "  -ns <int>   stop when the loss or gradient norm is not finite for this many steps in a row (default = 3)\n"
            "  -pi <string> process init: mpi, tcp or fs (default = mpi)\n"
            "  -pf <string> shared directory for -pi fs\n"
            "  -ps <string> server ip for -pi tcp\n"
            "  -pn <int>   number of processes (-pi tcp/fs)\n"
            "  -pr <int>   this process's rank (-pi tcp/fs)\n"
            "  -pg <int>   GPUs per node (-pi tcp/fs, default = 8)\n"
            "  -h          this help\n");
    if (moe) {
        fprintf(stderr,
                "MoE options (train_moe):\n"
                "  -ne <int>   experts per MoE layer (default = 8)\n"
                "  -tk <int>   experts per token: 1 = Switch, 2 = GShard (default = 1)\n"
                "  -me <int>   an MoE layer every N layers: 1 = all, 2 = every other (default = 2)\n"
                "  -eh <int>   expert hidden size (default = 4C)\n"
                "  -cf <float> capacity factor in training; <= 0: dropless (default = 1.25)\n"
                "  -cfe <float> capacity factor in evaluation (default = 2.0)\n"
                "  -ra <float> load-balancing loss coefficient (default = 0.01)\n"
                "  -rz <float> router z-loss coefficient (default = 0.001)\n"
                "  -ri <float> initialisation scale of router and expert weights (default = 0.1)\n"
                "  -ep <int>   expert-parallel degree N: groups of N processes share out the experts (default = 1)\n"
                "  -rj <float> router jitter: the router's input times U(1-rj, 1+rj) in training (default = 0)\n"
                "  -rn <int>   noisy top-k gating (Shazeer 2017), importance and load losses: 0/1 (default = 0;\n"
                "              a model file with a noise router has it on)\n"
                "  -rni <float> importance loss coefficient with -rn 1 (default = 0.1)\n"
                "  -rnl <float> load loss coefficient with -rn 1 (default = 0.1)\n");
    }
}




// The collective watchdog (-wt SECONDS): with several processes, a process that stops (a hung GPU, a stopped or
// lost node) leaves the others waiting forever inside an NCCL call. The training loop marks each phase that waits
// on the others (watchdog_begin: what and at which step; watchdog_end), and a thread checks every 100 ms that no
// phase has lasted longer than the limit; if one has, it names it and ends the whole job: ncclCommAbort on a GPU,
// then MPI_Abort (the CPU backend's NCCL is MPI, which MPI_Abort ends with every process of the job).
typedef struct {
    double limit_s;
    MultiGpuConfig* mg;
    const char* op;      // the phase in progress, NULL between phases (written by the loop, read by the thread)
    int step;
    long long start_ns;  // when it began
} Watchdog;
static Watchdog watchdog = {0.0, NULL, NULL, 0, 0};

static long long watchdog_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000ll + t.tv_nsec;
}

static void watchdog_begin(const char* op, int step) {
    // start before op: a thread that sees the new op also sees its start
    __atomic_store_n(&watchdog.step, step, __ATOMIC_RELAXED);
    __atomic_store_n(&watchdog.start_ns, watchdog_now_ns(), __ATOMIC_RELAXED);
    __atomic_store_n(&watchdog.op, op, __ATOMIC_RELEASE);
}

static void watchdog_end(void) { __atomic_store_n(&watchdog.op, (const char*)NULL, __ATOMIC_RELEASE); }

static void* watchdog_thread(void*) {
    for (;;) {
        usleep(100000);
        const char* op = __atomic_load_n(&watchdog.op, __ATOMIC_ACQUIRE);
        if (op == NULL) continue;
        long long start = __atomic_load_n(&watchdog.start_ns, __ATOMIC_RELAXED);
        if ((watchdog_now_ns() - start) * 1e-9 <= watchdog.limit_s) continue;
        if (op != __atomic_load_n(&watchdog.op, __ATOMIC_ACQUIRE)) continue;  // it has just ended
        fprintf(stderr, "watchdog: process %d, step %d: %s did not complete within %.0f s (-wt): another process is "
                "stuck or gone; aborting the job\n", watchdog.mg->process_rank, __atomic_load_n(&watchdog.step,
                __ATOMIC_RELAXED), op, watchdog.limit_s);
        fflush(stdout);
#ifndef __CUCC__
        ncclCommAbort(watchdog.mg->nccl_comm);  // frees the GPU's NCCL kernels (the CPU backend's NCCL is MPI)
        if (!watchdog.mg->used_mpi) _exit(EXIT_FAILURE);
#endif
        MPI_Abort(MPI_COMM_WORLD, EXIT_FAILURE);
        _exit(EXIT_FAILURE);
    }
    return NULL;
}

static void watchdog_start(MultiGpuConfig* mg, int limit_s) {
    if (limit_s <= 0 || mg->num_processes == 1) return;  // alone, nothing can stall a collective
    watchdog.limit_s = limit_s;
    watchdog.mg = mg;
    pthread_t thread;
    if (pthread_create(&thread, NULL, watchdog_thread, NULL) != 0) {
        fprintf(stderr, "-wt %d: cannot start the watchdog thread\n", limit_s);
        exit(EXIT_FAILURE);
    }
    pthread_detach(thread);
}

// One run at a time writes into an output directory: process 0 holds an exclusive flock on <dir>/train.lock (with
// its pid in it) for as long as it lives, and a second run is refused naming the holder. The kernel drops the lock
// when the process ends, however it ends, so a crashed run leaves no stale lock behind.
static void lock_output_dir(const char* dir) {
    create_dir_if_not_exists(dir);
    char path[1100];
    snprintf(path, sizeof(path), "%s/train.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) {
        fprintf(stderr, "-o %s: cannot open the lock file %s: %s\n", dir, path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char holder[32] = "";
        ssize_t got = pread(fd, holder, sizeof(holder) - 1, 0);
        holder[got > 0 ? got : 0] = '\0';
        holder[strcspn(holder, "\n")] = '\0';
        fprintf(stderr, "-o %s: in use by another run (pid %s holds %s)\n", dir, holder[0] ? holder : "unknown", path);
        exit(EXIT_FAILURE);
    }
    char pid[32];
    int n = snprintf(pid, sizeof(pid), "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, n, 0) != n) {
        fprintf(stderr, "-o %s: cannot write %s: %s\n", dir, path, strerror(errno));
        exit(EXIT_FAILURE);
    }
    // fd stays open (and locked) until the process exits
}

// A test hook (dev/test/test_train_gpt.sh): TRAIN_TEST_STOP_AT_STEP=N stops (SIGSTOP) the process of rank
// TRAIN_TEST_STOP_RANK (default 0) before training step N, as a hung or crashed process would stand still.
static void test_hook_stop(int step, int rank) {
    const char* at = getenv("TRAIN_TEST_STOP_AT_STEP");
    const char* who = getenv("TRAIN_TEST_STOP_RANK");
    if (at == NULL || atoi(at) != step || (who != NULL ? atoi(who) : 0) != rank) return;
    fprintf(stderr, "TRAIN_TEST_STOP_AT_STEP: process %d stops before step %d\n", rank, step);
    raise(SIGSTOP);
}

// Per MoE layer, after a validation pass: its aux and z losses, dropped choices and expert loads.
static void print_moe_layers(const GPT2* model, int N, Logger* logger, int step) {
    for (int m = 0; m < num_moe_layers(&model->config); m++) {
        MoELayerStatistics st = moe_layer_statistics(model, m, N);
        // aux: every balancing loss of the layer (Switch's, and noisy gating's importance and load losses)
        const float* losses = model->moe_losses_cpu + 4 * m;
        float aux = losses[0] + losses[2] + losses[3], z = losses[1];
        printf("val moe layer %d: aux %f z %f drop %f load min %.3f max %.3f cv %.3f\n", m, aux, z, st.drop_fraction,
               st.load_min, st.load_max, st.load_cv);
        char line[300];
        snprintf(line, sizeof(line), "s:%d layer:%d layer_aux:%f layer_z:%f layer_drop:%f layer_load_min:%.3f "
                 "layer_load_max:%.3f layer_load_cv:%.3f", step, m, aux, z, st.drop_fraction, st.load_min,
                 st.load_max, st.load_cv);
        logger_log_text(logger, line);
    }
}

// The start-up table: rows of a name and a value, printed with each column as wide as its widest entry.
typedef struct {
    char name[12][32];
    char value[12][128];
    int rows;
} InfoTable;

static void info_row(InfoTable* t, const char* name, const char* fmt, ...) {
    if (t->rows == 12) return;
    snprintf(t->name[t->rows], sizeof(t->name[0]), "%s", name);
    va_list args;
    va_start(args, fmt);
    vsnprintf(t->value[t->rows], sizeof(t->value[0]), fmt, args);
    va_end(args);
    t->rows++;
}

static void info_table_print(const InfoTable* t) {
    int wn = 0, wv = 0;
    for (int i = 0; i < t->rows; i++) {
        if ((int)strlen(t->name[i]) > wn) wn = (int)strlen(t->name[i]);
        if ((int)strlen(t->value[i]) > wv) wv = (int)strlen(t->value[i]);
    }
    char rule[200];
    int n = 0;
    rule[n++] = '+';
    for (int i = 0; i < wn + 2; i++) rule[n++] = '-';
    rule[n++] = '+';
    for (int i = 0; i < wv + 2; i++) rule[n++] = '-';
    rule[n++] = '+';
    rule[n] = '\0';
    printf("%s\n", rule);
    for (int i = 0; i < t->rows; i++) printf("| %-*s | %-*s |\n", wn, t->name[i], wv, t->value[i]);
    printf("%s\n", rule);
}

// Which trainer gpt2_main is: train_gpt.cu's (dense) or train_moe.cu's.
typedef enum { TRAINER_DENSE, TRAINER_MOE } TrainerKind;

// The trainer's main, shared by train_gpt.cu (TRAINER_DENSE) and train_moe.cu (TRAINER_MOE: MoE model files,
// descriptors with experts, the MoE flags, and aux/z/drop in the step line).
static int gpt2_main(int argc, char* argv[], TrainerKind kind) {
    const int moe = kind == TRAINER_MOE;
    // line-buffered even into a pipe or a file: the memory plan and every step line are out before a crash
    setvbuf(stdout, NULL, _IOLBF, 0);
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
    int B = 4, T = 1024, total_batch_size = -1, total_batch_size_set = 0, max_steps = -1, warmup_iterations = 0;
    float learning_rate = 3e-4f, final_lr_frac = 1.0f, weight_decay = 0.0f;
    int val_every = 20, val_max_steps = 20, sample_every = 20, gen_tokens = 64;
    int overfit_single_batch = 0, use_master_weights = 1, zero_stage = 0, recompute = 1, gelu_fusion = 1;
    float skip_update_lossz = 0.0f, skip_update_gradz = 0.0f;
    int num_processes = 1, process_rank = 0, gpus_per_node = 8;
    int num_experts = 8, top_k = 1, moe_every = 2, expert_hidden = 0, expert_parallel = 1;
    double capacity_factor = 1.25, capacity_factor_eval = 2.0;
    float aux_alpha = 0.01f, z_coef = 0.001f, router_jitter = 0.0f, init_scale = 0.1f;
    float importance_coef = 0.1f, load_coef = 0.1f;
    int noisy_topk = 0;
    int divergence_steps = 3, watchdog_s = 600;
    int shape_set[4] = {0, 0, 0, 0};  // -ne, -tk, -me, -eh given on the command line
    for (int i = 1; i < argc; i += 2) {
        const char* flag = argv[i];
        if (!strcmp(flag, "-h") || !strcmp(flag, "--help")) {
            usage(moe);
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
        else if (!strcmp(flag, "-d")) { total_batch_size = parse_int_flag(flag, v); total_batch_size_set = 1; }
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
        else if (!strcmp(flag, "-ns")) divergence_steps = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-wt")) watchdog_s = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-pi")) init_method = v;
        else if (!strcmp(flag, "-pf")) fs_path = v;
        else if (!strcmp(flag, "-ps")) server_ip = v;
        else if (!strcmp(flag, "-pn")) num_processes = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-pr")) process_rank = parse_int_flag(flag, v);
        else if (!strcmp(flag, "-pg")) gpus_per_node = parse_int_flag(flag, v);
        else if (moe && !strcmp(flag, "-ne")) { num_experts = parse_int_flag(flag, v); shape_set[0] = 1; }
        else if (moe && !strcmp(flag, "-tk")) { top_k = parse_int_flag(flag, v); shape_set[1] = 1; }
        else if (moe && !strcmp(flag, "-me")) { moe_every = parse_int_flag(flag, v); shape_set[2] = 1; }
        else if (moe && !strcmp(flag, "-eh")) { expert_hidden = parse_int_flag(flag, v); shape_set[3] = 1; }
        else if (moe && !strcmp(flag, "-cf")) capacity_factor = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-cfe")) capacity_factor_eval = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-ra")) aux_alpha = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-rz")) z_coef = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-rj")) router_jitter = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-rn")) noisy_topk = parse_int_flag(flag, v);
        else if (moe && !strcmp(flag, "-rni")) importance_coef = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-rnl")) load_coef = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-ri")) init_scale = parse_float_flag(flag, v);
        else if (moe && !strcmp(flag, "-ep")) expert_parallel = parse_int_flag(flag, v);
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
    if (moe) {
        if (!(router_jitter >= 0.0f && router_jitter < 1.0f)) { fprintf(stderr, "-rj %g: the jitter must be in [0, 1)\n", router_jitter); return EXIT_FAILURE; }
        if (noisy_topk != 0 && noisy_topk != 1) { fprintf(stderr, "-rn %d: expected 0 or 1\n", noisy_topk); return EXIT_FAILURE; }
        if (noisy_topk && top_k >= num_experts) { fprintf(stderr, "-rn 1: noisy top-k gating needs -tk (%d) below -ne (%d)\n", top_k, num_experts); return EXIT_FAILURE; }
        if (importance_coef < 0.0f || load_coef < 0.0f) { fprintf(stderr, "-rni and -rnl must not be negative\n"); return EXIT_FAILURE; }
        if (expert_parallel < 1) { fprintf(stderr, "-ep %d: the expert-parallel degree must be at least 1\n", expert_parallel); return EXIT_FAILURE; }
        if (num_experts < 1) { fprintf(stderr, "-ne %d: expected at least 1 expert\n", num_experts); return EXIT_FAILURE; }
        if (top_k < 1 || top_k > num_experts) { fprintf(stderr, "-tk %d: top-k must be between 1 and the number of experts (%d)\n", top_k, num_experts); return EXIT_FAILURE; }
        if (aux_alpha < 0.0f || z_coef < 0.0f || init_scale <= 0.0f) { fprintf(stderr, "-ra and -rz must not be negative, -ri must be positive\n"); return EXIT_FAILURE; }
    }
    // -d: default (absent) is B*T*processes; an explicit value must be a positive token count
    if (total_batch_size_set && total_batch_size < 1) { fprintf(stderr, "-d %d: expected a positive number of tokens per step\n", total_batch_size); return EXIT_FAILURE; }
    if (watchdog_s < 0) { fprintf(stderr, "-wt %d: expected seconds, or 0 for no watchdog\n", watchdog_s); return EXIT_FAILURE; }
    if (divergence_steps < 1) { fprintf(stderr, "-ns %d: expected at least 1 step\n", divergence_steps); return EXIT_FAILURE; }
    if (max_steps == 0 || max_steps < -1) { fprintf(stderr, "-x %d: expected a positive number of steps, or -1 for one epoch\n", max_steps); return EXIT_FAILURE; }
    {
        const char* names[] = {"-n", "-v", "-m", "-g", "-s"};
        int values[] = {checkpoint_every, val_every, val_max_steps, gen_tokens, sample_every};
        for (int i = 0; i < 5; i++) {
            if (values[i] < 0) { fprintf(stderr, "%s %d: expected 0 or a positive number\n", names[i], values[i]); return EXIT_FAILURE; }
        }
    }
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
    if (output_dir && rank0) lock_output_dir(output_dir);
    watchdog_start(&mg, watchdog_s);
    if (mg.num_processes % expert_parallel != 0) {
        fprintf(stderr, "-ep %d: the expert-parallel degree must divide the number of processes (%d)\n",
                expert_parallel, mg.num_processes);
        return EXIT_FAILURE;
    }
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
    model.moe.capacity_factor = capacity_factor;
    model.moe.capacity_factor_eval = capacity_factor_eval;
    model.moe.aux_alpha = aux_alpha;
    model.moe.z_coef = z_coef;
    model.moe.jitter = router_jitter;
    model.moe.importance_coef = importance_coef;
    model.moe.load_coef = load_coef;
    model.num_processes = mg.num_processes;
    model.process_rank = mg.process_rank;
    expert_parallel_init(&model.ep, &mg, expert_parallel);
    if (moe) {
        // a descriptor's experts (a model file brings its own)
        model.config.num_experts = num_experts;
        model.config.top_k = top_k;
        model.config.moe_every = moe_every;
        model.config.expert_hidden = expert_hidden;
        model.config.noisy_gating = noisy_topk;
    }
    char resume_dir_model[1024] = "";
    int resume_step = -1;
    if (resume) {
        // the latest complete checkpoint that every process verifies; else the one before it, and so on
        resume_step = find_latest_checkpoint(output_dir);
        int found_any = resume_step >= 0;
        while (resume_step >= 0) {
            char why[2600] = "";
            int legacy = 0;
            int ok = verify_checkpoint(output_dir, resume_step, mg.process_rank, mg.num_processes, &legacy, why,
                                       sizeof(why));
            if (!ok) fprintf(stderr, "-y 1: checkpoint step %d fails verification: %s\n", resume_step, why);
            if (multi_gpu_cpu_float_sum(ok ? 0.0f : 1.0f, &mg) == 0.0f) {
                if (legacy && rank0)
                    printf("note: %s/DONE_%08d has no checksums (an older checkpoint): loaded unverified\n", output_dir,
                           resume_step);
                break;
            }
            resume_step = find_checkpoint_before(output_dir, resume_step);
            if (rank0 && resume_step >= 0) printf("-y 1: trying the previous complete checkpoint, step %d\n", resume_step);
        }
        if (found_any && resume_step < 0) {
            fprintf(stderr, "-y 1: no complete checkpoint in %s passes verification\n", output_dir);
            return EXIT_FAILURE;
        }
        if (resume_step < 0) {
            if (rank0) printf("-y 1: no complete checkpoint in %s, starting from -e %s\n", output_dir, model_source);
        } else {
            checkpoint_paths(resume_dir_model, sizeof(resume_dir_model), output_dir, "model", resume_step, -1);
            model_source = resume_dir_model;
        }
    }
    if (file_exists(model_source)) gpt2_build_from_checkpoint(&model, model_source, moe);
    else if (model_source[0] == 'd' && isdigit((unsigned char)model_source[1]))
        gpt2_build_from_descriptor(&model, model_source, descriptor_vocab, descriptor_maxT, descriptor_seed, init_scale);
    else {
        fprintf(stderr, "-e %s: no such model file (and not a descriptor such as d12)\n", model_source);
        return EXIT_FAILURE;
    }
    const GPT2Config* cfg = &model.config;
    if (moe && file_exists(model_source)) {
        // the experts' shape is the model file's: a flag that says otherwise is a mistake, not a request
        const char* names[4] = {"-ne", "-tk", "-me", "-eh"};
        const char* what[4] = {"experts per MoE layer", "experts per token", "layers per MoE layer",
                               "as the experts' hidden size"};
        int given[4] = {num_experts, top_k, moe_every, expert_hidden};
        int has[4] = {cfg->num_experts, cfg->top_k, cfg->moe_every, cfg->expert_hidden};
        for (int i = 0; i < 4; i++) {
            if (shape_set[i] && given[i] != has[i]) {
                fprintf(stderr, "%s %d: the model file %s has %d %s (leave %s out, or start from a descriptor)\n",
                        names[i], given[i], model_source, has[i], what[i], names[i]);
                return EXIT_FAILURE;
            }
        }
    }
    if (noisy_topk && !cfg->noisy_gating) {
        fprintf(stderr, "-rn 1: %s has no noise router (header[12] = 0); noisy gating is part of the model: start "
                "from a descriptor with -rn 1\n", model_source);
        return EXIT_FAILURE;
    }
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
    // a sample is one forward pass over at most T positions: the first is the seed token, so T-1 are generated
    if (sample_every > 0 && gen_tokens > T - 1) {
        if (rank0) printf("-g %d: more than the sequence length -t %d allows; samples will have %d tokens\n", gen_tokens,
                          T, T - 1);
        gen_tokens = T - 1;
    }

    {
        // the activations and the optimizer state, before they are allocated: a line with what and how much, not a
        // bare out-of-memory error from the middle of the allocations
        size_t act = activation_bytes(cfg, &model.moe, B, T, recompute, model.ep.degree);
        int copies = use_master_weights && PRECISION_MODE != PRECISION_FP32 ? 3 : 2;
        size_t opt = (model.store.num_parameters_padded / (zero_stage ? mg.num_processes : 1) +
                      model.expert_store.num_parameters_padded / (zero_stage ? model.ep.replicas.num_processes : 1)) *
                     sizeof(float) * copies;
        size_t free_bytes = 0, total_bytes = 0;
        if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && act + opt > free_bytes) {
            fprintf(stderr, "%s: out of device memory: the activations (B=%d T=%d, recompute %d: %zu bytes) and the optimizer "
                    "state (%zu bytes) need %zu bytes, %zu are free\n", model_source, B, T, recompute, act, opt,
                    act + opt, free_bytes);
            return EXIT_FAILURE;
        }
    }
    // data
    DataLoader train_loader, val_loader;
    dataloader_init(&train_loader, train_pattern, B, T, mg.process_rank, mg.num_processes, !overfit_single_batch, 1337);
    int run_val = val_every > 0 && val_max_steps > 0 && strlen(val_pattern) > 0;
    if (run_val) dataloader_init(&val_loader, val_pattern, B, T, mg.process_rank, mg.num_processes, 0, 0);
    dataloader_set_vocab_size(&train_loader, cfg->vocab_size);
    if (run_val) dataloader_set_vocab_size(&val_loader, cfg->vocab_size);
    int train_num_batches = max_steps > 0 ? max_steps : (int)(dataloader_num_tokens(&train_loader) / total_batch_size);
    if (train_num_batches < 1) train_num_batches = 1;
    Tokenizer tokenizer;
    tokenizer_init(&tokenizer, tokenizer_path);
    // A tokenizer with more tokens than the model is not the model's: its EOT (the seed of every sample) may be no
    // token of the model at all, so it is not used. One with fewer decodes what it knows.
    if (tokenizer.init_ok && tokenizer.vocab_size > (uint32_t)cfg->vocab_size) {
        if (rank0) printf("note: tokenizer %s has %u tokens, more than the model's V = %d: not used, samples print token "
                          "ids\n", tokenizer_path, tokenizer.vocab_size, cfg->vocab_size);
        tokenizer_free(&tokenizer);
    } else if (tokenizer.init_ok && tokenizer.vocab_size != (uint32_t)cfg->vocab_size && rank0) {
        printf("note: tokenizer %s has %u tokens, the model %d: tokens it lacks print as <id>\n", tokenizer_path,
               tokenizer.vocab_size, cfg->vocab_size);
    }
    // Samples start from the end-of-text token: the tokenizer's, else the one the project's two vocabularies put last
    // (GPT-2's 50257 tokens, the byte level's 257), else token 0; never an id the model does not have.
    int sample_seed_token = 0;
    if (tokenizer.init_ok) sample_seed_token = tokenizer.eot_token;
    else if (cfg->vocab_size == 50257 || cfg->vocab_size == 257) sample_seed_token = cfg->vocab_size - 1;
    if (!tokenizer.init_ok && rank0 && sample_every > 0)
        printf("note: no tokenizer: samples start from token %d and print token ids\n", sample_seed_token);

    gpt2_allocate_activations(&model, B, T);
    gpt2_allocate_optimizer(&model, zero_stage);

    // the memory plan
    size_t param_bytes = (model.store.num_parameters_padded + model.expert_store.num_parameters_padded) * sizeof(floatX);
    size_t opt_bytes = (model.store.shard_size + model.expert_store.shard_size) * sizeof(float) *
                       (model.store.master_weights ? 3 : 2);
    size_t act_bytes = activation_bytes(cfg, &model.moe, B, T, recompute, model.ep.degree);
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    // the activations are already allocated: a batch fits if its activations fit in what they use plus what is free
    int max_fit_B = 0;
    while (max_fit_B < 65536 && activation_bytes(cfg, &model.moe, max_fit_B + 1, T, recompute, model.ep.degree) <= free_bytes + act_bytes) max_fit_B++;
    if (rank0) {
        // the start-up table: each column as wide as its widest entry
        InfoTable t = {};
        info_row(&t, "device", "%s", prop.name);
        info_row(&t, "precision", "%s", PRECISION_NAME);
        info_row(&t, "model", "L=%d NH=%d C=%d V=%d Vp=%d maxT=%d", cfg->num_layers, cfg->num_heads, cfg->channels,
                 cfg->vocab_size, cfg->padded_vocab_size, cfg->max_seq_len);
        info_row(&t, "parameters", "%zu", gpt2_num_parameters(cfg));
        if (cfg->num_experts > 0)
            info_row(&t, "experts", "%d per MoE layer, %d per process (-ep %d)", cfg->num_experts, model.local_experts,
                     model.ep.degree);
        info_row(&t, "batch", "B=%d T=%d processes=%d accumulation=%d", B, T, mg.num_processes, grad_accum_steps);
        info_row(&t, "memory: parameters", "%10.1f MiB", param_bytes / 1048576.0);
        info_row(&t, "memory: gradients", "%10.1f MiB", param_bytes / 1048576.0);
        info_row(&t, "memory: optimizer", "%10.1f MiB (m, v%s, ZeRO-%d shard)", opt_bytes / 1048576.0,
                 model.store.master_weights ? ", master" : "", zero_stage);
        info_row(&t, "memory: activations", "%10.1f MiB (recompute %d)", act_bytes / 1048576.0, recompute);
        info_row(&t, "largest B that fits", "%d", max_fit_B);
        info_table_print(&t);
    }

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
        read_checkpoint_state(output_dir, resume_step, &model, &train_loader, &ts, &mg);
        model.rng_state = ts.rng_state;
        model.loss_scaler.scale = ts.loss_scale;
        model.loss_scaler.good_steps = ts.good_steps;
        start_step = ts.step;
        if (rank0) printf("resumed from step %d of %s\n", start_step, output_dir);
    }
    if (output_dir) create_dir_if_not_exists(output_dir);
    Logger logger;
    logger_init(&logger, output_dir, mg.process_rank, resume_step >= 0);
    if (resume_step >= 0)
        logger_resume(&logger, start_step, run_val && (start_step % val_every == 0 || start_step == train_num_batches));
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
                watchdog_begin("validation", step);
                dataloader_next_batch(&val_loader);
                gpt2_forward(&model, val_loader.inputs, val_loader.targets, B, T, 0.0f, stream);
                val_loss += model.mean_loss;
            }
            watchdog_begin("the validation loss all-reduce", step);
            val_loss = multi_gpu_cpu_float_sum((float)(val_loss / val_max_steps), &mg) / mg.num_processes;
            watchdog_end();
            if (rank0) printf("val loss %f\n", val_loss);
            logger_log_val(&logger, step, (float)val_loss);
            if (rank0 && cfg->num_experts > 0) print_moe_layers(&model, B * T, &logger, step);
        }
        // with expert parallelism every process of the group takes part in each forward pass (the same tokens)
        if ((rank0 || model.ep.degree > 1) && sample_every > 0 && (step % sample_every == 0 || last_step) && gen_tokens > 0) {
            watchdog_begin("sampling", step);
            sample_and_print(&model, &tokenizer, sample_seed_token, gen_tokens, &ts.sample_rng_state, rank0, stream);
            watchdog_end();
        }
        int checkpoint_due = output_dir && checkpoint_every > 0 && step > start_step &&
                             (step % checkpoint_every == 0 || last_step);
        // never a checkpoint of non-finite state: not after a step whose loss or norm was not finite, and not of
        // parameters that are not (every process checks its own, so that all decide alike)
        if (checkpoint_due && bad_steps > 0) {
            if (rank0) printf("step %d: not finite for the last %d step%s: checkpoint not written\n", step, bad_steps,
                              bad_steps == 1 ? "" : "s");
            checkpoint_due = 0;
        } else if (checkpoint_due) {
            watchdog_begin("the checkpoint's parameter check", step);
            if (!gpt2_parameters_finite(&model, &mg, stream)) {
                if (rank0) printf("step %d: parameters not finite: checkpoint not written\n", step);
                checkpoint_due = 0;
            }
            watchdog_end();
        }
        if (checkpoint_due) {
            ts.step = step;
            ts.rng_state = model.rng_state;
            ts.loss_scale = model.loss_scaler.scale;
            ts.good_steps = model.loss_scaler.good_steps;
            watchdog_begin("writing the checkpoint", step);
            write_checkpoint(output_dir, &model, &train_loader, &ts, &mg, zero_stage, stream);
            watchdog_end();
            if (rank0) {
                printf("checkpoint written: step %d\n", step);
                // the newest -nk complete ones stay, whatever steps they are: so the last checkpoint written
                // before a run got into trouble is never the one deleted
                if (checkpoints_keep > 0) prune_checkpoints(output_dir, checkpoints_keep, mg.num_processes);
            }
        }
        if (last_step) break;

        test_hook_stop(step + 1, mg.process_rank);
        struct timespec ts0, ts1;
        clock_gettime(CLOCK_MONOTONIC, &ts0);
        gpt2_zero_grad(&model, stream);
        double step_loss = 0.0, step_aux = 0.0, step_z = 0.0, step_drop = 0.0, step_load_cv = 0.0;
        for (int micro = 0; micro < grad_accum_steps; micro++) {
            watchdog_begin("the forward and backward passes with the gradient reduction", step + 1);
            if (overfit_single_batch) dataloader_reset(&train_loader);
            dataloader_next_batch(&train_loader);
            float dlogits_scale = model.loss_scaler.scale / (float)(B * T * grad_accum_steps);
            model.noise_pass = (unsigned int)(step * grad_accum_steps + micro);
            gpt2_forward(&model, train_loader.inputs, train_loader.targets, B, T, dlogits_scale, stream);
            int last_micro_step = micro == grad_accum_steps - 1;
            gpt2_backward(&model, B, T, optimizer_next_seed(&model.rng_state), &mg, last_micro_step, zero_stage, stream);
            step_loss += model.mean_loss;
            step_aux += model.aux_loss + model.importance_loss + model.load_loss;  // every balancing loss
            step_z += model.z_loss;
            step_drop += model.drop_fraction;
            step_load_cv += model.load_cv;
        }
        float loss = (float)(step_loss / grad_accum_steps);
        watchdog_begin("the loss all-reduce", step + 1);
        if (mg.num_processes > 1) loss = multi_gpu_cpu_float_sum(loss, &mg) / mg.num_processes;
        watchdog_begin("the gradient norm all-reduce", step + 1);
        float norm = gpt2_gradient_norm(&model, &mg, zero_stage, stream);
        watchdog_end();
        // outliers: a spike in the loss or the gradient norm against the last 128 steps skips the update
        // divergence: a step whose loss or gradient norm is not finite updates nothing; -ns such steps in a row stop
        // the run. In FP16 a non-finite norm is an overflow the loss scale handles, until the scale is down to 1.
        int loss_finite = isfinite(loss);
        int norm_bad = !isfinite(norm) && (PRECISION_MODE != PRECISION_FP16 || model.loss_scaler.scale <= 1.0f);
        bad_steps = !loss_finite || norm_bad ? bad_steps + 1 : 0;
        double loss_z = update_detector(&ts.loss_outlier, loss);
        double norm_z = isfinite(norm) ? update_detector(&ts.norm_outlier, norm) : NAN;
        int loss_spike = skip_update_lossz > 0.0f && isfinite(loss_z) && loss_z > skip_update_lossz;
        int norm_spike = skip_update_gradz > 0.0f && isfinite(norm_z) && norm_z > skip_update_gradz;
        opt.learning_rate = lr_scheduler_get(&scheduler, step);
        watchdog_begin("the optimizer update", step + 1);
        if (!loss_spike && !norm_spike)
            gpt2_update(&model, &opt, loss_finite ? norm : NAN, step + 1, &mg, zero_stage, stream);
        cudaCheck(cudaStreamSynchronize(stream));
        watchdog_end();
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
            if (bad_steps > 0)
                printf("step %d: loss %f, gradient norm %f: not finite, update skipped (%d of -ns %d in a row)\n",
                       step + 1, loss, norm, bad_steps, divergence_steps);
            else if (!isfinite(norm) && PRECISION_MODE == PRECISION_FP16)
                printf("step %d: gradient overflow, update skipped, loss scale now %.0f\n", step + 1, model.loss_scaler.scale);
            char moe_fields[128] = "";
            if (cfg->num_experts > 0)
                snprintf(moe_fields, sizeof(moe_fields), " | aux %f | z %f | drop %.4f", step_aux / grad_accum_steps,
                         step_z / grad_accum_steps, step_drop / grad_accum_steps);
            if (mfu >= 0.0f)
                printf("step %d/%d | loss %f%s | norm %f | lr %e | %.2f ms | %.1f%% MFU | %.0f tok/s\n", step + 1,
                       train_num_batches, loss, moe_fields, norm, opt.learning_rate, ms, mfu, tokens_per_second);
            else
                printf("step %d/%d | loss %f%s | norm %f | lr %e | %.2f ms | %.0f tok/s\n", step + 1,
                       train_num_batches, loss, moe_fields, norm, opt.learning_rate, ms, tokens_per_second);
            fflush(stdout);
        }
        logger_log_train(&logger, step + 1, loss, norm, opt.learning_rate, ms, mfu, tokens_per_second);
        if (cfg->num_experts > 0) {
            char line[256];
            snprintf(line, sizeof(line), "s:%d aux:%f z:%f drop:%f load_min:%f load_max:%f load_cv:%f", step + 1,
                     step_aux / grad_accum_steps, step_z / grad_accum_steps, step_drop / grad_accum_steps,
                     model.load_min, model.load_max, step_load_cv / grad_accum_steps);
            logger_log_text(&logger, line);
        }
        if (bad_steps >= divergence_steps) {
            // every process saw the same loss and norm (both reduced over all of them): all stop here
            if (rank0) {
                int latest = output_dir ? find_latest_checkpoint(output_dir) : -1;
                char where[1100] = "no checkpoint to resume from";
                if (latest >= 0) snprintf(where, sizeof(where), "the last checkpoint is step %d in %s", latest, output_dir);
                fprintf(stderr, "step %d: training diverged: the loss or the gradient norm was not finite for %d steps "
                        "in a row (-ns %d); %s\n", step + 1, bad_steps, divergence_steps, where);
            }
            fflush(stdout);
            exit(EXIT_FAILURE);
        }
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
    expert_parallel_free(&model.ep);
    multi_gpu_config_free(&mg);
    return 0;
}

#ifndef TRAIN_GPT_LIBRARY
int main(int argc, char* argv[]) { return gpt2_main(argc, argv, TRAINER_DENSE); }
#endif
#endif
