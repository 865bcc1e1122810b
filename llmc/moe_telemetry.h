// llmc/moe_telemetry.h: what the MoE layers report (doc/moe.md, "Telemetry"): the start-up table's rows, the
// step line's aux, z and drop fields and their log entries, the expert loads since the last validation (dead
// experts, the load histogram) and the per-layer report after each validation. train_moe.cu includes it after
// llmc/moe_ffn.h and fills train_gpt.cu's TelemetryExtension table with it.
// Tests: train-moe-cli (the printed table, step lines and reports), dev/test/test_plot.py (the log's fields).
#pragma once

// ----------------------------------------------------------------------------------------------------
// Telemetry

// An expert that has had no token in this many steps in a row is reported dead.
#define MOE_DEAD_STEPS 100

// Takes in the last update's loads (summed over every process, moe_after_update), if they have not been: into the
// loads since the last validation, and each expert's run of steps without a token. Every process keeps them; process
// 0 prints them. A resumed run starts both afresh.
static void moe_take_step_loads(const Model* model) {
    MoEModel* moe = moe_of(model);
    if (!moe->step_loads_pending) return;
    moe->step_loads_pending = 0;
    cudaCheck(cudaEventSynchronize(moe->step_loads_copied));
    size_t n = (size_t)num_moe_layers(model) * moe->config.num_experts;
    for (size_t i = 0; i < n; i++) {
        moe->window_loads[i] += moe->step_loads_cpu[i];
        moe->quiet_steps[i] = moe->step_loads_cpu[i] > 0 ? 0 : moe->quiet_steps[i] + 1;
    }
    moe->window_steps++;
}

// MoE layer m's balancing bias into `b` (E values); 0 without one (under -pp the stages' report)
static int moe_layer_bias(const Model* model, int m, float* b) {
    const MoEModel* moe = moe_of(model);
    if (moe->balance_bias == NULL) return 0;
    int E = moe->config.num_experts;
    if (model_pp_stages(model) > 1)
        memcpy(b, moe->report.bias + (size_t)m * E, (size_t)E * sizeof(float));
    else
        cudaCheck(cudaMemcpy(b, moe->balance_bias + (size_t)m * E, (size_t)E * sizeof(float), cudaMemcpyDeviceToHost));
    return 1;
}

// Under -pp (collective over the pipeline group, on every process), what the stages measured put together. After a
// validation pass (`report`): its per-layer losses and counts and the balancing biases of every MoE layer, into the
// report. After a step's passes: the step line's sums over the micro-steps over every MoE layer of the model (the
// losses added, the per-layer averages, drop and load CV, weighted by each stage's layers) and the last micro-step's
// load min and max over the stages, in one all-reduce (each stage's min and max in places of their own, the other
// stages' zeros there).
static void moe_join_stages(Model* model, int report) {
    MoEModel* moe = moe_of(model);
    moe_statistics(model);  // the pass in use's, if not read yet
    int Lmodel = num_moe_layers(model), Lm = moe_stage_layers(model), E = moe->config.num_experts;
    if (!report) {
        int p = model_pp_stages(model), s = model_pp_stage(model);
        double sums[MOE_STEP_SUMS] = {moe->step_aux, moe->step_z, moe->step_drop * Lm / Lmodel,
                                      moe->step_load_cv * Lm / Lmodel};
        sums[4 + 2 * s] = moe->load_min, sums[5 + 2 * s] = moe->load_max;
        const MultiGpuConfig* g = &model->pp->group;
        size_t n = 4 + 2 * (size_t)p;
        cudaCheck(cudaMemcpy(moe->report.step_sums, sums, n * sizeof(double), cudaMemcpyHostToDevice));
        ncclCheck(ncclAllReduce(moe->report.step_sums, moe->report.step_sums, n, ncclFloat64, ncclSum, g->nccl_comm,
                                g->nccl_stream));
        cudaCheck(cudaMemcpyAsync(sums, moe->report.step_sums, n * sizeof(double), cudaMemcpyDeviceToHost,
                                  g->nccl_stream));
        cudaCheck(cudaStreamSynchronize(g->nccl_stream));
        moe->step_aux = sums[0], moe->step_z = sums[1], moe->step_drop = sums[2], moe->step_load_cv = sums[3];
        for (int t = 0; t < p; t++) {
            moe->load_min = t == 0 ? (float)sums[4] : fminf(moe->load_min, (float)sums[4 + 2 * t]);
            moe->load_max = t == 0 ? (float)sums[5] : fmaxf(moe->load_max, (float)sums[5 + 2 * t]);
        }
        return;
    }
    int* model_index = (int*)malloc_check((size_t)Lmodel * sizeof(int));
    moe_stage_model_indices(model, model_index);
    for (int m = 0; m < Lm; m++) {
        size_t to = (size_t)model_index[m];
        memcpy(moe->report.expert_counts + to * E, moe->slot->expert_counts_cpu + (size_t)m * E, E * sizeof(int));
        memcpy(moe->report.kept_counts + to * E, moe->slot->kept_counts_cpu + (size_t)m * E, E * sizeof(int));
        memcpy(moe->report.losses + to * MOE_LAYER_LOSSES, moe->slot->losses_cpu + (size_t)m * MOE_LAYER_LOSSES,
               MOE_LAYER_LOSSES * sizeof(float));
    }
    free(model_index);
    moe_join_stage_rows(model, moe->report.expert_counts, E * sizeof(int));
    moe_join_stage_rows(model, moe->report.kept_counts, E * sizeof(int));
    moe_join_stage_rows(model, moe->report.losses, MOE_LAYER_LOSSES * sizeof(float));
    if (moe->balance_bias != NULL) moe_join_stage_biases(model);
}

