// llmc/memory_plan.h: the memory plan and the start-up table: what each device holds at the run's ZeRO stage and
// offload, computed from the model's shape alone (doc/zero.md), the refusal of a run that does not fit, the largest
// batch and model that would, and the table every run prints before it trains (the model, the batch, the memory per
// device). train_gpt.cu includes it after the settings (llmc/train_settings.h); it needs the model's sizes
// (replicated_tensor_sizes, activation_bytes) and llmc/info_table.h. Tests: train-gpt-cli and train-moe-cli check
// the printed bytes against their own formulas.
#pragma once

// The memory plan: what each device holds at the run's ZeRO stage and offload, from the model's shape alone (the
// layouts of llmc/optimizer.cuh and model_allocate_activations; formulas in doc/zero.md), before anything is allocated.
// dev/test/test_train_gpt.sh checks the printed bytes against its own formulas.
typedef struct {
    size_t parameters;     // floatX: the replicated set and an extension's own, each padded for its shards (ZeRO-3:
                           // this process's shard of the replicated set)
    size_t gradients;      // floatX buffers, or ZeRO-2/3's fp32 shard
    size_t communication;  // ZeRO-2/3's gradient buckets and ZeRO-3's gather buffers (not NCCL's own buffers)
    size_t optimizer;      // m, v and master weights of the shard: device memory, or host memory with -oo 1 (and
                           // with -oo 2 their backups for the early update)
    size_t activations;
} MemoryPlan;

static size_t shard_padded_count(size_t n, int processes) { return CEIL_DIV(n, (size_t)processes * 8) * processes * 8; }

// Under -pp, the micro-batches this process's stage holds at once (its activation slots; llmc/pipeline.h), and with ZB
// the bytes of each slot's weight-gradient queue (train_gpt.cu's model_allocate_slots)
static int plan_stage_slots(const Model* model) {
    const Pipeline* pp = model->pp;
    if (model_pp_stages(model) == 1 || pp->micro_batches < 1) return 1;
    PipelinePass* passes = (PipelinePass*)malloc_check(3 * (size_t)pp->micro_batches * pp->chunks * sizeof(PipelinePass));
    int n = pipeline_passes(pp->schedule, pp->stages, pp->stage, pp->micro_batches, pp->chunks, passes);
    int slots = pipeline_slots(passes, n);
    free(passes);
    return slots;
}
// ... and the buffers where its passes' outputs wait for their sends
static size_t plan_staging_bytes(const Model* model, int B, int T) {
    const Pipeline* pp = model->pp;
    if (model_pp_stages(model) == 1 || pp->micro_batches < 1) return 0;
    int n = (pp->schedule == SCHEDULE_ZB ? 3 : 2) * pp->micro_batches * pp->chunks;
    PipelineOp* ops = (PipelineOp*)malloc_check(2 * (size_t)n * sizeof(PipelineOp));
    int* begin = (int*)malloc_check((n + 2) * sizeof(int));
    int* staging_of = (int*)malloc_check(n * sizeof(int));
    pipeline_ops(pp->schedule, pp->stages, pp->stage, pp->micro_batches, pp->chunks, ops, begin);
    size_t buffers = pipeline_staging(ops, begin, n, staging_of);
    free(ops);
    free(begin);
    free(staging_of);
    return buffers * model_stream_tokens(model, B * T) * model->config.channels * sizeof(floatX);
}
static size_t plan_weight_queue_bytes(const Model* model, int B, int T) {
    if (model_pp_stages(model) == 1 || model->pp->schedule != SCHEDULE_ZB) return 0;
    size_t N = (size_t)B * T, C = model->config.channels;
    size_t per_layer = N * (local_qkv_channels(model) + C + local_fc_channels(model) + C);
    if (model->recompute >= 1) per_layer += N * local_hidden(model);
    if (model->recompute >= 2) per_layer += 2 * N * C;
    return per_layer * model_stage_layers(model) * sizeof(floatX);
}

