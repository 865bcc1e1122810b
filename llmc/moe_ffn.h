// llmc/moe_ffn.h: the MoE layer as an FFN kind (doc/architecture.md, "Extensions"; doc/moe.md): its shape
// (MoEConfig) and hyperparameters (MoESettings), its tensors in the model file's extension slots and how they are
// sharded (the routers and shared experts in the model's replicated set, the routed experts in an own set over the
// processes that hold the same experts: llmc/expert_parallel.cuh), its activations, its forward and backward passes
// (router in fp32, top-k, slots, dispatch, the experts as batched or grouped GEMMs, combine; llmc/moe_*.cuh), and its
// pass and step boundaries. train_moe.cu includes it after train_gpt.cu, whose Model, FfnKind and ShardedParameters
// it uses, and fills train_gpt.cu's FfnExtension table with its functions. Its model file, checkpoint and telemetry
// parts are llmc/moe_model_file.h, moe_checkpoint.h and moe_telemetry.h.
// Tests (dev/test/run_tests.sh NAME, patterns work): moe-* and check-moe-* (test_moe.cu against train_moe.py),
// train-moe-cli, production-moe-*.
#pragma once
#include "expert_matmul.cuh"
#include "router_matmul.cuh"
#include "moe_router.cuh"
#include "moe_slots.cuh"
#include "moe_dispatch_combine.cuh"
#include "moe_losses.cuh"
#include "moe_balance.cuh"
#include "moe_noise.cuh"
#include "expert_parallel.cuh"

// The MoE model's shape (model-file header words 8..12 and 25..32): layer l's MLP is a Switch-MoE layer iff
// l >= first_dense and (l + 1 - first_dense) % moe_every == 0 (doc/moe.md).
typedef struct {
    int num_experts;   // E
    int top_k;         // k
    int moe_every;     // MoE every N layers
    int expert_hidden; // H
    int noisy_gating;  // noisy top-k gating: the MoE layers have routernw (doc/moe.md, "Router noise")
    int score;         // MOE_SCORE_SOFTMAX or MOE_SCORE_SIGMOID (doc/moe.md, "Routing options" 3)
    float routed_scale;  // rsf: the gates' factor (ibid. 5), 1 for a Switch model
    int shared_experts;  // S: dense experts every token of an MoE layer goes through (ibid. 2), 0: none
    int shared_hidden;   // H_s: their hidden size (0 exactly when S = 0)
    int balance_bias;    // 1: every MoE layer has aux-loss-free balancing's bias (ibid. 4 and 6; header word 29)
    int first_dense;     // the dense layers before the first MoE layer (DeepSeek's first_k_dense_replace), 0: none
    int expert_groups;   // G: the model's expert groups (ibid. 11, DeepSeek-V3's n_group), 0: none
    int kept_groups;     // M: the groups each token's experts lie in (topk_group), 0 exactly when G = 0
} MoEConfig;

// The MoE hyperparameters that are not part of the model file.
typedef struct {
    double capacity_factor;       // in training (<= 0: dropless)
    double capacity_factor_eval;  // in evaluation
    float aux_alpha;              // load-balancing loss coefficient
    float z_coef;                 // router z-loss coefficient
    float jitter;                 // router jitter EPS (0: off)
    float importance_coef;        // noisy gating's importance and load loss coefficients
    float load_coef;
    float init_scale;             // a descriptor's router and (shared) expert weights: GPT-2's std times
                                  // sqrt(init_scale)
    float bias_gamma;             // aux-loss-free balancing's step gamma (0: the bias, if any, stays fixed)
    int device_limit;             // M: each token's experts within M of the -ep groups (0: no limit)
    float seq_alpha;              // the sequence-wise balance loss's coefficient (0: off)
    int global_aux;               // 1: the Switch loss's f from the step's micro-batches so far on every process
} MoESettings;

// The extension's slots in the model file (train_gpt.cu's PARAM_EXTENSION + slot): the routers' and the shared
// experts' tensors live in the model's replicated parameter set, the routed experts' (efcw .. efcprojb) in the MoE's
// own set, where each process keeps those of its own experts (llmc/expert_parallel.cuh), reduced and sharded over the
// processes holding the same experts.
enum {
    MOE_ROUTERW, MOE_ROUTERNW, MOE_EFCW, MOE_EFCB, MOE_EFCPROJW, MOE_EFCPROJB,
    MOE_SHARED_FCW, MOE_SHARED_FCB, MOE_SHARED_FCPROJW, MOE_SHARED_FCPROJB
};
#define FIRST_EXPERT_SLOT MOE_EFCW
#define NUM_EXPERT_TENSORS 4
static int moe_is_expert_slot(int slot) {
    return slot >= FIRST_EXPERT_SLOT && slot < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS;
}

typedef struct {
    floatX* routerw;   // (Lm, E, C), Lm = the MoE layers
    floatX* routernw;  // (Lm, E, C) noisy gating's noise weights (noisy_gating only)
    floatX* efcw;      // (Lm, E_l, H, C) the experts' fc (E_l: this process's experts)
    floatX* efcb;      // (Lm, E_l, H)
    floatX* efcprojw;  // (Lm, E_l, C, H)
    floatX* efcprojb;  // (Lm, E_l, C)
    floatX* shared_fcw;      // (Lm, S, H_s, C) the shared experts (S = 0: empty)
    floatX* shared_fcb;      // (Lm, S, H_s)
    floatX* shared_fcprojw;  // (Lm, S, C, H_s)
    floatX* shared_fcprojb;  // (Lm, S, C)
} MoEParameterTensors;

// The MoE layers' activations (N = B*T tokens), kept per MoE layer for the backward pass. Rsrc = the rows of
// this process's dispatch layout, Rown = those of its experts' layout (llmc/expert_parallel.cuh; the same with one
// process per expert group): E*cap each when padded to a capacity, N*k and up to ep.degree*N*k when dropless.
// Every tensor once, in the order they are laid out in one allocation: X(type, name, elements), the elements an
// expression over moe_fill_in_activation_sizes' locals. The struct, the indices, the sizes and the pointers come
// from it.
#define MOE_ACTIVATION_TENSORS(X)                                                                                      \
    /* router_logits: (Lm, N, E) the logits routing uses (H, with noisy gating) */                                     \
    X(float, router_logits, Lm * NE)                                                                                   \
    X(float, router_clean, noisy * Lm * NE)              /* (Lm, N, E) noisy gating: the clean logits */               \
    /* router_noise: (Lm, N, E) noisy gating: the noise logits (softplus of them: the noise's std) */                  \
    X(float, router_noise, noisy * Lm * NE)                                                                            \
    X(float, router_probs, Lm * NE)                      /* (Lm, N, E) */                                              \
    X(float, router_lse, Lm * layer_stride(N))           /* (Lm, N) logsumexp, for the z-loss */                       \
    X(int, expert_index, Lm * NK)                        /* (Lm, N, k) */                                              \
    X(float, gates, Lm * NK)                             /* (Lm, N, k) */                                              \
    X(int, choice_row, Lm * NK)                          /* (Lm, N, k) row in the dispatch layout, -1 dropped */       \
    X(int, row_choice, Lm * rows_src)                    /* (Lm, Rsrc) the choice filling each row, -1 padding */      \
    X(int, expert_count, Lm * layer_stride(E))           /* (Lm, E) choices routed to each expert before dropping */   \
    X(int, kept_count, Lm * layer_stride(E))             /* (Lm, E) rows used */                                       \
    /* moe_stats: (Lm, MOE_LAYER_LOSSES + 2E) the layer's losses (MoELayerActivations.losses); noisy gating's */       \
    /*     Importance, Load (E) */                                                                                     \
    X(float, moe_stats, Lm * layer_stride(MOE_LAYER_LOSSES + 2 * E))                                                   \
    X(floatX, expert_input, Lm * rows_own * C)           /* (Lm, Rown, C) */                                           \
    /* expert_pre: (Lm, Rown, H) pre-GELU; llama (Lm, Rown, 2H) SwiGLU's [gate | up] */                                \
    X(floatX, expert_pre, Lm * rows_own * moe_fc_width(model, H))                                                      \
    /* expert_act: (Lm or 1, Rown, H) GELU (SwiGLU) output (recomputed with -r >= 1) */                                \
    X(floatX, expert_act, (recompute >= 1 ? 1 : Lm) * rows_own * H)                                                    \
    X(floatX, expert_output, Lm * rows_src * C)          /* (Lm, Rsrc, C) back in the dispatch layout */               \
    /* backward scratch (one layer) */                                                                                 \
    X(float, d_gates, NK)                                /* (N, k) */                                                  \
    /* d_logits: (N, E) of the routing's logits, then (noisy gating) of the clean ones */                              \
    X(float, d_logits, NE)                                                                                             \
    X(float, d_noise, noisy * NE)                        /* (N, E) noisy gating: of the noise logits */                \
    X(floatX, d_logits_x, NE)                            /* (N, E) */                                                  \
    /* noise_partials: noisy gating's loss scratch (moe_noisy_losses_partials_size) */                                 \
    X(float, noise_partials, noisy ? moe_noisy_losses_partials_size((int)E) : 0)                                       \
    /* slot_scratch: the slot assignment's per-tile counts (moe_assign_slots_scratch_size) */                          \
    X(int, slot_scratch, moe_assign_slots_scratch_size((int)N, (int)E, (int)K))                                        \
    /* loss_partials: the aux and z losses' partial sums (moe_router_losses_partials_size) */                          \
    X(float, loss_partials, moe_router_losses_partials_size())                                                         \
    /* seq_count: (Lm, B, E) the sequence-wise loss's choices per sequence and expert (seq_alpha > 0) */               \
    X(int, seq_count, seq * Lm * layer_stride(B * E))                                                                  \
    X(float, seq_partials, seq * B)                      /* (B) its per-sequence partial sums (seq_alpha > 0) */       \
    /* router_input: (2, N, C) with jitter: the router's jittered input and its gradient */                            \
    X(floatX, router_input, jitter * 2 * BTC)                                                                          \
    /* scratch_own: (Rown, C) the expert output, then the gradients of the experts' output and input */                \
    X(floatX, scratch_own, rows_own * C)                                                                               \
    X(floatX, d_expert_hidden, rows_own * H)             /* (Rown, H) */                                               \
    /* scratch_src: (Rsrc, C) the same in the dispatch layout, with expert parallelism only */                         \
    X(floatX, scratch_src, moe->ep.degree > 1 ? rows_src * C : 0)                                                      \
    /* lora_u, lora_g: (Rown, r) LoRA's rank-r intermediates over the experts (-fw experts; r = 0 without) */         \
    X(floatX, lora_u, lora_rank * rows_own)                                                                            \
    X(floatX, lora_g, lora_rank * rows_own)                                                                            \
    /* bias_scratch: the (shared) experts' bias-gradient scratch */                                                    \
    X(float, bias_scratch, bias_scratch > shared ? bias_scratch : shared)                                              \
    /* shared_pre: (Lm, S, N, H_s) the shared experts' pre-GELU; llama (Lm, S, N, 2H_s) [gate | up] */                 \
    X(floatX, shared_pre, Lm * S * N * moe_fc_width(model, Hs))                                                        \
    /* shared_act: (Lm or 1, S, N, H_s) their GELU (SwiGLU) output (recomputed with -r >= 1) */                        \
    X(floatX, shared_act, (recompute >= 1 ? 1 : Lm) * S * N * Hs)                                                      \
    X(floatX, d_shared_hidden, N * Hs)                   /* (N, H_s) */
typedef struct {
    MOE_ACTIVATION_TENSORS(ACTIVATION_FIELD)
} MoEActivations;
#define MOE_ACTIVATION_INDEX(type, name, elements) MOE_ACT_##name,
enum { MOE_ACTIVATION_TENSORS(MOE_ACTIVATION_INDEX) NUM_MOE_ACTIVATION_TENSORS };
// per MoE layer: the load-balancing, z, importance, load and sequence-wise losses
#define MOE_LAYER_LOSSES 5

// What one micro-batch keeps from its forward pass to its backward pass and telemetry: the activations and the
// per-layer host values (Lm: the MoE layers of this process's pipeline stage, every MoE layer at -pp 1). One such slot,
// or under -pp one per activation slot of the model (moe_use_slot).
typedef struct {
    MoEActivations acts;
    void* acts_memory;
    int* rows_src;              // (Lm, E) pinned host: rows per global expert in this process's dispatch layout
    cudaEvent_t counts_copied;  // dropless: the layer's rows_src are there (moe_layer_row_counts_finish)
    int* rows_own;              // (Lm, E) host: rows per (group member, local expert) in the expert layout
    int* expert_counts_cpu;     // (Lm, E) pinned host
    int* kept_counts_cpu;       // (Lm, E) pinned host
    float* losses_cpu;          // (Lm, MOE_LAYER_LOSSES) pinned host: aux, z, importance, load, seq of each layer
    cudaEvent_t statistics_copied;  // those are there once this has completed (moe_statistics)
    int statistics_tokens;      // N of the forward pass they are of; 0 once moe_statistics has read them
} MoESlot;

// Under -pp the last pass's per-layer statistics and the balancing biases of every MoE layer of the model, put
// together from the stages for the reports (moe_join_stages): (Lmodel, E) and (Lmodel, MOE_LAYER_LOSSES) host.
// ... and the step line's sums (moe_join_stages): 4, then each stage's load min and max
#define MOE_STEP_SUMS (4 + 2 * PIPELINE_MAX_STAGES)
typedef struct {
    int* expert_counts;
    int* kept_counts;
    float* losses;
    float* bias;
    double* step_sums;  // (MOE_STEP_SUMS) device
} MoEStagesReport;

