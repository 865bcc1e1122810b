// test_gpt.cu: the GPT trainer against the PyTorch reference (train_gpt.py). It includes train_gpt.cu (without
// its main) and checks, for one model and batch written by
//   /usr/bin/python3 train_gpt.py --write-reference PREFIX ...
// the logits, the loss, every parameter gradient, and the losses of 10 AdamW steps on that batch, with the optimizer
// the reference's steps ran with (the debug state's words 12..17, doc/formats.md). The model file's header says which
// model: GPT-2, or the Llama-style model of -arch llama (train_gpt.py --arch llama; `make test` runs
// build/ref/llama_gqa_* and llama_tied_*, Makefile LLAMA_REF_*).
//   make test_gpt_cpu [PRECISION=FP32|BF16]; ./test_gpt_cpu PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2] [-fa 0|1]
//   [-st N] (the first N steps only: the checking build's runs, whose plain twins run all 10, take 3; the later steps
//   launch the same kernels in the same order as the third)
//   (also under mpirun: every process takes the reference batch; test_moe.cu adds its MoE checks and -ep N through
//   TestExtension, and includes this file with OMIT_TEST_GPT_MAIN defined)
// `make test` runs it in FP32, BF16 (and FP16) over the recompute and master-weight settings; the same binary
// built with nvcc (make test_gpt) runs on a GPU.
//
// Tolerances, all relative to the largest reference magnitude of the compared tensor (gradients of
// different tensors differ by orders of magnitude, so a per-tensor scale is the meaningful one):
//   FP32: 1e-5 for logits and gradients (measured: at most 4e-7). Both sides compute in fp32 with
//         different summation orders (OpenBLAS or cuBLAS vs PyTorch); with 48..192-term dot products and
//         69-term gradient sums the rounding stays near 1e-7, while a dropped bias or a swapped index
//         changes a tensor by O(1) of its scale. Loss: 1e-6 (measured 1e-7). The 10 step losses: 1e-5
//         (measured 1e-7; Adam normalises by sqrt(v), which amplifies tiny gradient differences).
//   BF16: activations and gradients are stored in bf16 (8-bit mantissa: 2^-9 relative rounding per
//         store) and a value passes through about 10 stores between the input and a gradient: 3e-2 for
//         gradients and logits (measured: at most 1e-2, on wte, whose rows sum many bf16 terms). Loss:
//         1e-3 (measured 1.3e-5: the mean over B*T cancels rounding). Step losses: 5e-3 (measured 1.5e-3).
//   FP16: 10-bit mantissa (2^-11 per store), with dynamic loss scaling: 5e-3 for gradients and logits
//         (measured: at most 1.3e-3), 1e-3 for the loss, 5e-3 for the step losses. Checked against the
//         bf16 reference state (its parameters are bf16 values, which fp16 holds nearly exactly).
// The llama references take the same tolerances for the same reasons: their pieces round once where GPT-2's do
// (RMSNorm, RoPE and SwiGLU compute in fp32 and round their outputs once, doc/kernels.md), with about as many
// stores between input and gradient (RoPE adds one to q and k, SwiGLU replaces GELU). Measured: FP32 at most
// 5.0e-7 for gradients, 2.9e-7 for logits, 1.1e-7 for the step losses; BF16 at most 9.4e-3 for gradients (lm_head),
// 4.8e-3 for logits, 1.5e-5 for the loss, 2.0e-4 for the step losses; FP16 (against the BF16 reference) 1.0e-3 for
// gradients, 6.6e-4 for logits, 1.6e-5 for the step losses.
// test_moe.cu has included train_moe.cu, and with it train_gpt.cu, before this file
#ifndef OMIT_TEST_GPT_MAIN
#define OMIT_TRAIN_GPT_MAIN
#include "train_gpt.cu"
#endif

typedef struct {
    int B, T, V, Vp, nsteps;
    int micro_batches;  // K: each step is K micro-batches of B/K sequences (header[10], train_moe.py only; else 1)
    int* x;
    int* y;
    float* logits;  // (B, T, V)
    float loss;
    float* grads;   // model-file order, num_parameters
    float* step_losses;
    void* extension;  // what a TestExtension reads between the loss and the gradients (test_moe.cu: the routing)
} ReferenceState;

typedef struct ModelTest ModelTest;
// What a model with an MLP extension adds to the test (test_moe.cu); test_gpt.cu's GPT-2 has none.
typedef struct {
    const char* name;         // "test_moe"
    const char* usage_flags;  // its flags, for the usage line
    int (*parse_flag)(ModelTest* t, const char* flag, const char* value);  // 1: its flag, taken
    // its settings from the debug state's header (path), refusing a flag that disagrees; before any model is built
    void (*take_settings)(ModelTest* t, const int* header, const char* path);
    // gives a model its extension, with expert-parallel degree `degree` (collective); the harness frees extension_state
    void (*attach)(Model* model, const ModelTest* t, const MultiGpuConfig* mg, int degree);
    // its part of the debug state (header: the file's), read from f after the loss
    void* (*read_reference)(FILE* f, const char* path, const int* header, const Model* model);
    // after each micro-step `micro` of test_gradient's pass (its statistics: test_moe.cu sums the routing over them)
    void (*micro_step_done)(const Model* model, int micro);
    // after the gradient pass on the reference batch: its own checks (losses, routing)
    void (*check_forward)(const Model* model, const ReferenceState* ref);
    // the stored gradient of tensor i times this is the step's (1 but for an extension's own set)
    float (*gradient_multiplier)(const Model* model, int i);
    // after the reference checks: its own comparisons (expert parallelism against degree 1)
    void (*extra_checks)(const ModelTest* t, const ReferenceState* ref, const MultiGpuConfig* mg, float tol_tensor,
                         float tol_steps, cudaStream_t stream);
    // how many of the reference's micro-batches one forward pass routes as groups of their own (test_moe.cu: the
    // tensor-parallel members of a folded MoE layer); NULL: one
    int (*groups_per_pass)(const Model* model);
    // before an evaluation pass on the reference batch's first micro-batch outside the reference's own passes (the
    // merged model's check): that pass routes as the reference's first logits pass did (test_moe.cu: teacher-forced in
    // BF16, so that two models within rounding of each other route alike); NULL: nothing to do
    void (*repeat_first_evaluation)(void);
} TestExtension;