// The load histogram's bins: an expert's load since the last validation over the mean load
static const double moe_histogram_edges[] = {0.5, 0.8, 1.25, 2.0};
#define MOE_HISTOGRAM_BINS 5

// Per MoE layer, after a validation pass: its aux and z losses, dropped choices and expert loads of the validation
// pass; the dead experts and, from the training steps since the last validation, the histogram of the experts'
// loads; the balancing bias. The log line has the steps' choices (summed over the processes and micro-batches,
// layer_choices), every expert's load (over the mean, layer_loads) and bias (layer_bias), comma-separated, for
// scripts/plot_log.py.
static void print_moe_layers(const Model* model, int N, Logger* logger, int step) {
    MoEModel* moe = moe_of(model);
    moe_statistics(model);
    moe_take_step_loads(model);
    int E = moe->config.num_experts, stages = model_pp_stages(model) > 1;
    // the last pass's, the stages' under -pp (moe_join_stages)
    const int* expert_counts = stages ? moe->report.expert_counts : moe->slot->expert_counts_cpu;
    const int* kept_counts = stages ? moe->report.kept_counts : moe->slot->kept_counts_cpu;
    const float* layer_losses = stages ? moe->report.losses : moe->slot->losses_cpu;
    float* bias = (float*)malloc_check((size_t)E * sizeof(float));
    size_t line_size = 512 + (size_t)E * 32;
    char* line = (char*)malloc_check(line_size);
    for (int m = 0; m < num_moe_layers(model); m++) {
        MoELayerStatistics st = moe_layer_statistics(model, expert_counts, kept_counts, m, N);
        // aux: every balancing loss of the layer (Switch's, noisy gating's importance and load, the sequence-wise)
        const float* losses = layer_losses + MOE_LAYER_LOSSES * m;
        float aux = losses[0] + losses[2] + losses[3] + losses[4], z = losses[1];
        const long long* loads = moe->window_loads + (size_t)m * E;
        long long total = 0;
        int dead = 0, histogram[MOE_HISTOGRAM_BINS] = {0};
        for (int e = 0; e < E; e++) {
            total += loads[e];
            dead += moe->quiet_steps[(size_t)m * E + e] >= MOE_DEAD_STEPS;
        }
        double mean = (double)total / E;
        for (int e = 0; e < E && total > 0; e++) {
            int bin = 0;
            while (bin < MOE_HISTOGRAM_BINS - 1 && loads[e] / mean >= moe_histogram_edges[bin]) bin++;
            histogram[bin]++;
        }
        int has_bias = moe_layer_bias(model, m, bias);
        printf("val moe layer %d: aux %f z %f drop %f load min %.3f max %.3f cv %.3f dead %d", m, aux, z,
               st.drop_fraction, st.load_min, st.load_max, st.load_cv, dead);
        if (total > 0)
            printf(" loads <0.5:%d 0.5-0.8:%d 0.8-1.25:%d 1.25-2:%d >=2:%d", histogram[0], histogram[1], histogram[2],
                   histogram[3], histogram[4]);
        if (has_bias && E > 16) {
            float lo = bias[0], hi = bias[0];
            for (int e = 1; e < E; e++) {
                lo = fminf(lo, bias[e]);
                hi = fmaxf(hi, bias[e]);
            }
            printf(" bias min %.5f max %.5f", lo, hi);
        } else if (has_bias) {
            printf(" bias");
            for (int e = 0; e < E; e++) printf(" %.5f", bias[e]);
        }
        printf("\n");
        size_t used = (size_t)snprintf(line, line_size, "s:%d layer:%d layer_aux:%f layer_z:%f layer_drop:%f "
                                       "layer_load_min:%.3f layer_load_max:%.3f layer_load_cv:%.3f layer_dead:%d",
                                       step, m, aux, z, st.drop_fraction, st.load_min, st.load_max, st.load_cv, dead);
        if (total > 0) {
            used += (size_t)snprintf(line + used, line_size - used, " layer_steps:%d layer_choices:%lld layer_loads:",
                                     moe->window_steps, total);
            for (int e = 0; e < E; e++)
                used += (size_t)snprintf(line + used, line_size - used, "%s%.3f", e ? "," : "", loads[e] / mean);
        }
        if (has_bias) {
            used += (size_t)snprintf(line + used, line_size - used, " layer_bias:");
            for (int e = 0; e < E; e++)
                used += (size_t)snprintf(line + used, line_size - used, "%s%.6g", e ? "," : "", bias[e]);
        }
        logger_log_text(logger, line);
    }
    size_t n = (size_t)num_moe_layers(model) * E;
    memset(moe->window_loads, 0, n * sizeof(long long));
    moe->window_steps = 0;
    free(line);
    free(bias);
}


