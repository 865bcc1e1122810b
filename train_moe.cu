// train_moe.cu: Switch-Transformer Mixture-of-Experts training: the model of train_gpt.cu whose MLP is, every `-me`
// layers, a Switch-MoE layer (router in fp32, top-k, capacity with dropping or dropless, dispatch, the experts as
// batched or grouped GEMMs, combine; load-balancing and z losses, router jitter and noisy top-k gating), with expert
// parallelism over processes. Everything else — the model around it, the kernels, precision, recompute, ZeRO,
// checkpoints and the training loop — is train_gpt.cu's, which this file includes. The MoE layer is an FFN kind of
// its own (llmc/moe_ffn.h), with its model file, checkpoint and telemetry parts (llmc/moe_model_file.h,
// moe_checkpoint.h, moe_telemetry.h); this file is the MoE trainer: its flags, the process layout, the extension's
// tables that plug those parts into train_gpt.cu's model and loop, the named descriptors and main. Semantics, the
// model file and the expert state file: doc/moe.md and doc/formats.md. Build and run:
//   make train_moe [PRECISION=...]      GPU; make train_moe_cpu: the CPU backend
//   ./train_moe -e d12 -ne 8 -tk 1 -me 2 -i "data/x/*train*.bin" ...     (./train_moe -h lists the flags)
// test_moe.cu includes this file with OMIT_TRAIN_MOE_MAIN defined.
#define OMIT_TRAIN_GPT_MAIN
#include "train_gpt.cu"
#include "llmc/moe_ffn.h"
#include "llmc/moe_model_file.h"
#include "llmc/moe_checkpoint.h"
#include "llmc/moe_telemetry.h"

// ----------------------------------------------------------------------------------------------------
// The trainer's hooks: flags, process layout, start-up table, telemetry