// One test's setup: the model file and the trainer's settings (an extension keeps its own: test_moe.cu's MoESettings)
struct ModelTest {
    const char* path;
    int recompute, master, gelu_fusion, zero_stage;
    int flash_attention;  // -fa, as the trainer's (model_set_attention)
    int ep_degree;
    const TestExtension* extension;
    int offload;  // -oo, as the trainer's
    AdamWConfig opt;  // test_step's: the reference's (take_reference_optimizer)
    int steps;  // -st: the reference's first this many steps are run and compared (0, without -st: all of them)
    const TensorParallel* tp;  // -tp N -sp S: the tensor-parallel layout (degree 1: every layer whole)
    const MultiGpuConfig* world;  // every process (an extension's groups may span the tensor-parallel ones)
    // a fine-tuning reference (debug state word 40): its adapter file, whose rank, targets and alpha the models take;
    // NULL: every parameter trains
    const char* adapter_path;
    int adapter_method;
    int adapter_rank;
    unsigned adapter_targets;
    float adapter_alpha;
};

// The debug state's words 12..17 (doc/formats.md, "Debug state"): the reference steps' AdamW, fp32 bits
#define STATE_OPTIMIZER_WORD 12
// ... and word 40: the fine-tuning method (FT_METHOD_LORA), whose adapter is PREFIX_adapter.bin; 0: none
#define STATE_FINE_TUNING_WORD 40

static float header_float(const int* header, int word) {
    float value;
    memcpy(&value, header + word, sizeof(value));
    return value;
}

// A debug state's header (magic, version 3); the file is left at its payload for read_reference_state
static FILE* open_reference_state(const char* path, int* header) {
    FILE* f = fopen_check(path, "rb");
    read_header_check(f, header, path, 20240327, "debug state");
    if (header[1] != 3) {
        fprintf(stderr, "%s: debug state version %d, expected 3 (written before its settings were: write it again)\n",
                path, header[1]);
        exit(EXIT_FAILURE);
    }
    return f;
}

// The steps' optimizer is the reference's: lr, betas, eps, weight decay and the clipping norm (<= 0: none) as
// train_gpt.py --write-reference ran them
static void take_reference_optimizer(AdamWConfig* opt, const int* header) {
    const int w = STATE_OPTIMIZER_WORD;
    float clip = header_float(header, w + 5);
    AdamWConfig o = {header_float(header, w), header_float(header, w + 1), header_float(header, w + 2),
                     header_float(header, w + 3), header_float(header, w + 4), clip > 0.0f ? clip : INFINITY};
    *opt = o;
}

// what the reference's gradients cover: the model's parameters, or under fine-tuning the adapter's
static size_t test_trained_parameters(const Model* model) {
    return model->frozen ? adapter_parameter_count(model) : model_num_parameters(model);
}

// the payload of the debug state at path, after its header (open_reference_state)
static void read_reference_state(ReferenceState* r, FILE* f, const char* path, const int* header, const Model* model,
                                 const TestExtension* x) {
    r->B = header[2];
    r->T = header[3];
    r->nsteps = header[4];
    r->V = header[5];
    r->Vp = header[6];
    // train_moe.py --micro-batches K writes K > 1 here; train_gpt.py's debug state has 0 (one micro-batch)
    r->micro_batches = header[10] > 1 ? header[10] : 1;
    if (r->B % r->micro_batches != 0) {
        fprintf(stderr, "%s: %d micro-batches do not divide B = %d\n", path, r->micro_batches, r->B);
        exit(EXIT_FAILURE);
    }
    if (r->V != model->config.vocab_size || r->Vp != model->config.padded_vocab_size) {
        fprintf(stderr, "%s: vocabulary %d/%d does not match the model's %d/%d\n", path, r->V, r->Vp,
                model->config.vocab_size, model->config.padded_vocab_size);
        exit(EXIT_FAILURE);
    }
    size_t BT = (size_t)r->B * r->T;
    r->x = (int*)malloc_check(BT * sizeof(int));
    r->y = (int*)malloc_check(BT * sizeof(int));
    r->logits = (float*)malloc_check(BT * r->V * sizeof(float));
    size_t num_grads = test_trained_parameters(model);
    r->grads = (float*)malloc_check(num_grads * sizeof(float));
    r->step_losses = (float*)malloc_check((size_t)r->nsteps * sizeof(float));
    fread_check(r->x, sizeof(int), BT, f, path);
    fread_check(r->y, sizeof(int), BT, f, path);
    fread_check(r->logits, sizeof(float), BT * r->V, f, path);
    fread_check(&r->loss, sizeof(float), 1, f, path);
    r->extension = x ? x->read_reference(f, path, header, model) : NULL;
    fread_check(r->grads, sizeof(float), num_grads, f, path);
    fread_check(r->step_losses, sizeof(float), r->nsteps, f, path);
    fclose_check(f, path);
}

// the gradients as stored, in model-file order (host)
static void model_get_gradients(const Model* model, floatX* file_order, cudaStream_t stream) {
    model_get_replicated(model, file_order, model->store.grads_memory, cudaMemcpyDeviceToHost);
    const FfnExtension* x = model->extension.ffn;
    if (x->get_gradients) x->get_gradients(model, file_order + model_extension_offset(model), stream);
}