static MemoryPlan model_memory_plan(const Model* model, int B, int T) {
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    replicated_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    int P = model->num_processes, stage = model->zero_stage, own_P = 1;
    size_t padded = shard_padded_count(n, P), own = 0;
    const FfnExtension* x = model->extension.ffn;
    if (x->own_parameter_count && x->own_parameter_count(model) > 0) {
        own_P = x->own_group(model)->num_processes;
        own = shard_padded_count(x->own_parameter_count(model), own_P);
    }
    size_t shard = stage >= 1 ? padded / P + own / own_P : padded + own;
    MemoryPlan m;
    m.parameters = (stage == 3 ? padded / P + own / own_P : padded + own) * sizeof(floatX);
    m.gradients = stage >= 2 ? shard * sizeof(float) : (padded + own) * sizeof(floatX);
    m.communication = 0;
    int master = model->offload_optimizer || (model->use_master_weights && PRECISION_MODE != PRECISION_FP32);
    int Tm = T + model_adapter_sequence_extra(model);  // the positions the passes run (prompt tuning's virtual ones)
    m.activations = activation_bytes(model, B, Tm, model->recompute);
    if (model_pp_stages(model) > 1) {  // a slot per micro-batch in flight; a tied wte's gradient from the other stage
        m.activations = plan_stage_slots(model) * (m.activations + plan_weight_queue_bytes(model, B, Tm)) +
                        plan_staging_bytes(model, B, Tm);
        if (model_shares_wte(model) && !model->frozen && (model_first_stage(model) || model_last_stage(model))) {
            size_t wte = (size_t)local_vocab(model) * model->config.channels * sizeof(floatX);
            m.activations += wte;
            if (stage >= 2) m.gradients += wte;  // ZeRO-2/3: its own, whole over the micro-batches
        }
    }
    // an extension's own set, stacked over the layers it replaces (the MoE experts): one layer's, for its two buckets
    // or gather buffers
    int replaced = model->config.num_layers - model_dense_layers(model);
    size_t own_layer = own > 0 && replaced > 0 ? x->own_parameter_count(model) / replaced : 0;
    if (model->frozen) {  // fine-tuning: the model's parameters only (ZeRO-3: gathered), the adapter's set beside
        size_t adapter = shard_padded_count(adapter_parameter_count(model), P);
        size_t adapter_shard = adapter_zero_stage(model) >= 1 ? adapter / P : adapter;
        m.parameters += adapter * sizeof(floatX);
        m.gradients = adapter * sizeof(floatX);
        if (stage == 3) {
            size_t layer, rest;
            model_gradient_bucket_sizes(model, sizes, &layer, &rest);
            m.communication = (2 * layer + rest + 2 * own_layer) * sizeof(floatX);
        }
        m.optimizer = adapter_shard * sizeof(float) * (master ? 3 : 2);
        if (model->offload_optimizer == 2) m.optimizer += adapter_shard * sizeof(float) * 3;
        // the adapter's scratch, and what the bottleneck adapter or llama_adapter keeps for the backward pass
        int slots = model_pp_stages(model) > 1 ? plan_stage_slots(model) : 1;
        m.activations += (3 * (size_t)B * Tm * model->adapter_rank + adapter_activation_count(model, B, Tm, slots)) *
                         sizeof(floatX) + shared_keys_scratch_floats(model, B, Tm) * sizeof(float);
        return m;
    }
    if (stage >= 2) {
        size_t layer, rest;
        model_gradient_bucket_sizes(model, sizes, &layer, &rest);
        // ZeRO-3: gather buffers alike
        m.communication = (stage == 3 ? 2 : 1) * (2 * layer + rest + 2 * own_layer) * sizeof(floatX);
    }
    m.optimizer = shard * sizeof(float) * (master ? 3 : 2);
    if (model->offload_optimizer == 2) m.optimizer += shard * sizeof(float) * 3;  // the early update's backups
    return m;
}
static size_t memory_plan_device_bytes(const Model* model, const MemoryPlan* m) {
    return m->parameters + m->gradients + m->communication + (model->offload_optimizer ? 0 : m->optimizer) +
           m->activations;
}