// The MoE trainer's own flags, each once (llmc/cli.h): X(name, type, MoEFlags member, default, help line(s) ending
// with the default in words). MoEFlags, its defaults and the parsed table come from it.
#define MOE_FLAGS(X)                                                                                                   \
    X("-ne", INT, num_experts, 8, "experts per MoE layer (default = 8)")                                               \
    X("-tk", INT, top_k, 1, "experts per token: 1 = Switch, 2 = GShard (default = 1)")                                 \
    X("-me", INT, moe_every, 2, "an MoE layer every N layers: 1 = all, 2 = every other (default = 2)")                 \
    X("-md", INT, first_dense, 0,                                                                                      \
      "dense layers first: -me counts from layer F (DeepSeek's first_k_dense_replace; default = 0;\na model "          \
      "file's are its own)")                                                                                           \
    X("-eh", INT, expert_hidden, 0, "expert hidden size (default = the dense MLP's: 4C, llama -fh's)")                 \
    X("-cf", FLOAT, capacity_factor, 1.25f, "capacity factor in training; <= 0: dropless (default = 1.25)")            \
    X("-cfe", FLOAT, capacity_factor_eval, 2.0f, "capacity factor in evaluation (default = 2.0)")                      \
    X("-ra", FLOAT, aux_alpha, 0.01f, "load-balancing loss coefficient (default = 0.01)")                              \
    X("-rz", FLOAT, z_coef, 0.001f, "router z-loss coefficient (default = 0.001)")                                     \
    X("-ri", FLOAT, init_scale, 0.1f, "initialisation scale of router and expert weights (default = 0.1)")             \
    X("-ep", INT, expert_parallel, 1,                                                                                  \
      "expert-parallel degree N: groups of N processes (of a stage, with -pp) share out the experts (default = 1)")    \
    X("-etp", INT, expert_tensor_parallel, 1,                                                                          \
      "with -tp N: 1 = the experts whole, expert parallelism (-ep) over all processes and each tensor-parallel\n"      \
      "member routing its own B*T/N tokens (MoE parallel folding); N = each expert's hidden units split over the\n"  \
      "members, -ep over the data-parallel processes (default = 1)")                                                  \
    X("-rj", FLOAT, router_jitter, 0.0f,                                                                               \
      "router jitter: the router's input times U(1-rj, 1+rj) in training (default = 0)")                               \
    X("-rn", INT, noisy_topk, 0,                                                                                       \
      "noisy top-k gating (Shazeer 2017), importance and load losses: 0/1 (default = 0;\na model file with a noise "   \
      "router has it on)")                                                                                             \
    X("-rni", FLOAT, importance_coef, 0.1f, "importance loss coefficient with -rn 1 (default = 0.1)")                  \
    X("-rnl", FLOAT, load_coef, 0.1f, "load loss coefficient with -rn 1 (default = 0.1)")                              \
    X("-rs", STRING, score, "softmax",                                                                                 \
      "router scores: softmax, or sigmoid affinities whose chosen k are renormalised (DeepSeek-V3)\n(default = "       \
      "softmax; a model file's are its own)")                                                                          \
    X("-rsf", FLOAT, routed_scale, 1.0f,                                                                               \
      "routed scaling factor: the gates times it, with either score (default = 1; a model file's is its own)")         \
    X("-se", INT, shared_experts, 0,                                                                                   \
      "shared experts per MoE layer: dense MLPs every token goes through, added to the routed output\n(default = 0; "  \
      "a model file's are its own)")                                                                                   \
    X("-seh", INT, shared_hidden, 0, "the shared experts' hidden size, with -se (default = -eh's)")                    \
    X("-rb", FLOAT, bias_gamma, 0.0f,                                                                                  \
      "aux-loss-free balancing: each step moves a per-expert selection bias by GAMMA towards the mean load\n(sigmoid " \
      "scores only; default = 0: off, a model file's bias stays fixed)")                                               \
    X("-dl", INT, device_limit, 0,                                                                                     \
      "device-limited routing: each token's experts within the M expert-parallel groups (-ep) of its\nlargest "        \
      "keys (default = 0: off)")                                                                                       \
    X("-eg", INT, expert_groups, 0,                                                                                    \
      "the model's expert groups G: each token's experts lie within the -egk groups whose two largest affinity\n"      \
      "+ bias sum highest (DeepSeek-V3's n_group; sigmoid scores; default = 0: none; a model file's are its own)")     \
    X("-egk", INT, kept_groups, 0, "the expert groups each token keeps, with -eg (DeepSeek-V3's topk_group)")          \
    X("-rsl", FLOAT, seq_alpha, 0.0f,                                                                                  \
      "sequence-wise balance loss coefficient ALPHA: the Switch loss per sequence, averaged over the sequences\n"      \
      "(DeepSeek-V3; default = 0: off)")                                                                               \
    X("-rg", INT, global_aux, 0,                                                                                       \
      "global-batch balance loss: 1 = the Switch loss's expert fractions from the step's micro-batches so far on\n"    \
      "every process (Qwen; default = 0: each micro-batch's own)")
typedef struct {
    MOE_FLAGS(FLAG_FIELD)
} MoEFlags;
static MoEFlags moe_flags = {MOE_FLAGS(FLAG_DEFAULT_VALUE)};
#define FLAG_TARGET moe_flags
static Flag moe_flag_table[] = {MOE_FLAGS(FLAG_ROW)};
#undef FLAG_TARGET

// -rs's name -> MOE_SCORE_*, -1 when it is neither
static int moe_score_of(const char* name) {
    if (!strcmp(name, "softmax")) return MOE_SCORE_SOFTMAX;
    if (!strcmp(name, "sigmoid")) return MOE_SCORE_SIGMOID;
    return -1;
}