// The MoE extension's state (Model.extension_state).
typedef struct {
    MoEConfig config;
    int config_from_file;     // the shape came from a model file's header (else from the flags: a descriptor's)
    MoESettings settings;
    ExpertParallel ep;        // which process holds which experts (degree 1: every process all of them)
    int local_experts;        // experts per MoE layer on this process: E / ep.degree
    int expert_tp;            // -etp: 1, each expert whole (folded under -tp N), or N, each expert's hidden units
                              // split over the N tensor-parallel members (moe_routing_groups)
    MoEParameterTensors params;
    ShardedParameters expert_store;  // this process's experts, replicated over ep.replicas
    MoESlot* slot;              // the activations in use (moe_use_slot)
    MoESlot** slots;            // every one allocated (moe_allocate_activations)
    int num_slots;
    // of the last forward pass
    int capacity_used;          // rows per expert
    int dropless;               // dropless routing (-cf 0): the expert buffers packed (else padded to capacity)
    int training;               // a training pass (jitter and noise on)
    float aux_grad_scale;       // scale of the aux and z gradients (the loss-scale / micro-steps)
    float aux_loss, z_loss;     // summed over MoE layers
    float importance_loss, load_loss;  // noisy gating's, summed over MoE layers
    float seq_loss;             // the sequence-wise balance loss, summed over MoE layers
    int seq_tokens;             // T of the last forward pass (moe_begin_forward)
    float drop_fraction;        // dropped choices / all choices, over MoE layers
    float load_min, load_max, load_cv;  // expert loads (choices before dropping / mean), over MoE layers
    // the training step's sums over micro-steps (the step line)
    double step_aux, step_z, step_drop, step_load_cv;
    // aux-loss-free balancing (doc/moe.md, "Routing options" 6): routing state, not parameters
    int file_has_bias;          // the model file read had the biases after its parameters (header word 29)
    float* balance_bias;        // (Lm, E) device fp32, with config.balance_bias; else NULL
    int* step_loads;            // (Lm, E) device: the step's choices per expert before dropping, this process's
                                // training passes so far (each layer's added as its router runs); all-reduced over
                                // the processes at the update
    // the routed loads' telemetry (doc/moe.md, "Telemetry"): each update's summed loads come to the host, every MoE
    // layer's of the model (Lmodel; under -pp put together from the stages in model_loads)
    int* model_loads;               // (Lmodel, E) device, under -pp; else NULL
    int* step_loads_cpu;            // (Lmodel, E) pinned host
    cudaEvent_t step_loads_copied;  // they are there once this has completed
    int step_loads_pending;         // a copy not yet taken in by moe_take_step_loads
    long long* window_loads;        // (Lmodel, E) host: the loads since the last validation
    int window_steps;               // the steps they are of
    int* quiet_steps;               // (Lmodel, E) host: steps in a row in which the expert had no token
    MoEStagesReport report;         // -pp: the stages' last pass and biases (moe_join_stages)
    // the global-batch balance loss (doc/moe.md, "Routing options" 8; global_aux): the step's training
    // passes so far, and step_loads summed over every process (what the Switch loss's f reads); the pass's aux
    // coefficient (moe_begin_forward)
    int global_passes;
    int* global_counts;         // (Lm, E) device, with more than one process (else step_loads is the sum)
    float aux_alpha_pass;
    // test_moe.cu's teacher-forced routing (doc/moe.md, "Teacher-forced routing"): called after each MoE layer's
    // top-k, it may replace the choices (expert_index, (N, k)) and their gates, which it computes from this pass's
    // probs and logits, before the slots, the dispatch and the losses read them. NULL in the trainer, where no flag
    // or file sets it.
    void (*route_hook)(Model* model, int m, int* expert_index, float* gates, const float* probs, const float* logits,
                       int N, cudaStream_t stream);
} MoEModel;

static MoEModel* moe_of(const Model* model) { return (MoEModel*)model->extension_state; }
// A llama MoE's experts, routed and shared, are SwiGLU MLPs without biases (doc/moe.md, "Routing
// options and the llama MoE"): fc has 2H outputs, each row [gate (H) | up (H)] as in llmc/swiglu.cuh; a bias slot
// has size 0. gpt2's are GPT-2's MLP: fc has H outputs, and biases.
static int moe_swiglu(const Model* model) { return model->config.activation == ACTIVATION_SWIGLU; }
static size_t moe_fc_width(const Model* model, size_t hidden) { return (moe_swiglu(model) ? 2 : 1) * hidden; }
static size_t moe_bias_size(const Model* model, size_t n) { return model->config.biases ? n : 0; }

// MoE layer m's slices of the parameters: the same struct, each pointer at layer m
static MoEParameterTensors moe_layer_parameters(const Model* model, const MoEParameterTensors* p, int m) {
    const MoEModel* moe = moe_of(model);
    size_t E = moe->config.num_experts, E_l = moe->local_experts, H = moe->config.expert_hidden / moe->expert_tp;
    size_t S = moe->config.shared_experts, Hs = moe->config.shared_hidden;
    size_t C = model->config.channels, l = m;
    MoEParameterTensors lp;
    lp.routerw = p->routerw + l * E * C;
    lp.routernw = p->routernw + l * E * C;
    size_t FC = moe_fc_width(model, H), FCs = moe_fc_width(model, Hs);
    lp.efcw = p->efcw + l * E_l * FC * C;
    lp.efcb = p->efcb + l * moe_bias_size(model, E_l * H);
    lp.efcprojw = p->efcprojw + l * E_l * C * H;
    lp.efcprojb = p->efcprojb + l * moe_bias_size(model, E_l * C);
    lp.shared_fcw = p->shared_fcw + l * S * FCs * C;
    lp.shared_fcb = p->shared_fcb + l * moe_bias_size(model, S * Hs);
    lp.shared_fcprojw = p->shared_fcprojw + l * S * C * Hs;
    lp.shared_fcprojb = p->shared_fcprojb + l * moe_bias_size(model, S * C);
    return lp;
}

static int is_moe_layer(const MoEConfig* c, int l) {
    return l >= c->first_dense && (l + 1 - c->first_dense) % c->moe_every == 0;
}
// the model's MoE layers (Lmodel), and MoE layer l's index among them
static int num_moe_layers(const Model* model) {
    const MoEConfig* c = &moe_of(model)->config;
    return (model->config.num_layers - c->first_dense) / c->moe_every;
}
static int moe_index(const MoEModel* moe, int l) {
    return (l + 1 - moe->config.first_dense) / moe->config.moe_every - 1;
}
static int moe_layer_of(const MoEModel* moe, int m) {
    return (m + 1) * moe->config.moe_every - 1 + moe->config.first_dense;
}
// Under -pp a process holds and runs its stage's MoE layers only (Lm of them; llmc/model_pipeline.h cuts the extension
// slots' tensors by the layers they replace), chunk after chunk: MoE layer l's index among them, and the model's MoE
// index of each of them (`model_index`, Lm values). At -pp 1 both are the model's.
static int moe_stage_layers(const Model* model) {
    return model_stage_layers(model) - model_stage_dense_layers(model);
}
static int moe_stage_index(const Model* model, int l) {
    return model_local_layer(model, l) - model_stage_dense_index(model, l);
}
static int moe_stage_model_indices(const Model* model, int* model_index) {
    StageCut cut = model_stage_cut(model);
    int n = 0;
    for (int c = 0; c < cut.chunks; c++)
        for (int l = cut_begin(&cut, model_pp_stage(model), c); l < cut_end(&cut, model_pp_stage(model), c); l++)
            if (is_moe_layer(&moe_of(model)->config, l)) model_index[n++] = moe_index(moe_of(model), l);
    return n;
}

// Under tensor parallelism (-tp N, llmc/model_tensor_parallel.h) the MoE layers fold expert parallelism over the
// TP x DP processes (-etp 1, Megatron's "MoE parallel folding"; doc/parallelism.md): the experts stay whole, the -ep
// groups are formed over all processes, and each member routes its own contiguous B*T/N tokens of the micro-batch,
// rows [member B*T/N, (member + 1) B*T/N), as a routing group of its own (N groups per micro-batch, each with its
// own capacity and balance losses, as N data-parallel processes of B/N sequences would route them). The layer reads
// those rows of the gathered ln2 and writes those rows of its output, the others zero, so that the model's sum over
// the members puts the members' rows together; the routers' and shared experts' gradients, each member's tokens'
// part, are summed over the members before the data-parallel reduction, as the norms' are with -sp 1.
// With -etp N instead each expert's hidden units are split over the members like the dense MLP's (fc by rows, fcproj
// by columns, its bias added by member 0): every member routes the whole micro-batch (identically: the same input,
// weights and kernels), dispatches it over its -ep group (formed over the data-parallel processes), and its part of
// the output is summed by the model's join; the gates' gradient, each member's part, is summed over the members
// before the router's backward, whose input gradient member 0 adds. The shared experts run whole on member 0 (the
// others' gradients of them zero, summed over the members as above).
static int moe_expert_split(const Model* model) { return moe_of(model)->expert_tp; }
static int moe_routing_groups(const Model* model) { return moe_expert_split(model) > 1 ? 1 : model_tp_degree(model); }
static int moe_routed_tokens(const Model* model, int BT) { return BT / moe_routing_groups(model); }
// which slice of each expert this process holds: its member index at -etp N, else 0 (the one slice, whole)
static int moe_expert_member(const Model* model) { return moe_expert_split(model) > 1 ? model_tp_member(model) : 0; }
// whether this process runs the parts that the members share at -etp N: the shared experts, fcproj's bias, the
// router's input gradient
static int moe_member_zero(const Model* model) { return moe_expert_split(model) == 1 || model_tp_member(model) == 0; }

// The model starts as one process holding every expert; moe_model_set_processes shares them out.
static void moe_model_init(MoEModel* moe, const MoEConfig* config, const MoESettings* settings) {
    memset(moe, 0, sizeof(*moe));
    moe->config = *config;
    moe->settings = *settings;
    moe->ep.degree = 1;
    moe->ep.replicas.num_processes = 1;
    moe->expert_tp = 1;
}

// ----------------------------------------------------------------------------------------------------
// The parameters: the slots' sizes, initialisation, allocation and how they are sharded

static int moe_replaces_mlp(const Model* model, int l) { return is_moe_layer(&moe_of(model)->config, l); }

// the slots' sizes over `layers` MoE layers with E experts each, each with 1/hidden_split of its hidden units: the
// file's (every layer, all experts, whole) or a process's (its stage's layers, its own experts, its slices of them at
// -etp N: moe_own_slot_sizes)
static void moe_slot_sizes(const Model* model, int layers, int experts, int hidden_split, size_t* sizes) {
    const MoEConfig* c = &moe_of(model)->config;
    size_t Lm = layers, C = model->config.channels, E = experts, H = c->expert_hidden / hidden_split;
    sizes[MOE_ROUTERW] = Lm * c->num_experts * C;  // the router scores every expert on every process
    sizes[MOE_ROUTERNW] = c->noisy_gating ? Lm * c->num_experts * C : 0;
    sizes[MOE_EFCW] = Lm * E * moe_fc_width(model, H) * C;
    sizes[MOE_EFCB] = Lm * moe_bias_size(model, E * H);
    sizes[MOE_EFCPROJW] = Lm * E * C * H;
    sizes[MOE_EFCPROJB] = Lm * moe_bias_size(model, E * C);
    size_t S = c->shared_experts, Hs = c->shared_hidden;  // every process holds the shared experts
    sizes[MOE_SHARED_FCW] = Lm * S * moe_fc_width(model, Hs) * C;
    sizes[MOE_SHARED_FCB] = Lm * moe_bias_size(model, S * Hs);
    sizes[MOE_SHARED_FCPROJW] = Lm * S * C * Hs;
    sizes[MOE_SHARED_FCPROJB] = Lm * moe_bias_size(model, S * C);
}

static void moe_file_slot_sizes(const Model* model, size_t* sizes) {
    moe_slot_sizes(model, num_moe_layers(model), moe_of(model)->config.num_experts, 1, sizes);
}
static void moe_own_slot_sizes(const Model* model, size_t* sizes) {
    moe_slot_sizes(model, moe_stage_layers(model), moe_of(model)->local_experts, moe_expert_split(model), sizes);
}

// the routers and shared experts of the stage's MoE layers in the replicated set
static void moe_tensor_sizes(const Model* model, size_t* in_file, size_t* in_replicated_set) {
    moe_file_slot_sizes(model, in_file);
    moe_slot_sizes(model, moe_stage_layers(model), moe_of(model)->config.num_experts, 1, in_replicated_set);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) in_replicated_set[i] = 0;
}

// Switch's reduced initialisation scale: router and (shared) expert weights drawn with GPT-2's std times
// sqrt(-ri), the projections into the residual with its residual scale; routernw starts at 0 (Shazeer)
static float moe_init_std(const Model* model, int slot, float residual_scale) {
    if (slot == MOE_ROUTERNW) return 0.0f;
    int projection = slot == MOE_EFCPROJW || slot == MOE_SHARED_FCPROJW;
    return (projection ? 0.02f * residual_scale : 0.02f) * sqrtf(moe_of(model)->settings.init_scale);
}

static size_t moe_own_parameter_count(const Model* model) {
    size_t sizes[MLP_EXTENSION_SLOTS], n = 0;
    moe_own_slot_sizes(model, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) n += sizes[i];
    return n;
}

// the slots' pointers: the replicated ones one after another from `replicated` (the extension's part of the
// model's set), the experts' from `experts` (the MoE's own set)
static void moe_point_parameters(MoEParameterTensors* p, floatX* replicated, floatX* experts, const size_t* sizes) {
    floatX** ptrs[MLP_EXTENSION_SLOTS] = {&p->routerw, &p->routernw, &p->efcw, &p->efcb, &p->efcprojw, &p->efcprojb,
                                          &p->shared_fcw, &p->shared_fcb, &p->shared_fcprojw, &p->shared_fcprojb};
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++) {
        floatX** next = moe_is_expert_slot(i) ? &experts : &replicated;
        *ptrs[i] = *next;
        *next += sizes[i];
    }
}