// The largest micro-batch, and the largest GPT-2 (descriptor dN, this model's V and maxT, dense) whose plan at this
// micro-batch, fits in `budget` bytes of device memory (0: none)
static int memory_plan_largest_batch(const Model* model, int T, size_t budget) {
    int B = 0;
    while (B < 65536) {
        MemoryPlan m = model_memory_plan(model, B + 1, T);
        if (memory_plan_device_bytes(model, &m) > budget) break;
        B++;
    }
    return B;
}
static int memory_plan_largest_depth(const Model* model, int B, int T, size_t budget) {
    Model probe = *model;
    probe.extension = no_extension;
    probe.pp = NULL;  // the whole model on one device
    int best = 0;
    for (int depth = 1; depth <= 200; depth++) {
        model_descriptor_shape(&probe.config, depth, model->config.vocab_size, model->config.max_seq_len);
        MemoryPlan m = model_memory_plan(&probe, B, T);
        if (memory_plan_device_bytes(&probe, &m) <= budget) best = depth;
    }
    return best;
}

// Under tensor parallelism: one layer's activations (the plan's with one layer more, less the plan's) beside Korthikanti
// et al.'s formula for 16-bit activations with TP and SP, s b h (34/t + 5 a s / (h t)) bytes (which counts the dropout
// masks and, without flash attention, the attention scores: a cross-check of the order, not of the bytes); and what
// each process sends per micro-step in its tensor-parallel group (4L + 2 joins of B*T*C values, each an all-reduce or a
// reduce-scatter with its all-gather: 2(N-1)/N of the values) and per step in its data-parallel group (the gradient's
// reduction and ZeRO's all-gather: 2(D-1)/D of the set, as a ring sends it).
static void tensor_parallel_plan_rows(InfoTable* t, const Model* model, int B, int T) {
    const ModelConfig* c = &model->config;
    Model one = *model, two = *model;  // (one stage of one and of two layers: the difference is a layer's)
    one.pp = two.pp = NULL;
    one.config.num_layers = 1, two.config.num_layers = 2;
    double layer = (double)activation_bytes(&two, B, T, model->recompute) -
                   (double)activation_bytes(&one, B, T, model->recompute);
    double s = T, b = B, h = c->channels, a = c->num_heads, N = model_tp_degree(model);
    double formula = model_sequence_parallel(model) ? s * b * h * (34.0 / N + 5.0 * a * s / (h * N))
                                                    : s * b * h * (10.0 + 24.0 / N + 5.0 * a * s / (h * N));
    const double MiB = 1048576.0;
    info_row(t, "activations per layer", "%10.1f MiB (%.0f bytes; Korthikanti et al.'s %s formula: %.1f MiB)",
             layer / MiB, layer, model_sequence_parallel(model) ? "TP+SP" : "TP", formula / MiB);
    double joins = 4.0 * model_stage_layers(model) + 2.0;
    double tp_bytes = joins * 2.0 * (N - 1.0) / N * (double)B * T * c->channels * sizeof(floatX);
    size_t sizes[NUM_PARAMETER_TENSORS], n = 0;
    replicated_tensor_sizes(sizes, model);
    for (int i = 0; i < NUM_PARAMETER_TENSORS; i++) n += sizes[i];
    double D = model->num_processes, dp_bytes = 2.0 * (D - 1.0) / D * (double)n * sizeof(floatX);
    info_row(t, "sent per process", "%10.1f MiB per micro-step in the tensor-parallel group, %.1f MiB per step in the "
             "data-parallel group", tp_bytes / MiB, dp_bytes / MiB);
}