static int moe_check_flags(void) {
    const MoEFlags* f = &moe_flags;
    const Flag* seh = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), "-seh");
    if (f->shared_experts < 0) {
        fprintf(stderr, "-se %d: expected 0 or more shared experts\n", f->shared_experts);
        return 0;
    }
    if (seh->given && f->shared_experts == 0) {
        fprintf(stderr, "-seh %d: the shared experts' hidden size needs -se N > 0\n", f->shared_hidden);
        return 0;
    }
    if (seh->given && f->shared_hidden <= 0) {
        fprintf(stderr, "-seh %d: the shared experts' hidden size must be positive\n", f->shared_hidden);
        return 0;
    }
    if (moe_score_of(f->score) < 0) { fprintf(stderr, "-rs %s: expected softmax or sigmoid\n", f->score); return 0; }
    if (!(isfinite(f->bias_gamma) && f->bias_gamma >= 0.0f)) {
        fprintf(stderr, "-rb %g: the balancing bias step must be finite and >= 0\n", f->bias_gamma);
        return 0;
    }
    if (f->first_dense < 0 || f->expert_groups < 0 || f->kept_groups < 0) {
        fprintf(stderr, "-md %d -eg %d -egk %d: expected >= 0\n", f->first_dense, f->expert_groups, f->kept_groups);
        return 0;
    }
    if ((f->expert_groups > 0) != (f->kept_groups > 0)) {
        fprintf(stderr, "-eg %d -egk %d: the expert groups and the groups kept go together, both positive\n",
                f->expert_groups, f->kept_groups);
        return 0;
    }
    if (f->device_limit < 0) {
        fprintf(stderr, "-dl %d: the device limit must be >= 0 (0: off)\n", f->device_limit);
        return 0;
    }
    if (!(isfinite(f->seq_alpha) && f->seq_alpha >= 0.0f)) {
        fprintf(stderr, "-rsl %g: the sequence-wise loss coefficient must be finite and >= 0\n", f->seq_alpha);
        return 0;
    }
    if (f->global_aux != 0 && f->global_aux != 1) {
        fprintf(stderr, "-rg %d: expected 0 or 1\n", f->global_aux);
        return 0;
    }
    if (!(isfinite(f->routed_scale) && f->routed_scale > 0.0f)) {
        fprintf(stderr, "-rsf %g: the routed scale must be finite and positive\n", f->routed_scale);
        return 0;
    }
    if (f->noisy_topk && moe_score_of(f->score) != MOE_SCORE_SOFTMAX) {
        fprintf(stderr, "-rn 1 -rs %s: noisy top-k gating is defined on softmax scores only\n", f->score);
        return 0;
    }
    if (!(f->router_jitter >= 0.0f && f->router_jitter < 1.0f)) {
        fprintf(stderr, "-rj %g: the jitter must be in [0, 1)\n", f->router_jitter);
        return 0;
    }
    if (f->noisy_topk != 0 && f->noisy_topk != 1) { fprintf(stderr, "-rn %d: expected 0 or 1\n", f->noisy_topk); return 0; }
    if (f->noisy_topk && f->top_k >= f->num_experts) {
        fprintf(stderr, "-rn 1: noisy top-k gating needs -tk (%d) below -ne (%d)\n", f->top_k, f->num_experts);
        return 0;
    }
    if (f->importance_coef < 0.0f || f->load_coef < 0.0f) { fprintf(stderr, "-rni and -rnl must not be negative\n"); return 0; }
    if (f->expert_parallel < 1) {
        fprintf(stderr, "-ep %d: the expert-parallel degree must be at least 1\n", f->expert_parallel);
        return 0;
    }
    if (f->num_experts < 1) { fprintf(stderr, "-ne %d: expected at least 1 expert\n", f->num_experts); return 0; }
    if (f->top_k < 1 || f->top_k > f->num_experts) {
        fprintf(stderr, "-tk %d: top-k must be between 1 and the number of experts (%d)\n", f->top_k, f->num_experts);
        return 0;
    }
    if (f->aux_alpha < 0.0f || f->z_coef < 0.0f || f->init_scale <= 0.0f) {
        fprintf(stderr, "-ra and -rz must not be negative, -ri must be positive\n");
        return 0;
    }
    return 1;
}