static int checks_passed = 0, checks_failed = 0;
static int printing = 1;  // with several processes, only process 0 prints (all of them check the same values)

static void count_check(int ok) {
    if (ok) checks_passed++;
    else checks_failed++;
}

// max |got - want| relative to max |want|, over n values
static void compare_scaled(const char* what, const float* got, const float* want, size_t n, float tol) {
    double max_want = 0.0, max_err = 0.0;
    size_t worst = 0, nonfinite = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(got[i])) nonfinite++;
        max_want = fmax(max_want, fabs(want[i]));
        double err = fabs((double)got[i] - want[i]);
        if (err > max_err) {
            max_err = err;
            worst = i;
        }
    }
    double rel = max_want > 0 ? max_err / max_want : max_err;
    int ok = nonfinite == 0 && rel <= tol;
    count_check(ok);
    if (!printing) return;
    printf("%s %-10s max err %.3e of scale %.3e (rel %.2e, tol %.0e)%s\n", ok ? "OK  " : "FAIL", what, max_err,
           max_want, rel, tol, nonfinite ? " NON-FINITE VALUES" : "");
    if (!ok) printf("     worst at %zu: got %.8g want %.8g\n", worst, got[worst], want[worst]);
}

static void compare_value(const char* what, float got, float want, float rtol) {
    int ok = isfinite(got) && fabsf(got - want) <= rtol * fabsf(want);
    count_check(ok);
    if (printing) printf("%s %-10s got %.7f want %.7f (rel tol %.0e)\n", ok ? "OK  " : "FAIL", what, got, want, rtol);
}

// every tensor of two model-file-order buffers (fp32), one check each
static void compare_tensors(const char* prefix, const Model* model, const float* got, const float* want, float tol) {
    size_t sizes[NUM_PARAMETER_TENSORS], offset = 0;
    file_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        if (sizes[i] == 0) continue;  // an unused slot
        char what[64];
        snprintf(what, sizeof(what), "%s%s", prefix, parameter_name(model, i));
        compare_scaled(what, got + offset, want + offset, sizes[i], tol);
        offset += sizes[i];
    }
}

// The step's gradient in model-file order as fp32, on every process (collective over an extension's groups; the
// gradient must have been reduced with ZeRO-0).
static float* gathered_gradients(const Model* model, const TestExtension* x, cudaStream_t stream) {
    size_t n = model_num_parameters(model), sizes[NUM_PARAMETER_TENSORS];
    file_tensor_sizes(sizes, model);
    floatX* g = (floatX*)malloc_check(n * sizeof(floatX));
    model_get_gradients(model, g, stream);
    float* out = (float*)malloc_check(n * sizeof(float));
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        float scale = x ? x->gradient_multiplier(model, i) : 1.0f;
        for (size_t j = offset; j < offset + sizes[i]; j++) out[j] = (float)g[j] * scale;
        offset += sizes[i];
    }
    free(g);
    return out;
}

// The gradients of what trains, as fp32 (collective as gathered_gradients): the model's, or under fine-tuning the
// adapter's, every A and B in its set's order (the frozen model has none)
static float* trained_gradients(const Model* model, const TestExtension* x, cudaStream_t stream) {
    if (!model->adapter) return gathered_gradients(model, x, stream);
    return adapter_host_values(model, model->adapter->store.grads_memory);
}
// ... compared tensor by tensor, each name after `prefix`
static void compare_trained_gradients(const char* prefix, const Model* model, const float* got, const float* want,
                                      float tol) {
    if (!model->adapter) {
        compare_tensors(prefix, model, got, want, tol);
        return;
    }
    const ShardedParameters* a = &model->adapter->store;
    size_t offset = 0;
    for (int i = 0; i < a->num_tensors; i++) {
        if (a->sizes[i] == 0) continue;
        char name[64], what[80];
        snprintf(what, sizeof(what), "%s%s", prefix, adapter_tensor_name(model, i, name, sizeof(name)));
        compare_scaled(what, got + offset, want + offset, a->sizes[i], tol);
        offset += a->sizes[i];
    }
}

// A model from the test's model file, with the run's process layout (and an extension's, of expert-parallel degree
// `degree`; collective); the caller allocates its activations and optimizer state.
static void build_test_model(Model* model, const ModelTest* t, const MultiGpuConfig* mg, int degree) {
    model_init_common(model);
    model->recompute = t->recompute;
    model->use_master_weights = t->master;
    model->gelu_fusion = t->gelu_fusion;
    model->num_processes = mg->num_processes;
    model->process_rank = mg->process_rank;
    model->zero_stage = t->zero_stage;
    model->multi_gpu = mg;
    model->tp = t->tp;
    model->offload_optimizer = t->offload;
    model->frozen = t->adapter_path != NULL;
    model->adapter_method = t->adapter_method;
    model->adapter_rank = t->adapter_rank;
    model->adapter_targets = t->adapter_targets;
    if (t->extension) t->extension->attach(model, t, mg, degree);
    model_build_from_checkpoint(model, t->path);
    if (!model_set_attention(model, t->flash_attention, t->path)) exit(EXIT_FAILURE);
}

// After the model's activations, before its optimizer: a fine-tuning test's adapter, the reference's (whose base
// checksum is the test's model file's)
static void attach_test_adapter(Model* model, const ModelTest* t) {
    if (!t->adapter_path) return;
    model->adapter = adapter_allocate(model, t->adapter_alpha, model->batch_size, model->seq_len);
    if (!checkpoint_checksum(t->path, &model->adapter->base_size, &model->adapter->base_hash)) {
        fprintf(stderr, "%s: cannot read it for its checksum\n", t->path);
        exit(EXIT_FAILURE);
    }
    adapter_read_file(model, t->adapter_path);
}