// Under -pp: the layout, and each stage's parameters, optimizer state and activations in flight (its first process's,
// of its data-parallel group's shards), and what a process sends its neighbours per micro-batch
static void pipeline_plan_rows(InfoTable* t, const Model* model, int B, int T) {
    Pipeline* pp = model->pp;
    const double MiB = 1048576.0;
    char cut[256] = "";  // the layers of each model chunk (one per stage but interleaved)
    for (int j = 0, n = 0; j < pp->stages * pp->chunks && n < (int)sizeof(cut) - 12; j++)
        n += snprintf(cut + n, sizeof(cut) - n, "%s%d", j ? "," : "", pp->first_layer[j + 1] - pp->first_layer[j]);
    info_row(t, "pipeline", "%d stages (-pp) x %d chunk%s of layers %s, %s, %d micro-batches, idle %.3f", pp->stages,
             pp->chunks, pp->chunks == 1 ? "" : "s", cut, pipeline_schedule_names[pp->schedule], pp->micro_batches,
             pipeline_formula_idle(pp->schedule, pp->stages, pp->micro_batches > 0 ? pp->micro_batches : 1,
                                   pp->chunks));
    int mine = pp->stage;
    for (int s = 0; s < pp->stages; s++) {
        pp->stage = s;
        MemoryPlan m = model_memory_plan(model, B, T);
        char name[32];
        snprintf(name, sizeof(name), "stage %d", s);
        info_row(t, name, "%8.1f MiB parameters, %8.1f MiB optimizer, %8.1f MiB activations (%d in flight)",
                 m.parameters / MiB, m.optimizer / MiB, m.activations / MiB, plan_stage_slots(model));
    }
    pp->stage = mine;
    double sent = (double)model_stream_tokens(model, B * T) * model->config.channels * sizeof(floatX);
    info_row(t, "sent per stage boundary", "%10.3f MiB per micro-batch each way (B*T*C, -sp: B*T/N tokens)", sent / MiB);
}

// the plan's rows for a device of `budget` bytes
static void memory_plan_rows(InfoTable* t, const Model* model, int B, int T, size_t budget) {
    MemoryPlan m = model_memory_plan(model, B, T);
    const double MiB = 1048576.0;
    int stage = model->zero_stage;
    info_row(t, "memory: parameters", "%10.1f MiB (%zu bytes)", m.parameters / MiB, m.parameters);
    const char* gradient_note = stage >= 2 ? (stage == 3 ? ", fp32 ZeRO-3 shard" : ", fp32 ZeRO-2 shard") : "";
    if (model->frozen) gradient_note = ", the adapter's only";
    info_row(t, "memory: gradients", "%10.1f MiB (%zu bytes%s)", m.gradients / MiB, m.gradients, gradient_note);
    const FfnExtension* x = model->extension.ffn;
    int buckets = 3 + (x->own_parameter_count && x->own_parameter_count(model) > 0 ? 2 : 0);
    char bucket_note[64] = "";
    if (stage == 2 && !model->frozen) snprintf(bucket_note, sizeof(bucket_note), ", %d ZeRO-2 buckets", buckets);
    if (stage == 3 && !model->frozen)
        snprintf(bucket_note, sizeof(bucket_note), ", %d ZeRO-3 buckets and %d gather buffers", buckets, buckets);
    if (stage == 3 && model->frozen) snprintf(bucket_note, sizeof(bucket_note), ", 3 ZeRO-3 gather buffers");
    info_row(t, "memory: communication", "%10.1f MiB (%zu bytes%s)", m.communication / MiB, m.communication,
             bucket_note);
    if (model->offload_optimizer)
        info_row(t, "memory: optimizer", "%10.1f MiB (%zu bytes) host memory (m, v, master%s, ZeRO-%d shard; -oo %d)",
                 m.optimizer / MiB, m.optimizer, model->offload_optimizer == 2 ? " and their backups" : "", stage,
                 model->offload_optimizer);
    else
        info_row(t, "memory: optimizer", "%10.1f MiB (%zu bytes; m, v%s, ZeRO-%d shard%s)", m.optimizer / MiB,
                 m.optimizer, model->use_master_weights && PRECISION_MODE != PRECISION_FP32 ? ", master" : "",
                 model->frozen ? adapter_zero_stage(model) : stage, model->frozen ? " of the adapter" : "");
    info_row(t, "memory: activations", "%10.1f MiB (%zu bytes, recompute %d)", m.activations / MiB, m.activations,
             model->recompute);
    if (model_tp_degree(model) > 1) tensor_parallel_plan_rows(t, model, B, T);
    if (model_pp_stages(model) > 1) pipeline_plan_rows(t, model, B, T);
    size_t device = memory_plan_device_bytes(model, &m);
    info_row(t, "memory: device total", "%10.1f MiB (%zu bytes) of %.1f MiB", device / MiB, device, budget / MiB);
    info_row(t, "largest B that fits", "%d", memory_plan_largest_batch(model, T, budget));
    int depth = memory_plan_largest_depth(model, B, T, budget);
    if (depth > 0) {
        Model probe = *model;
        probe.extension = no_extension;
        probe.pp = NULL;
        model_descriptor_shape(&probe.config, depth, model->config.vocab_size, model->config.max_seq_len);
        info_row(t, "largest GPT-2 at this B", "d%d (%zu parameters)", depth, model_num_parameters(&probe));
    } else {
        info_row(t, "largest GPT-2 at this B", "none fits");
    }
}

