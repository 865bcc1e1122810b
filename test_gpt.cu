// test_gpt.cu: the GPT trainer against the PyTorch reference (train_gpt.py). It includes train_gpt.cu (with
// TESTING defined, so without its main) and checks, for one model and batch written by
//   /usr/bin/python3 train_gpt.py --write-reference PREFIX ...
// the logits, the loss, every parameter gradient, and the losses of 10 AdamW steps on that batch.
//   make test_gpt_cpu [PRECISION=FP32|BF16]; ./test_gpt_cpu PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2]
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
#define TESTING
#include "train_gpt.cu"

typedef struct {
    int B, T, V, Vp, nsteps;
    int* x;
    int* y;
    float* logits;  // (B, T, V)
    float loss;
    float aux_loss, z_loss;  // MoE: summed over the MoE layers
    int* dropped;            // MoE: (Lm) dropped choices per layer
    int* expert_counts;      // MoE: (Lm, E) choices routed to each expert before dropping
    float* grads;   // model-file order, num_parameters
    float* step_losses;
} ReferenceState;

static void read_reference_state(ReferenceState* r, const char* path, const GPT2* model) {
    FILE* f = fopen_check(path, "rb");
    int header[256];
    read_header_check(f, header, path, 20240327, "debug state");
    if (header[1] != 2) {
        fprintf(stderr, "%s: debug state version %d, expected 2\n", path, header[1]);
        exit(EXIT_FAILURE);
    }
    r->B = header[2];
    r->T = header[3];
    r->nsteps = header[4];
    r->V = header[5];
    r->Vp = header[6];
    if (r->V != model->config.vocab_size || r->Vp != model->config.padded_vocab_size) {
        fprintf(stderr, "%s: vocabulary %d/%d does not match the model's %d/%d\n", path, r->V, r->Vp,
                model->config.vocab_size, model->config.padded_vocab_size);
        exit(EXIT_FAILURE);
    }
    size_t BT = (size_t)r->B * r->T;
    r->x = (int*)malloc_check(BT * sizeof(int));
    r->y = (int*)malloc_check(BT * sizeof(int));
    r->logits = (float*)malloc_check(BT * r->V * sizeof(float));
    r->grads = (float*)malloc_check(model->store.num_parameters * sizeof(float));
    r->step_losses = (float*)malloc_check((size_t)r->nsteps * sizeof(float));
    fread_check(r->x, sizeof(int), BT, f, path);
    fread_check(r->y, sizeof(int), BT, f, path);
    fread_check(r->logits, sizeof(float), BT * r->V, f, path);
    fread_check(&r->loss, sizeof(float), 1, f, path);
    int Lm = num_moe_layers(&model->config), E = model->config.num_experts;
    r->dropped = (int*)malloc_check((size_t)(Lm + 1) * sizeof(int));
    r->expert_counts = (int*)malloc_check((size_t)(Lm * E + 1) * sizeof(int));
    if (E > 0) {
        if (header[7] != Lm) {
            fprintf(stderr, "%s: %d MoE layers, the model has %d\n", path, header[7], Lm);
            exit(EXIT_FAILURE);
        }
        fread_check(&r->aux_loss, sizeof(float), 1, f, path);
        fread_check(&r->z_loss, sizeof(float), 1, f, path);
        for (int m = 0; m < Lm; m++) {
            fread_check(&r->dropped[m], sizeof(int), 1, f, path);
            fread_check(r->expert_counts + (size_t)m * E, sizeof(int), E, f, path);
        }
    }
    fread_check(r->grads, sizeof(float), model->store.num_parameters, f, path);
    fread_check(r->step_losses, sizeof(float), r->nsteps, f, path);
    fclose_check(f, path);
}

static int checks_passed = 0, checks_failed = 0;

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
    if (ok) checks_passed++;
    else checks_failed++;
    printf("%s %-10s max err %.3e of scale %.3e (rel %.2e, tol %.0e)%s\n", ok ? "OK  " : "FAIL", what, max_err,
           max_want, rel, tol, nonfinite ? " NON-FINITE VALUES" : "");
    if (!ok) printf("     worst at %zu: got %.8g want %.8g\n", worst, got[worst], want[worst]);
}