static const int moe_expert_decays[NUM_EXPERT_TENSORS] = {1, 0, 1, 0};

static void moe_allocate_parameters(Model* model) {
    MoEModel* moe = moe_of(model);
    size_t sizes[MLP_EXTENSION_SLOTS];
    if (moe_stage_layers(model) == 0) {  // its sets, buckets and routing state are per MoE layer
        StageCut cut = model_stage_cut(model);
        fprintf(stderr, "-pp %d: stage %d (layers %d..%d) holds no MoE layer: each stage needs one (-ppl, -me, -md)\n",
                cut.stages, model_pp_stage(model), cut_begin(&cut, model_pp_stage(model), 0),
                cut_end(&cut, model_pp_stage(model), 0) - 1);
        exit(EXIT_FAILURE);
    }
    moe_own_slot_sizes(model, sizes);
    // fine-tuning (-ft) freezes the experts with the rest of the model: no gradients, optimizer state or reductions
    if (model->frozen)
        sharded_parameters_allocate_frozen(&moe->expert_store, NUM_EXPERT_TENSORS, sizes + FIRST_EXPERT_SLOT,
                                           moe_expert_decays, moe->ep.replicas.process_rank,
                                           moe->ep.replicas.num_processes, model->zero_stage);
    else
        sharded_parameters_allocate(&moe->expert_store, NUM_EXPERT_TENSORS, sizes + FIRST_EXPERT_SLOT,
                                    moe_expert_decays, moe->ep.replicas.process_rank, moe->ep.replicas.num_processes,
                                    model->zero_stage);
    // an owner's expert gradient sums the routing groups of its -ep group's ep.degree processes, which the replicas
    // then average: the step's gradient (the mean over the data-parallel groups, each of moe_routing_groups routing
    // groups whose tokens' gradients are already the data-parallel group's part) is that times groups / ep.degree
    moe->expert_store.grad_multiplier = (float)moe_routing_groups(model) / (float)moe->ep.degree;
    size_t routers = sharded_parameters_offset(&model->store, PARAM_EXTENSION);
    if (model->zero_stage < 3)
        moe_point_parameters(&moe->params, model->store.params_memory + routers, moe->expert_store.params_memory,
                             sizes);
    else
        memset(&moe->params, 0, sizeof(moe->params));  // gathered per layer (moe_layer_weights)
    // ZeRO-2/3: MoE layers alternate between two buckets of one layer's expert slices, as the model's layers do
    // between theirs (model_allocate_gradient_buckets sizes those for the routers' slices too); ZeRO-3 between two
    // gather buffers alike (the model's hold the routers' slices). Frozen, the gather buffers only.
    if (model->zero_stage >= 2) {
        size_t layer = 0, Lm = moe_stage_layers(model);
        for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) layer += sizes[i] / Lm;
        if (!model->frozen)
            for (int b = 0; b < 2; b++) sharded_parameters_add_bucket(&moe->expert_store, layer);
        if (model->zero_stage == 3)
            for (int b = 0; b < 2; b++) sharded_parameters_add_gather_buffer(&moe->expert_store, layer);
    }
    // the balancing biases start at 0 (a descriptor's, or -rb on a model file without them); a file's replace them
    // (moe_read_file_tail). Replicated on every process of the stage: each updates them from the same summed loads.
    size_t biases = (size_t)moe_stage_layers(model) * moe->config.num_experts;
    size_t model_biases = (size_t)num_moe_layers(model) * moe->config.num_experts;
    if (moe->config.balance_bias) {
        cudaCheck(cudaMalloc(&moe->balance_bias, biases * sizeof(float)));
        cudaCheck(cudaMemset(moe->balance_bias, 0, biases * sizeof(float)));
    }
    // the step's loads move the biases (-rb) and feed the telemetry (moe_take_step_loads)
    cudaCheck(cudaMalloc(&moe->step_loads, biases * sizeof(int)));
    cudaCheck(cudaMemset(moe->step_loads, 0, biases * sizeof(int)));
    if (model_pp_stages(model) > 1) {
        cudaCheck(cudaMalloc(&moe->model_loads, model_biases * sizeof(int)));
        moe->report.expert_counts = (int*)malloc_check(model_biases * sizeof(int));
        moe->report.kept_counts = (int*)malloc_check(model_biases * sizeof(int));
        moe->report.losses = (float*)malloc_check((size_t)num_moe_layers(model) * MOE_LAYER_LOSSES * sizeof(float));
        moe->report.bias = (float*)malloc_check(model_biases * sizeof(float));
        cudaCheck(cudaMalloc(&moe->report.step_sums, MOE_STEP_SUMS * sizeof(double)));
    }
    cudaCheck(cudaMallocHost((void**)&moe->step_loads_cpu, model_biases * sizeof(int)));
    cudaCheck(cudaEventCreateWithFlags(&moe->step_loads_copied, cudaEventDisableTiming));
    moe->window_loads = (long long*)malloc_check(model_biases * sizeof(long long));
    memset(moe->window_loads, 0, model_biases * sizeof(long long));
    moe->quiet_steps = (int*)malloc_check(model_biases * sizeof(int));
    memset(moe->quiet_steps, 0, model_biases * sizeof(int));
    if (moe->settings.global_aux && model->num_processes * moe_routing_groups(model) > 1)
        cudaCheck(cudaMalloc(&moe->global_counts, biases * sizeof(int)));
}

// How expert tensor `slot` of `experts` experts per MoE layer (each expert's matrices one after another, layer by
// layer) is cut over the -etp N members: fc by rows (SwiGLU's gate and up halves alike) and its bias likewise, fcproj
// by columns, its bias whole (added by member 0)
static TensorSplit moe_expert_tensor_split(const Model* model, int slot, size_t experts) {
    size_t C = model->config.channels, H = moe_of(model)->config.expert_hidden;
    size_t layers = (size_t)moe_stage_layers(model) * experts;
    int swiglu = moe_swiglu(model);
    TensorSplit fc = {SPLIT_ROWS, layers, moe_fc_width(model, H), C, swiglu ? 2 : 1, {H, H, 0}};
    TensorSplit fcb = {SPLIT_ROWS, layers, H, 1, 1, {H, 0, 0}};
    TensorSplit proj = {SPLIT_COLUMNS, layers, C, H, 0, {0, 0, 0}};
    TensorSplit projb = {SPLIT_NONE, layers, C, 1, 0, {0, 0, 0}};
    return slot == MOE_EFCW ? fc : slot == MOE_EFCB ? fcb : slot == MOE_EFCPROJW ? proj : projb;
}
// Member `member`'s slices of every expert tensor of `experts` experts of the stage's MoE layers (host, laid out as
// the expert set: tensor by tensor, each (Lm, experts, ...)) from the whole experts, or the inverse (to_whole), elem
// bytes per value. At -etp 1 the one slice is the whole expert.
static void moe_cut_experts(const Model* model, size_t experts, int member, void* whole, void* slices, size_t elem,
                            int to_whole) {
    size_t sizes[MLP_EXTENSION_SLOTS], at_whole = 0, at_slice = 0;
    int N = moe_expert_split(model);
    moe_slot_sizes(model, moe_stage_layers(model), (int)experts, 1, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) {
        if (sizes[i] == 0) continue;  // a llama MoE's bias slots
        TensorSplit s = moe_expert_tensor_split(model, i, experts);
        tensor_split_copy(&s, member, N, (char*)whole + at_whole * elem, (char*)slices + at_slice * elem, elem,
                          to_whole);
        at_whole += sizes[i];
        at_slice += tensor_split_slice_size(&s, N);
    }
}

// The file's expert tensors (host, every expert: the extension block's slots) -> this process's experts of its
// stage's MoE layers (at -etp N its member's slices of them).
static void moe_set_parameters(Model* model, const floatX* file_block) {
    MoEModel* moe = moe_of(model);
    size_t global[MLP_EXTENSION_SLOTS], local[MLP_EXTENSION_SLOTS], whole = 0;
    int Lmodel = num_moe_layers(model), Lm = moe_stage_layers(model);
    moe_file_slot_sizes(model, global);
    moe_slot_sizes(model, Lm, moe->local_experts, 1, local);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) whole += local[i];
    int first_expert = moe->ep.member * moe->local_experts;
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    moe_stage_model_indices(model, model_index);
    floatX* experts = (floatX*)malloc_check(whole * sizeof(floatX) + 1);
    size_t from = 0, to = 0;
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++) {
        if (moe_is_expert_slot(i)) {
            // per MoE layer, this process's experts are a contiguous run of the layer's E
            size_t per_expert = global[i] / Lmodel / moe->config.num_experts, run = local[i] / Lm;
            for (int m = 0; m < Lm; m++) {
                size_t at = from + global[i] / Lmodel * model_index[m] + first_expert * per_expert;
                memcpy(experts + to, file_block + at, run * sizeof(floatX));
                to += run;
            }
        }
        from += global[i];
    }
    free(model_index);
    floatX* slices = (floatX*)malloc_check(moe->expert_store.num_parameters * sizeof(floatX) + 1);
    moe_cut_experts(model, moe->local_experts, moe_expert_member(model), experts, slices, sizeof(floatX), 0);
    sharded_parameters_set(&moe->expert_store, slices);
    free(slices);
    free(experts);
}

// The experts of every process of the group, in the layout of the model file's expert tensors over the stage's MoE
// layers (efcw .. efcprojb, each (Lm, E, ...); moe_place_stage_experts puts them into the file's), from this
// process's `local` (device, laid out as expert_store, elem bytes per value: parameters, gradients or optimizer
// state) into `host`: at -etp N its member's slices of them (see moe_gather_experts). Collective over the expert
// group.
static void moe_gather_expert_group(const Model* model, void* host, const void* local, size_t elem,
                                    cudaStream_t stream) {
    const MoEModel* moe = moe_of(model);
    int Lm = moe_stage_layers(model), N = moe->ep.degree;
    size_t sizes[MLP_EXTENSION_SLOTS], largest = 0;
    moe_own_slot_sizes(model, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++)
        largest = sizes[i] / Lm > largest ? sizes[i] / Lm : largest;
    char* gathered;
    cudaCheck(cudaMalloc((void**)&gathered, N * largest * elem));
    const char* from = (const char*)local;
    char* to = (char*)host;
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) {
        if (sizes[i] == 0) continue;  // a llama MoE's bias slots
        size_t layer_bytes = sizes[i] / Lm * elem;  // this process's experts of one layer
        for (int m = 0; m < Lm; m++) {
            // members in order hold consecutive experts: the gathered runs are the layer's E experts in order
            expert_parallel_allgather(&moe->ep, gathered, from + m * layer_bytes, layer_bytes, stream);
            cudaCheck(cudaMemcpy(to + m * N * layer_bytes, gathered, N * layer_bytes, cudaMemcpyDeviceToHost));
        }
        from += sizes[i] * elem;
        to += Lm * N * layer_bytes;
    }
    cudaCheck(cudaFree(gathered));
}