// Before anything for training is allocated: the activations, the optimizer state and ZeRO-2's gradient shard fit
// in the free device memory, or one line says what and how much (not a bare out-of-memory error from the middle of
// the allocations).
static int check_training_memory(Model* model, const TrainerSettings* s) {
    MemoryPlan m = model_memory_plan(model, s->B, s->T);
    size_t act = m.activations, opt = model->offload_optimizer ? 0 : m.optimizer;  // offloaded: in host memory
    size_t shard = model->zero_stage >= 2 ? m.gradients : 0;
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess && act + opt + shard > free_bytes) {
        fprintf(stderr, "%s: out of device memory: the activations (B=%d T=%d, recompute %d: %zu bytes), the optimizer "
                "state (%zu bytes) and the gradient shard (%zu bytes) need %zu bytes, %zu are free\n", s->model_source,
                s->B, s->T, s->recompute, act, opt, shard, act + opt + shard, free_bytes);
        return 0;
    }
    return 1;
}

static void model_rows(InfoTable* t, const Model* model) {
    const ModelConfig* cfg = &model->config;
    if (cfg->family == FAMILY_LLAMA) {
        info_row(t, "model", "llama L=%d NH=%d NKV=%d C=%d H=%d V=%d Vp=%d maxT=%d", cfg->num_layers, cfg->num_heads,
                 cfg->num_kv_heads, cfg->channels, cfg->ffn_hidden, cfg->vocab_size, cfg->padded_vocab_size,
                 cfg->max_seq_len);
        info_row(t, "llama", "RoPE theta %g, RMSNorm eps %g, %s", cfg->rope_theta, cfg->norm_eps,
                 cfg->tied ? "output embedding tied to wte" : "own lm_head");
    } else {
        info_row(t, "model", "L=%d NH=%d C=%d V=%d Vp=%d maxT=%d", cfg->num_layers, cfg->num_heads, cfg->channels,
                 cfg->vocab_size, cfg->padded_vocab_size, cfg->max_seq_len);
    }
    info_row(t, "parameters", "%zu", model_num_parameters(model));
    if (model->extension.telemetry->info_rows) model->extension.telemetry->info_rows(model, t);
    if (model->frozen) {
        size_t trainable = adapter_parameter_count(model), all = model_num_parameters(model);
        char where[96] = "after the attention and the FFN";
        if (model->adapter_method == FT_METHOD_PROMPT) snprintf(where, sizeof(where), "(virtual tokens)");
        if (model->adapter_method == FT_METHOD_PREFIX) snprintf(where, sizeof(where), "(keys and values per layer)");
        if (model->adapter_method == FT_METHOD_LLAMA_ADAPTER)
            snprintf(where, sizeof(where), "(prompt rows in the top %u layers, gated)", model->adapter_targets);
        if (model->adapter_method == FT_METHOD_LORA) {
            snprintf(where, sizeof(where), "on ");
            for (int i = 0, first = 1; i < LORA_NUM_TARGETS; i++)
                if ((model->adapter_targets >> i) & 1) {
                    snprintf(where + strlen(where), sizeof(where) - strlen(where), "%s%s", first ? "" : ",",
                             lora_target_names[i]);
                    first = 0;
                }
        }
        info_row(t, "fine-tuning", "%s r=%d %s: %zu trainable parameters, %.4f%% of the model's %zu (frozen)",
                 ft_method_names[model->adapter_method], model->adapter_rank, where, trainable, 100.0 * trainable / all,
                 all);
    }
}