// The trainer's model state: its settings from the flags, a descriptor's shape, and the experts shared out over
// the processes of a pipeline stage, `mg` (collective; a memory plan's: sizes only).
static MoEModel trainer_moe;
static void moe_setup(Model* model, const MultiGpuConfig* mg, int plan) {
    const MoEFlags* f = &moe_flags;
    int tp = model_tp_degree(model), etp = f->expert_tensor_parallel;
    if (etp != 1 && etp != tp) {
        fprintf(stderr, "-etp %d: expected 1 (the experts whole) or -tp's %d (their hidden units split)\n", etp, tp);
        exit(EXIT_FAILURE);
    }
    // fine-tuning freezes the model, its balancing biases with it: they are not the adapter's to move
    if (model->frozen && f->bias_gamma > 0.0f) {
        fprintf(stderr, "-rb %g: the balancing biases are the model's, frozen under -ft (leave -rb out)\n",
                f->bias_gamma);
        exit(EXIT_FAILURE);
    }
    // the global-batch loss's coefficient counts the step's passes so far, which a pipeline's order interleaves
    // with the backward passes that use it
    if (model_pp_stages(model) > 1 && f->global_aux) {
        fprintf(stderr, "-rg 1: the global-batch balance loss runs without pipeline stages (-pp 1)\n");
        exit(EXIT_FAILURE);
    }
    // the -ep groups: over every process (of the stage), or at -etp N over the data-parallel processes that hold the
    // same slices
    const MultiGpuConfig* over = etp > 1 ? &model->tp->dp : mg;
    if (over->num_processes % f->expert_parallel != 0) {
        fprintf(stderr, "-ep %d: the expert-parallel degree must divide the number of %sprocesses%s (%d)\n",
                f->expert_parallel, etp > 1 ? "data-parallel " : "", model_pp_stages(model) > 1 ? " of a stage" : "",
                over->num_processes);
        exit(EXIT_FAILURE);
    }
    MoEConfig config = {};
    config.num_experts = f->num_experts;
    config.top_k = f->top_k;
    config.moe_every = f->moe_every;
    config.expert_hidden = f->expert_hidden;
    config.noisy_gating = f->noisy_topk;
    config.score = moe_score_of(f->score);
    config.routed_scale = f->routed_scale;
    config.shared_experts = f->shared_experts;
    config.shared_hidden = f->shared_hidden;
    config.balance_bias = 0;
    config.first_dense = f->first_dense;
    config.expert_groups = f->expert_groups;
    config.kept_groups = f->kept_groups;
    MoESettings settings = {};
    settings.capacity_factor = f->capacity_factor;
    settings.capacity_factor_eval = f->capacity_factor_eval;
    settings.aux_alpha = f->aux_alpha;
    settings.z_coef = f->z_coef;
    settings.jitter = f->router_jitter;
    settings.importance_coef = f->importance_coef;
    settings.load_coef = f->load_coef;
    settings.init_scale = f->init_scale;
    settings.bias_gamma = f->bias_gamma;
    settings.device_limit = f->device_limit;
    settings.seq_alpha = f->seq_alpha;
    settings.global_aux = f->global_aux;
    moe_model_init(&trainer_moe, &config, &settings);
    trainer_moe.expert_tp = etp;
    if (plan) expert_parallel_plan(&trainer_moe.ep, over, f->expert_parallel);
    else expert_parallel_init(&trainer_moe.ep, over, f->expert_parallel);
    model->extension_state = &trainer_moe;
}