static void moe_info_rows(const Model* model, InfoTable* t) {
    const MoEModel* moe = moe_of(model);
    info_row(t, "experts", "%d per MoE layer, %d per process (-ep %d)", moe->config.num_experts, moe->local_experts,
             moe->ep.degree);
    info_row(t, "router scores", "%s, gates times %g", moe->config.score == MOE_SCORE_SIGMOID ? "sigmoid" : "softmax",
             moe->config.routed_scale);
    if (moe->config.shared_experts > 0)
        info_row(t, "shared experts", "%d per MoE layer, hidden size %d", moe->config.shared_experts,
                 moe->config.shared_hidden);
    if (moe->settings.seq_alpha > 0.0f)
        info_row(t, "sequence-wise loss", "alpha %g (-rsl), in the aux field", moe->settings.seq_alpha);
    if (moe->settings.global_aux)
        info_row(t, "global-batch loss", "on (-rg 1): f from the step's micro-batches so far on every process");
    if (moe->config.balance_bias)
        info_row(t, "balancing bias", moe->settings.bias_gamma > 0.0f ? "moves by %g per step (-rb)" : "fixed (-rb %g)",
                 moe->settings.bias_gamma);
    if (moe->settings.device_limit > 0)
        info_row(t, "device limit", "each token's experts within %d of %d groups of %d (-dl)",
                 moe->settings.device_limit, moe->ep.degree, moe->local_experts);
    if (moe->config.expert_groups > 0)
        info_row(t, "expert groups", "each token's experts within %d of %d groups of %d, by their two best (-egk, -eg)",
                 moe->config.kept_groups, moe->config.expert_groups,
                 moe->config.num_experts / moe->config.expert_groups);
    if (moe->config.first_dense > 0)
        info_row(t, "dense layers first", "%d, then an MoE layer every %d (-md, -me)", moe->config.first_dense,
                 moe->config.moe_every);
}


static void moe_step_fields(const Model* model, int micro_steps, char* out, size_t size) {
    const MoEModel* moe = moe_of(model);
    snprintf(out, size, " | aux %f | z %f | drop %.4f", moe->step_aux / micro_steps, moe->step_z / micro_steps,
             moe->step_drop / micro_steps);
}
static void moe_log_step(const Model* model, Logger* logger, int step, int micro_steps) {
    const MoEModel* moe = moe_of(model);
    char line[256];
    snprintf(line, sizeof(line), "s:%d aux:%f z:%f drop:%f load_min:%f load_max:%f load_cv:%f", step,
             moe->step_aux / micro_steps, moe->step_z / micro_steps, moe->step_drop / micro_steps, moe->load_min,
             moe->load_max, moe->step_load_cv / micro_steps);
    logger_log_text(logger, line);
}