// ... and at -etp N the members' slices put together into the whole experts (collective over the expert group and the
// tensor-parallel members)
static void moe_gather_experts(const Model* model, void* host, const void* local, size_t elem, cudaStream_t stream) {
    int N = moe_expert_split(model);
    if (N == 1) {
        moe_gather_expert_group(model, host, local, elem, stream);
        return;
    }
    size_t sizes[MLP_EXTENSION_SLOTS], n = 0, E = moe_of(model)->config.num_experts;
    moe_slot_sizes(model, moe_stage_layers(model), (int)E, N, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) n += sizes[i];
    char* slices = (char*)malloc_check(N * n * elem);
    moe_gather_expert_group(model, slices, local, elem, stream);
    char *mine, *all;
    cudaCheck(cudaMalloc((void**)&mine, n * elem));
    cudaCheck(cudaMalloc((void**)&all, N * n * elem));
    cudaCheck(cudaMemcpy(mine, slices, n * elem, cudaMemcpyHostToDevice));
    tensor_parallel_all_gather_bytes(model->tp, all, mine, n * elem, stream);
    cudaCheck(cudaMemcpyAsync(slices, all, N * n * elem, cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    for (int m = 0; m < N; m++) moe_cut_experts(model, E, m, host, slices + m * n * elem, elem, 1);
    cudaCheck(cudaFree(mine));
    cudaCheck(cudaFree(all));
    free(slices);
}

// the values of every expert, whole: the model file's expert tensors
static size_t moe_file_expert_values(const Model* model) {
    size_t sizes[MLP_EXTENSION_SLOTS], n = 0;
    moe_file_slot_sizes(model, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) n += sizes[i];
    return n;
}

// The stage that holds MoE layer m of the model
static int moe_layer_stage(const Model* model, int m) {
    StageCut cut = model_stage_cut(model);
    int l = moe_layer_of(moe_of(model), m);
    for (int s = 0; s < cut.stages; s++)
        for (int c = 0; c < cut.chunks; c++)
            if (l >= cut_begin(&cut, s, c) && l < cut_end(&cut, s, c)) return s;
    return 0;
}

// The stage's experts (host, moe_gather_experts' layout: each tensor (Lm, E, ...)) into the layout of the model file's
// expert tensors (`file_experts`, each (Lmodel, E, ...)) at the stage's MoE layers, elem bytes per value
static void moe_place_stage_experts(const Model* model, void* file_experts, const void* stage_experts, size_t elem) {
    size_t sizes[MLP_EXTENSION_SLOTS];
    int Lmodel = num_moe_layers(model), Lm = moe_stage_layers(model);
    moe_file_slot_sizes(model, sizes);
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    moe_stage_model_indices(model, model_index);
    char* to = (char*)file_experts;
    const char* from = (const char*)stage_experts;
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) {
        size_t layer_bytes = sizes[i] / Lmodel * elem;  // one MoE layer's experts
        for (int m = 0; m < Lm; m++) memcpy(to + model_index[m] * layer_bytes, from + m * layer_bytes, layer_bytes);
        to += Lmodel * layer_bytes;
        from += Lm * layer_bytes;
    }
    free(model_index);
}

// Each MoE layer's rows (host, `row_bytes` per layer, (Lmodel, ...)) from the stage that holds it, on every stage:
// collective over the pipeline group
static void moe_join_stage_rows(const Model* model, void* host, size_t row_bytes) {
    if (model_pp_stages(model) == 1) return;
    int Lmodel = num_moe_layers(model);
    const MultiGpuConfig* g = &model->pp->group;
    char* device;
    cudaCheck(cudaMalloc((void**)&device, Lmodel * row_bytes));
    cudaCheck(cudaMemcpy(device, host, Lmodel * row_bytes, cudaMemcpyHostToDevice));
    for (int m = 0; m < Lmodel; m++)
        ncclCheck(ncclBroadcast(device + m * row_bytes, device + m * row_bytes, row_bytes, ncclChar,
                                moe_layer_stage(model, m), g->nccl_comm, g->nccl_stream));
    cudaCheck(cudaStreamSynchronize(g->nccl_stream));
    cudaCheck(cudaMemcpy(host, device, Lmodel * row_bytes, cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(device));
}
// ... each expert tensor's in turn (the model file's expert tensors' layout)
static void moe_join_stage_experts(const Model* model, void* file_experts, size_t elem) {
    size_t sizes[MLP_EXTENSION_SLOTS];
    moe_file_slot_sizes(model, sizes);
    char* at = (char*)file_experts;
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) {
        if (sizes[i] == 0) continue;
        moe_join_stage_rows(model, at, sizes[i] / num_moe_layers(model) * elem);
        at += sizes[i] * elem;
    }
}

// Per MoE layer of the stage, E values of `device` ((Lm, E), elem bytes each) into the model's (Lmodel, E) on the host
// at the stage's MoE layers, then every stage's (collective over the pipeline group)
static void moe_join_stage_layers(const Model* model, void* model_layers, const void* device, size_t elem) {
    int Lmodel = num_moe_layers(model), Lm = moe_stage_layers(model);
    size_t row = (size_t)moe_of(model)->config.num_experts * elem;
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    moe_stage_model_indices(model, model_index);
    for (int m = 0; m < Lm; m++)
        cudaCheck(cudaMemcpy((char*)model_layers + model_index[m] * row, (const char*)device + m * row, row,
                             cudaMemcpyDeviceToHost));
    free(model_index);
    moe_join_stage_rows(model, model_layers, row);
}
// -pp: every MoE layer's balancing biases into report.bias
static void moe_join_stage_biases(const Model* model) {
    moe_join_stage_layers(model, moe_of(model)->report.bias, moe_of(model)->balance_bias, sizeof(float));
}

// The stage's experts from this process's `local` (device, laid out as expert_store) into the model file's expert
// tensors' layout (`file_experts`, host) at the stage's MoE layers (moe_gather_experts, then moe_place_stage_experts)
static void moe_gather_stage_experts(const Model* model, void* file_experts, const void* local, size_t elem,
                                     cudaStream_t stream) {
    if (model_pp_stages(model) == 1) {
        moe_gather_experts(model, file_experts, local, elem, stream);
        return;
    }
    size_t sizes[MLP_EXTENSION_SLOTS], n = 0;
    moe_slot_sizes(model, moe_stage_layers(model), moe_of(model)->config.num_experts, 1, sizes);
    for (int i = FIRST_EXPERT_SLOT; i < FIRST_EXPERT_SLOT + NUM_EXPERT_TENSORS; i++) n += sizes[i];
    char* stage = (char*)malloc_check(n * elem + 1);
    moe_gather_experts(model, stage, local, elem, stream);
    moe_place_stage_experts(model, file_experts, stage, elem);
    free(stage);
}

// where the expert tensors start in the extension block of the file
static size_t moe_experts_in_block(const Model* model) {
    size_t global[MLP_EXTENSION_SLOTS];
    moe_file_slot_sizes(model, global);
    return global[MOE_ROUTERW] + global[MOE_ROUTERNW];
}
// the experts' parameters, or their gradients as stored (times expert_store.grad_multiplier once reduced they are
// the step's; see moe_allocate_parameters), into the file's extension block at the stage's MoE layers (the model's
// join of the stages puts the others' there). Collective over the expert group; under -pp the balancing biases are
// put together from the stages too (collective over the pipeline group; moe_write_file_tail writes them).
// Under ZeRO-3 the process's experts are first put together from their shards (over the processes that hold the same
// experts) in a temporary device buffer: the model file costs their memory while it is written.
static void moe_get_parameters(const Model* model, floatX* file_block, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    ShardedParameters* experts = &moe->expert_store;
    if (moe->balance_bias != NULL && model_pp_stages(model) > 1) moe_join_stage_biases(model);
    if (model->zero_stage < 3) {
        moe_gather_stage_experts(model, file_block + moe_experts_in_block(model), experts->params_memory,
                                 sizeof(floatX), stream);
        return;
    }
    floatX* host = (floatX*)malloc_check(experts->num_parameters * sizeof(floatX) + 1);
    floatX* local;
    sharded_parameters_gather_all(experts, host, &moe->ep.replicas, stream);
    cudaCheck(cudaMalloc((void**)&local, experts->num_parameters * sizeof(floatX) + 1));
    cudaCheck(cudaMemcpy(local, host, experts->num_parameters * sizeof(floatX), cudaMemcpyHostToDevice));
    moe_gather_stage_experts(model, file_block + moe_experts_in_block(model), local, sizeof(floatX), stream);
    cudaCheck(cudaFree(local));
    free(host);
}
static void moe_get_gradients(const Model* model, floatX* file_block, cudaStream_t stream) {  // ZeRO-0/1 only
    moe_gather_stage_experts(model, file_block + moe_experts_in_block(model),
                             moe_of(model)->expert_store.grads_memory, sizeof(floatX), stream);
}
// process 0's expert group gathers the experts for the model file (process 0 writes it); under ZeRO-3 every process
// (the replicated set's shards, and the experts' over their replicas, are put together by all)
static int moe_gathers_model_file(const Model* model) {
    return moe_of(model)->ep.group == 0 || model->zero_stage == 3 || model_tp_degree(model) > 1;
}

static ShardedParameters* moe_own_set(Model* model) { return &moe_of(model)->expert_store; }
static const MultiGpuConfig* moe_own_group(const Model* model) { return &moe_of(model)->ep.replicas; }
// the squared norm of the experts' gradient: this process's, summed over its expert group (every expert once) and at
// -etp N over the members (every slice once; fcproj's bias, which each member holds whole, member 0's)
static float moe_own_norm_squared(Model* model, int zero_stage, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    if (moe->expert_store.frozen) return 0.0f;  // every process's experts alike: no sum to take part in
    int include[NUM_EXPERT_TENSORS] = {1, 1, 1, moe_member_zero(model)};
    float norm2 = sharded_parameters_norm_squared_of(&moe->expert_store, include, &moe->ep.replicas, zero_stage,
                                                     stream);
    norm2 = expert_parallel_float_sum(&moe->ep, norm2, stream);
    return moe->expert_tp > 1 ? tensor_parallel_float_sum(model->tp, norm2, stream) : norm2;
}
// a token meets k of the E experts of an MoE layer: the routers and shared experts whole, the experts' k/E
// LoRA's experts targets (FfnExtension.expert_linears): fc (C -> H, llama C -> 2H [gate | up]) or fcproj (H -> C) of
// every expert of every MoE layer, whole, as the model file stacks them (Lm, E, OC, C)
static size_t moe_expert_linears(const Model* model, int which, int* C, int* OC, int* slot) {
    const MoEModel* moe = moe_of(model);
    int channels = model->config.channels, H = moe->config.expert_hidden;
    *C = which ? H : channels;
    *OC = which ? channels : (int)moe_fc_width(model, H);
    *slot = which ? MOE_EFCPROJW : MOE_EFCW;
    return (size_t)num_moe_layers(model) * moe->config.num_experts;
}

static double moe_active_parameters_per_token(const Model* model) {
    const MoEConfig* c = &moe_of(model)->config;
    size_t sizes[MLP_EXTENSION_SLOTS];
    moe_file_slot_sizes(model, sizes);
    double active = 0.0;
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++)
        active += moe_is_expert_slot(i) ? (double)sizes[i] * c->top_k / c->num_experts : (double)sizes[i];
    return active;
}

// ----------------------------------------------------------------------------------------------------
// Activation memory

// The row stride of one MoE layer's expert buffers, padded to `capacity` rows per expert or packed (dropless): in
// this process's dispatch layout (src) and in its experts' layout (own), which with expert parallelism of degree N
// may receive every choice of the N processes of its group.
static void moe_layer_rows(const MoEConfig* c, int capacity, int dropless, int N, int degree, size_t* src,
                           size_t* own) {
    size_t padded = (size_t)c->num_experts * capacity, choices = (size_t)N * c->top_k;
    *src = layer_stride(dropless ? choices : padded);
    *own = layer_stride(dropless ? degree * choices : padded);
}

// ... the larger of training's and evaluation's, which the activations hold
static void moe_allocated_rows(const MoEModel* moe, int N, size_t* src, size_t* own) {
    const MoEConfig* c = &moe->config;
    *src = *own = 0;
    const double factors[2] = {moe->settings.capacity_factor, moe->settings.capacity_factor_eval};
    for (int i = 0; i < 2; i++) {
        size_t s, o;
        moe_layer_rows(c, moe_capacity(N, c->num_experts, c->top_k, factors[i]), factors[i] <= 0.0, N, moe->ep.degree,
                       &s, &o);
        *src = s > *src ? s : *src;
        *own = o > *own ? o : *own;
    }
}

// LoRA's rank over the experts (-ft lora -fw experts, llmc/model_adapter.h), 0 without
static size_t moe_experts_lora_rank(const Model* model) {
    int lora = model->frozen && model->adapter_method == FT_METHOD_LORA;
    return lora && (model->adapter_targets & LORA_EXPERTS_TARGETS) ? (size_t)model->adapter_rank : 0;
}

// The activation tensors' sizes in bytes, indexed by MOE_ACT_<name>.
static void moe_fill_in_activation_sizes(size_t* s, const Model* model, size_t B, size_t T, int recompute) {
    const MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    size_t C = model->config.channels, E = c->num_experts, K = c->top_k, H = c->expert_hidden / moe->expert_tp;
    size_t Lm = moe_stage_layers(model), N = moe_routed_tokens(model, (int)(B * T)), BTC = layer_stride(N * C);
    size_t rows_src, rows_own;
    moe_allocated_rows(moe, (int)N, &rows_src, &rows_own);
    size_t NE = layer_stride(N * E), NK = layer_stride(N * K);
    size_t noisy = c->noisy_gating, jitter = moe->settings.jitter > 0.0f;
    size_t seq = moe->settings.seq_alpha > 0.0f;
    // the experts' bias gradients: E / ep_degree batches or groups of up to max(H, C) columns; a shared expert's
    // one matrix of up to max(H_s, C)
    int widest = (int)(H > C ? H : C);
    size_t batched = matmul_batched_dbias_buffer_floats(moe->local_experts, widest);
    size_t grouped = matmul_grouped_dbias_buffer_floats(moe->local_experts, widest);
    size_t S = c->shared_experts, Hs = c->shared_hidden;
    size_t shared = matmul_dbias_buffer_floats((int)(Hs > C ? Hs : C));
    if (!model->config.biases) batched = grouped = shared = 0;
    size_t bias_scratch = batched > grouped ? batched : grouped;
    size_t lora_rank = moe_experts_lora_rank(model);
#define MOE_ACTIVATION_BYTES(type, name, elements) s[MOE_ACT_##name] = (elements) * sizeof(type);
    MOE_ACTIVATION_TENSORS(MOE_ACTIVATION_BYTES)
#undef MOE_ACTIVATION_BYTES
}

static size_t moe_activation_bytes(const Model* model, size_t B, size_t T, int recompute) {
    size_t sizes[NUM_MOE_ACTIVATION_TENSORS], bytes = 0;
    moe_fill_in_activation_sizes(sizes, model, B, T, recompute);
    for (int i = 0; i < NUM_MOE_ACTIVATION_TENSORS; i++) bytes += CEIL_DIV(sizes[i], 256) * 256;  // as allocated
    return bytes;
}