// Once built: a model file's experts are its own; a flag that says otherwise is a mistake, not a request.
static void moe_check_model(const Model* model, const char* source, int from_file) {
    const MoEConfig* c = &moe_of(model)->config;
    const char* names[] = {"-ne", "-tk", "-me", "-eh", "-md", "-eg", "-egk"};
    const char* what[] = {"experts per MoE layer", "experts per token", "layers per MoE layer",
                          "as the experts' hidden size", "dense layers first", "expert groups", "expert groups kept"};
    int given[] = {moe_flags.num_experts, moe_flags.top_k, moe_flags.moe_every, moe_flags.expert_hidden,
                   moe_flags.first_dense, moe_flags.expert_groups, moe_flags.kept_groups};
    int has[] = {c->num_experts, c->top_k, c->moe_every, c->expert_hidden, c->first_dense, c->expert_groups,
                 c->kept_groups};
    for (int i = 0; from_file && i < (int)(sizeof(has) / sizeof(has[0])); i++) {
        const Flag* f = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), names[i]);
        if (f->given && given[i] != has[i]) {
            fprintf(stderr, "%s %d: the model file %s has %d %s (leave %s out, or start from a descriptor)\n",
                    names[i], given[i], source, has[i], what[i], names[i]);
            exit(EXIT_FAILURE);
        }
    }
    // the scores and the routed scale are the model's too (header words 27 and 28)
    const Flag* score_flag = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), "-rs");
    const Flag* scale_flag = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), "-rsf");
    if (from_file && score_flag->given && moe_score_of(moe_flags.score) != c->score) {
        fprintf(stderr, "-rs %s: the model file %s has %s scores (header word 27; leave -rs out, or start from a "
                "descriptor)\n", moe_flags.score, source, c->score == MOE_SCORE_SIGMOID ? "sigmoid" : "softmax");
        exit(EXIT_FAILURE);
    }
    if (from_file && scale_flag->given && moe_flags.routed_scale != c->routed_scale) {
        fprintf(stderr, "-rsf %g: the model file %s has the routed scale %g (header word 28; leave -rsf out, or start "
                "from a descriptor)\n", moe_flags.routed_scale, source, c->routed_scale);
        exit(EXIT_FAILURE);
    }
    // and so are the shared experts (header words 25 and 26)
    const Flag* se_flag = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), "-se");
    const Flag* seh_flag = flag_find(moe_flag_table, sizeof(moe_flag_table) / sizeof(moe_flag_table[0]), "-seh");
    if (from_file && ((se_flag->given && moe_flags.shared_experts != c->shared_experts) ||
                      (seh_flag->given && moe_flags.shared_hidden != c->shared_hidden))) {
        fprintf(stderr, "-se %d -seh %d: the model file %s has %d shared experts of hidden size %d (header words 25 "
                "and 26; leave -se and -seh out, or start from a descriptor)\n", moe_flags.shared_experts,
                moe_flags.shared_hidden, source, c->shared_experts, c->shared_hidden);
        exit(EXIT_FAILURE);
    }
    if (moe_flags.noisy_topk && !c->noisy_gating) {
        fprintf(stderr, "-rn 1: %s has no noise router (header[12] = 0); noisy gating is part of the model: start "
                "from a descriptor with -rn 1\n", source);
        exit(EXIT_FAILURE);
    }
}

// The MoE model's parts of train_gpt.cu's ModelExtension
static const FfnExtension moe_ffn = {
    .kind = {.forward = moe_forward, .backward = moe_backward},
    .replaces_mlp = moe_replaces_mlp,
    .configure = moe_configure,
    .tensor_names = {"routerw", "routernw", "efcw", "efcb", "efcprojw", "efcprojb", "shared_fcw", "shared_fcb",
                     "shared_fcprojw", "shared_fcprojb"},
    .tensor_decays = {1, 1, 1, 0, 1, 0, 1, 0, 1, 0},
    .tensor_sizes = moe_tensor_sizes,
    .init_std = moe_init_std,
    .own_parameter_count = moe_own_parameter_count,
    .allocate_parameters = moe_allocate_parameters,
    .set_parameters = moe_set_parameters,
    .get_parameters = moe_get_parameters,
    .get_gradients = moe_get_gradients,
    .active_parameters_per_token = moe_active_parameters_per_token,
    .expert_linears = moe_expert_linears,
    .gathers_model_file = moe_gathers_model_file,
    .own_set = moe_own_set,
    .own_group = moe_own_group,
    .own_norm_squared = moe_own_norm_squared,
    .reduce_layer = moe_reduce_layer,
    .gather_replicated_slices = moe_gather_router_slices,
    .prefetch_own = moe_prefetch_experts,
    .collective_forward = moe_collective_forward,
    .activation_bytes = moe_activation_bytes,
    .allocate_activations = moe_allocate_activations,
    .use_slot = moe_use_slot,
    .begin_forward = moe_begin_forward,
    .end_forward = moe_end_forward,
    .step_begin = moe_step_begin,
    .micro_step_done = moe_micro_step_done,
    .after_update = moe_after_update,
    .free = moe_free,
};
static const ModelFileExtension moe_model_file = {
    .model_magic = MOE_MODEL_MAGIC,
    .fp32_version = 1,
    .bf16_version = 2,
    .model_name = "MoE model",
    .read_header = moe_read_header,
    .write_header = moe_write_header,
    .file_tail_bytes = moe_file_tail_bytes,
    .read_file_tail = moe_read_file_tail,
    .write_file_tail = moe_write_file_tail,
};
static const CheckpointExtension moe_checkpoint = {
    .state_file = "expert_state",
    .write_state = write_expert_state,
    .read_state = read_expert_state,
};
static const TelemetryExtension moe_telemetry = {
    .join_stages = moe_join_stages,
    .info_rows = moe_info_rows,
    .step_fields = moe_step_fields,
    .log_step = moe_log_step,
    .print_validation = print_moe_layers,
};
static const TrainerExtension moe_trainer = {
    .trainer = "train_moe",
    .flags = moe_flag_table,
    .num_flags = (int)(sizeof(moe_flag_table) / sizeof(moe_flag_table[0])),
    .flags_title = "MoE options (train_moe):",
    .check_flags = moe_check_flags,
    .setup = moe_setup,
    .check_model = moe_check_model,
};
static const ModelExtension moe_extension = {
    .ffn = &moe_ffn,
    .file = &moe_model_file,
    .checkpoint = &moe_checkpoint,
    .telemetry = &moe_telemetry,
    .trainer = &moe_trainer,
};