static void compare_value(const char* what, float got, float want, float rtol) {
    int ok = isfinite(got) && fabsf(got - want) <= rtol * fabsf(want);
    if (ok) checks_passed++;
    else checks_failed++;
    printf("%s %-10s got %.7f want %.7f (rel tol %.0e)\n", ok ? "OK  " : "FAIL", what, got, want, rtol);
}

// The test's main, shared with test_moe.cu (moe = 1: an MoE model file and debug state, whose aux and z
// losses and routing counts are compared too; -cf, -ra, -rz give the settings the reference was written with).
static int test_main(int argc, char** argv, int moe) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s PREFIX [-r 0|1|2] [-w 0|1] [-ge 0|1|2]%s\n", argv[0],
                moe ? " [-cf capacity factor] [-ra aux coefficient] [-rz z coefficient]" : "");
        return EXIT_FAILURE;
    }
    const char* prefix = argv[1];
    int recompute = 1, master = 1, gelu_fusion = 1;
    MoESettings moe_settings = {1.25, 1.25, 0.01f, 0.001f};
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-r")) recompute = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w")) master = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-ge")) gelu_fusion = atoi(argv[i + 1]);
        else if (moe && !strcmp(argv[i], "-cf")) moe_settings.capacity_factor = moe_settings.capacity_factor_eval = atof(argv[i + 1]);
        else if (moe && !strcmp(argv[i], "-ra")) moe_settings.aux_alpha = (float)atof(argv[i + 1]);
        else if (moe && !strcmp(argv[i], "-rz")) moe_settings.z_coef = (float)atof(argv[i + 1]);
        else {
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
    printf("%s: %s, %s, recompute %d, master weights %d, gelu fusion %d\n", moe ? "test_moe" : "test_gpt", prefix,
           PRECISION_NAME, recompute, master, gelu_fusion);

    int device_count = 0;
    cudaError_t device_error = cudaGetDeviceCount(&device_count);
    if (device_error != cudaSuccess || device_count == 0) {
        fprintf(stderr, "no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(device_error));
        return EXIT_FAILURE;
    }
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream));
    cublas_setup();
#ifdef ENABLE_CUDNN
    cudnn_attention_setup();