// The trained parameters after a run, in model-file order (the model's, as the trainer writes its model file: under
// ZeRO-3 gathered), or the adapter's in its set's order; test_trained_parameters of them
static void test_trained_values(Model* model, floatX* values, cudaStream_t stream) {
    if (!model->adapter) {
        model_get_parameters(model, values, stream);
        return;
    }
    float* adapter = adapter_host_parameters(model);
    for (size_t i = 0; i < model->adapter->store.num_parameters; i++) values[i] = (floatX)adapter[i];
    free(adapter);
}

// the extension's state is the test's (attach allocated it)
static void free_test_model(Model* model) {
    void* state = model->extension_state;
    model_free(model);
    free(state);
}

// One step's gradient on the B sequences (x, y) as `micro_batches` micro-steps of B/K sequences each, in order
// (train_moe.py splits the batch along B the same way), accumulated as train_gpt.cu's train_step accumulates them
// and reduced over the processes (ZeRO-0) after the last; returns the mean over the micro-steps of their mean losses.
// The micro-steps are the reference's training passes 0 .. K-1 (doc/moe.md, "Router noise" 4); `ext` (NULL or an
// extension) sees each one's statistics.
// The passes of a step of the reference's K micro-batches: K, or K/N when each pass routes N of them (a folded MoE
// layer's members each route B/K sequences of a pass's B N/K); 0 and one line when N does not divide K.
static int test_passes(const Model* model, const ReferenceState* ref, const TestExtension* x) {
    int groups = x && x->groups_per_pass ? x->groups_per_pass(model) : 1;
    if (ref->micro_batches % groups != 0) {
        fprintf(stderr, "the reference's %d micro-batches per step: each pass routes %d of them (a routing group per "
                "tensor-parallel member); write it with --micro-batches a multiple of %d\n", ref->micro_batches,
                groups, groups);
        return 0;
    }
    return ref->micro_batches / groups;
}

// A loss mask in the step's targets y (B*T; -1: masked, doc/formats.md "Loss mask"): the step's loss is the mean over
// the targets that count, as train_step weighs them (each process here holds the whole batch). Returns 1 / their
// count and sets the classifier's weight per target (`scale` times it); 0 and no weight without a mask.
static double test_target_weight(Model* model, const int* y, size_t n, float scale) {
    size_t counted = 0;
    for (size_t i = 0; i < n; i++) counted += y[i] >= 0;
    double weight = counted < n && counted > 0 ? 1.0 / (double)counted : 0.0;
    model->masked_dloss = (float)(scale * weight);
    return weight;
}

static float test_gradient(Model* model, const int* x, const int* y, int B, int T, int micro_batches,
                           const MultiGpuConfig* mg, const TestExtension* ext, cudaStream_t stream) {
    int micro_B = B / micro_batches;
    size_t micro_tokens = (size_t)micro_B * T;
    model_zero_grad(model, stream);
    if (model->extension.ffn->step_begin) model->extension.ffn->step_begin(model);
    double target_weight = test_target_weight(model, y, (size_t)B * T, 1.0f);
    double loss = 0.0;
    for (int micro = 0; micro < micro_batches; micro++) {
        model->pass_number = (unsigned int)micro;
        model_forward(model, x + micro * micro_tokens, y + micro * micro_tokens, micro_B, T,
                     1.0f / (float)(B * T), stream);
        int last_micro_step = micro == micro_batches - 1;
        model_backward(model, micro_B, T, optimizer_next_seed(&model->rng_state), mg, last_micro_step, 0, stream);
        float mean_loss = model_mean_loss(model);
        loss += target_weight > 0.0 ? model->loss_sum * target_weight * micro_batches : mean_loss;
        if (ext && ext->micro_step_done) ext->micro_step_done(model, micro);
    }
    cudaCheck(cudaStreamSynchronize(stream));
    cudaCheck(cudaStreamSynchronize(mg->nccl_stream));  // the overlapped reduction
    return (float)(loss / micro_batches);
}

// One training step with the trainer's update path (train_gpt.cu's train_step: the extension's step_begin, then
// `micro_batches` micro-steps of B/K sequences, each one's logit gradient scaled by 1/(B T) so that the accumulated
// gradient is the mean loss's, the reduction and -oo 2's early update on the last, the update); returns the step's
// loss (the mean over the micro-steps) averaged over the processes.
// Training steps on the same batch use the trainer's own update (gradient clipping, AdamW with weight decay on
// the matrices) with the reference's optimizer `opt` (the debug state's; the Makefile's REF_ARGS clip at 0.5, below
// these models' gradient norm of ~0.8, so that the clipping path is exercised).
static float test_step(Model* model, const int* x, const int* y, int B, int T, int micro_batches, int step,
                       const MultiGpuConfig* mg, int zero_stage, const AdamWConfig* opt, cudaStream_t stream) {
    int micro_B = B / micro_batches;
    size_t micro_tokens = (size_t)micro_B * T;
    model_zero_grad(model, stream);
    if (model->extension.ffn->step_begin) model->extension.ffn->step_begin(model);
    double target_weight = test_target_weight(model, y, (size_t)B * T, model->loss_scaler.scale);
    double step_loss = 0.0;
    for (int micro = 0; micro < micro_batches; micro++) {
        model->pass_number = (unsigned int)(step * micro_batches + micro);
        model_forward(model, x + micro * micro_tokens, y + micro * micro_tokens, micro_B, T,
                     model->loss_scaler.scale / (float)(B * T), stream);
        int last_micro_step = micro == micro_batches - 1;
        model_backward(model, micro_B, T, optimizer_next_seed(&model->rng_state), mg, last_micro_step, zero_stage,
                      stream);
        if (last_micro_step) model_early_update(model, opt, step + 1);
        float mean_loss = model_mean_loss(model);
        step_loss += target_weight > 0.0 ? model->loss_sum * target_weight * micro_batches : mean_loss;
        if (model->extension.ffn->micro_step_done) model->extension.ffn->micro_step_done(model);
    }
    float loss = (float)(step_loss / micro_batches);
    float norm = model_gradient_norm(model, mg, zero_stage, stream);
    model_update(model, opt, norm, step + 1, mg, zero_stage, stream);
    return multi_gpu_cpu_float_sum(loss, mg) / mg->num_processes;
}