// ----------------------------------------------------------------------------------------------------
// The named descriptors (doc/moe.md, "Descriptors"): `-e mix8` (the Mixtral shape) and `-e ds64` (the DeepSeek-V3
// shape, fine-grained and shared experts) are descriptor d8 (8 layers, C 512, 8 heads of 64) with these flags; the
// command line's own flags come after them, so that they override them (a repeated flag takes its last value).
typedef struct {
    const char* name;
    const char* flags[40];
} MoEDescriptor;
static const MoEDescriptor moe_descriptors[] = {
    {"mix8", {"-arch", "llama", "-kv", "2", "-rt", "1000000", "-ne", "8", "-tk", "2", "-me", "1", "-eh", "1792",
              "-cf", "0", "-ra", "0.01", "-rz", "0.001", NULL}},
    {"ds64", {"-arch", "llama", "-kv", "8", "-rt", "10000", "-ne", "64", "-tk", "6", "-me", "1", "-eh", "128",
              "-se", "2", "-seh", "128", "-rs", "sigmoid", "-rsf", "2.5", "-cf", "0", "-rb", "0.001", "-rsl", "0.0001",
              "-ra", "0", "-rz", "0", NULL}},
};

// argv with a named descriptor's flags after argv[0] and `-e NAME` as `-e d8`; argv itself when -e names none
static char** moe_expand_descriptor(int* argc, char* argv[]) {
    const MoEDescriptor* d = NULL;
    int at = -1;
    for (int i = 1; i + 1 < *argc; i += 2) {
        if (strcmp(argv[i], "-e") != 0) continue;
        d = NULL;  // the last -e counts
        at = i + 1;
        for (size_t k = 0; k < sizeof(moe_descriptors) / sizeof(moe_descriptors[0]); k++)
            if (!strcmp(argv[i + 1], moe_descriptors[k].name)) d = &moe_descriptors[k];
    }
    if (d == NULL) return argv;
    int extra = 0;
    while (d->flags[extra] != NULL) extra++;
    char** out = (char**)malloc_check((size_t)(*argc + extra + 1) * sizeof(char*));
    out[0] = argv[0];
    for (int i = 0; i < extra; i++) out[1 + i] = (char*)d->flags[i];
    for (int i = 1; i < *argc; i++) out[extra + i] = i == at ? (char*)"d8" : argv[i];
    *argc += extra;
    out[*argc] = NULL;
    return out;
}

#ifndef OMIT_TRAIN_MOE_MAIN
int main(int argc, char* argv[]) {
    char** args = moe_expand_descriptor(&argc, argv);
    return trainer_main(argc, args, &moe_extension);
}
#endif