static void moe_allocate_activations(Model* model, int B, int T) {
    MoEModel* moe = moe_of(model);
    size_t sizes[NUM_MOE_ACTIVATION_TENSORS];
    moe_fill_in_activation_sizes(sizes, model, B, T, model->recompute);
    // a slot of its own, in use from now on: the model's activations are allocated once, or once per slot (-pp)
    moe->slots = (MoESlot**)realloc(moe->slots, (size_t)(moe->num_slots + 1) * sizeof(MoESlot*));
    moe->slot = moe->slots[moe->num_slots++] = (MoESlot*)calloc(1, sizeof(MoESlot));
    cudaCheck(cudaMalloc(&moe->slot->acts_memory, moe_activation_bytes(model, B, T, model->recompute)));
    MoEActivations* a = &moe->slot->acts;
    void** ptrs[NUM_MOE_ACTIVATION_TENSORS];
#define MOE_ACTIVATION_POINTER(type, name, elements) ptrs[MOE_ACT_##name] = (void**)&a->name;
    MOE_ACTIVATION_TENSORS(MOE_ACTIVATION_POINTER)
#undef MOE_ACTIVATION_POINTER
    char* p = (char*)moe->slot->acts_memory;
    for (int i = 0; i < NUM_MOE_ACTIVATION_TENSORS; i++) {
        *ptrs[i] = p;
        p += CEIL_DIV(sizes[i], 256) * 256;  // 256-byte alignment for vector loads and cuBLASLt
    }
    int Lm = moe_stage_layers(model), E = moe->config.num_experts;
    cudaCheck(cudaMallocHost((void**)&moe->slot->expert_counts_cpu, (size_t)Lm * E * sizeof(int)));
    cudaCheck(cudaMallocHost((void**)&moe->slot->kept_counts_cpu, (size_t)Lm * E * sizeof(int)));
    cudaCheck(cudaMallocHost((void**)&moe->slot->losses_cpu, (size_t)MOE_LAYER_LOSSES * Lm * sizeof(float)));
    cudaCheck(cudaEventCreateWithFlags(&moe->slot->statistics_copied, cudaEventDisableTiming));
    cudaCheck(cudaMallocHost((void**)&moe->slot->rows_src, (size_t)Lm * E * sizeof(int)));
    moe->slot->rows_own = (int*)malloc_check((size_t)Lm * E * sizeof(int));
    cudaCheck(cudaEventCreateWithFlags(&moe->slot->counts_copied, cudaEventDisableTiming));
    char why[256];
    if (!moe_noise_support(moe_routed_tokens(model, B * T), model->config.channels, E, moe->config.top_k,
                           moe->config.noisy_gating, moe->settings.jitter, why, sizeof(why))) {
        fprintf(stderr, "router noise: %s\n", why);
        exit(EXIT_FAILURE);
    }
}

static void moe_free(Model* model) {
    MoEModel* moe = moe_of(model);
    sharded_parameters_free(&moe->expert_store);
    cudaCheck(cudaFree(moe->balance_bias));
    cudaCheck(cudaFree(moe->step_loads));
    if (moe->step_loads_cpu) {
        cudaCheck(cudaFreeHost(moe->step_loads_cpu));
        cudaCheck(cudaEventDestroy(moe->step_loads_copied));
    }
    free(moe->window_loads);
    free(moe->quiet_steps);
    cudaCheck(cudaFree(moe->global_counts));
    cudaCheck(cudaFree(moe->model_loads));
    free(moe->report.expert_counts);
    free(moe->report.kept_counts);
    free(moe->report.losses);
    free(moe->report.bias);
    cudaCheck(cudaFree(moe->report.step_sums));
    for (int k = 0; k < moe->num_slots; k++) {
        MoESlot* a = moe->slots[k];
        cudaCheck(cudaFree(a->acts_memory));
        free(a->rows_own);
        cudaCheck(cudaFreeHost(a->rows_src));
        cudaCheck(cudaEventDestroy(a->counts_copied));
        cudaCheck(cudaFreeHost(a->expert_counts_cpu));
        cudaCheck(cudaFreeHost(a->kept_counts_cpu));
        cudaCheck(cudaFreeHost(a->losses_cpu));
        cudaCheck(cudaEventDestroy(a->statistics_copied));
        free(a);
    }
    free(moe->slots);
    expert_parallel_free(&moe->ep);
}

// -pp: micro-batch slot k's activations in use (the k-th allocated: model_allocate_slots allocates the model's alike)
static void moe_use_slot(Model* model, int k) { moe_of(model)->slot = moe_of(model)->slots[k]; }

// ----------------------------------------------------------------------------------------------------
// The MoE layer (llmc/moe_router.cuh, moe_slots.cuh, moe_dispatch_combine.cuh, moe_losses.cuh): router in fp32,
// top-k, slots, dispatch to the expert buffer, with expert parallelism the all-to-all to the experts' owners and
// back (llmc/expert_parallel.cuh), the experts as batched GEMMs over buffers padded to the capacity or as grouped
// GEMMs over their exact rows (dropless), combine weighted by the gates. Its output (N, C) goes to `out`, like the dense MLP's.

typedef struct {
    int m;                // the MoE layer among the stage's
    int model_m;          // ... and among the model's
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
    float* losses;        // (MOE_LAYER_LOSSES) aux, z, importance, load, seq
    int* seq_count;       // (N / T, E) the sequence-wise loss's
    float* importance;    // (E) noisy gating
    float* load;          // (E) noisy gating
    floatX* expert_input;
    floatX* expert_pre;
    floatX* expert_act;
    floatX* expert_output;
    int* rows_src;  // (E) host: rows per global expert in the dispatch layout
    int* rows_own;  // (ep.degree, E / ep.degree) host: rows per (group member, local expert) in the expert layout
} MoELayerActivations;

// (m: the layer's index among the stage's MoE layers, model_m among the model's)
static MoELayerActivations moe_layer_activations(const Model* model, int m, int model_m, int N) {
    const MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    const MoEActivations* a = &moe->slot->acts;
    size_t E = c->num_experts, K = c->top_k, H = c->expert_hidden / moe->expert_tp, C = model->config.channels;
    size_t NE = layer_stride(N * E), NK = layer_stride(N * K), SRC, OWN;
    moe_layer_rows(c, moe->capacity_used, moe->dropless, N, moe->ep.degree, &SRC, &OWN);
    MoELayerActivations l;
    l.m = m;
    l.model_m = model_m;
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
    l.losses = a->moe_stats + m * layer_stride(MOE_LAYER_LOSSES + 2 * E);
    l.importance = l.losses + MOE_LAYER_LOSSES;
    l.load = l.losses + MOE_LAYER_LOSSES + E;
    size_t seq_stride = layer_stride((size_t)model->batch_size * E);
    l.seq_count = moe->settings.seq_alpha > 0.0f ? a->seq_count + m * seq_stride : NULL;
    l.expert_input = a->expert_input + m * OWN * C;
    l.expert_pre = a->expert_pre + m * OWN * moe_fc_width(model, H);
    l.expert_act = a->expert_act + (model->recompute >= 1 ? 0 : m * OWN * H);
    l.expert_output = a->expert_output + m * SRC * C;
    l.rows_src = moe->slot->rows_src + m * E;
    l.rows_own = moe->slot->rows_own + m * E;
    return l;
}