// The reference's training steps on a fresh model with t's ZeRO stage and offload, from the stochastic-rounding
// generator's state `rng_state`: their losses into `losses` (ref->nsteps), and the parameters after them in model-file
// order into `params` (as the trainer writes its model file: under ZeRO-3 gathered; NULL: not wanted). Returns how many
// steps kept -oo 2's early update.
static int run_test_steps(const ModelTest* t, const ReferenceState* ref, const MultiGpuConfig* mg,
                          unsigned long long rng_state, float* losses, floatX* params, cudaStream_t stream) {
    Model model;
    build_test_model(&model, t, mg, 1);
    int passes = test_passes(&model, ref, t->extension);
    if (passes == 0) exit(EXIT_FAILURE);
    // a micro-batch's, as the trainer's (and prompt tuning's virtual tokens)
    model_allocate_activations(&model, ref->B / passes, ref->T + model_adapter_sequence_extra(&model));
    attach_test_adapter(&model, t);
    model_allocate_optimizer(&model, t->zero_stage);
    model.rng_state = rng_state;
    for (int step = 0; step < ref->nsteps; step++)
        losses[step] = test_step(&model, ref->x, ref->y, ref->B, ref->T, passes, step, mg, t->zero_stage, &t->opt,
                                 stream);
    if (params) test_trained_values(&model, params, stream);
    int adopted = model.adapter ? model.adapter->store.early_adopted : model.store.early_adopted;
    free_test_model(&model);
    return adopted;
}

// The test's main, shared with test_moe.cu (x: its extension, which adds its flags, its part of the model file and
// debug state, and its checks). Under mpirun with P processes every process takes the reference batch, so the
// gradient averaged over them is the reference's.
static int test_main(int argc, char** argv, const TestExtension* x) {
    const char* name = x ? x->name : "test_gpt";
    if (argc < 2) {
        fprintf(stderr, "usage: %s PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2] [-fa 0|1] [-z 0|1|2|3] [-oo 0|1|2] [-st N] "
                "[-tp N] [-sp 0|1]%s\n",
                argv[0],
                x ? x->usage_flags : "");
        return EXIT_FAILURE;
    }
    const char* prefix = argv[1];
    ModelTest t = {NULL, 1, 1, 1, 0, -1, 1, x, 0, {0}, 0, NULL, NULL};
    int tp_degree = 1, sequence_parallel = 1;
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-r")) t.recompute = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) t.master = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-ge")) t.gelu_fusion = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-fa")) t.flash_attention = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-z")) t.zero_stage = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-oo")) t.offload = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-tp")) tp_degree = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-sp")) sequence_parallel = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-st")) {
            char* end;
            t.steps = (int)strtol(argv[i + 1], &end, 10);
            if (*end != '\0' || end == argv[i + 1] || t.steps < 1) {
                fprintf(stderr, "-st %s: expected a number of steps, 1 or more\n", argv[i + 1]);
                return EXIT_FAILURE;
            }
        }
#ifdef ENABLE_CUDNN
        else if (!strcmp(argv[i], "-cd")) cudnn_attention_deterministic = atoi(argv[i + 1]);
#endif
        else if (!x || !x->parse_flag(&t, argv[i], argv[i + 1])) {
            fprintf(stderr, "unknown flag %s\n", argv[i]);
            return EXIT_FAILURE;
        }
    }
    float tol_tensor = 1e-5f, tol_loss = 1e-6f, tol_steps = 1e-5f;
    if (PRECISION_MODE == PRECISION_BF16) {
        tol_tensor = 3e-2f;
        tol_loss = 1e-3f;
        tol_steps = 5e-3f;
    } else if (PRECISION_MODE == PRECISION_FP16) {
        tol_tensor = 5e-3f;
        tol_loss = 1e-3f;
        tol_steps = 5e-3f;
    }

    int device_count = 0;
    cudaError_t device_error = cudaGetDeviceCount(&device_count);
    if (device_error != cudaSuccess || device_count == 0) {
        fprintf(stderr, "no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(device_error));
        return EXIT_FAILURE;
    }
    MultiGpuConfig world = multi_gpu_config_init("mpi", 1, 0, 8, "", "");
    printing = world.process_rank == 0;
    if (t.ep_degree < 1 || world.num_processes % t.ep_degree != 0) {
        fprintf(stderr, "-ep %d: must divide the number of processes (%d)\n", t.ep_degree, world.num_processes);
        return EXIT_FAILURE;
    }
    if (tp_degree < 1 || world.num_processes % tp_degree != 0 || (sequence_parallel != 0 && sequence_parallel != 1)) {
        fprintf(stderr, "-tp %d -sp %d: expected a degree dividing the %d processes, and -sp 0 or 1\n", tp_degree,
                sequence_parallel, world.num_processes);
        return EXIT_FAILURE;
    }
    t.world = &world;
    // the tensor-parallel groups; mg, the data-parallel group (the world at -tp 1), is what the model averages over
    TensorParallel tp;
    tensor_parallel_init(&tp, &world, tp_degree, sequence_parallel);
    t.tp = &tp;
    MultiGpuConfig mg = tp_degree > 1 ? tp.dp : world;
    if (printing)
        printf("%s: %s, %s, recompute %d, master weights %d, gelu fusion %d, %d process%s, -ep %d, -tp %d%s\n", name,
               prefix, PRECISION_NAME, t.recompute, t.master, t.gelu_fusion, world.num_processes,
               world.num_processes > 1 ? "es" : "", t.ep_degree, tp_degree,
               tp_degree > 1 ? (sequence_parallel ? " -sp 1" : " -sp 0") : "");
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream));
    cublas_setup();
