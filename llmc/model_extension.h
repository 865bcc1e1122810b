// llmc/model_extension.h: what a model adds to the layer kinds of train_gpt.cu (doc/architecture.md,
// "Extensions"): the FFN kind's interface (FfnKind), and an extension's five parts as tables filled in by member
// name (FfnExtension, ModelFileExtension, CheckpointExtension, TelemetryExtension, TrainerExtension), with GPT-2's
// empty ones. train_gpt.cu includes it before its model struct: it needs the model's forward declaration (Model) and
// its LayerParameters, LayerActivations and MLP_EXTENSION_SLOTS, and llmc/optimizer.cuh, multi_gpu.cuh, logger.h,
// info_table.h and cli.h. train_moe.cu fills it in for the MoE layer.
#pragma once

// An FFN kind (doc/architecture.md): out (B, T, C) from the layer's la->ln2 (B, T, C), and its transpose, d_ln2
// (B, T, C) = the gradient of la->ln2 from dout (B, T, C) with the gradients into lg (lp, lg: the layer's dense-MLP
// slices, NULL in a layer whose FFN is an extension's, which holds its own).
typedef struct {
    void (*forward)(Model* model, int layer, const LayerParameters* lp, const LayerActivations* la, floatX* out, int B,
                    int T, cudaStream_t stream);
    void (*backward)(Model* model, int layer, const LayerParameters* lp, const LayerParameters* lg,
                     const LayerActivations* la, floatX* d_ln2, const floatX* dout, int B, int T, cudaStream_t stream);
} FfnKind;

// ----------------------------------------------------------------------------------------------------
// An extension: a model whose FFN in some layers is a kind with parameters, activations and a process layout of its
// own (train_moe.cu's Switch-MoE layers), and what comes with it. Its parts are small tables, each filled in by member
// name; a NULL member has nothing to do, and GPT-2's parts are empty (no_extension). `model->extension_state` is the
// extension's own data.

// The FFN kind and what the model asks of it. Its tensors sit in slots PARAM_EXTENSION.. of the model file, each
// stacked over the layers whose FFN it replaces (so that a pipeline stage holds its layers' blocks of them,
// llmc/model_pipeline.h): the part that every process holds (e.g. a router) in the model's replicated parameter set,
// the rest (e.g. experts shared out over processes) in a set of its own (own_set), reduced and sharded over own_group.
// Under -pp a process holds and runs its stage's layers only, and its hooks see those.
typedef struct {
    FfnKind kind;
    int (*replaces_mlp)(const Model* model, int layer);  // NULL: no layer
    // after the model's sizes are set (file or descriptor), before anything is allocated: defaults and checks
    void (*configure)(Model* model, const char* source);
    // parameters: names and weight decay per slot; sizes in the file and in the replicated set (0: unused slot)
    const char* tensor_names[MLP_EXTENSION_SLOTS];
    int tensor_decays[MLP_EXTENSION_SLOTS];
    void (*tensor_sizes)(const Model* model, size_t* in_file, size_t* in_replicated_set);
    // a descriptor's initialisation of a weight (decay) slot: the std of its normal draw, 0 for zeros
    float (*init_std)(const Model* model, int slot, float residual_scale);
    size_t (*own_parameter_count)(const Model* model);  // before the own set exists
    void (*allocate_parameters)(Model* model);  // its own set, once the replicated set is allocated
    // its own tensors from / into the model file's extension block (host, slots in file order); get is collective
    void (*set_parameters)(Model* model, const floatX* file_block);
    void (*get_parameters)(const Model* model, floatX* file_block, cudaStream_t stream);
    void (*get_gradients)(const Model* model, floatX* file_block, cudaStream_t stream);
    double (*active_parameters_per_token)(const Model* model);  // of its tensors (for the flops count)
    // LoRA's experts targets (-fw experts, llmc/model_adapter.h): its expert Linear `which` (0: fc, 1: fc_proj), each
    // matrix (OC, C) in model-file slot PARAM_EXTENSION + *slot; returns how many matrices the slot stacks (every
    // expert of every layer). NULL: the extension has no experts.
    size_t (*expert_linears)(const Model* model, int which, int* C, int* OC, int* slot);
    // how its parameters are sharded
    int (*gathers_model_file)(const Model* model);  // whether this process takes part in get_parameters
    ShardedParameters* (*own_set)(Model* model);                 // NULL: none
    const MultiGpuConfig* (*own_group)(const Model* model);      // the processes that hold the same own tensors
    // the squared norm of the own set's gradient, every value of it once over all processes (collective)
    float (*own_norm_squared)(Model* model, int zero_stage, cudaStream_t stream);
    // the gradient reduction of its slices of `layer` (after the layer's backward pass, on the last micro-step)
    void (*reduce_layer)(Model* model, int layer, const MultiGpuConfig* mg, int zero_stage, cudaStream_t stream);
    // ZeRO-3's gathers of `layer`: its slices of the replicated set into the model's gather buffer layer % 2 (called
    // between the model's gather_begin and gather_end, which model_prefetch_layer does), and its own set's into
    // buffers of its own (unless they hold them already)
    void (*gather_replicated_slices)(Model* model, int layer);
    void (*prefetch_own)(Model* model, int layer, cudaStream_t stream);
    int (*collective_forward)(const Model* model);  // every process of a group takes part in each forward pass
    // activations and passes
    size_t (*activation_bytes)(const Model* model, size_t B, size_t T, int recompute);
    void (*allocate_activations)(Model* model, int B, int T);  // once, or under -pp once per slot, each then in use
    void (*use_slot)(Model* model, int slot);  // -pp: the activations of the model's slot k (its k-th allocation)
    void (*begin_forward)(Model* model, int B, int T, float dlogits_scale);  // a pass over (B, T) tokens
    void (*end_forward)(Model* model, int N, cudaStream_t stream);  // after a forward pass with targets
    // the training step's boundaries: before its first micro-step, after each micro-step's forward pass, and after
    // each optimizer update that changed the parameters, on every process (model_update)
    void (*step_begin)(Model* model);
    void (*micro_step_done)(Model* model);
    void (*after_update)(Model* model, const MultiGpuConfig* mg, cudaStream_t stream);
    void (*free)(Model* model);
} FfnExtension;