#endif
    MultiGpuConfig mg;
    memset(&mg, 0, sizeof(mg));
    mg.num_processes = 1;

    char path[1024];
    GPT2 model;
    gpt2_init_common(&model);
    model.recompute = recompute;
    model.use_master_weights = master;
    model.gelu_fusion = gelu_fusion;
    model.moe = moe_settings;
    snprintf(path, sizeof(path), "%s_model.bin", prefix);
    gpt2_build_from_checkpoint(&model, path, 1, moe);
    ReferenceState ref;
    snprintf(path, sizeof(path), "%s_debug_state.bin", prefix);
    read_reference_state(&ref, path, &model);
    int B = ref.B, T = ref.T, V = ref.V, Vp = ref.Vp;
    gpt2_allocate_activations(&model, B, T);
    sharded_parameters_allocate_optimizer(&model.store, model.use_master_weights, 0, 1, 0);

    // logits
    size_t BT = (size_t)B * T;
    gpt2_forward(&model, ref.x, nullptr, B, T, 0.0f, stream);
    floatX* logits_x = (floatX*)malloc_check(BT * Vp * sizeof(floatX));
    cudaCheck(cudaMemcpy(logits_x, model.acts.output, BT * Vp * sizeof(floatX), cudaMemcpyDeviceToHost));
    float* logits = (float*)malloc_check(BT * V * sizeof(float));
    for (size_t bt = 0; bt < BT; bt++)
        for (int v = 0; v < V; v++) logits[bt * V + v] = (float)logits_x[bt * Vp + v];
    compare_scaled("logits", logits, ref.logits, BT * V, tol_tensor);

    // loss and gradients
    sharded_parameters_zero_grad(&model.store, stream);
    gpt2_forward(&model, ref.x, ref.y, B, T, 1.0f / (float)BT, stream);
    compare_value("loss", model.mean_loss, ref.loss, tol_loss);
    if (moe) {
        // routing is discrete: in fp32 every count must match; in bf16 and fp16 the router reads a rounded
        // LayerNorm output, so a choice whose logits are within rounding of a tie may flip (the reference's
        // smallest margins are ~4e-5): up to 2% of the choices may move
        compare_value("aux loss", model.aux_loss, ref.aux_loss, PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 2e-2f);
        compare_value("z loss", model.z_loss, ref.z_loss, PRECISION_MODE == PRECISION_FP32 ? 1e-5f : 2e-2f);
        int Lm = num_moe_layers(&model.config), E = model.config.num_experts;
        long moved = 0, dropped_diff = 0, choices = (long)Lm * B * T * model.config.top_k;
        for (int m = 0; m < Lm; m++) {
            long dropped = 0;
            for (int e = 0; e < E; e++) {
                moved += labs((long)model.expert_counts_cpu[m * E + e] - ref.expert_counts[m * E + e]);
                dropped += model.expert_counts_cpu[m * E + e] - model.kept_counts_cpu[m * E + e];
            }
            dropped_diff += labs(dropped - ref.dropped[m]);
        }
        long allowed = PRECISION_MODE == PRECISION_FP32 ? 0 : choices / 50;
        int routing_ok = moved <= allowed && dropped_diff <= allowed;
        if (routing_ok) checks_passed++;
        else checks_failed++;
        printf("%s %-10s %ld of %ld choices routed elsewhere, drops differ by %ld (allowed %ld)\n",
               routing_ok ? "OK  " : "FAIL", "routing", moved, choices, dropped_diff, allowed);
    }
    gpt2_backward(&model, B, T, sharded_parameters_next_seed(&model.store), &mg, 1, 0, stream);
    floatX* grads_x = (floatX*)malloc_check(model.store.num_parameters * sizeof(floatX));
    float* grads = (float*)malloc_check(model.store.num_parameters * sizeof(float));
    cudaCheck(cudaMemcpy(grads_x, model.store.grads_memory, model.store.num_parameters * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < model.store.num_parameters; i++) grads[i] = (float)grads_x[i];
    size_t offset = 0;
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) {
        if (model.store.sizes[i] == 0) continue;  // the MoE tensors of a dense model
        compare_scaled(parameter_names[i], grads + offset, ref.grads + offset, model.store.sizes[i], tol_tensor);
        offset += model.store.sizes[i];
    }

    // training steps on the same batch, with the trainer's own update path (gradient clipping, AdamW with
    // weight decay on the matrices): lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay 0.1, and clipping
    // at 0.5, below this model's gradient norm (~0.8), so that the clipping path is exercised — the
    // reference is written with the same values (Makefile: REF_ARGS)
    AdamWConfig opt = {1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.5f};
    float* losses = (float*)malloc_check((size_t)ref.nsteps * sizeof(float));
    for (int step = 0; step < ref.nsteps; step++) {
        sharded_parameters_zero_grad(&model.store, stream);
        gpt2_forward(&model, ref.x, ref.y, B, T, model.store.loss_scale / (float)BT, stream);
        gpt2_backward(&model, B, T, sharded_parameters_next_seed(&model.store), &mg, 1, 0, stream);
        losses[step] = model.mean_loss;
        float norm = sharded_parameters_reduce_and_norm(&model.store, &mg, 0, stream);
        sharded_parameters_apply_update(&model.store, &opt, norm, step + 1, &mg, 0, stream);
        printf("     step %2d: loss %.6f (reference %.6f)\n", step, losses[step], ref.step_losses[step]);
    }
    double worst = 0.0;
    for (int step = 0; step < ref.nsteps; step++)
        worst = fmax(worst, fabs(losses[step] - ref.step_losses[step]) / fabs(ref.step_losses[step]));
    int steps_ok = worst <= tol_steps && ref.nsteps > 0;
    if (steps_ok) checks_passed++;
    else checks_failed++;
    printf("%s %-10s %d step losses, max rel err %.2e (tol %.0e)\n", steps_ok ? "OK  " : "FAIL", "steps", ref.nsteps,
           worst, tol_steps);

    free(losses);
    free(grads);
    free(grads_x);
    free(logits);
    free(logits_x);
    gpt2_free(&model);
#ifdef ENABLE_CUDNN
    cudnn_attention_teardown();
#endif
    cublas_teardown();
    cudaCheck(cudaStreamDestroy(stream));
    printf("%s: %d passed, %d failed\n", moe ? "test_moe" : "test_gpt", checks_passed, checks_failed);
    return checks_failed == 0 ? 0 : 1;
}

#ifndef TEST_GPT_LIBRARY
int main(int argc, char** argv) { return test_main(argc, argv, 0); }
#endif