#ifdef ENABLE_CUDNN
    cudnn_attention_setup();
#endif

    char* path = string_format("%s_model.bin", prefix);
    char* state_path = string_format("%s_debug_state.bin", prefix);
    t.path = path;
    if (t.zero_stage < 0 || t.zero_stage > 3 || t.offload < 0 || t.offload > 2) {
        fprintf(stderr, "-z %d -oo %d: expected -z 0, 1, 2 or 3 and -oo 0, 1 or 2\n", t.zero_stage, t.offload);
        return EXIT_FAILURE;
    }
    // the settings are the reference's, from its debug state's header
    int header[256];
    FILE* state = open_reference_state(state_path, header);
    take_reference_optimizer(&t.opt, header);
    if (x) x->take_settings(&t, header, state_path);
    char* adapter_path = NULL;
    if (header[STATE_FINE_TUNING_WORD] != 0) {
        int method = header[STATE_FINE_TUNING_WORD];
        if (method < FT_METHOD_LORA || method > FT_METHOD_LLAMA_ADAPTER) {
            fprintf(stderr, "%s: fine-tuning method %d in word %d: %s tests lora (1), adapter (2), prompt (3), prefix "
                    "(4) and llama_adapter (5)\n", state_path, method, STATE_FINE_TUNING_WORD, name);
            return EXIT_FAILURE;
        }
        t.adapter_method = method;
        adapter_path = string_format("%s_adapter.bin", prefix);
        int adapter_header[256];
        FILE* f = fopen_check(adapter_path, "rb");
        read_versioned_header_check(f, adapter_header, adapter_path, ADAPTER_FILE_MAGIC, ADAPTER_FILE_VERSION,
                                    "adapter");
        fclose_check(f, adapter_path);
        t.adapter_path = adapter_path;
        t.adapter_rank = adapter_header[3];
        t.adapter_targets = (unsigned)adapter_header[4];
        memcpy(&t.adapter_alpha, &adapter_header[5], sizeof(float));
        if (printing)
            printf("fine-tuning: %s r=%d alpha %g, targets 0x%x, from %s\n", ft_method_names[method], t.adapter_rank,
                   t.adapter_alpha, t.adapter_targets, adapter_path);
    }
    if (printing)
        printf("optimizer: the reference's: lr %g, betas (%g, %g), eps %g, weight decay %g, clipping at %g\n",
               t.opt.learning_rate, t.opt.beta1, t.opt.beta2, t.opt.eps, t.opt.weight_decay, t.opt.grad_clip);
    // the reference checks read the whole gradient: ZeRO-0, no offload (test_moe.cu's own checks take -z)
    ModelTest unsharded = t;
    unsharded.zero_stage = 0;
    unsharded.offload = 0;
    Model model;
    build_test_model(&model, &unsharded, &mg, t.ep_degree);
    if (printing) printf("attention: %s\n", model_attention_name(&model));
    ReferenceState ref;
    read_reference_state(&ref, state, state_path, header, &model, x);
    // -st N: the first N steps (each compared value is a step's, so a prefix of the reference's is its own reference)
    if (t.steps > ref.nsteps) {
        fprintf(stderr, "-st %d: the reference has %d steps\n", t.steps, ref.nsteps);
        return EXIT_FAILURE;
    }
    if (t.steps > 0) ref.nsteps = t.steps;
    int B = ref.B, T = ref.T, V = ref.V, Vp = ref.Vp;
    int K = test_passes(&model, &ref, x);  // the passes per step
    if (K == 0) return EXIT_FAILURE;
    if (printing && ref.micro_batches > 1)
        printf("micro-batches: each step %d of %d sequences, as the reference's%s\n", ref.micro_batches,
               B / ref.micro_batches, K < ref.micro_batches ? ", routed by the tensor-parallel members" : "");
    int extra = model_adapter_sequence_extra(&model), Tx = T + extra;  // prompt tuning runs Tx positions
    model_allocate_activations(&model, B / K, Tx);
    attach_test_adapter(&model, &unsharded);
    model_allocate_optimizer(&model, 0);

    // logits: an evaluation pass over each micro-batch (an MoE layer routes each as its own group)
    size_t BT = (size_t)B * T;
    size_t micro_tokens = BT / K, micro_rows = micro_tokens / T * Tx;  // the logits' rows: Tx per sequence
    floatX* logits_x = (floatX*)malloc_check((size_t)B * Tx * Vp * sizeof(floatX));
    for (int micro = 0; micro < K; micro++) {
        model_forward(&model, ref.x + micro * micro_tokens, nullptr, B / K, T, 0.0f, stream);
        model_copy_logits(&model, logits_x + micro * micro_rows * Vp, 0, micro_rows, stream);
    }
    float* logits = (float*)malloc_check(BT * V * sizeof(float));  // the real positions' (a sequence's last T rows)
    for (size_t bt = 0; bt < BT; bt++)
        for (int v = 0; v < V; v++)
            logits[bt * V + v] = (float)logits_x[((bt / T) * Tx + extra + bt % T) * Vp + v];
    compare_scaled("logits", logits, ref.logits, BT * V, tol_tensor);

    // the trainer's samples of a model whose decode step the engine lacks (prompt tuning, a prefix, LLaMA-Adapter:
    // llmc/generation.h's generate_by_prefill): the logits its first token is drawn from, after prefixes of 1, T/2 and
    // T tokens of the reference's first sequence, against the reference's at the prefix's last position (causal
    // attention: the same logits). Not in an MoE test: a prefix is a routing group of its own, whose capacity drops
    // other choices than the whole batch's.
    if (x == NULL && !engine_decodes(&model)) {
        SamplingSettings sampling = {1.0f, 0, 1.0f};
        Engine e;
        engine_init(&e, &model, &sampling, 1, 16, CEIL_DIV(T + 1, 16), stream);
        int lengths[3] = {1, T / 2, T};
        float* got = (float*)malloc_check(3 * (size_t)V * sizeof(float));
        float* want = (float*)malloc_check(3 * (size_t)V * sizeof(float));
        for (int i = 0; i < 3; i++) {
            Sequence s;
            sequence_init(&s, &e, 0, 0, ref.x, lengths[i], 1, 1337);
            generate_by_prefill(&e, &s);
            memcpy(got + (size_t)i * V, e.row_logits, (size_t)V * sizeof(float));
            memcpy(want + (size_t)i * V, ref.logits + (size_t)(lengths[i] - 1) * V, (size_t)V * sizeof(float));
            sequence_free(&s);
        }
        compare_scaled("sampled", got, want, 3 * (size_t)V, tol_tensor);
        free(got);
        free(want);
        engine_free(&e);
    }

    // loss and gradients
    float loss = test_gradient(&model, ref.x, ref.y, B, T, K, &mg, x, stream);
    compare_value("loss", loss, ref.loss, tol_loss);
    if (x) x->check_forward(&model, &ref);
    float* grads = NULL;
    grads = trained_gradients(&model, x, stream);
    compare_trained_gradients("", &model, grads, ref.grads, tol_tensor);

    // the reference's training steps on the same batch
    float* losses = (float*)malloc_check((size_t)ref.nsteps * sizeof(float));
    unsigned long long steps_rng_state = model.rng_state;  // the stochastic-rounding seeds of these steps
    for (int step = 0; step < ref.nsteps; step++) {
        losses[step] = test_step(&model, ref.x, ref.y, B, T, K, step, &mg, 0, &t.opt, stream);
        if (printing) printf("     step %2d: loss %.6f (reference %.6f)\n", step, losses[step], ref.step_losses[step]);
    }
    double worst = 0.0;
    for (int step = 0; step < ref.nsteps; step++)
        worst = fmax(worst, fabs(losses[step] - ref.step_losses[step]) / fabs(ref.step_losses[step]));
    int steps_ok = worst <= tol_steps && ref.nsteps > 0;
    count_check(steps_ok);
    if (printing)
        printf("%s %-10s %d step losses, max rel err %.2e (tol %.0e)\n", steps_ok ? "OK  " : "FAIL", "steps",
               ref.nsteps, worst, tol_steps);

    // -fm: the trained adapter merged into the model (W + s B A, llmc/model_adapter.h) gives the adapted model's logits.
    // Both sides compute in the working precision: FP32 agrees to rounding; BF16's merged weights are rounded once
    // to bf16 where the adapted model rounds x A^T, s (x A^T) and the sum, hence the logits' BF16 tolerance.
    int lora = model.adapter && model.adapter->method == FT_METHOD_LORA;
    if (lora && !lora_can_merge(&model) && printing)
        printf("     merged: not compared: an adapter on lm_head of a tied model has no merged form\n");
    if (lora && lora_can_merge(&model)) {
        floatX* adapted = (floatX*)malloc_check(BT * Vp * sizeof(floatX));
        floatX* merged_logits = (floatX*)malloc_check(BT * Vp * sizeof(floatX));
        if (x && x->repeat_first_evaluation) x->repeat_first_evaluation();
        model_forward(&model, ref.x, nullptr, B / K, T, 0.0f, stream);
        model_copy_logits(&model, adapted, 0, micro_tokens, stream);
        size_t n = model_num_parameters(&model);
        floatX* merged = (floatX*)malloc_check(n * sizeof(floatX));
        model_get_parameters(&model, merged, stream);
        lora_merge(&model, merged);
        model_set_parameters(&model, merged);
        Adapter* adapter = model.adapter;
        model.adapter = NULL;  // the merged model alone
        if (x && x->repeat_first_evaluation) x->repeat_first_evaluation();
        model_forward(&model, ref.x, nullptr, B / K, T, 0.0f, stream);
        model_copy_logits(&model, merged_logits, 0, micro_tokens, stream);
        model.adapter = adapter;
        float* got = (float*)malloc_check(micro_tokens * V * sizeof(float));
        float* want = (float*)malloc_check(micro_tokens * V * sizeof(float));
        for (size_t bt = 0; bt < micro_tokens; bt++)
            for (int v = 0; v < V; v++) {
                got[bt * V + v] = (float)merged_logits[bt * Vp + v];
                want[bt * V + v] = (float)adapted[bt * Vp + v];
            }
        compare_scaled("merged", got, want, micro_tokens * V, tol_tensor);
        free(got);
        free(want);
        free(merged);
        free(adapted);
        free(merged_logits);
    }

    // -tp N against -tp 1: the same steps with every layer whole, each process on its own (a communicator of one
    // process), from the same parameters and stochastic-rounding seeds. The split changes only summation orders (the
    // members' partial sums are added by the all-reduce), so the two agree within the reference's step tolerance.
    if (tp_degree > 1) {
        MultiGpuConfig alone = world;
        alone.num_processes = 1;
        alone.process_rank = 0;
        alone.used_mpi = 0;
        ncclUniqueId id;
        ncclCheck(ncclGetUniqueId(&id));
        ncclCheck(ncclCommInitRank(&alone.nccl_comm, 1, id, 0));
        ModelTest whole = unsharded;
        whole.tp = NULL;
        float* whole_losses = (float*)malloc_check((size_t)ref.nsteps * sizeof(float));
        run_test_steps(&whole, &ref, &alone, steps_rng_state, whole_losses, NULL, stream);
        double worst_whole = 0.0;
        for (int step = 0; step < ref.nsteps; step++)
            worst_whole = fmax(worst_whole, fabs(losses[step] - whole_losses[step]) / fabs(whole_losses[step]));
        count_check(worst_whole <= tol_steps);
        if (printing)
            printf("%s %-10s %d step losses against -tp 1's, max rel err %.2e (tol %.0e)\n",
                   worst_whole <= tol_steps ? "OK  " : "FAIL", "tp1", ref.nsteps, worst_whole, tol_steps);
        free(whole_losses);
        ncclCheck(ncclCommDestroy(alone.nccl_comm));
    }

    // -z / -oo: the steps with the gradient and optimizer state sharded (ZeRO-1/2), the parameters too (ZeRO-3), and
    // the update offloaded.
    // Every process has the reference batch, so each piece of the gradient is averaged in the same order at every
    // stage; one micro-step leaves ZeRO-2's fp32 shard the exact value of the reduced floatX gradient; AdamW's noise
    // is indexed within each tensor (llmc/adamw.cuh) and the host AdamW computes the device's bits. What differs is
    // the global norm's order: ZeRO-1/2/3 sum squares per shard, then over processes; ZeRO-3's gathered parameters are
    // copies. So -oo 1 at stage 0 gives -z 0's losses bit for bit, ZeRO-2/3 and offload give -z 1's losses and final
    // parameters (ZeRO-3's gathered for the model file) bit for bit, and -z 1 gives the reference's within tol_steps.
    if (!x && (t.zero_stage > 0 || t.offload)) {
        float* sharded = (float*)malloc_check((size_t)ref.nsteps * sizeof(float));
        float* staged = (float*)malloc_check((size_t)ref.nsteps * sizeof(float));
        size_t n = test_trained_parameters(&model);
        floatX* sharded_params = (floatX*)malloc_check(n * sizeof(floatX));
        floatX* staged_params = (floatX*)malloc_check(n * sizeof(floatX));
        const float* baseline = losses;
        if (t.zero_stage > 0) {
            ModelTest zero1 = t;
            zero1.zero_stage = 1;
            zero1.offload = 0;
            run_test_steps(&zero1, &ref, &mg, steps_rng_state, sharded, sharded_params, stream);
            double worst_sharded = 0.0;
            for (int step = 0; step < ref.nsteps; step++)
                worst_sharded = fmax(worst_sharded, fabs(sharded[step] - ref.step_losses[step]) /
                                                         fabs(ref.step_losses[step]));
            count_check(worst_sharded <= tol_steps);
            if (printing)
                printf("%s %-10s %d step losses with -z 1, max rel err %.2e (tol %.0e)\n",
                       worst_sharded <= tol_steps ? "OK  " : "FAIL", "zero1", ref.nsteps, worst_sharded, tol_steps);
            baseline = sharded;
        }
        if (t.zero_stage != 1 || t.offload) {
            run_test_steps(&t, &ref, &mg, steps_rng_state, staged, staged_params, stream);
            int same = memcmp(staged, baseline, (size_t)ref.nsteps * sizeof(float)) == 0;
            count_check(same);
            if (printing)
                printf("%s %-10s %d step losses with -z %d -oo %d, bit-identical to -z %d -oo 0's\n",
                       same ? "OK  " : "FAIL", "staged", ref.nsteps, t.zero_stage, t.offload, t.zero_stage ? 1 : 0);
            if (t.zero_stage > 0) {
                int same_params = memcmp(staged_params, sharded_params, n * sizeof(floatX)) == 0;
                count_check(same_params);
                if (printing)
                    printf("%s %-10s %zu parameters after them, bit-identical to -z 1's\n",
                           same_params ? "OK  " : "FAIL", "staged", n);
            }
        }
        // -oo 2: the steps above clip, so each early update was undone and made again. Without clipping (the
        // threshold far above the norm) each is kept: the steps' losses and parameters are -oo 0's at this stage
        // bit for bit, and every step kept its early update.
        if (t.offload == 2) {
            ModelTest unclipped = t;
            unclipped.opt.grad_clip = 1e30f;
            unclipped.offload = 0;
            run_test_steps(&unclipped, &ref, &mg, steps_rng_state, sharded, sharded_params, stream);
            unclipped.offload = 2;
            int adopted = run_test_steps(&unclipped, &ref, &mg, steps_rng_state, staged, staged_params, stream);
            int same = memcmp(staged, sharded, (size_t)ref.nsteps * sizeof(float)) == 0 &&
                       memcmp(staged_params, sharded_params, n * sizeof(floatX)) == 0;
            int ok = same && adopted == ref.nsteps;
            count_check(ok);
            if (printing)
                printf("%s %-10s %d unclipped steps with -z %d -oo 2, %d early updates kept, losses and parameters "
                       "bit-identical to -oo 0's\n", ok ? "OK  " : "FAIL", "early", ref.nsteps, t.zero_stage, adopted);
        }
        free(sharded);
        free(staged);
        free(sharded_params);
        free(staged_params);
    }

    if (x) x->extra_checks(&t, &ref, &mg, tol_tensor, tol_steps, stream);

    free(losses);
    free(grads);
    free(logits);
    free(logits_x);
    free(path);
    free(state_path);
    free(adapter_path);
    free_test_model(&model);
#ifdef ENABLE_CUDNN
    cudnn_attention_teardown();
#endif
    cublas_teardown();
    cudaCheck(cudaStreamDestroy(stream));
    // every process checked the same values; the counts agree everywhere
    if (printing) printf("%s: %d passed, %d failed\n", name, checks_passed, checks_failed);
    tensor_parallel_free(&tp);
    multi_gpu_config_free(&world);
    return checks_failed == 0 ? 0 : 1;
}

#ifndef OMIT_TEST_GPT_MAIN
int main(int argc, char** argv) { return test_main(argc, argv, NULL); }
#endif