// The model file: magic and versions (fp32, bf16), header words 8.. and a tail after the parameters (GPT-2's format,
// llm.c's, when the extension has none)
typedef struct {
    int model_magic, fp32_version, bf16_version;
    const char* model_name;  // in messages: "MoE model"
    void (*read_header)(Model* model, const int* header, const char* path);
    void (*write_header)(const Model* model, int* header);
    // the tail's bytes (once configured from the header), read from the file positioned there, written after the
    // parameters by process 0
    size_t (*file_tail_bytes)(const Model* model);
    void (*read_file_tail)(Model* model, FILE* f, const char* path);
    void (*write_file_tail)(const Model* model, FILE* f, const char* path);
} ModelFileExtension;

// Its checkpoint file ("expert_state"), listed in DONE markers, written and read beside the model's
typedef struct {
    const char* state_file;
    void (*write_state)(const char* dir, int step, Model* model, int zero_stage, cudaStream_t stream);
    void (*read_state)(const char* dir, int step, Model* model);
} CheckpointExtension;

// What it shows: rows of the start-up table, fields of the step line, the log, and a report at each validation.
// Under -pp join_stages puts the stages' parts together (every process; collective over the pipeline group): after
// the step's passes, the step line's; after a validation pass (`report`), the report's.
typedef struct {
    void (*join_stages)(Model* model, int report);
    void (*info_rows)(const Model* model, InfoTable* table);
    void (*step_fields)(const Model* model, int micro_steps, char* out, size_t size);
    void (*log_step)(const Model* model, Logger* logger, int step, int micro_steps);
    void (*print_validation)(const Model* model, int N, Logger* logger, int step);
} TelemetryExtension;

// The trainer's flags and process layout
typedef struct {
    const char* trainer;  // "train_moe"
    Flag* flags;  // parsed with the trainer's
    int num_flags;
    const char* flags_title;
    int (*check_flags)(void);  // after parsing: 0 (with a message) when a value is unusable
    // before the model is built, from the flags, over a stage's processes `mg` (plan: the memory plan's layout of
    // mg->num_processes, sizes only: nothing communicates)
    void (*setup)(Model* model, const MultiGpuConfig* mg, int plan);
    void (*check_model)(const Model* model, const char* source, int from_file);  // once built
} TrainerExtension;

typedef struct {
    const FfnExtension* ffn;
    const ModelFileExtension* file;
    const CheckpointExtension* checkpoint;
    const TelemetryExtension* telemetry;
    const TrainerExtension* trainer;
} ModelExtension;

static const FfnExtension no_ffn_extension = {};
static const ModelFileExtension gpt2_model_file = {.model_magic = GPT2_MODEL_MAGIC, .fp32_version = 3,
                                                   .bf16_version = 5, .model_name = "GPT-2 model"};
static const CheckpointExtension no_checkpoint_extension = {};
static const TelemetryExtension no_telemetry_extension = {};
static const TrainerExtension no_trainer_extension = {};
// GPT-2's: the dense MLP in every layer, nothing else
static const ModelExtension no_extension = {&no_ffn_extension, &gpt2_model_file, &no_checkpoint_extension,
                                            &no_telemetry_extension, &no_trainer_extension};
// an extension with its missing parts empty
static ModelExtension model_extension(const ModelExtension* x) {
    ModelExtension e = no_extension;
    if (x && x->ffn) e.ffn = x->ffn;
    if (x && x->file) e.file = x->file;
    if (x && x->checkpoint) e.checkpoint = x->checkpoint;
    if (x && x->telemetry) e.telemetry = x->telemetry;
    if (x && x->trainer) e.trainer = x->trainer;
    return e;
}