// The start-up table (process 0), once everything is allocated: the model, the batch, the memory plan per device, and
// what would fit in the memory this process uses plus what is free.
static void print_startup_table(Model* model, const TrainerSettings* s, const cudaDeviceProp* prop,
                                const MultiGpuConfig* mg, int grad_accum_steps) {
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    MemoryPlan m = model_memory_plan(model, s->B, s->T);
    size_t budget = free_bytes + memory_plan_device_bytes(model, &m);  // everything planned is allocated now
    if (mg->process_rank != 0) return;
    InfoTable t = {};
    info_row(&t, "device", "%s", prop->name);
    info_row(&t, "precision", "%s", PRECISION_NAME);
#ifdef ENABLE_CUDNN
    if (model->attention == ATTENTION_CUDNN)
        info_row(&t, "attention", "cuDNN, %s backward (-cd %d)",
                 cudnn_attention_deterministic ? "deterministic" : "non-deterministic", cudnn_attention_deterministic);
    else
#endif
        info_row(&t, "attention", "%s", model_attention_name(model));
    model_rows(&t, model);
    info_row(&t, "batch", "B=%d T=%d processes=%d accumulation=%d", s->B, s->T, mg->num_processes, grad_accum_steps);
    if (model_tp_degree(model) > 1)
        info_row(&t, "tensor parallel", "every layer over %d processes (-tp), sequence parallel %s (-sp), %d data-parallel",
                 model_tp_degree(model), model_sequence_parallel(model) ? "on" : "off", model->num_processes);
    memory_plan_rows(&t, model, s->B, s->T, budget);
    info_table_print(&t);
}

// -pm GIB: the plan of a descriptor's model on a device of GIB GiB, without allocating anything (process 0 prints)
static void print_memory_plan(const Model* model, const TrainerSettings* s, const MultiGpuConfig* mg) {
    if (mg->process_rank != 0) return;
    InfoTable t = {};
    info_row(&t, "memory plan", "a device of %d GiB (-pm), nothing allocated", s->plan_gib);
    info_row(&t, "precision", "%s", PRECISION_NAME);
    info_row(&t, "attention", "%s", model_attention_name(model));
    model_rows(&t, model);
    info_row(&t, "batch", "B=%d T=%d processes=%d, ZeRO-%d, offload %d", s->B, s->T, mg->num_processes,
             model->zero_stage, model->offload_optimizer);
    if (model_tp_degree(model) > 1)
        info_row(&t, "tensor parallel", "every layer over %d processes (-tp), sequence parallel %s (-sp), %d data-parallel",
                 model_tp_degree(model), model_sequence_parallel(model) ? "on" : "off", model->num_processes);
    memory_plan_rows(&t, model, s->B, s->T, (size_t)s->plan_gib << 30);
    info_table_print(&t);
}