// The row counts of layer m's buffers (host): the capacity everywhere when padded; when packed (dropless), the
// kept counts of this process's routing and, exchanged over the expert group, what each member sends to this
// process's experts. The grouped GEMMs take their shapes from the host, so dropless the host must wait for the
// counts: moe_layer_row_counts_begin starts their copy, the caller queues the dispatch, which does not need them,
// and moe_layer_row_counts_finish waits, so that the dispatch runs while the host waits.
static void moe_layer_row_counts_begin(Model* model, const MoELayerActivations* l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int E = moe->config.num_experts;
    if (!moe->dropless) {
        for (int e = 0; e < E; e++) l->rows_src[e] = l->rows_own[e] = moe->capacity_used;
        return;
    }
    cudaCheck(cudaMemcpyAsync(l->rows_src, l->kept_count, E * sizeof(int), cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaEventRecord(moe->slot->counts_copied, stream));
}
static void moe_layer_row_counts_finish(Model* model, const MoELayerActivations* l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    if (!moe->dropless) return;
    cudaCheck(cudaEventSynchronize(moe->slot->counts_copied));
    expert_parallel_exchange_counts(&moe->ep, l->rows_own, l->rows_src, moe->config.num_experts, stream);
}

// Packed layout: the rows of each of this process's experts (E_l, host), what every group member sent it; returns
// their sum, the rows of the expert layout in use (padded: E * capacity, all rows).
static size_t moe_local_expert_rows(const Model* model, const MoELayerActivations* l, int* rows) {
    MoEModel* moe = moe_of(model);
    int E_l = moe->local_experts, N = moe->ep.degree;
    if (!moe->dropless) return (size_t)moe->config.num_experts * moe->capacity_used;
    size_t total = 0;
    for (int e = 0; e < E_l; e++) {
        rows[e] = 0;
        for (int s = 0; s < N; s++) rows[e] += l->rows_own[s * E_l + e];
        total += rows[e];
    }
    return total;
}

// One GEMM over this process's experts on their rows in the expert layout: weight (E_l, OC, IC), bias (E_l, OC),
// inp (Rown, IC) -> out (Rown, OC) [pre_gelu: out = GELU(pre_gelu); accumulate: out +=, no GELU]. Padded: E_l buffers
// of ep.degree * capacity rows, one batched GEMM; packed: each local expert's rows from every member, one grouped GEMM.
static void moe_experts_gemm_forward(const Model* model, const MoELayerActivations* l, floatX* out, const floatX* inp,
                                     const floatX* weight, const floatX* bias, int IC, int OC, floatX* pre_gelu,
                                     cudaStream_t stream, bool accumulate = false) {
    MoEModel* moe = moe_of(model);
    int E_l = moe->local_experts, N = moe->ep.degree;
    if (!moe->dropless) {
        matmul_forward_batched(out, inp, weight, bias, E_l, N * moe->capacity_used, IC, OC, stream, pre_gelu,
                               model_forward_gelu_fusion(model), accumulate);
        return;
    }
    int rows[MOE_MAX_EXPERTS];
    moe_local_expert_rows(model, l, rows);
    matmul_forward_grouped(out, inp, weight, bias, E_l, rows, IC, OC, stream, pre_gelu,
                           model_forward_gelu_fusion(model), accumulate);
}

// Its backward: dinp (Rown, IC) overwritten (accumulate: +=, no GELU), dweight and dbias accumulated (+=); pre_gelu
// as in the forward.
static void moe_experts_gemm_backward(const Model* model, const MoELayerActivations* l, floatX* dinp, floatX* dweight,
                                      floatX* dbias, const floatX* dout, const floatX* inp, const floatX* weight,
                                      int IC, int OC, const floatX* pre_gelu, cudaStream_t stream,
                                      bool accumulate = false) {
    MoEModel* moe = moe_of(model);
    int E_l = moe->local_experts, N = moe->ep.degree;
    float* scratch = moe->slot->acts.bias_scratch;
    if (!moe->dropless) {
        matmul_backward_batched(dinp, dweight, dbias, dout, inp, weight, scratch, E_l, N * moe->capacity_used, IC,
                                OC, stream, pre_gelu, model->gelu_fusion, accumulate);
        return;
    }
    int rows[MOE_MAX_EXPERTS];
    moe_local_expert_rows(model, l, rows);
    matmul_backward_grouped(dinp, dweight, dbias, dout, inp, weight, scratch, E_l, rows, IC, OC, stream, pre_gelu,
                            accumulate);
}

// LoRA over the experts (-fw experts, llmc/model_adapter.h "Adapter"): target t's pairs of this process's experts in
// MoE layer l->m, A (E_l, r, IC) and B (E_l, OC, r), in a buffer laid out as the adapter's set (its parameters or
// gradients)
static void moe_experts_lora_pairs(const Model* model, const MoELayerActivations* l, int t, floatX* set, floatX** A,
                                   floatX** B) {
    const MoEModel* moe = moe_of(model);
    size_t first = (size_t)l->model_m * moe->config.num_experts + (size_t)moe->ep.member * moe->local_experts;
    lora_pair(model, set, t, first, A, B);
}
// u (Rown, r) = s (inp A_e^T) on each expert e's rows, the rank-r intermediate of both passes (llmc/lora.cuh's
// lora_intermediate with the experts' GEMM; the padding rows' zero inputs give zeros)
static void moe_experts_lora_intermediate(const Model* model, const MoELayerActivations* l, floatX* u,
                                          const floatX* inp, const floatX* A, int IC, size_t own_rows,
                                          cudaStream_t stream) {
    const Adapter* a = model->adapter;
    moe_experts_gemm_forward(model, l, u, inp, A, nullptr, IC, a->rank, nullptr, stream);
    lora_scale(u, a->scale, own_rows * a->rank, stream);
}

// An expert Linear layer (IC -> OC) of target t (LORA_EXPERTS_*), as train_gpt.cu's linear_forward is a dense one:
// the experts' GEMM, then with an adapter on t its update out += s (inp A_e^T) B_e^T, as two more of the experts'
// GEMMs of width r. pre_gelu only without the update (which goes in before the GELU: the caller runs the GELU).
static void moe_experts_linear_forward(const Model* model, const MoELayerActivations* l, int t, floatX* out,
                                       const floatX* inp, const floatX* weight, const floatX* bias, int IC, int OC,
                                       floatX* pre_gelu, cudaStream_t stream) {
    moe_experts_gemm_forward(model, l, out, inp, weight, bias, IC, OC, pre_gelu, stream);
    if (!lora_has(model, t)) return;
    int rows[MOE_MAX_EXPERTS];
    size_t own_rows = moe_local_expert_rows(model, l, rows);
    if (own_rows == 0) return;  // dropless, no row reached this process's experts
    const Adapter* a = model->adapter;
    floatX *A, *B, *u = moe_of(model)->slot->acts.lora_u;  // (Rown, r)
    moe_experts_lora_pairs(model, l, t, a->store.params_memory, &A, &B);
    moe_experts_lora_intermediate(model, l, u, inp, A, IC, own_rows, stream);
    moe_experts_gemm_forward(model, l, out, u, B, nullptr, a->rank, OC, nullptr, stream, true);
}

// Its transpose: dinp (Rown, IC) = dout W (plus the adapter's part: with u = s inp A_e^T and g = s dout B_e,
// dinp += g A_e, dB_e += dout^T u, dA_e += g^T inp, u recomputed as llmc/lora.cuh does), dweight and dbias += (NULL:
// frozen, not computed). pre_gelu only without an adapter on t.
static void moe_experts_linear_backward(const Model* model, const MoELayerActivations* l, int t, floatX* dinp,
                                        floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                                        const floatX* weight, int IC, int OC, const floatX* pre_gelu,
                                        cudaStream_t stream) {
    moe_experts_gemm_backward(model, l, dinp, dweight, dbias, dout, inp, weight, IC, OC, pre_gelu, stream);
    if (!lora_has(model, t)) return;
    int rows[MOE_MAX_EXPERTS];
    size_t own_rows = moe_local_expert_rows(model, l, rows);
    if (own_rows == 0) return;
    const Adapter* a = model->adapter;
    floatX *A, *B, *dA, *dB;
    moe_experts_lora_pairs(model, l, t, a->store.params_memory, &A, &B);
    moe_experts_lora_pairs(model, l, t, a->store.grads_memory, &dA, &dB);
    floatX *u = moe_of(model)->slot->acts.lora_u, *g = moe_of(model)->slot->acts.lora_g;  // (Rown, r) each
    moe_experts_lora_intermediate(model, l, u, inp, A, IC, own_rows, stream);
    moe_experts_gemm_backward(model, l, g, dB, nullptr, dout, u, B, a->rank, OC, nullptr, stream);
    lora_scale(g, a->scale, own_rows * a->rank, stream);
    moe_experts_gemm_backward(model, l, dinp, dA, nullptr, g, inp, A, IC, a->rank, nullptr, stream, true);
}

// The experts' MLP on their rows in the expert layout, inp (Rown, C) -> out (Rown, C): gpt2 fcproj(GELU(fc)) with the
// GELU in fc's epilogue; llama fcproj(swiglu(fc)) without biases, fc's output (Rown, 2H) [gate | up] in expert_pre and
// llmc/swiglu.cuh's pass over the rows in use (padded: all of them, the padding's zeros give zeros). An adapter on fc
// (LoRA over the experts) goes in before the activation, so that GPT-2's GELU then leaves the epilogue, as the dense
// MLP's does.
static void moe_experts_mlp_forward(const Model* model, const MoELayerActivations* l, const MoEParameterTensors* lp,
                                    floatX* out, cudaStream_t stream) {
    const MoEModel* moe = moe_of(model);
    int C = model->config.channels, H = moe->config.expert_hidden / moe->expert_tp;  // at -etp N its slice
    int rows[MOE_MAX_EXPERTS];
    size_t own_rows = moe_local_expert_rows(model, l, rows);
    if (!moe_swiglu(model)) {
        if (lora_has(model, LORA_EXPERTS_FC)) {
            moe_experts_linear_forward(model, l, LORA_EXPERTS_FC, l->expert_pre, l->expert_input, lp->efcw, lp->efcb,
                                       C, H, nullptr, stream);
            if (own_rows > 0) gelu_forward(l->expert_act, l->expert_pre, own_rows * H, stream);
        } else {
            moe_experts_linear_forward(model, l, LORA_EXPERTS_FC, l->expert_act, l->expert_input, lp->efcw, lp->efcb,
                                       C, H, l->expert_pre, stream);
        }
        const floatX* fcprojb = moe_member_zero(model) ? lp->efcprojb : nullptr;  // at -etp N added once
        moe_experts_linear_forward(model, l, LORA_EXPERTS_FC_PROJ, out, l->expert_act, lp->efcprojw, fcprojb, H, C,
                                   nullptr, stream);
        return;
    }
    moe_experts_linear_forward(model, l, LORA_EXPERTS_FC, l->expert_pre, l->expert_input, lp->efcw, nullptr, C, 2 * H,
                               nullptr, stream);
    if (own_rows > 0) swiglu_forward(l->expert_act, l->expert_pre, (int)own_rows, H, stream);
    moe_experts_linear_forward(model, l, LORA_EXPERTS_FC_PROJ, out, l->expert_act, lp->efcprojw, nullptr, H, C, nullptr,
                               stream);
}

// Its backward: d_io (Rown, C) holds the output's gradient and is overwritten with the input's; the parameter
// gradients accumulate (+=) into lg's (the adapter's into its set). -r >= 1 recomputes the activation from expert_pre
// first. llama: SwiGLU's gradient [dgate | dup] overwrites expert_pre in place (nothing reads the forward's [gate |
// up] after it), as the dense llama MLP does with fch. An adapter on fcproj adds to the activation's gradient, so that
// GPT-2's GELU backward then leaves the epilogue.
static void moe_experts_mlp_backward(const Model* model, const MoELayerActivations* l, const MoEParameterTensors* lp,
                                     const MoEParameterTensors* lg, floatX* d_io, cudaStream_t stream) {
    const MoEModel* moe = moe_of(model);
    int C = model->config.channels, H = moe->config.expert_hidden / moe->expert_tp;  // at -etp N its slice
    floatX* d_hidden = moe->slot->acts.d_expert_hidden;  // (Rown, H)
    int rows[MOE_MAX_EXPERTS];
    size_t own_rows = moe_local_expert_rows(model, l, rows);  // dropless, the experts may have received no row at all
    if (!moe_swiglu(model)) {
        if (model->recompute >= 1 && own_rows > 0) gelu_forward(l->expert_act, l->expert_pre, own_rows * H, stream);
        int lora_fcproj = lora_has(model, LORA_EXPERTS_FC_PROJ);
        moe_experts_linear_backward(model, l, LORA_EXPERTS_FC_PROJ, d_hidden, lg->efcprojw, lg->efcprojb, d_io,
                                    l->expert_act, lp->efcprojw, H, C, lora_fcproj ? nullptr : l->expert_pre, stream);
        if (lora_fcproj && own_rows > 0) gelu_backward_inplace(d_hidden, l->expert_pre, own_rows * H, stream);
        moe_experts_linear_backward(model, l, LORA_EXPERTS_FC, d_io, lg->efcw, lg->efcb, d_hidden, l->expert_input,
                                    lp->efcw, C, H, nullptr, stream);
        return;
    }
    if (model->recompute >= 1 && own_rows > 0) swiglu_forward(l->expert_act, l->expert_pre, (int)own_rows, H, stream);
    moe_experts_linear_backward(model, l, LORA_EXPERTS_FC_PROJ, d_hidden, lg->efcprojw, nullptr, d_io, l->expert_act,
                                lp->efcprojw, H, C, nullptr, stream);
    if (own_rows > 0) swiglu_backward(l->expert_pre, d_hidden, l->expert_pre, (int)own_rows, H, stream);
    moe_experts_linear_backward(model, l, LORA_EXPERTS_FC, d_io, lg->efcw, nullptr, l->expert_pre, l->expert_input,
                                lp->efcw, C, 2 * H, nullptr, stream);
}

// The seed of MoE layer m's jitter or gating noise in the current pass (doc/moe.md, "Router noise" 1)
// (folded under tensor parallelism, member j's routing group of pass p is pass p N + j: the passes of N micro-batches)
static unsigned int moe_layer_seed(const Model* model, int m, int kind) {
    unsigned int groups = (unsigned int)moe_routing_groups(model);
    unsigned int pass = model->pass_number * groups + (groups > 1 ? (unsigned int)model_tp_member(model) : 0u);
    return moe_noise_seed((unsigned int)model->process_rank, pass, m, kind);
}

// What the router reads: ln2, or in a training pass with jitter ln2 times its multipliers (in router_input)
static const floatX* moe_router_input(const Model* model, int m, const floatX* ln2, int N, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    if (!moe->training || moe->settings.jitter <= 0.0f) return ln2;
    floatX* jittered = moe->slot->acts.router_input;
    moe_jitter_forward(jittered, ln2, N, model->config.channels, moe->settings.jitter,
                       moe_layer_seed(model, m, MOE_NOISE_JITTER), stream);
    return jittered;
}

// The tensors of an MoE layer's slices, gathered (ZeRO-3), and reduced by moe_reduce_layer in the order they are put
// into their buckets: the routers and the shared experts (in the replicated set; routernw and the shared experts may
// be empty) and the experts (in the MoE's own set)
static const int moe_router_tensors[] = {PARAM_EXTENSION + MOE_ROUTERW,        PARAM_EXTENSION + MOE_ROUTERNW,
                                         PARAM_EXTENSION + MOE_SHARED_FCW,     PARAM_EXTENSION + MOE_SHARED_FCB,
                                         PARAM_EXTENSION + MOE_SHARED_FCPROJW, PARAM_EXTENSION + MOE_SHARED_FCPROJB};
static const int moe_expert_tensors[] = {0, 1, 2, 3};
#define MOE_ROUTER_TENSORS 6

// An MoE layer's tensors from its slices of the replicated set (moe_router_tensors' order) and of the experts
static MoEParameterTensors moe_tensors_from_slices(floatX* const* routers, floatX* const* experts) {
    MoEParameterTensors t;
    t.routerw = routers[0], t.routernw = routers[1];
    t.shared_fcw = routers[2], t.shared_fcb = routers[3], t.shared_fcprojw = routers[4], t.shared_fcprojb = routers[5];
    t.efcw = experts[0], t.efcb = experts[1], t.efcprojw = experts[2], t.efcprojb = experts[3];
    return t;
}

// ZeRO-3: model layer l's router slices into the model's gather buffer l % 2, behind the layer's other slices
// (model_prefetch_layer)
static void moe_gather_router_slices(Model* model, int l) {
    sharded_parameters_gather_slices(&model->store, l % 2, moe_router_tensors, MOE_ROUTER_TENSORS,
                                     moe_stage_index(model, l), moe_stage_layers(model), model->multi_gpu);
}
// ... and its experts into the expert set's gather buffer m % 2 (m: its index among the stage's MoE layers), from the
// processes that hold the same experts
static void moe_prefetch_experts(Model* model, int l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int m = moe_stage_index(model, l);
    const MultiGpuConfig* replicas = &moe->ep.replicas;
    if (!sharded_parameters_gather_begin(&moe->expert_store, m % 2, m, replicas, stream)) return;
    sharded_parameters_gather_slices(&moe->expert_store, m % 2, moe_expert_tensors, NUM_EXPERT_TENSORS, m,
                                     moe_stage_layers(model), replicas);
    sharded_parameters_gather_end(&moe->expert_store, m % 2, replicas);
}

// Model layer l's MoE parameters for kernels on `stream`: in the parameter buffers, or under ZeRO-3 in the gather
// buffers (the stream waits for their gathers)
static MoEParameterTensors moe_layer_weights(Model* model, int l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int m = moe_stage_index(model, l), Lm = moe_stage_layers(model);
    if (model->zero_stage < 3) return moe_layer_parameters(model, &moe->params, m);
    moe_prefetch_experts(model, l, stream);
    floatX* routers[MOE_ROUTER_TENSORS];
    floatX* experts[NUM_EXPERT_TENSORS];
    sharded_parameters_gathered_slices(&model->store, l % 2, moe_router_tensors, MOE_ROUTER_TENSORS, m, Lm, routers,
                                       stream);
    sharded_parameters_gathered_slices(&moe->expert_store, m % 2, moe_expert_tensors, NUM_EXPERT_TENSORS, m, Lm,
                                       experts, stream);
    return moe_tensors_from_slices(routers, experts);
}

// The shared experts of MoE layer m (doc/moe.md, "Routing options" 2), GPT-2's dense MLP each, on every
// token: out (N, C), the routed sum, += Shared_0(ln2) + ... + Shared_{S-1}(ln2) in that order. The projection's
// GEMM accumulates into out (cuBLASLt's beta = 1, the bias in its epilogue), so each addition rounds once where the
// reference rounds Shared_s(ln2) to floatX first; the same in fp32 up to the GEMM's own rounding.
static void moe_shared_forward(Model* model, int m, const MoEParameterTensors* lp, floatX* out, const floatX* ln2, int N,
                               cudaStream_t stream) {
    const MoEModel* moe = moe_of(model);
    size_t S = moe->config.shared_experts, Hs = moe->config.shared_hidden, C = model->config.channels;
    size_t FCs = moe_fc_width(model, Hs);
    int swiglu = moe_swiglu(model);
    if (!moe_member_zero(model)) return;  // at -etp N member 0's
    for (size_t s = 0; s < S; s++) {
        floatX* pre = moe->slot->acts.shared_pre + (m * S + s) * N * FCs;
        floatX* act = moe->slot->acts.shared_act + ((model->recompute >= 1 ? 0 : m * S) + s) * N * Hs;
        if (swiglu) {  // SwiGLU without biases: pre (N, 2H_s) [gate | up]
            matmul_forward(pre, ln2, lp->shared_fcw + s * FCs * C, nullptr, N, 1, (int)C, (int)FCs, stream);
            swiglu_forward(act, pre, N, (int)Hs, stream);
        } else {
            matmul_forward(act, ln2, lp->shared_fcw + s * Hs * C, lp->shared_fcb + s * Hs, N, 1, (int)C, (int)Hs,
                           stream, pre, model_forward_gelu_fusion(model));
        }
        const floatX* fcprojb = swiglu ? nullptr : lp->shared_fcprojb + s * C;
        matmul_cublaslt(out, lp->shared_fcprojw + s * C * Hs, act, fcprojb, (int)C, N, (int)Hs, stream, true, false,
                        true, nullptr, false);
    }
}

// Their backward: the parameter gradients accumulate (+=) into lg's; every shared expert's input gradient adds into
// d_ln2, which holds the routed path's. matmul_backward overwrites its input gradient, so fc's backward is its three
// parts with the input gradient's GEMM accumulating.
static void moe_shared_backward(Model* model, int m, const MoEParameterTensors* lp, const MoEParameterTensors* lg,
                                floatX* d_ln2, const floatX* dout, const floatX* ln2, int N, cudaStream_t stream) {
    const MoEModel* moe = moe_of(model);
    size_t S = moe->config.shared_experts, Hs = moe->config.shared_hidden, C = model->config.channels;
    size_t FCs = moe_fc_width(model, Hs);
    int swiglu = moe_swiglu(model);
    floatX* d_hidden = moe->slot->acts.d_shared_hidden;
    float* scratch = moe->slot->acts.bias_scratch;
    int frozen = model->frozen;
    if (!moe_member_zero(model)) return;  // at -etp N member 0's
    for (size_t s = 0; s < S; s++) {
        floatX* pre = moe->slot->acts.shared_pre + (m * S + s) * N * FCs;
        floatX* act = moe->slot->acts.shared_act + ((model->recompute >= 1 ? 0 : m * S) + s) * N * Hs;
        // d_fc (N, FCs), fc's output gradient: gpt2 d_hidden through GELU in fcproj's backward; llama SwiGLU's
        // [dgate | dup] over pre in place (as the routed experts)
        floatX* d_fc = swiglu ? pre : d_hidden;
        // expert s's gradients, or NULL when the model is frozen (fine-tuning: the input's gradient only)
        floatX* dfcprojw = frozen ? nullptr : lg->shared_fcprojw + s * C * Hs;
        floatX* dfcprojb = frozen ? nullptr : lg->shared_fcprojb + s * C;
        if (swiglu) {
            if (model->recompute >= 1) swiglu_forward(act, pre, N, (int)Hs, stream);
            matmul_backward(d_hidden, dfcprojw, nullptr, dout, act, lp->shared_fcprojw + s * C * Hs, scratch, N, 1,
                            (int)Hs, (int)C, stream);
            swiglu_backward(pre, d_hidden, pre, N, (int)Hs, stream);
        } else {
            if (model->recompute >= 1) gelu_forward(act, pre, (size_t)N * Hs, stream);
            matmul_backward(d_hidden, dfcprojw, dfcprojb, dout, act, lp->shared_fcprojw + s * C * Hs, scratch, N, 1,
                            (int)Hs, (int)C, stream, pre, model->gelu_fusion);
            if (!frozen) matmul_backward_bias(lg->shared_fcb + s * Hs, d_hidden, scratch, N, (int)Hs, stream);
        }
        matmul_cublaslt(d_ln2, lp->shared_fcw + s * FCs * C, d_fc, nullptr, (int)C, N, (int)FCs, stream, false, false,
                        true, nullptr, false);
        if (!frozen)
            matmul_cublaslt(lg->shared_fcw + s * FCs * C, ln2, d_fc, nullptr, (int)C, (int)FCs, N, stream, false, true,
                            true, nullptr, false);
    }
}

// The global-batch loss (training passes with -rg 1) is the Switch loss whose f_e counts the choices of the step's
// micro-batches 0..j on every process, over (j + 1) * P * N * k choices: moe_router_losses and moe_router_backward
// compute it from those counts with the coefficient aux_alpha / ((j + 1) * P), as they divide by N * k.
static int moe_global_aux(const MoEModel* moe) { return moe->settings.global_aux && moe->training; }
static const int* moe_global_counts(const Model* model, int m) {
    const MoEModel* moe = moe_of(model);
    return (moe->global_counts != NULL ? moe->global_counts : moe->step_loads) + (size_t)m * moe->config.num_experts;
}

// A training pass adds MoE layer m's choices to the step's loads. The counts the Switch loss reads: the pass's own,
// or (global-batch loss) the step's loads so far summed over every process (an all-reduce of E ints on the compute
// stream: integers, the same sum on every process in any order)
static const int* moe_aux_counts(Model* model, int m, const MoELayerActivations* l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int E = moe->config.num_experts;
    int* local = moe->step_loads + (size_t)m * E;
    if (moe->training) moe_add_counts(local, l->expert_count, E, stream);
    if (!moe_global_aux(moe)) return l->expert_count;
    if (moe->global_counts != NULL) {
        int* global = moe->global_counts + (size_t)m * E;
        if (model->num_processes > 1)
            ncclCheck(ncclAllReduce(local, global, E, ncclInt32, ncclSum, model->multi_gpu->nccl_comm, stream));
        else
            cudaCheck(cudaMemcpyAsync(global, local, E * sizeof(int), cudaMemcpyDeviceToDevice, stream));
        if (moe_routing_groups(model) > 1) tensor_parallel_all_reduce_int(model->tp, global, E, stream);
    }
    return moe_global_counts(model, m);
}

static void moe_layer_forward(Model* model, int layer, floatX* out, const floatX* ln2, int N, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    int m = moe_stage_index(model, layer), g = moe_index(moe, layer);  // among the stage's and the model's MoE layers
    MoEParameterTensors lp = moe_layer_weights(model, layer, stream);
    const MoEActivations* a = &moe->slot->acts;
    int E = c->num_experts, K = c->top_k, C = model->config.channels;
    int exchange_rows = moe->ep.degree > 1;  // expert parallelism: rows go to and come back from the experts' owners
    MoELayerActivations l = moe_layer_activations(model, m, g, N);
    const floatX* router_in = moe_router_input(model, g, ln2, N, stream);
    if (c->noisy_gating) {
        matmul_forward_fp32_output(l.clean, router_in, lp.routerw, N, C, E, stream);
        matmul_forward_fp32_output(l.noise, router_in, lp.routernw, N, C, E, stream);
        moe_noisy_logits_forward(l.logits, l.clean, l.noise, N, E, moe_layer_seed(model, g, MOE_NOISE_GATING),
                                 moe->training, stream);
    } else {
        matmul_forward_fp32_output(l.logits, router_in, lp.routerw, N, C, E, stream);
    }
    const float* bias = moe->balance_bias != NULL ? moe->balance_bias + (size_t)m * E : NULL;
    if (c->expert_groups > 0) {
        moe_router_forward(l.probs, l.expert_index, l.gates, l.lse, l.logits, bias, N, E, K, c->score,
                           c->routed_scale, c->expert_groups, c->kept_groups, MOE_GROUP_TOP2_SUM, stream);
    } else {
        moe_router_forward(l.probs, l.expert_index, l.gates, l.lse, l.logits, bias, N, E, K, c->score,
                           c->routed_scale, moe->ep.degree, moe->settings.device_limit, MOE_GROUP_MAX_KEY, stream);
    }
    if (moe->route_hook != NULL) moe->route_hook(model, g, l.expert_index, l.gates, l.probs, l.logits, N, stream);
    moe_assign_slots(l.choice_row, l.row_choice, l.expert_count, l.kept_count, a->slot_scratch, l.expert_index, N, E,
                     K, moe->capacity_used, moe->dropless, stream);
    moe_layer_row_counts_begin(model, &l, stream);
    int rows_src = moe->dropless ? N * K : E * moe->capacity_used;
    floatX* dispatched = exchange_rows ? a->scratch_src : l.expert_input;
    moe_dispatch(dispatched, ln2, l.row_choice, rows_src, K, C, stream);
    moe_layer_row_counts_finish(model, &l, stream);
    if (exchange_rows)
        expert_parallel_exchange(&moe->ep, dispatched, l.expert_input, l.rows_src, l.rows_own, E, C, 1, stream);
    floatX* expert_output = exchange_rows ? a->scratch_own : l.expert_output;
    moe_experts_mlp_forward(model, &l, &lp, expert_output, stream);
    if (exchange_rows)
        expert_parallel_exchange(&moe->ep, l.expert_output, expert_output, l.rows_src, l.rows_own, E, C, 0, stream);
    moe_combine(out, l.expert_output, l.choice_row, l.gates, N, K, C, stream);
    moe_shared_forward(model, m, &lp, out, ln2, N, stream);
    moe_router_losses(l.losses, a->loss_partials, l.probs, l.lse, moe_aux_counts(model, m, &l, stream), N, E, K,
                      moe->aux_alpha_pass, moe->settings.z_coef, stream);
    if (c->noisy_gating) {
        moe_noisy_losses_forward(l.importance, l.load, l.losses + 2, a->noise_partials, l.clean, l.noise, l.logits,
                                 l.expert_index, l.gates, N, E, K, moe->settings.importance_coef, moe->settings.load_coef,
                                 stream);
    } else {
        cudaCheck(cudaMemsetAsync(l.losses + 2, 0, 2 * sizeof(float), stream));
    }
    if (moe->settings.seq_alpha > 0.0f)
        moe_seq_losses(l.losses + 4, l.seq_count, a->seq_partials, l.probs, l.expert_index, N, moe->seq_tokens, E, K,
                       moe->settings.seq_alpha, stream);
    else
        cudaCheck(cudaMemsetAsync(l.losses + 4, 0, sizeof(float), stream));
}

// Where the backward pass of model layer l (MoE layer m) accumulates its gradients: in the sets' gradient buffers,
// or under ZeRO-2 (zeroed) in the replicated set's bucket l % 2, behind the layer's every-layer slices
// (model_layer_gradients), and in the expert set's bucket m % 2 (llmc/optimizer.cuh).
static MoEParameterTensors moe_layer_gradients(Model* model, int l, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int m = moe_stage_index(model, l), Lm = moe_stage_layers(model);
    floatX* routers[MOE_ROUTER_TENSORS];
    floatX* experts[NUM_EXPERT_TENSORS];
    sharded_parameters_gradient_slices(&model->store, l % 2, moe_router_tensors, MOE_ROUTER_TENSORS, m, Lm, routers,
                                       stream);
    sharded_parameters_gradient_slices(&moe->expert_store, m % 2, moe_expert_tensors, NUM_EXPERT_TENSORS, m, Lm,
                                       experts, stream);
    return moe_tensors_from_slices(routers, experts);
}

// dout (N, C): the gradient of the layer's output; d_ln2 (N, C) = the gradient of its input (overwritten; the routed
// experts', the router's and the shared experts'); the router's aux and z losses add their gradients scaled by
// moe->aux_grad_scale; the layer's parameter gradients accumulate (+=) into lg (moe_layer_gradients).
static void moe_layer_backward(Model* model, int layer, MoEParameterTensors lg, floatX* d_ln2, const floatX* dout,
                               const floatX* ln2, int N, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    int m = moe_stage_index(model, layer), g = moe_index(moe, layer);  // among the stage's and the model's MoE layers
    MoEParameterTensors lp = moe_layer_weights(model, layer, stream);
    const MoEActivations* a = &moe->slot->acts;
    int E = c->num_experts, K = c->top_k, C = model->config.channels;
    int exchange_rows = moe->ep.degree > 1;
    MoELayerActivations l = moe_layer_activations(model, m, g, N);
    int rows_src = moe->dropless ? N * K : E * moe->capacity_used;
    // d_own: the experts' output gradient, then their input gradient, in the expert layout; d_src: the same in
    // the dispatch layout (one buffer without expert parallelism)
    floatX* d_own = a->scratch_own;
    floatX* d_src = exchange_rows ? a->scratch_src : d_own;
    moe_combine_backward(d_src, a->d_gates, dout, l.expert_output, l.choice_row, l.gates, l.row_choice, N, rows_src, K,
                         C, stream);
    // at -etp N each member's expert output, and so its gates' gradient, is its hidden units' part
    if (moe->expert_tp > 1) tensor_parallel_all_reduce_float(model->tp, a->d_gates, (size_t)N * K, ncclSum, stream);
    if (exchange_rows) expert_parallel_exchange(&moe->ep, d_src, d_own, l.rows_src, l.rows_own, E, C, 1, stream);
    // the output gradient in d_own is consumed: the input gradient overwrites it
    moe_experts_mlp_backward(model, &l, &lp, &lg, d_own, stream);
    if (exchange_rows) expert_parallel_exchange(&moe->ep, d_src, d_own, l.rows_src, l.rows_own, E, C, 0, stream);
    cudaCheck(cudaMemsetAsync(d_ln2, 0, (size_t)N * C * sizeof(floatX), stream));
    moe_dispatch_backward(d_ln2, d_src, l.choice_row, N, K, C, stream);
    // the router: the gates' gradient (with noisy gating, plus the importance loss's), the Switch and z losses
    // through the softmax or the sigmoid into the routing logits, then (noisy gating) through H into the clean and
    // noise logits
    if (c->noisy_gating)
        moe_importance_backward(a->d_gates, l.importance, l.expert_index, N, E, K, moe->settings.importance_coef,
                                moe->aux_grad_scale, stream);
    const int* aux_counts = moe_global_aux(moe) ? moe_global_counts(model, m) : l.expert_count;
    moe_router_backward(a->d_logits, l.probs, l.logits, l.expert_index, l.gates, a->d_gates, l.lse, aux_counts, N, E,
                        K, c->score, c->routed_scale, moe->aux_alpha_pass, moe->settings.z_coef, moe->aux_grad_scale,
                        stream);
    if (moe->settings.seq_alpha > 0.0f)
        moe_seq_loss_backward(a->d_logits, l.probs, l.logits, l.seq_count, N, moe->seq_tokens, E, K, c->score,
                              moe->settings.seq_alpha, moe->aux_grad_scale, stream);
    if (c->noisy_gating)
        moe_noisy_backward(a->d_logits, a->d_noise, a->d_logits, l.clean, l.noise, l.logits, l.expert_index, l.load, N,
                           E, K, moe->settings.load_coef, moe->aux_grad_scale,
                           moe_layer_seed(model, g, MOE_NOISE_GATING), stream);
    // with jitter the router read its jittered input: recomputed here, its gradient then scaled by the same
    // multipliers into d_ln2; without, the router's input gradient adds into d_ln2 directly
    // (at -etp N every member computes the router's same gradients; its input gradient is added by member 0)
    int jitter = moe->settings.jitter > 0.0f && moe_member_zero(model);
    const floatX* router_in = moe_router_input(model, g, ln2, N, stream);
    floatX* d_router_in = !moe_member_zero(model) ? nullptr : jitter ? a->router_input + (size_t)N * C : d_ln2;
    if (jitter) cudaCheck(cudaMemsetAsync(d_router_in, 0, (size_t)N * C * sizeof(floatX), stream));
    matmul_backward_fp32_dout(d_router_in, lg.routerw, a->d_logits, router_in,
                              lp.routerw, a->d_logits_x, N, C, E, stream);
    if (c->noisy_gating)
        matmul_backward_fp32_dout(d_router_in, lg.routernw, a->d_noise, router_in,
                                  lp.routernw, a->d_logits_x, N, C, E, stream);
    if (jitter)
        moe_jitter_backward(d_ln2, d_router_in, N, C, moe->settings.jitter, moe_layer_seed(model, g, MOE_NOISE_JITTER),
                            stream);
    moe_shared_backward(model, m, &lp, &lg, d_ln2, dout, ln2, N, stream);
}

// Routing statistics of MoE layer m from the counts of the last forward pass (host): the fraction of
// choices dropped and the expert loads (choices before dropping over their mean: min, max, CV).
typedef struct {
    double drop_fraction, load_min, load_max, load_cv;
} MoELayerStatistics;

// (expert_counts, kept_counts: (layers, E) host, a slot's or the stages' report)
static MoELayerStatistics moe_layer_statistics(const Model* model, const int* expert_counts, const int* kept_counts,
                                               int m, int N) {
    MoEModel* moe = moe_of(model);
    const MoEConfig* c = &moe->config;
    int E = c->num_experts, K = c->top_k;
    double mean = (double)N * K / E, var = 0.0, dropped = 0.0;
    MoELayerStatistics st = {0.0, 1e30, 0.0, 0.0};
    for (int e = 0; e < E; e++) {
        int routed = expert_counts[m * E + e];
        dropped += routed - kept_counts[m * E + e];
        st.load_min = fmin(st.load_min, routed / mean);
        st.load_max = fmax(st.load_max, routed / mean);
        var += (routed - mean) * (routed - mean) / E;
    }
    st.drop_fraction = dropped / ((double)N * K);
    st.load_cv = sqrt(var) / mean;
    return st;
}

// Telemetry of the last forward pass's MoE layers (under -pp its chunk's; a micro-batch's last forward pass completes
// the stage's): their losses and counts come back to the host without a
// synchronisation (pinned buffers and an event, like the loss: model_forward), and moe_statistics turns them into
// the aux and z losses and the routing statistics (drop fraction averaged, load min and max over layers, CV
// averaged) when they are first needed.
static void moe_end_forward(Model* model, int N, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int E = moe->config.num_experts;
    for (int layer = model_layer_begin(model); layer < model_layer_end(model); layer++) {  // the pass's (-pp: chunk's)
        if (!moe_replaces_mlp(model, layer)) continue;
        int m = moe_stage_index(model, layer);
        MoELayerActivations l = moe_layer_activations(model, m, moe_index(moe, layer), N);
        cudaCheck(cudaMemcpyAsync(moe->slot->losses_cpu + MOE_LAYER_LOSSES * m, l.losses,
                                  MOE_LAYER_LOSSES * sizeof(float), cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaMemcpyAsync(moe->slot->expert_counts_cpu + m * E, l.expert_count, E * sizeof(int),
                                  cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaMemcpyAsync(moe->slot->kept_counts_cpu + m * E, l.kept_count, E * sizeof(int),
                                  cudaMemcpyDeviceToHost, stream));
    }
    cudaCheck(cudaEventRecord(moe->slot->statistics_copied, stream));
    moe->slot->statistics_tokens = N;
    if (moe_global_aux(moe)) moe->global_passes++;
}

static void moe_statistics(const Model* model) {
    MoEModel* moe = moe_of(model);
    int N = moe->slot->statistics_tokens;
    if (N == 0) return;  // already done
    moe->slot->statistics_tokens = 0;
    cudaCheck(cudaEventSynchronize(moe->slot->statistics_copied));
    int Lm = moe_stage_layers(model);
    moe->aux_loss = moe->z_loss = moe->importance_loss = moe->load_loss = moe->seq_loss = 0.0f;
    double drop = 0.0, load_min = 1e30, load_max = 0.0, cv = 0.0;
    for (int m = 0; m < Lm; m++) {
        const float* losses = moe->slot->losses_cpu + MOE_LAYER_LOSSES * m;
        moe->aux_loss += losses[0];
        moe->z_loss += losses[1];
        moe->importance_loss += losses[2];
        moe->load_loss += losses[3];
        moe->seq_loss += losses[4];
        MoELayerStatistics st =
            moe_layer_statistics(model, moe->slot->expert_counts_cpu, moe->slot->kept_counts_cpu, m, N);
        drop += st.drop_fraction;
        load_min = fmin(load_min, st.load_min);
        load_max = fmax(load_max, st.load_max);
        cv += st.load_cv;
    }
    moe->drop_fraction = (float)(drop / Lm);
    moe->load_min = (float)load_min;
    moe->load_max = (float)load_max;
    moe->load_cv = (float)(cv / Lm);
}


// ----------------------------------------------------------------------------------------------------
// The passes' hooks

// the capacity factor of training (a backward pass follows) or of evaluation
static void moe_begin_forward(Model* model, int B, int T, float dlogits_scale) {
    MoEModel* moe = moe_of(model);
    int groups = moe_routing_groups(model), N = moe_routed_tokens(model, B * T);
    const MoEConfig* c = &moe->config;
    // folded, the members' routing groups are equal runs of tokens; with the sequence-wise loss, whole sequences
    if ((B * T) % groups != 0 || (dlogits_scale > 0.0f && moe->settings.seq_alpha > 0.0f && B % groups != 0)) {
        fprintf(stderr, "-tp %d -etp 1: each member routes an equal part of the B*T = %d*%d tokens%s: B*T%s must be a "
                "multiple of %d\n", groups, B, T, moe->settings.seq_alpha > 0.0f ? ", whole sequences with -rsl" : "",
                moe->settings.seq_alpha > 0.0f ? " and B" : "", groups);
        exit(EXIT_FAILURE);
    }
    double cf = dlogits_scale > 0.0f ? moe->settings.capacity_factor : moe->settings.capacity_factor_eval;
    moe->capacity_used = moe_capacity(N, c->num_experts, c->top_k, cf);
    moe->dropless = cf <= 0.0;
    moe->training = dlogits_scale > 0.0f;
    moe->aux_grad_scale = dlogits_scale * N;  // folded, 1/N of the micro-batch's: the members' gradients add up
    moe->seq_tokens = T;  // the sequence-wise loss's sequences
    moe->aux_alpha_pass = moe->settings.aux_alpha;
    if (moe_global_aux(moe))
        moe->aux_alpha_pass /= (float)(moe->global_passes + 1) * (float)(model->num_processes * groups);
}

// The MoE layer as an FFN kind (train_gpt.cu's FfnKind): its parameters are its own, not the dense MLP's lp and lg
// (B, T, C) in and out; folded under tensor parallelism, this member's rows (moe_routing_groups)
static void moe_forward(Model* model, int l, const LayerParameters* lp, const LayerActivations* la, floatX* out, int B,
                        int T, cudaStream_t stream) {
    size_t BT = (size_t)B * T, C = model->config.channels, rows = moe_routed_tokens(model, B * T);
    size_t first = rows < BT ? (size_t)model_tp_member(model) * rows : 0;
    if (rows < BT) cudaCheck(cudaMemsetAsync(out, 0, BT * C * sizeof(floatX), stream));
    moe_layer_forward(model, l, out + first * C, la->ln2 + first * C, (int)rows, stream);
}
// Under tensor parallelism the replicated tensors' gradients of MoE layer m that are each member's part, summed over
// the members once they are complete (the step's last micro-step; every micro-step under ZeRO-2/3): folded, the
// routers' and the shared experts' (each member's tokens); at -etp N the shared experts' (member 0's, the others'
// zero); the routers' are then every member's the same.
static void moe_sum_replicated_gradients(Model* model, const MoEParameterTensors* lg, cudaStream_t stream) {
    if (model_tp_degree(model) == 1 || !(model->store.last_micro_step || model->zero_stage >= 2)) return;
    size_t sizes[MLP_EXTENSION_SLOTS], Lm = moe_stage_layers(model);
    moe_own_slot_sizes(model, sizes);
    int folded = moe_routing_groups(model) > 1;
    floatX* grads[MLP_EXTENSION_SLOTS] = {folded ? lg->routerw : NULL, folded ? lg->routernw : NULL, NULL, NULL, NULL,
                                          NULL, lg->shared_fcw, lg->shared_fcb, lg->shared_fcprojw,
                                          lg->shared_fcprojb};
    for (int i = 0; i < MLP_EXTENSION_SLOTS; i++)
        if (grads[i] != NULL && sizes[i] > 0) tensor_parallel_all_reduce(model->tp, grads[i], sizes[i] / Lm, stream);
}
static void moe_backward(Model* model, int l, const LayerParameters* lp, const LayerParameters* lg,
                         const LayerActivations* la, floatX* d_ln2, const floatX* dout, int B, int T,
                         cudaStream_t stream) {
    size_t BT = (size_t)B * T, C = model->config.channels, rows = moe_routed_tokens(model, B * T);
    size_t first = rows < BT ? (size_t)model_tp_member(model) * rows : 0;
    MoEParameterTensors grads = moe_layer_gradients(model, l, stream);
    if (rows < BT) cudaCheck(cudaMemsetAsync(d_ln2, 0, BT * C * sizeof(floatX), stream));
    moe_layer_backward(model, l, grads, d_ln2 + first * C, dout + first * C,
                       la->ln2 + first * C, (int)rows, stream);
    moe_sum_replicated_gradients(model, &grads, stream);
}

// the routers' slices (in the replicated set) over all processes, the experts' over exactly the processes that
// hold the same experts
static void moe_reduce_layer(Model* model, int l, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int m = moe_stage_index(model, l), Lm = moe_stage_layers(model);
    sharded_parameters_reduce_slices(&model->store, moe_router_tensors, MOE_ROUTER_TENSORS, m, Lm, mg, zero_stage,
                                     stream);
    sharded_parameters_reduce_slices(&moe->expert_store, moe_expert_tensors, NUM_EXPERT_TENSORS, m, Lm,
                                     &moe->ep.replicas, zero_stage, stream);
}
// ----------------------------------------------------------------------------------------------------
// The step's boundaries

// with expert parallelism every process of the group takes part in each forward pass
static int moe_collective_forward(const Model* model) { return moe_of(model)->ep.degree > 1; }

// The step's loads (the balancing bias's, the telemetry's and the global-batch loss's counts) start again with each
// step, train_gpt.cu's and test_gpt.cu's alike.
static void moe_take_step_loads(const Model* model);  // llmc/moe_telemetry.h
static void moe_step_begin(Model* model) {
    MoEModel* moe = moe_of(model);
    moe->step_aux = moe->step_z = moe->step_drop = moe->step_load_cv = 0.0;
    // a step whose update was skipped (an outlier) leaves its loads behind: each step counts its own
    size_t n = (size_t)moe_stage_layers(model) * moe->config.num_experts;
    cudaCheck(cudaMemset(moe->step_loads, 0, n * sizeof(int)));
    moe->global_passes = 0;
    moe_take_step_loads(model);
}
static void moe_micro_step_done(Model* model) {
    MoEModel* moe = moe_of(model);
    moe_statistics(model);
    moe->step_aux += moe->aux_loss + moe->importance_loss + moe->load_loss + moe->seq_loss;  // every balancing loss
    moe->step_z += moe->z_loss;
    moe->step_drop += moe->drop_fraction;
    moe->step_load_cv += moe->load_cv;
}
// After each optimizer update (every process): the loads of this process's training passes since the last update,
// summed over every process (ints: exact, the same sum everywhere; under -ep each process routed its own tokens),
// move every bias by gamma with -rb (llmc/moe_balance.cuh moe_balance_bias_update), identically on every process, and go to
// the host for the telemetry (moe_take_step_loads), under -pp every stage's (model_loads, summed over the pipeline
// group where each stage put its layers' and zeros); the next step_begin sets them to 0 (a blocking stream's memset:
// after this copy).
static void moe_after_update(Model* model, const MultiGpuConfig* mg, cudaStream_t stream) {
    MoEModel* moe = moe_of(model);
    int Lm = moe_stage_layers(model), E = moe->config.num_experts;
    if (mg->num_processes > 1)
        ncclCheck(ncclAllReduce(moe->step_loads, moe->step_loads, (size_t)Lm * E, ncclInt32, ncclSum, mg->nccl_comm,
                                stream));
    if (moe_routing_groups(model) > 1)  // folded: the members routed other tokens
        tensor_parallel_all_reduce_int(model->tp, moe->step_loads, (size_t)Lm * E, stream);
    if (moe->settings.bias_gamma > 0.0f)
        moe_balance_bias_update(moe->balance_bias, moe->step_loads, Lm, E, moe->settings.bias_gamma, stream);
    const int* loads = moe->step_loads;
    if (model_pp_stages(model) > 1) {
        int Lmodel = num_moe_layers(model);
        int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
        moe_stage_model_indices(model, model_index);
        cudaCheck(cudaMemsetAsync(moe->model_loads, 0, (size_t)Lmodel * E * sizeof(int), stream));
        for (int m = 0; m < Lm; m++)
            cudaCheck(cudaMemcpyAsync(moe->model_loads + (size_t)model_index[m] * E, moe->step_loads + (size_t)m * E,
                                      E * sizeof(int), cudaMemcpyDeviceToDevice, stream));
        free(model_index);
        ncclCheck(ncclAllReduce(moe->model_loads, moe->model_loads, (size_t)Lmodel * E, ncclInt32, ncclSum,
                                model->pp->group.nccl_comm, stream));
        loads = moe->model_loads;
    }
    cudaCheck(cudaMemcpyAsync(moe->step_loads_cpu, loads, (size_t)num_moe_layers(model) * E * sizeof(int),
                              cudaMemcpyDeviceToHost, stream));
    cudaCheck(cudaEventRecord(moe->step_loads_copied, stream));
    moe->step_loads_pending = 1;
}
